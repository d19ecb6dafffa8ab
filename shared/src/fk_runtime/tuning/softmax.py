"""Launch table for fk-softmax.

Rows that fit `sizing.fused_row_block` are held whole by one program (several short rows per
program); longer rows are walked twice by one program each when there are enough of them (the
second walk hits the L2 cache), else split into chunks across programs: per-chunk (max, sum)
partials, then a pass that combines them and writes the chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import backend, sizing

# Short rows: one program covers about this many bytes of input (several rows), so each program
# moves enough data to hide latency.
ROW_TILE_BYTES = 32768
# Long rows: each program owns one chunk of this many bytes (the fused-row budget).
CHUNK_BYTES = sizing.MAX_FUSED_ROW_BYTES
# Rows past the fused budget but at most this long, with enough rows to give every
# multiprocessor LOOPED_MIN_ROWS_PER_SM of them, take the looped path: one program per row, two
# walks over it, the second served by the L2 cache (a multiprocessor's rows in flight stay well
# inside the H100's 50 MB of L2). Other long rows are split into chunks across programs.
LOOPED_MAX_ROW_BYTES = 256 << 10
LOOPED_MIN_ROWS_PER_SM = 2
# Chunk one looped program walks per step.
LOOPED_CHUNK_BYTES = 16384
PLAN_CACHE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    fused: bool  # whole rows per program
    looped: bool  # one program walks its row in chunks (else, if not fused: split rows)
    block_rows: int  # rows per program (fused)
    block_cols: int  # columns per program: the padded row (fused) or the chunk (split)
    chunks: int  # chunks per row (split); 1 when fused
    chunks_p2: int  # chunks rounded up to a power of two, for the combine step
    num_warps: int


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None:
        rows = sizing.rows_per_program(n_rows, block, dtype, ROW_TILE_BYTES)
        return Plan(True, False, rows, block, 1, 1, sizing.num_warps_for(rows * block))
    row_bytes = n_cols * sizing.element_size(dtype)
    enough_rows = n_rows >= LOOPED_MIN_ROWS_PER_SM * backend.multiprocessor_count()
    if row_bytes <= LOOPED_MAX_ROW_BYTES and enough_rows:
        chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
        return Plan(False, True, 1, chunk, 1, 1, sizing.num_warps_for(chunk))
    chunk = CHUNK_BYTES // sizing.element_size(dtype)
    chunks = sizing.cdiv(n_cols, chunk)
    return Plan(False, False, 1, chunk, chunks, sizing.next_power_of_2(chunks), sizing.num_warps_for(chunk))

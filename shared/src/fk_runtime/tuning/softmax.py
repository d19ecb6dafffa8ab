"""Launch table for fk-softmax (softmax and log-softmax share it, forward and backward).

Three paths, by row length:
- fused: rows that fit `sizing.fused_row_block` are held whole in registers, one or a few rows per
  program: one read and one write of HBM per tensor;
- split: longer rows are cut into chunks, one program per (row, chunk). The
  programs of a row ("siblings") publish per-chunk partials (max and sum of exp, or sum of y*g),
  wait for each other, then write their chunk from registers: still one read and one write. This
  needs the siblings resident together, so a row may have at most `max_siblings()` chunks;
- two-pass: rows with more chunks than that (on an H100, past 2 x 132 x 4096 = 1.08M columns
  forward and 2.16M backward): a partials kernel, then a kernel that combines the row's
  partials and re-reads its chunk to write it (one more read of the input), over chunks of the
  fused size.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from .. import sizing
from ..siblings import max_siblings, spin_limit

# Short rows: a program takes whole rows until it holds at least this many bytes of input. H100
# run of 2026-11-22 (BENCHMARKS.md), 1024 columns: Liger's one row per 4-warp program reached 90%
# of copy bandwidth in fp32 (4 KB a program) and 82% in bf16 (2 KB), fk's 16-32 KB multi-row tiles
# on 16-32 warps 55-69%. Sweep of 2026-11-24 (graph replays; 2-16 KB x half, default and double
# warps; 16384x1024, 8192x4096, 4096x16384, bf16 and fp32, forward and backward): every setting
# within 2% of the best except 16 KB or doubled warps on short bf16 rows (down to 2000 GB/s); 8 KB
# tied 4 KB everywhere but fp32 16384x1024, where it gained 1.8% forward (2717 GB/s against 2670).
FUSED_TILE_BYTES = 8192
# Split rows: columns per program, on SPLIT_NUM_WARPS warps. H100 sweep of 2026-11-22 (launcher
# timed alone, 1024x65536, 256x262144, 64x1048576, bf16 and fp32; chunks 2048-16384 on 4-16
# warps): 4096 columns on 4 warps (32 values per thread) was best or within 3% of best forward
# in 5 of 6 cases and backward in all (fp32 forward 2536-2657 GB/s, bf16 1995-2126; the 8-warp
# 4096 chunk gave 1634-2058 bf16). Few threads per program keep many programs resident per
# multiprocessor: while some wait for their siblings, the others keep loads in flight.
SPLIT_CHUNK_ELEMENTS = 4096
# ... and twice that when it pads the row no more and the row has at most SPLIT_WIDE_MAX_CHUNKS
# of them. H100, 2026-11-24, graph replays of the forward, 4096 -> 8192 columns: 1024x65536 bf16
# 2118 -> 2368 GB/s, fp32 2623 -> 2783; 256x262144 bf16 2134 -> 2272, fp32 2649 -> 2691; but
# 64x1048576 (128 wide chunks a row) bf16 2038 -> 1828, fp32 2561 -> 2409, and 1000x20000 fp32
# (a last wide chunk under half full) 2418 -> 2317.
SPLIT_WIDE_CHUNK_ELEMENTS = 8192
SPLIT_WIDE_MAX_CHUNKS = 32
# The backward holds its y and grad_y chunks in their own dtype through the wait, which leaves
# registers for twice the columns. H100, 2026-11-23, graph replays (1024x65536 to 64x1048576 and
# 1000x20000): 8192 columns on 4 warps gave bf16 2620-2660 GB/s (64x1048576: 2000 against 1860
# for 4096 columns) and fp32 2690-2960 (64x1048576: 2660 against 2480); 1000x20000 within 1%.
SPLIT_BACKWARD_CHUNK_ELEMENTS = 8192
SPLIT_NUM_WARPS = 4
PLAN_CACHE_SIZE = 1024


class Path(str, enum.Enum):
    FUSED = "fused"
    SPLIT = "split"
    TWO_PASS = "two_pass"


@dataclasses.dataclass(frozen=True)
class Plan:
    path: Path
    block_rows: int  # rows per program (fused), else 1
    block_cols: int  # the padded row (fused) or one chunk (split, two-pass)
    chunks: int  # chunks per row; 1 when fused
    chunks_p2: int  # chunks rounded up to a power of two, for combining a row's partials
    num_warps: int
    programs: int  # grid size
    spin_limit: int


def _forward_chunk(n_cols: int) -> int:
    wide, narrow = SPLIT_WIDE_CHUNK_ELEMENTS, SPLIT_CHUNK_ELEMENTS
    wide_chunks = sizing.cdiv(n_cols, wide)
    if wide_chunks <= SPLIT_WIDE_MAX_CHUNKS and wide_chunks * wide <= sizing.cdiv(n_cols, narrow) * narrow:
        return wide
    return narrow


# Plans depend only on the shape and dtype: cached, so a call pays for a dict lookup.
@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan(n_rows: int, n_cols: int, dtype: torch.dtype, backward: bool = False) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None:
        rows = sizing.rows_per_program(n_rows, block, dtype, FUSED_TILE_BYTES)
        return Plan(Path.FUSED, rows, block, 1, 1, sizing.row_warps(rows * block), sizing.cdiv(n_rows, rows), 0)
    chunk, path = SPLIT_BACKWARD_CHUNK_ELEMENTS if backward else _forward_chunk(n_cols), Path.SPLIT
    if sizing.cdiv(n_cols, chunk) > max_siblings():
        chunk, path = sizing.looped_row_block(dtype), Path.TWO_PASS
    chunks = sizing.cdiv(n_cols, chunk)
    warps = SPLIT_NUM_WARPS if path is Path.SPLIT else sizing.row_warps(chunk)
    return Plan(path, 1, chunk, chunks, sizing.next_power_of_2(chunks), warps,
                n_rows * chunks, spin_limit())

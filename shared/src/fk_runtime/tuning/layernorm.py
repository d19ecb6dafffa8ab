"""Launch table for fk-layernorm (LayerNorm and RMSNorm share it).

Rows that fit `sizing.fused_row_block` are held whole in registers: several rows per program in
the forward, and a persistent backward where each program walks a group of rows and keeps its
dweight / dbias partial sums in registers. Longer rows are walked in chunks by one program per row,
with dweight / dbias from a column-tiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import backend, sizing

# Forward, short rows: a program takes whole rows until it holds about this many bytes of input,
# on `sizing.row_warps` warps. H100 sweep of 2026-11-22 (1024-16384 features, bf16 and fp32, 1-8
# rows on 4-32 warps): 8 KB tiles reached 2590-2900 GB/s; the 32 KB tiles of before fell to
# 1800 GB/s (bf16, 1024 features) and 2060 (bf16, 16384 features on 32 warps).
FORWARD_ROW_TILE_BYTES = 8192
# Backward: rows are held whole up to this many features. Same sweep: 8192 features (one row on
# 16 warps) ran at 2390 GB/s bf16 and 2740 fp32; 16384 spilled at any warp count (330 GB/s), so
# longer rows take the chunked kernels.
BACKWARD_FUSED_MAX_ELEMENTS = 8192
# Backward, short rows: rows per loop step, as bytes of one input tile (16 KB: 8 rows of 1024
# bf16 features, 4 of fp32; 2510 and 2720 GB/s in that sweep).
BACKWARD_ROW_TILE_BYTES = 16384
# Backward: warps from one row's features (`sizing.row_warps`: 4 at 1024, 8 at 4096, 16 at 8192),
# and as many row groups per multiprocessor as fill BACKWARD_WARPS_PER_SM warps (4, 2 and 1
# groups there: the sweep's best at each width). Each group ends in one partial row of dweight /
# dbias. One stage: the loop's loads gain nothing from pipelining (1 and 2 stages tied).
BACKWARD_WARPS_PER_SM = 16
BACKWARD_NUM_STAGES = 1
# The dweight / dbias partial buffers (fp32, groups x features, two of them) stay under this many
# bytes, so peak memory stays under PyTorch's for long rows.
PARTIAL_BYTES_BUDGET = 32 << 20
# Long rows: chunk walked per loop step, and the column tile of the parameter-gradient kernel.
LOOPED_CHUNK_BYTES = 16384
PARAMS_TILE_BYTES = 16384
PARAMS_MAX_BLOCK_D = 512
PLAN_CACHE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    fused: bool
    block_rows: int
    block_cols: int
    num_warps: int
    groups: int = 1  # backward: row groups (partial rows of dweight / dbias)
    rows_per_group: int = 0
    col_tiles: int = 1  # backward, long rows: column tiles of the parameter kernel
    params_block_rows: int = 1
    params_block_cols: int = 1
    params_num_warps: int = sizing.MIN_WARPS


def _groups(n_rows: int, n_cols: int, block_rows: int, programs_per_sm: int) -> tuple[int, int]:
    row_tiles = sizing.cdiv(n_rows, block_rows)
    by_memory = max(1, PARTIAL_BYTES_BUDGET // (2 * 4 * max(n_cols, 1)))
    wanted = backend.multiprocessor_count() * programs_per_sm
    groups = max(1, min(row_tiles, wanted, by_memory))
    rows_per_group = sizing.cdiv(row_tiles, groups) * block_rows
    return sizing.cdiv(n_rows, rows_per_group), rows_per_group


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def forward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None:
        rows = sizing.rows_per_program(n_rows, block, dtype, FORWARD_ROW_TILE_BYTES)
        return Plan(True, rows, block, sizing.row_warps(rows * block))
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    return Plan(False, 1, chunk, sizing.num_warps_for(chunk))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None and block <= BACKWARD_FUSED_MAX_ELEMENTS:
        rows = sizing.rows_per_program(n_rows, block, dtype, BACKWARD_ROW_TILE_BYTES)
        warps = sizing.row_warps(block)
        groups, per_group = _groups(n_rows, n_cols, rows, max(1, BACKWARD_WARPS_PER_SM // warps))
        return Plan(True, rows, block, warps, groups, per_group)
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    tile = sizing.tile_2d(n_rows, n_cols, dtype, PARAMS_TILE_BYTES, PARAMS_MAX_BLOCK_D)
    col_tiles = sizing.cdiv(n_cols, tile.block_cols)
    groups, per_group = _groups(n_rows, n_cols, tile.block_rows, 1)
    return Plan(False, 1, chunk, sizing.num_warps_for(chunk), groups, per_group, col_tiles,
                tile.block_rows, tile.block_cols, tile.num_warps)

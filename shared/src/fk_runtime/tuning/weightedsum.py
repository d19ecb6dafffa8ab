"""Launch table for fk-weightedsum (row tiles x D tiles, fp32 accumulation)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import backend, sizing

# Forward: elements of x one program loads per loop step (a BLOCK_R x BLOCK_D tile), and tile
# elements per thread by element size (which sets the warps). H100 sweep of 2026-11-22 (5 shapes
# x bf16/fp32, tiles 8-64 KB x 16-128 elements per thread, timed as CUDA graph replays): 8192
# elements on 8 warps (bf16) or 4 warps (fp32) came within 0.5% (bf16) and 3% (fp32) of each
# shape's best, 2500-2910 GB/s; the 32 KB bf16 tiles of before reached 2070 on short rows.
FORWARD_TILE_ELEMENTS = 8192
FORWARD_ELEMENTS_PER_THREAD_BY_ITEMSIZE = {1: 32, 2: 32, 4: 64, 8: 64}
# Widest forward D tile: 4096 (wider tiles read longer contiguous runs; the sweep tied or won at
# 4096 on every shape).
FORWARD_MAX_BLOCK_D = 4096
# Forward: when row tiles alone give fewer programs than this many per multiprocessor, D is
# split across programs too (partial sums reduced afterwards).
FORWARD_MIN_PROGRAMS_PER_SM = 4
# Backward tile: BACKWARD_TILE_ELEMENTS values (its fp32 products set the register use, whatever
# the dtype), D up to BACKWARD_MAX_BLOCK_D wide, at most BACKWARD_MAX_BLOCK_ROWS rows. H100 sweep
# of 2026-11-22 (65536x1024, 16384x4096, 262144x256, bf16 and fp32; tiles 8-32 rows x 128-1024,
# 4-8 warps, 4-16 programs per SM, 1-3 stages): 16 x 1024 (32 x 256 for short rows) gave
# 2618-2803 GB/s, within 2% of each case's best; the 32 KB tiles of before spilled in bf16
# (665 GB/s at 16384x4096).
BACKWARD_TILE_ELEMENTS = 16384
BACKWARD_MAX_BLOCK_D = 1024
BACKWARD_MAX_BLOCK_ROWS = 32
BACKWARD_NUM_STAGES = 1
# Backward (warps, row groups per multiprocessor) by element size: same sweep, bf16 led on 4
# warps with 8 groups per SM, fp32 on 8 warps with 16.
BACKWARD_LAUNCH_BY_ITEMSIZE = {2: (4, 8), 4: (8, 16)}
PLAN_CACHE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    tile: sizing.Tile2D
    row_programs: int  # forward: row tiles; backward: row groups
    col_programs: int  # forward: D splits; backward: D tiles
    span: int  # forward: D elements one split covers; backward: rows one group walks


def _with_warps(tile: sizing.Tile2D, num_warps: int) -> sizing.Tile2D:
    return dataclasses.replace(tile, num_warps=max(sizing.MIN_WARPS, min(num_warps, sizing.max_warps())))


# Plans depend only on the shape and dtype: cached, so a call pays for a dict lookup, not the
# arithmetic (host time matters when the kernel itself takes tens of microseconds).
@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def forward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    itemsize = sizing.element_size(dtype)
    tile = sizing.tile_2d(n_rows, n_cols, dtype, FORWARD_TILE_ELEMENTS * itemsize, FORWARD_MAX_BLOCK_D)
    threads = sizing.cdiv(tile.elements, FORWARD_ELEMENTS_PER_THREAD_BY_ITEMSIZE[itemsize])
    tile = _with_warps(tile, sizing.next_power_of_2(sizing.cdiv(threads, backend.warp_size())))
    row_programs = sizing.cdiv(n_rows, tile.block_rows)
    wanted = backend.multiprocessor_count() * FORWARD_MIN_PROGRAMS_PER_SM
    col_tiles = sizing.cdiv(n_cols, tile.block_cols)
    splits = min(col_tiles, max(1, wanted // max(row_programs, 1)))
    # Each split walks a whole number of D tiles.
    tiles_per_split = sizing.cdiv(col_tiles, splits)
    splits = sizing.cdiv(col_tiles, tiles_per_split)
    return Plan(tile, row_programs, splits, tiles_per_split * tile.block_cols)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    block_cols = min(sizing.next_power_of_2(n_cols), BACKWARD_MAX_BLOCK_D)
    block_rows = min(BACKWARD_TILE_ELEMENTS // block_cols, BACKWARD_MAX_BLOCK_ROWS,
                     sizing.next_power_of_2(n_rows))
    num_warps, per_sm = BACKWARD_LAUNCH_BY_ITEMSIZE[sizing.element_size(dtype)]
    tile = _with_warps(sizing.Tile2D(block_rows, block_cols, num_warps), num_warps)
    col_programs = sizing.cdiv(n_cols, tile.block_cols)
    row_tiles = sizing.cdiv(n_rows, tile.block_rows)
    total = sizing.persistent_grid(row_tiles * col_programs, programs_per_sm=per_sm)
    groups = max(1, min(row_tiles, total // col_programs))
    rows_per_group = sizing.cdiv(row_tiles, groups) * tile.block_rows
    return Plan(tile, sizing.cdiv(n_rows, rows_per_group), col_programs, rows_per_group)

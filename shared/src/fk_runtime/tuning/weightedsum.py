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
FORWARD_ELEMENTS_PER_THREAD_BY_ITEMSIZE = {2: 32, 4: 64}
# Widest forward D tile: 4096 (wider tiles read longer contiguous runs; the sweep tied or won at
# 4096 on every shape).
FORWARD_MAX_BLOCK_D = 4096
# Forward: when row tiles alone give fewer programs than this many per multiprocessor, D is
# split across programs too (partial sums reduced afterwards).
FORWARD_MIN_PROGRAMS_PER_SM = 4
# Backward tile: BACKWARD_TILE_BYTES of x, D up to BACKWARD_MAX_BLOCK_D wide, at most
# BACKWARD_MAX_BLOCK_ROWS rows, one stage; (warps, row groups per multiprocessor) by element size.
# H100 sweeps of 2026-11-22, timed as CUDA graph replays (65536x1024 to 1048576x128, bf16 and
# fp32; tiles 8192-32768 values x 16-64 rows, 4-8 warps, 8-16 groups per SM): 32 KB tiles of up
# to 64 rows on 4 warps with 8 groups per SM (bf16) or 8 warps with 8 (fp32) came within 5.5%
# (bf16) and 1% (fp32) of each shape's best, 2290-2710 GB/s; 32 rows at most held bf16 short
# rows to 1970-2010.
BACKWARD_TILE_BYTES = 32768
BACKWARD_MAX_BLOCK_D = 1024
BACKWARD_MAX_BLOCK_ROWS = 64
BACKWARD_NUM_STAGES = 1
BACKWARD_LAUNCH_BY_ITEMSIZE = {2: (4, 8), 4: (8, 8)}
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
    tile_elements = BACKWARD_TILE_BYTES // sizing.element_size(dtype)
    block_rows = min(max(1, tile_elements // block_cols), BACKWARD_MAX_BLOCK_ROWS,
                     sizing.next_power_of_2(n_rows))
    num_warps, per_sm = BACKWARD_LAUNCH_BY_ITEMSIZE[sizing.element_size(dtype)]
    tile = _with_warps(sizing.Tile2D(block_rows, block_cols, num_warps), num_warps)
    col_programs = sizing.cdiv(n_cols, tile.block_cols)
    row_tiles = sizing.cdiv(n_rows, tile.block_rows)
    total = sizing.persistent_grid(row_tiles * col_programs, programs_per_sm=per_sm)
    groups = max(1, min(row_tiles, total // col_programs))
    rows_per_group = sizing.cdiv(row_tiles, groups) * tile.block_rows
    return Plan(tile, sizing.cdiv(n_rows, rows_per_group), col_programs, rows_per_group)

"""Launch table for fk-weightedsum (row tiles x D tiles, fp32 accumulation)."""

from __future__ import annotations

import dataclasses

import torch

from .. import backend, sizing

# Bytes of x one program loads per loop step (a BLOCK_R x BLOCK_D tile).
FORWARD_TILE_BYTES = 16384
BACKWARD_TILE_BYTES = 16384
# Widest D tile: wider tiles only lengthen the per-row reduction, rows give the parallelism.
MAX_BLOCK_D = 1024
# Forward: when row tiles alone give fewer programs than this many per multiprocessor, D is
# split across programs too (partial sums reduced afterwards).
FORWARD_MIN_PROGRAMS_PER_SM = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    tile: sizing.Tile2D
    row_programs: int  # forward: row tiles; backward: row groups
    col_programs: int  # forward: D splits; backward: D tiles
    span: int  # forward: D elements one split covers; backward: rows one group walks


def forward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    tile = sizing.tile_2d(n_rows, n_cols, dtype, FORWARD_TILE_BYTES, MAX_BLOCK_D)
    row_programs = sizing.cdiv(n_rows, tile.block_rows)
    wanted = backend.multiprocessor_count() * FORWARD_MIN_PROGRAMS_PER_SM
    col_tiles = sizing.cdiv(n_cols, tile.block_cols)
    splits = min(col_tiles, max(1, wanted // max(row_programs, 1)))
    # Each split walks a whole number of D tiles.
    tiles_per_split = sizing.cdiv(col_tiles, splits)
    splits = sizing.cdiv(col_tiles, tiles_per_split)
    return Plan(tile, row_programs, splits, tiles_per_split * tile.block_cols)


def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype) -> Plan:
    tile = sizing.tile_2d(n_rows, n_cols, dtype, BACKWARD_TILE_BYTES, MAX_BLOCK_D)
    col_programs = sizing.cdiv(n_cols, tile.block_cols)
    row_tiles = sizing.cdiv(n_rows, tile.block_rows)
    groups = max(1, min(row_tiles, sizing.persistent_grid(row_tiles * col_programs) // col_programs))
    rows_per_group = sizing.cdiv(row_tiles, groups) * tile.block_rows
    return Plan(tile, sizing.cdiv(n_rows, rows_per_group), col_programs, rows_per_group)

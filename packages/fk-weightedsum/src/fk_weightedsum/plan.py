"""fk-weightedsum's plan, top to bottom: its numbers, the tiles of a shape and the launch code that
binds them once per (shape, strides, dtype, device). y = x @ w over the last dim, fp32 accumulation.

- forward: one program per row tile, walking D in BLOCK_D steps; when row tiles alone give fewer
  than FORWARD_MIN_PROGRAMS_PER_SM programs per multiprocessor, D is split across programs too
  and their fp32 partial sums are added afterwards (`fk_runtime.partials.sum_rows`);
- backward: a persistent grid of row groups x D tiles; each program writes grad_x for its rows
  and one fp32 partial row of grad_w, which are summed in a fixed order afterwards.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fk_runtime import alloc, backend, checks, partials, sizing, views
from fk_runtime.launch import PLAN_CACHE_SIZE, Launch, PlanCache, layout_key

from . import kernels

# Forward: elements of x one program loads per loop step (a BLOCK_R x BLOCK_D tile), and tile
# elements per thread by element size (which sets the warps).
# 8192 on 8 warps (bf16) or 4 (fp32): within 0.5% / 3% of each H100 shape's best (TUNING.md).
FORWARD_TILE_ELEMENTS = 8192
FORWARD_ELEMENTS_PER_THREAD_BY_ITEMSIZE = {2: 32, 4: 64}
# Widest forward D tile: wider tiles read longer contiguous runs; 4096 tied or won on every shape.
FORWARD_MAX_BLOCK_D = 4096
# Forward: when row tiles alone give fewer programs than this many per multiprocessor, D is
# split across programs too (partial sums reduced afterwards).
FORWARD_MIN_PROGRAMS_PER_SM = 4
# Backward tile: BACKWARD_TILE_BYTES of x, D up to BACKWARD_MAX_BLOCK_D wide, at most
# BACKWARD_MAX_BLOCK_ROWS rows, one stage; (warps, row groups per multiprocessor) by element size.
# These: within 5.5% (bf16) and 1% (fp32) of each H100 shape's best (TUNING.md).
BACKWARD_TILE_BYTES = 32768
BACKWARD_MAX_BLOCK_D = 1024
BACKWARD_MAX_BLOCK_ROWS = 64
BACKWARD_NUM_STAGES = 1
BACKWARD_LAUNCH_BY_ITEMSIZE = {2: (4, 8), 4: (8, 8)}


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


# ---- launch: a plan bound once per (shape, strides, dtype, device) --------------------------------

BOUND = PlanCache()


def bind_forward_2d(x2: torch.Tensor, weight: torch.Tensor, plan: Plan | None = None):
    """The forward of x2 (rows, D)'s shape, strides, dtype and device: run(x2, weight) -> y (rows,)."""
    n_rows, n_cols = x2.shape
    dtype, device = x2.dtype, x2.device
    if n_rows == 0 or n_cols == 0:
        return lambda x2, weight: torch.zeros(n_rows, dtype=dtype, device=device)
    plan = plan or forward_plan(n_rows, n_cols, dtype)
    split = plan.col_programs > 1
    launch = Launch(kernels.weighted_sum_fwd_kernel, (plan.row_programs, plan.col_programs),
                    (n_rows, n_cols, x2.stride(0), x2.stride(1), weight.stride(0), n_rows, plan.span),
                    dict(BLOCK_R=plan.tile.block_rows, BLOCK_D=plan.tile.block_cols,
                         **sizing.launch_options(plan.tile.num_warps)), device)
    # D split across programs: fp32 partial sums, reduced in a fixed order (deterministic).
    sum_parts = partials.bind_sum_rows(1, plan.col_programs, n_rows, (dtype,), device) if split else None

    fp32 = torch.empty(0, dtype=torch.float32, device=device)

    def run(x2, weight):
        out = alloc.new_empty(fp32 if split else x2, (plan.col_programs, n_rows))
        launch(x2, weight, out)
        return sum_parts(out[None])[0] if split else out[0]

    return run


def bind_backward_2d(grad_y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, plan: Plan | None = None,
                     need_x: bool = True, need_w: bool = True):
    """The backward of one key: run(grad_y (rows,), x2, weight) -> (grad_x (rows, D), grad_w); a
    gradient not needed comes back empty (0 elements) and costs nothing (no grad_w: x is not read)."""
    n_rows, n_cols = x2.shape
    dtype, device = x2.dtype, x2.device
    if n_rows == 0 or n_cols == 0 or not (need_x or need_w):
        grad_x_shape = (n_rows, n_cols) if need_x else (0,)
        return lambda grad_y, x2, weight: (alloc.empty(grad_x_shape, dtype=dtype, device=device),
                                           torch.zeros_like(weight) if need_w else weight.new_empty(0))
    plan = plan or backward_plan(n_rows, n_cols, dtype)
    launch = Launch(kernels.weighted_sum_bwd_kernel, (plan.row_programs, plan.col_programs),
                    (n_rows, n_cols, x2.stride(0), x2.stride(1), weight.stride(0), grad_y.stride(0), n_cols,
                     plan.span),
                    dict(BLOCK_R=plan.tile.block_rows, BLOCK_D=plan.tile.block_cols, NEED_DX=need_x, NEED_DW=need_w,
                         **sizing.launch_options(plan.tile.num_warps, BACKWARD_NUM_STAGES)), device)
    # Row groups reduced in a fixed order: grad_w has the same bits every run.
    sum_parts = partials.bind_sum_rows(1, plan.row_programs, n_cols, (weight.dtype,), device) if need_w else None

    fp32 = torch.empty(0, dtype=torch.float32, device=device)

    def run(grad_y, x2, weight):
        grad_x = alloc.new_empty(x2, (n_rows, n_cols) if need_x else (0,))
        partial = alloc.new_empty(fp32, (plan.row_programs, n_cols) if need_w else (0,))
        launch(x2, weight, grad_y, grad_x, partial)
        return grad_x, sum_parts(partial[None])[0] if need_w else weight.new_empty(0)

    return run


def forward_2d(x2: torch.Tensor, weight: torch.Tensor, plan: Plan | None = None) -> torch.Tensor:
    """y = x2 @ weight for x2 (rows, D), with `plan` forced (tests) or the table's."""
    return bind_forward_2d(x2, weight, plan)(x2, weight)


def backward_2d(grad_y, x2, weight, plan: Plan | None = None, need_x: bool = True, need_w: bool = True):
    return bind_backward_2d(grad_y, x2, weight, plan, need_x, need_w)(grad_y, x2, weight)


def check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """What the kernels take: x (..., D) and weight (D,) of one float dtype and device. The public
    call checks before autocast; the binds check again, once per plan, for callers of the
    registered ops (`torch.ops.fk.weighted_sum`)."""
    checks.check_tensor("x", x, min_dim=1)
    checks.check_tensor("weight", weight, min_dim=1, max_dim=1)
    checks.check_same_dtype(x=x, weight=weight)
    checks.check_same_device(x=x, weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have x's last dim ({x.shape[-1]}) elements, got shape {tuple(weight.shape)}")


def _bind_forward(x: torch.Tensor, weight: torch.Tensor):
    check_inputs(x, weight)
    checks.check_kernel_device("x", x)
    checks.check_kernel_device("weight", weight)
    x2 = views.rows(x)
    is_view = views.in_place(x2, x)
    run2d = bind_forward_2d(x2, weight)
    out_shape = x.shape[:-1]
    return lambda x, weight: run2d(x if is_view else views.rows(x), weight).reshape(out_shape)


def _bind_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool):
    check_inputs(x, weight)
    checks.check_tensor("grad_y", grad_y)
    if grad_y.shape != x.shape[:-1]:
        raise ValueError(f"grad_y must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got {tuple(grad_y.shape)}")
    for name, t in (("grad_y", grad_y), ("x", x), ("weight", weight)):
        checks.check_kernel_device(name, t)
    checks.check_same_device(grad_y=grad_y, x=x, weight=weight)
    checks.check_same_dtype(grad_y=grad_y, x=x, weight=weight)
    x2 = views.rows(x)
    is_view = views.in_place(x2, x)
    run2d = bind_backward_2d(grad_y.reshape(-1), x2, weight, None, need_x, need_w)
    shape = x.shape if need_x else (0,)

    def run(grad_y, x, weight):
        grad_x, grad_w = run2d(grad_y.reshape(-1), x if is_view else views.rows(x), weight)
        return grad_x.reshape(shape), grad_w

    return run


def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight over the last dim, shape x.shape[:-1]."""
    return bound_forward(x, weight)(x, weight)


def bound_forward(x: torch.Tensor, weight: torch.Tensor):
    """run(x, weight) -> y: the forward bound for these inputs' layouts."""
    key = layout_key(x, weight)
    return BOUND.get(key) or BOUND.get_or_build(key, lambda: _bind_forward(x, weight))


def backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool = True, need_w: bool = True):
    """(grad_x like x, contiguous; grad_weight); one not needed (need_x / need_w false) comes back
    empty, uncomputed."""
    key = (*layout_key(x, grad_y, weight), "backward", need_x, need_w)
    run = BOUND.get(key) or BOUND.get_or_build(key, lambda: _bind_backward(grad_y, x, weight, need_x, need_w))
    return run(grad_y, x, weight)

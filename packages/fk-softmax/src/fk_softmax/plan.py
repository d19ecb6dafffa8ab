"""fk-softmax's plan, top to bottom: its numbers, the path and tiles of a shape, and the launch
code that binds them once per (shape, strides, dtype, device, flags). Softmax and log-softmax
share it, forward and backward.

Three paths (`fk_runtime.siblings.RowPath`), by row length:
- fused: rows that fit `sizing.fused_row_block` are held whole in registers, one or a few rows per
  program: one read and one write of HBM per tensor;
- split: longer rows are cut into chunks, one program per (row, chunk). The
  programs of a row ("siblings") publish per-chunk partials (max and sum of exp, or sum of y*g),
  wait for each other, then write their chunk from registers: still one read and one write. This
  needs the siblings resident together, so a row may have at most `max_siblings()` chunks;
- long, in two passes: rows with more chunks than that (on an H100, past 2 x 132 x 4096 = 1.08M
  columns forward and 2.16M backward): a partials kernel, then a kernel that combines the row's
  partials and re-reads its chunk to write it (one more read of the input), over chunks of the
  fused size.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fk_runtime import alloc, checks, siblings, sizing, views
from fk_runtime.launch import PLAN_CACHE_SIZE, Launch, PlanCache, layout_key
from fk_runtime.siblings import RowPath as Path
from fk_runtime.siblings import PROGRAM_WARPS, max_siblings, spin_limit

from . import kernels

# Short rows: a program takes whole rows until it holds at least this many bytes of input.
# 8 KB: within 2% of the best on every H100 row swept; 1.8% ahead of 4 KB on fp32 (TUNING.md).
FUSED_TILE_BYTES = 8192
# Split rows: columns per program, on the sibling protocol's PROGRAM_WARPS (4) warps.
# 4096 on 4 warps: best or within 3% of it in 11 of the 12 H100 cases swept (TUNING.md).
SPLIT_CHUNK_ELEMENTS = 4096
# ... and twice that when it pads the row no more and the row has at most SPLIT_WIDE_MAX_CHUNKS
# of them: on an H100 that gained 2-12% at 8-32 chunks a row, lost 6-10% at 128 (TUNING.md).
SPLIT_WIDE_CHUNK_ELEMENTS = 8192
SPLIT_WIDE_MAX_CHUNKS = 32
# The split forward keeps this many programs on a multiprocessor, by (chunk, element size): the
# occupancy Triton 3.6's registers give (56, 96 and 105-118 registers); 3.8 and 3.9 took 70 and
# 120, one or two programs less: 1.06-1.10x slower on an H100. Not causal rows, which spill at
# these caps (`sizing.register_cap`, TUNING.md).
SPLIT_FORWARD_PROGRAMS_PER_SM = {(4096, 2): 9, (4096, 4): 9, (8192, 2): 5, (8192, 4): 4}
# The backward holds its y and grad_y chunks in their own dtype through the wait, which leaves
# registers for twice the columns: 7% faster than 4096 on the longest rows (TUNING.md).
SPLIT_BACKWARD_CHUNK_ELEMENTS = 8192


def _forward_chunk(n_cols: int) -> int:
    wide, narrow = SPLIT_WIDE_CHUNK_ELEMENTS, SPLIT_CHUNK_ELEMENTS
    wide_chunks = sizing.cdiv(n_cols, wide)
    if wide_chunks <= SPLIT_WIDE_MAX_CHUNKS and wide_chunks * wide <= sizing.cdiv(n_cols, narrow) * narrow:
        return wide
    return narrow


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
    max_registers: int | None = None  # a cap on each thread's registers (maxnreg)


# Plans depend only on the shape and dtype: cached, so a call pays for a dict lookup.
@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan(n_rows: int, n_cols: int, dtype: torch.dtype, backward: bool = False) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None:
        rows = sizing.rows_per_program(n_rows, block, dtype, FUSED_TILE_BYTES)
        return Plan(Path.FUSED, rows, block, 1, 1, sizing.row_warps(rows * block), sizing.cdiv(n_rows, rows), 0)
    chunk, path = SPLIT_BACKWARD_CHUNK_ELEMENTS if backward else _forward_chunk(n_cols), Path.SPLIT
    if sizing.cdiv(n_cols, chunk) > max_siblings():
        chunk, path = sizing.looped_row_block(dtype), Path.LONG
    chunks = sizing.cdiv(n_cols, chunk)
    warps = PROGRAM_WARPS if path is Path.SPLIT else sizing.row_warps(chunk)
    cap = None
    if path is Path.SPLIT and not backward:
        programs = SPLIT_FORWARD_PROGRAMS_PER_SM.get((chunk, sizing.element_size(dtype)))
        cap = sizing.register_cap(programs, warps) if programs else None
    return Plan(path, 1, chunk, chunks, sizing.next_power_of_2(chunks), warps,
                n_rows * chunks, spin_limit(), cap)


# ---- launch: a plan bound once per (shape, strides, dtype, device, flags) -------------------------

BOUND = PlanCache()


def check_dim(x: torch.Tensor, dim, causal) -> int:
    """x's dim to normalize over, as a non-negative int, after the checks the kernels need (a float
    tensor; `causal` masks x[..., i, j] for j > i: the last dim of a tensor of at least 2). The
    public calls check before launching; the binds check again, once per plan, for callers of the
    registered ops (`torch.ops.fk.softmax`)."""
    checks.check_tensor("x", x)
    checks.check_flag("causal", causal)
    d = checks.normalize_dim("dim", dim, x.dim())
    if causal:
        if x.dim() < 2:
            raise ValueError(f"causal=True needs x with at least 2 dims, got shape {tuple(x.shape)}")
        if d != x.dim() - 1:
            raise ValueError(f"causal=True needs dim=-1 (the last dim), got dim={dim}")
    return d


def _bind_forward(x: torch.Tensor, dim: int, causal: bool, log: bool):
    """The forward of one (shape, strides, dtype, device, dim, causal, log): run(x) -> y."""
    dim = check_dim(x, dim, causal)
    checks.check_kernel_device("x", x)
    shape, dtype, device = x.shape, x.dtype, x.device
    if x.numel() == 0:
        return lambda x: alloc.empty(shape, dtype=dtype, device=device)
    x3 = views.around(x, dim)
    is_view = views.in_place(x3, x)
    outer, n_cols, inner = x3.shape
    n_rows, out_outer = outer * inner, n_cols * inner
    seq_rows = x.shape[-2] if causal else 1
    p = plan(n_rows, n_cols, dtype)
    opts = sizing.launch_options(p.num_warps, max_registers=None if causal else p.max_registers)
    sx = x3.stride()
    grid = (p.programs,)
    if p.path is Path.FUSED:
        fused = Launch(kernels.softmax_fwd_rows_kernel, grid, (n_rows, n_cols, inner, seq_rows, *sx, out_outer),
                       dict(BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, CAUSAL=causal, **opts), device)

        def launch(x3, y):
            fused(x3, y)
    elif p.path is Path.SPLIT:
        split = Launch(kernels.softmax_fwd_split_kernel, grid,
                       (n_cols, inner, seq_rows, *sx, out_outer, p.chunks, p.spin_limit),
                       dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, CAUSAL=causal, **opts), device)

        def launch(x3, y):
            arrived, states, stats = siblings.scratch(n_rows, p.chunks, 2, device)
            split(x3, y, stats, arrived, states)
    else:
        partial = Launch(kernels.softmax_fwd_partials_kernel, grid, (n_cols, inner, seq_rows, *sx, p.chunks),
                         dict(CHUNK=p.block_cols, CAUSAL=causal, **opts), device)
        combine = Launch(kernels.softmax_fwd_combine_kernel, grid,
                         (n_cols, inner, seq_rows, *sx, out_outer, p.chunks),
                         dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, CAUSAL=causal, **opts), device)

        def launch(x3, y):
            stats = _partials(2 * p.programs, device)
            partial(x3, stats)
            combine(x3, y, stats)

    def run(x):
        y = alloc.new_empty(x, shape)
        launch(x if is_view else views.around(x, dim), y)
        return y

    return run


def _bind_backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool):
    """The backward of one (shapes, strides, dtype, device, dim, log): run(y, grad_y) -> grad_x."""
    checks.check_tensor("y", y)
    checks.check_tensor("grad_y", grad_y)
    if grad_y.shape != y.shape:
        raise ValueError(f"grad_y must have y's shape {tuple(y.shape)}, got {tuple(grad_y.shape)}")
    dim = check_dim(y, dim, False)
    checks.check_kernel_device("y", y)
    checks.check_same_device(y=y, grad_y=grad_y)
    checks.check_same_dtype(y=y, grad_y=grad_y)
    shape, dtype, device = y.shape, y.dtype, y.device
    if y.numel() == 0:
        return lambda y, g: alloc.empty(shape, dtype=dtype, device=device)
    y3, g3 = views.around(y, dim), views.around(grad_y, dim)
    y_view, g_view = views.in_place(y3, y), views.in_place(g3, grad_y)
    outer, n_cols, inner = y3.shape
    n_rows, out_outer = outer * inner, n_cols * inner
    p = plan(n_rows, n_cols, dtype, backward=True)
    opts = sizing.launch_options(p.num_warps)
    strides = (*y3.stride(), *g3.stride())
    grid = (p.programs,)
    if p.path is Path.FUSED:
        fused = Launch(kernels.softmax_bwd_rows_kernel, grid, (n_rows, n_cols, inner, *strides, out_outer),
                       dict(BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, **opts), device)

        def launch(y3, g3, gx):
            fused(y3, g3, gx)
    elif p.path is Path.SPLIT:
        split = Launch(kernels.softmax_bwd_split_kernel, grid,
                       (n_cols, inner, *strides, out_outer, p.chunks, p.spin_limit),
                       dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, **opts), device)

        def launch(y3, g3, gx):
            arrived, states, parts = siblings.scratch(n_rows, p.chunks, 1, device)
            split(y3, g3, gx, parts, arrived, states)
    else:
        partial = Launch(kernels.softmax_bwd_partials_kernel, grid, (n_cols, inner, *strides, p.chunks),
                         dict(CHUNK=p.block_cols, LOG=log, **opts), device)
        combine = Launch(kernels.softmax_bwd_combine_kernel, grid,
                         (n_cols, inner, *strides, out_outer, p.chunks),
                         dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, **opts), device)

        def launch(y3, g3, gx):
            parts = _partials(p.programs, device)
            partial(y3, g3, parts)
            combine(y3, g3, gx, parts)

    def run(y, grad_y):
        grad_x = alloc.new_empty(y, shape)
        launch(y if y_view else views.around(y, dim), grad_y if g_view else views.around(grad_y, dim), grad_x)
        return grad_x

    return run


def _partials(numel: int, device: torch.device) -> torch.Tensor:
    """The two-pass path's fp32 partials, handed to the kernels as int32 bits (NaN-poisoned in
    tests, so a partial never written shows up)."""
    return alloc.empty(numel, dtype=torch.float32, device=device).view(torch.int32)


def forward(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    """y (contiguous, x's shape) = softmax / log-softmax of x over `dim` (non-negative)."""
    return bound_forward(x, dim, causal, log)(x)


def bound_forward(x: torch.Tensor, dim: int, causal: bool, log: bool):
    """run(x) -> y: the forward bound for x's layout, `dim` and flags."""
    key = (*layout_key(x), dim, causal, log)
    return BOUND.get(key) or BOUND.get_or_build(key, lambda: _bind_forward(x, dim, causal, log))


def backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """grad_x (contiguous, y's shape) from the forward's output y and its gradient."""
    key = (*layout_key(y, grad_y), dim, log, "backward")
    run = BOUND.get(key) or BOUND.get_or_build(key, lambda: _bind_backward(y, grad_y, dim, log))
    return run(y, grad_y)

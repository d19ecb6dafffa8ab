"""Parameter gradients from fp32 partial rows, summed in a fixed order, in one launch.

A kernel that reduces over rows (e.g. the gradient of a per-feature weight or bias) leaves one
fp32 partial row per program group. `sum_rows` adds those rows column by column, in
the same order every run (the same bits every run), and writes each sum in its parameter's
dtype: one small launch for every parameter at once, where `parts.sum(0).to(dtype)` per
parameter takes up to two each (plus the fp32 row between them). Next to a backward of a few
tens of microseconds, those launches were a few percent of its time.

Triton helpers here are `@triton.jit`: import this module only after the backend is chosen (as
op packages' kernels are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import alloc, backend, sizing
from .launch import Launch, PlanCache

# Column tiles: as narrow as it takes for the launch to give every multiprocessor a program
# (between these bounds); each program walks all the partial rows of its tile.
MIN_BLOCK_COLS = 16
MAX_BLOCK_COLS = 256
# Partial rows a program adds per loop step: a tile of about this many fp32 elements.
TILE_ELEMENTS = 2048


@triton.jit
def _sum_rows_kernel(
    parts_ptr, out0_ptr, out1_ptr, n_rows, n_cols,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (tile, s): columns [tile * BLOCK_D, ...) of set s of the (sets, n_rows, n_cols) fp32
    partials, summed over the rows into out{s}."""
    tile = tl.program_id(0)
    which = tl.program_id(1)
    cols = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    base = parts_ptr + which.to(tl.int64) * n_rows * n_cols
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(out0_ptr + cols, total.to(out0_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(out1_ptr + cols, total.to(out1_ptr.dtype.element_ty), mask=col_mask)


def _block_cols(n_cols: int, sets: int) -> int:
    wanted = max(1, n_cols * sets // backend.multiprocessor_count())
    block = sizing.next_power_of_2(wanted)
    if block > wanted:
        block //= 2  # round down: at least one program per multiprocessor
    return max(MIN_BLOCK_COLS, min(block, MAX_BLOCK_COLS, sizing.next_power_of_2(n_cols)))


def bind_sum_rows(sets: int, n_rows: int, n_cols: int, dtypes: tuple[torch.dtype, ...], device: torch.device):
    """`sum_rows` for one (sets, rows, cols, dtypes, device), bound once: run(parts) -> sums."""
    if sets != len(dtypes) or sets not in (1, 2) or n_rows < 1:
        raise ValueError(f"parts must hold 1 or 2 sets (one dtype each) of at least one row, got "
                         f"{(sets, n_rows, n_cols)} with {len(dtypes)} dtypes")
    block_cols = _block_cols(n_cols, sets)
    block_rows = min(sizing.next_power_of_2(n_rows), max(1, TILE_ELEMENTS // block_cols))
    launch = Launch(_sum_rows_kernel, (sizing.cdiv(n_cols, block_cols), sets), (n_rows, n_cols),
                    dict(BLOCK_R=block_rows, BLOCK_D=block_cols, **sizing.launch_options(sizing.MIN_WARPS)),
                    device)

    protos = [torch.empty(0, dtype=dtype, device=device) for dtype in dtypes]

    def run(parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # NaN-poisoned under test like every op output: a column the kernel misses shows up.
        outs = tuple(alloc.new_empty(proto, (n_cols,)) for proto in protos)
        if n_cols:
            launch(parts, outs[0], outs[-1])
        return outs

    return run


_BOUND = PlanCache()


def sum_rows(parts: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...]:
    """`parts`: contiguous fp32 (sets, rows, cols), one or two sets with at least one row. Returns
    one (cols,) tensor per set, set s in `dtypes[s]`: the sum over its rows, in a fixed order."""
    if parts.dtype != torch.float32 or parts.dim() != 3 or not parts.is_contiguous():
        raise ValueError(f"parts must be a contiguous fp32 (sets, rows, cols) tensor, got "
                         f"{tuple(parts.shape)} {parts.dtype}")
    key = (parts.shape, tuple(dtypes), parts.device)
    run = _BOUND.get(key) or _BOUND.get_or_build(key, lambda: bind_sum_rows(*parts.shape, tuple(dtypes),
                                                                            parts.device))
    return run(parts)

"""Output allocation for kernels, with optional poisoning for tests.

Every op allocates the tensors its kernels write through `empty`. Under `poisoned_outputs()` (the
test harness turns it on) those tensors start full of NaN, so an element a kernel forgot to write
shows up as NaN in the comparison instead of hiding behind whatever memory happened to hold.
"""

from __future__ import annotations

import contextlib
import math

import torch

_poison = False


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison and out.is_floating_point():
        out.fill_(math.nan)
    return out


def new_empty(like: torch.Tensor, shape) -> torch.Tensor:
    """A contiguous tensor of `shape` in `like`'s dtype and on its device: what bound launch plans
    allocate per call (no dtype or device to parse: a few microseconds less than `empty`)."""
    out = like.new_empty(shape)
    if _poison and out.is_floating_point():
        out.fill_(math.nan)
    return out


def new_empty_strided(like: torch.Tensor, shape, strides) -> torch.Tensor:
    """`new_empty` with the given strides (an output laid out like an input), a tensor of its own
    (no view of a larger one)."""
    out = like.new_empty_strided(shape, strides)
    if _poison and out.is_floating_point():
        out.fill_(math.nan)
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor shaped like `t` (its strides are not copied)."""
    return empty(t.shape, dtype=dtype or t.dtype, device=t.device)


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    global _poison
    previous, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = previous


def poisoning() -> bool:
    return _poison

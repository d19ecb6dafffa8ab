"""The views kernels read: a tensor as (rows, features) or as (outer, n, inner) around one dim.

`reshape` gives a view whenever the strides allow one and a copy only when they do not (the same
rule einops' `rearrange` follows; it calls `reshape`). These views sit on every launch path, where
host time is part of the speed of kernels that take tens of microseconds; einops adds a pattern
lookup per call on top (microseconds: shared/TUNING.md), so the launch paths call `reshape`
directly.
"""

from __future__ import annotations

import math

import torch


def rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, last dim): einops' `"... d -> (...) d"`."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def around(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` as (dims before `dim`, `dim`, dims after `dim`), `dim` non-negative: the reduced dim in
    the middle, so no dim is moved."""
    shape = t.shape
    return t.reshape(math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]))


def in_place(view: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `view` (from `rows` or `around`) reads t's own memory rather than a copy: the same
    for every tensor of t's shape and strides, so a bound launch decides it once."""
    return view.numel() == 0 or view.data_ptr() == t.data_ptr()

"""Launchers, `torch.library` ops and autograd for softmax and log-softmax.

Path of a call: checks (fk_runtime) -> autograd.Function -> rows view (dim moved last, einops) ->
plan (fk_runtime.tuning.softmax: whole rows or chunks) -> kernels. Eager calls reach the launchers
directly; under `torch.compile` they go through the registered ops (fk_runtime.dispatch).
"""

from __future__ import annotations

import torch
from einops import rearrange
from fk_runtime import alloc, checks, dispatch
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import softmax as plans

from . import kernels


def _moved(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == x.dim() - 1 else x.movedim(dim, -1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, n) view of a tensor whose softmax dim is last: a view whenever strides allow."""
    return rearrange(t, "... n -> (...) n")


def _new_output(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Output laid out contiguously with `dim` last, returned in x's dim order."""
    out = alloc.empty(_moved(x, dim).shape, dtype=x.dtype, device=x.device)
    return out if dim == x.dim() - 1 else out.movedim(-1, dim)


def forward_rows(x2: torch.Tensor, y2: torch.Tensor, seq_rows: int, log: bool, causal: bool) -> None:
    n_rows, n_cols = x2.shape
    p = plans.plan(n_rows, n_cols, x2.dtype)
    opts = fk_sizing.launch_options(p.num_warps)
    if p.fused:
        kernels.softmax_fwd_rows_kernel[(fk_sizing.cdiv(n_rows, p.block_rows),)](
            x2, y2, n_rows, n_cols, seq_rows, x2.stride(0), x2.stride(1), y2.stride(0),
            BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, CAUSAL=causal, **opts,
        )
        return
    if p.looped:
        kernels.softmax_fwd_looped_kernel[(n_rows,)](
            x2, y2, n_cols, seq_rows, x2.stride(0), x2.stride(1), y2.stride(0),
            CHUNK=p.block_cols, LOG=log, CAUSAL=causal, **opts,
        )
        return
    stats = torch.empty((2, n_rows, p.chunks), dtype=torch.float32, device=x2.device)
    grid = (p.chunks, n_rows)
    kernels.softmax_fwd_chunk_stats_kernel[grid](
        x2, stats[0], stats[1], n_cols, seq_rows, x2.stride(0), x2.stride(1), p.chunks,
        CHUNK=p.block_cols, CAUSAL=causal, **opts,
    )
    kernels.softmax_fwd_chunk_write_kernel[grid](
        x2, y2, stats[0], stats[1], n_cols, seq_rows, x2.stride(0), x2.stride(1), y2.stride(0),
        p.chunks, CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, CAUSAL=causal, **opts,
    )


def backward_rows(y2: torch.Tensor, g2: torch.Tensor, gx2: torch.Tensor, log: bool) -> None:
    n_rows, n_cols = y2.shape
    p = plans.plan(n_rows, n_cols, y2.dtype)
    opts = fk_sizing.launch_options(p.num_warps)
    if p.fused:
        kernels.softmax_bwd_rows_kernel[(fk_sizing.cdiv(n_rows, p.block_rows),)](
            y2, g2, gx2, n_rows, n_cols, y2.stride(0), g2.stride(0), g2.stride(1), gx2.stride(0),
            BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, **opts,
        )
        return
    if p.looped:
        kernels.softmax_bwd_looped_kernel[(n_rows,)](
            y2, g2, gx2, n_cols, y2.stride(0), g2.stride(0), g2.stride(1), gx2.stride(0),
            CHUNK=p.block_cols, LOG=log, **opts,
        )
        return
    dots = torch.empty((n_rows, p.chunks), dtype=torch.float32, device=y2.device)
    grid = (p.chunks, n_rows)
    kernels.softmax_bwd_chunk_dot_kernel[grid](
        y2, g2, dots, n_cols, y2.stride(0), g2.stride(0), g2.stride(1), p.chunks,
        CHUNK=p.block_cols, LOG=log, **opts,
    )
    kernels.softmax_bwd_chunk_write_kernel[grid](
        y2, g2, gx2, dots, n_cols, y2.stride(0), g2.stride(0), g2.stride(1), gx2.stride(0),
        p.chunks, CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, **opts,
    )


def _forward(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    checks.check_kernel_device("x", x)
    y = _new_output(x, dim)
    if x.numel() == 0:
        return y
    seq_rows = x.shape[-2] if causal else 1
    forward_rows(_rows(_moved(x, dim)), _rows(_moved(y, dim)), seq_rows, log, causal)
    return y


def _backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    grad_x = _new_output(y, dim)
    if y.numel() == 0:
        return grad_x
    backward_rows(_rows(_moved(y, dim)), _rows(_moved(grad_y, dim)), _rows(_moved(grad_x, dim)), log)
    return grad_x


@torch.library.custom_op("fk::softmax", mutates_args=())
def softmax_op(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    return _forward(x, dim, causal, log)


@softmax_op.register_fake
def _(x, dim, causal, log):
    return _new_output(x, dim)


@torch.library.custom_op("fk::softmax_backward", mutates_args=())
def softmax_backward_op(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _backward(y, grad_y, dim, log)


@softmax_backward_op.register_fake
def _(y, grad_y, dim, log):
    return _new_output(y, dim)


_run_forward = dispatch.eager_or_op(softmax_op, _forward)
_run_backward = dispatch.eager_or_op(softmax_backward_op, _backward)


class SoftmaxFunction(torch.autograd.Function):
    """Saves only the output: softmax's gradient needs y, log-softmax's needs exp(y)."""

    @staticmethod
    def forward(ctx, x, dim, causal, log):
        y = _run_forward(x, dim, causal, log)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log = dim, log
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return _run_backward(y, grad_y, ctx.dim, ctx.log), None, None, None


def _checked_dim(x, dim: int, causal: bool) -> int:
    checks.check_tensor("x", x)
    d = checks.normalize_dim("dim", dim, x.dim())
    if causal:
        if x.dim() < 2:
            raise ValueError(f"causal=True needs x with at least 2 dims, got shape {tuple(x.shape)}")
        if d != x.dim() - 1:
            raise ValueError(f"causal=True needs dim=-1 (the last dim), got dim={dim}")
    return d


def _apply(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    d = _checked_dim(x, dim, causal)
    if x.dim() == 0:
        return SoftmaxFunction.apply(x.reshape(1), 0, False, log).reshape(())
    return SoftmaxFunction.apply(x, d, causal, log)


def softmax(x: torch.Tensor, dim: int = -1, causal: bool = False) -> torch.Tensor:
    """`torch.softmax(x, dim)`, optionally masking x[..., i, j] for j > i (`causal`, last dim only).

    fp32/fp16/bf16 with fp32 math, any row length, any dim, strided inputs; the backward saves only
    the output."""
    return _apply(x, dim, causal, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.log_softmax(x, dim)`, same coverage as `softmax`."""
    return _apply(x, dim, False, True)

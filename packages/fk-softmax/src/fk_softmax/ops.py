"""Launchers, `torch.library` ops and autograd for softmax and log-softmax.

Path of a call: checks (fk_runtime) -> autograd.Function -> (outer, n, inner) view of the input
(fk_runtime.views; the softmax dim in the middle, so no dim is moved or copied) -> plan
(fk_runtime.tuning.softmax: fused rows, split rows or two passes) -> kernels. Eager calls reach
the launchers directly; under `torch.compile` they go through the registered ops
(fk_runtime.dispatch).
"""

from __future__ import annotations


import torch
from fk_runtime import alloc, checks, dispatch, siblings, views
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import softmax as plans

from . import kernels


def _partials(numel: int, device: torch.device) -> torch.Tensor:
    """The two-pass path's fp32 partials, handed to the kernels as int32 bits (NaN-poisoned in
    tests, so a partial never written shows up)."""
    return alloc.empty(numel, dtype=torch.float32, device=device).view(torch.int32)


def forward_rows(x3: torch.Tensor, y: torch.Tensor, seq_rows: int, log: bool, causal: bool) -> None:
    """y (contiguous, same layout as x3) = softmax of x3 over its middle dim."""
    outer, n_cols, inner = x3.shape
    n_rows = outer * inner
    p = plans.plan(n_rows, n_cols, x3.dtype)
    opts = fk_sizing.launch_options(p.num_warps)
    sx = x3.stride()
    out_outer = n_cols * inner
    if p.path is plans.Path.FUSED:
        kernels.softmax_fwd_rows_kernel[(p.programs,)](
            x3, y, n_rows, n_cols, inner, seq_rows, *sx, out_outer,
            BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, CAUSAL=causal, **opts,
        )
    elif p.path is plans.Path.SPLIT:
        arrived, states, stats = siblings.scratch(n_rows, p.chunks, 2, x3.device)
        kernels.softmax_fwd_split_kernel[(p.programs,)](
            x3, y, stats, arrived, states, n_cols, inner, seq_rows, *sx, out_outer, p.chunks,
            p.spin_limit, CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, CAUSAL=causal, **opts,
        )
    else:
        stats = _partials(2 * p.programs, x3.device)
        kernels.softmax_fwd_partials_kernel[(p.programs,)](
            x3, stats, n_cols, inner, seq_rows, *sx, p.chunks, CHUNK=p.block_cols, CAUSAL=causal, **opts,
        )
        kernels.softmax_fwd_combine_kernel[(p.programs,)](
            x3, y, stats, n_cols, inner, seq_rows, *sx, out_outer, p.chunks,
            CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, CAUSAL=causal, **opts,
        )


def backward_rows(y3: torch.Tensor, g3: torch.Tensor, gx: torch.Tensor, log: bool) -> None:
    """gx (contiguous, same layout as y3) = gradient of the input from y3 and grad_y g3."""
    outer, n_cols, inner = y3.shape
    n_rows = outer * inner
    p = plans.plan(n_rows, n_cols, y3.dtype, backward=True)
    opts = fk_sizing.launch_options(p.num_warps)
    sy, sg = y3.stride(), g3.stride()
    out_outer = n_cols * inner
    if p.path is plans.Path.FUSED:
        kernels.softmax_bwd_rows_kernel[(p.programs,)](
            y3, g3, gx, n_rows, n_cols, inner, *sy, *sg, out_outer,
            BLOCK_R=p.block_rows, BLOCK_C=p.block_cols, LOG=log, **opts,
        )
    elif p.path is plans.Path.SPLIT:
        arrived, states, parts = siblings.scratch(n_rows, p.chunks, 1, y3.device)
        kernels.softmax_bwd_split_kernel[(p.programs,)](
            y3, g3, gx, parts, arrived, states, n_cols, inner, *sy, *sg, out_outer, p.chunks,
            p.spin_limit, CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, **opts,
        )
    else:
        parts = _partials(p.programs, y3.device)
        kernels.softmax_bwd_partials_kernel[(p.programs,)](
            y3, g3, parts, n_cols, inner, *sy, *sg, p.chunks, CHUNK=p.block_cols, LOG=log, **opts,
        )
        kernels.softmax_bwd_combine_kernel[(p.programs,)](
            y3, g3, gx, parts, n_cols, inner, *sy, *sg, out_outer, p.chunks,
            CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, LOG=log, **opts,
        )


def _new_output(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, in t's shape: the layout the kernels write."""
    return alloc.empty(t.shape, dtype=t.dtype, device=t.device)


def _forward(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    checks.check_kernel_device("x", x)
    y = _new_output(x)
    if x.numel() > 0:
        forward_rows(views.around(x, dim), y, x.shape[-2] if causal else 1, log, causal)
    return y


def _backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    grad_x = _new_output(y)
    if y.numel() > 0:
        backward_rows(views.around(y, dim), views.around(grad_y, dim), grad_x, log)
    return grad_x


@torch.library.custom_op("fk::softmax", mutates_args=())
def softmax_op(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    return _forward(x, dim, causal, log)


@softmax_op.register_fake
def _(x, dim, causal, log):
    return _new_output(x)


@torch.library.custom_op("fk::softmax_backward", mutates_args=())
def softmax_backward_op(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _backward(y, grad_y, dim, log)


@softmax_backward_op.register_fake
def _(y, grad_y, dim, log):
    return _new_output(y)


_run_forward = dispatch.eager_or_op(softmax_op, _forward)
_run_backward = dispatch.gradients_eager_or_op(softmax_backward_op, _backward, "fk::softmax_backward")


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

    fp32/fp16/bf16 with fp32 math, any row length, any dim, strided inputs; the output is
    contiguous in x's shape; the backward saves only the output."""
    return _apply(x, dim, causal, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.log_softmax(x, dim)`, same coverage as `softmax`."""
    return _apply(x, dim, False, True)

"""Launchers, `torch.library` ops and autograd for LayerNorm and RMSNorm.

Path of a call: checks (fk_runtime) -> autograd.Function -> rows view (fk_runtime.views) -> plan
(fk_runtime.tuning.layernorm: whole rows or chunks) -> kernels. The forward writes per-row
statistics only when autograd will need them; backward saves x itself and those statistics.
Eager calls reach the launchers directly; under `torch.compile` they go through the registered
ops (fk_runtime.dispatch).
"""

from __future__ import annotations

from typing import Optional

import torch
from fk_runtime import alloc, checks, dispatch, partials, siblings, views
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import layernorm as plans

from . import kernels



def _flags(weight, bias, is_rms: bool, stable: bool) -> dict:
    return dict(IS_RMS=is_rms, STABLE=stable, HAS_W=weight is not None, HAS_B=bias is not None)


def _stats(n_rows: int, device, save: bool) -> torch.Tensor:
    """(mean, rstd, row_max) per row, fp32; an empty placeholder when nothing is saved."""
    return torch.empty((3, n_rows) if save else (3, 1), dtype=torch.float32, device=device)


def _forward(x, weight, bias, eps: float, is_rms: bool, stable: bool, save_stats: bool):
    checks.check_kernel_device("x", x)
    y = alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, y2 = views.rows(x), views.rows(y)
    n_rows, n_cols = x2.shape
    stats = _stats(n_rows, x.device, save_stats)
    if x.numel() == 0:
        return y, stats
    p = plans.forward_plan(n_rows, n_cols, x.dtype, is_rms)
    common = dict(**_flags(weight, bias, is_rms, stable), SAVE_STATS=save_stats,
                  **fk_sizing.launch_options(p.num_warps))
    # The kernels read parameters as contiguous vectors (a strided one is D elements to copy).
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    if p.path is plans.Path.FUSED:
        kernels.norm_fwd_fused_kernel[(fk_sizing.cdiv(n_rows, p.block_rows),)](
            x2, w, b, y2, stats[0], stats[1], stats[2], n_rows, n_cols, 1.0 / n_cols,
            x2.stride(0), x2.stride(1), y2.stride(0), eps,
            BLOCK_R=p.block_rows, BLOCK_D=p.block_cols, **common,
        )
    elif p.path is plans.Path.SPLIT:
        arrived, states, parts = siblings.scratch(n_rows, p.chunks, kernels.FWD_PARTIALS.value, x.device)
        kernels.norm_fwd_split_kernel[(n_rows * p.chunks,)](
            x2, w, b, y2, stats[0], stats[1], stats[2], parts, arrived, states, n_cols, 1.0 / n_cols,
            x2.stride(0), x2.stride(1), y2.stride(0), eps, p.chunks, p.spin_limit,
            CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, **common,
        )
    else:
        kernels.norm_fwd_looped_kernel[(n_rows,)](
            x2, w, b, y2, stats[0], stats[1], stats[2], n_cols, 1.0 / n_cols,
            x2.stride(0), x2.stride(1), y2.stride(0), eps, BLOCK_D=p.block_cols, **common,
        )
    return y, stats


def _absent(x: torch.Tensor) -> torch.Tensor:
    """Placeholder gradient for a parameter that is None (a custom op returns tensors only; each
    placeholder is its own tensor, since outputs may not alias)."""
    return x.new_empty(0)


def _backward(grad_y, x, weight, bias, stats, is_rms: bool, stable: bool):
    grad_x = alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        zeros = [torch.zeros_like(p) if p is not None else _absent(x) for p in (weight, bias)]
        return grad_x, zeros[0], zeros[1]
    x2, dy2, dx2 = views.rows(x), views.rows(grad_y), views.rows(grad_x)
    n_rows, n_cols = x2.shape
    p = plans.backward_plan(n_rows, n_cols, x.dtype, stable, is_rms)
    flags = _flags(weight, bias, is_rms, stable)
    # fp32 partial sums (groups x features) only for the parameters there are; where one is
    # absent its kernel argument is a stand-in fp32 tensor that no store reaches (HAS_W, HAS_B).
    parts = torch.empty((sum(t is not None for t in (weight, bias)), p.groups, n_cols),
                        dtype=torch.float32, device=x.device)
    w_parts = parts[0] if weight is not None else stats
    b_parts = parts[-1] if bias is not None else stats
    w = weight.contiguous() if weight is not None else x2
    if p.path is plans.Path.SPLIT:
        arrived, states, sums = siblings.scratch(n_rows, p.chunks, kernels.BWD_PARTIALS.value, x.device)
        kernels.norm_bwd_split_kernel[(p.groups * p.chunks,)](
            x2, w, dy2, dx2, stats[0], stats[1], w_parts, b_parts, sums, arrived, states,
            n_rows, n_cols, 1.0 / n_cols, x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
            dx2.stride(0), p.groups, p.chunks, p.spin_limit, CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2,
            BATCH_ROWS=p.batch_rows,
            IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None,
            **fk_sizing.launch_options(p.num_warps),
        )
    elif p.path is plans.Path.FUSED:
        kernels.norm_bwd_fused_kernel[(p.groups,)](
            x2, w, dy2, dx2, stats[0], stats[1], stats[2], w_parts, b_parts, n_rows, n_cols, 1.0 / n_cols,
            x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1), dx2.stride(0), p.rows_per_group,
            BLOCK_R=p.block_rows, BLOCK_D=p.block_cols, PREFETCH=p.prefetch, RECOMPUTE=p.recompute,
            **flags,
            **fk_sizing.launch_options(p.num_warps, plans.BACKWARD_NUM_STAGES),
        )
    else:
        kernels.norm_bwd_looped_dx_kernel[(n_rows,)](
            x2, w, dy2, dx2, stats[0], stats[1], stats[2], n_cols, 1.0 / n_cols,
            x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1), dx2.stride(0),
            BLOCK_D=p.block_cols, IS_RMS=is_rms, STABLE=stable, HAS_W=weight is not None,
            **fk_sizing.launch_options(p.num_warps),
        )
        if weight is not None or bias is not None:
            kernels.norm_bwd_params_kernel[(p.groups, p.col_tiles)](
                x2, dy2, stats[0], stats[1], stats[2], w_parts, b_parts, n_rows, n_cols,
                x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1), p.rows_per_group,
                BLOCK_R=p.params_block_rows, BLOCK_D=p.params_block_cols,
                **flags, **fk_sizing.launch_options(p.params_num_warps),
            )
    if weight is None and bias is None:
        return grad_x, _absent(x), _absent(x)
    # Group partials reduced in a fixed order: the same bits every run.
    sums = partials.sum_rows(parts, tuple(t.dtype for t in (weight, bias) if t is not None))
    grad_w = sums[0] if weight is not None else _absent(x)
    grad_b = sums[-1] if bias is not None else _absent(x)
    return grad_x, grad_w, grad_b


@torch.library.custom_op("fk::norm", mutates_args=())
def norm_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,  # noqa: UP045
    is_rms: bool, stable: bool, save_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, bias, eps, is_rms, stable, save_stats)


@norm_op.register_fake
def _(x, weight, bias, eps, is_rms, stable, save_stats):
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape), x.new_empty((3, n_rows) if save_stats else (3, 1), dtype=torch.float32)


@torch.library.custom_op("fk::norm_backward", mutates_args=())
def norm_backward_op(
    grad_y: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],  # noqa: UP045
    bias: Optional[torch.Tensor], stats: torch.Tensor, is_rms: bool, stable: bool,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_y, x, weight, bias, stats, is_rms, stable)


@norm_backward_op.register_fake
def _(grad_y, x, weight, bias, stats, is_rms, stable):
    return (x.new_empty(x.shape), _absent(x) if weight is None else weight.new_empty(weight.shape),
            _absent(x) if bias is None else bias.new_empty(bias.shape))


_run_forward = dispatch.eager_or_op(norm_op, _forward)
_run_backward = dispatch.gradients_eager_or_op(norm_backward_op, _backward, "fk::norm_backward")


class NormFunction(torch.autograd.Function):
    """Saves x (the caller's tensor, no copy), the parameters and per-row statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, stable):
        save = any(ctx.needs_input_grad[:3])
        y, stats = _run_forward(x, weight, bias, eps, is_rms, stable, save)
        ctx.save_for_backward(x, weight, bias, stats)
        ctx.is_rms, ctx.stable = is_rms, stable
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, stats = ctx.saved_tensors
        grad_x, grad_w, grad_b = _run_backward(grad_y, x, weight, bias, stats, ctx.is_rms, ctx.stable)
        return (grad_x, grad_w if weight is not None else None, grad_b if bias is not None else None,
                None, None, None)


def _check(x, weight, bias, eps):
    checks.check_tensor("x", x, min_dim=1)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            checks.check_tensor(name, p, min_dim=1, max_dim=1)
            if p.shape[0] != x.shape[-1]:
                raise ValueError(
                    f"{name} must have x's last dim ({x.shape[-1]}) elements, got shape {tuple(p.shape)}"
                )
    checks.check_same_device(x=x, weight=weight, bias=bias)
    checks.check_same_dtype(weight=weight, bias=bias)
    checks.check_positive("eps", eps)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, stable: bool = False) -> torch.Tensor:
    """LayerNorm over the last dim (`torch.nn.functional.layer_norm(x, x.shape[-1:], ...)`).

    `stable=True` divides each row by its max first (the seed's meaning), with the gradient
    flowing through the division. fp32 statistics for every dtype."""
    _check(x, weight, bias, eps)
    return NormFunction.apply(x, weight, bias, float(eps), False, stable)


def default_rms_eps(x: torch.Tensor) -> float:
    """torch's RMSNorm epsilon when none is given: the machine epsilon of the math dtype, fp32
    for 16-bit inputs (not the input dtype's own, which is 7.8e-3 for bf16)."""
    return torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


def rms_norm(x, weight=None, eps: float | None = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (`torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)`);
    `eps=None` is torch's default (`default_rms_eps`)."""
    if eps is None and isinstance(x, torch.Tensor):
        eps = default_rms_eps(x)
    _check(x, weight, None, eps)
    return NormFunction.apply(x, weight, None, float(eps), True, False)

"""Launchers, `torch.library` ops and autograd for the weighted sum.

Path of a call: checks (fk_runtime) -> autograd.Function -> rows view (fk_runtime.views) -> plan
(fk_runtime.tuning) -> kernel. Eager calls reach the launchers directly; under `torch.compile`
they go through the registered ops (opaque, with fake implementations), so compiled graphs call
the same kernels without a graph break (fk_runtime.dispatch).
"""

from __future__ import annotations

import torch
from fk_runtime import alloc, checks, dispatch, partials, views
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import weightedsum as plans

from .kernels import weighted_sum_bwd_kernel, weighted_sum_fwd_kernel



def forward_2d(x2: torch.Tensor, weight: torch.Tensor, plan: plans.Plan | None = None) -> torch.Tensor:
    n_rows, n_cols = x2.shape
    if n_rows == 0 or n_cols == 0:
        return torch.zeros(n_rows, dtype=x2.dtype, device=x2.device)
    plan = plan or plans.forward_plan(n_rows, n_cols, x2.dtype)
    if plan.col_programs == 1:
        out = alloc.empty((1, n_rows), dtype=x2.dtype, device=x2.device)
    else:
        out = alloc.empty((plan.col_programs, n_rows), dtype=torch.float32, device=x2.device)
    weighted_sum_fwd_kernel[(plan.row_programs, plan.col_programs)](
        x2, weight, out,
        n_rows, n_cols,
        x2.stride(0), x2.stride(1), weight.stride(0), out.stride(0),
        plan.span,
        BLOCK_R=plan.tile.block_rows, BLOCK_D=plan.tile.block_cols,
        **fk_sizing.launch_options(plan.tile.num_warps),
    )
    # Partial sums over D splits, reduced in a fixed order (deterministic).
    return out[0] if plan.col_programs == 1 else partials.sum_rows(out[None], (x2.dtype,))[0]


def backward_2d(
    grad_y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, plan: plans.Plan | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x2.shape
    grad_x = alloc.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    if n_rows == 0 or n_cols == 0:
        return grad_x, torch.zeros_like(weight)
    plan = plan or plans.backward_plan(n_rows, n_cols, x2.dtype)
    partial = alloc.empty((plan.row_programs, n_cols), dtype=torch.float32, device=x2.device)
    weighted_sum_bwd_kernel[(plan.row_programs, plan.col_programs)](
        x2, weight, grad_y, grad_x, partial,
        n_rows, n_cols,
        x2.stride(0), x2.stride(1), weight.stride(0), grad_y.stride(0), grad_x.stride(0),
        plan.span,
        BLOCK_R=plan.tile.block_rows, BLOCK_D=plan.tile.block_cols,
        **fk_sizing.launch_options(plan.tile.num_warps, plans.BACKWARD_NUM_STAGES),
    )
    # Row groups reduced in a fixed order: grad_w has the same bits every run.
    return grad_x, partials.sum_rows(partial[None], (weight.dtype,))[0]


def _forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    checks.check_kernel_device("x", x)
    checks.check_kernel_device("weight", weight)
    return forward_2d(views.rows(x), weight).reshape(x.shape[:-1])


def _backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    grad_x, grad_w = backward_2d(grad_y.reshape(-1), views.rows(x), weight)
    return grad_x.reshape(x.shape), grad_w


@torch.library.custom_op("fk::weighted_sum", mutates_args=())
def weighted_sum_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _forward(x, weight)


@weighted_sum_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[:-1])


@torch.library.custom_op("fk::weighted_sum_backward", mutates_args=())
def weighted_sum_backward_op(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad_y, x, weight)


@weighted_sum_backward_op.register_fake
def _(grad_y, x, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


_run_forward = dispatch.eager_or_op(weighted_sum_op, _forward)
_run_backward = dispatch.gradients_eager_or_op(weighted_sum_backward_op, _backward,
                                               "fk::weighted_sum_backward")


class WeightedSumFunction(torch.autograd.Function):
    """Autograd for the weighted sum: saves x and weight (no copies), one backward kernel."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _run_forward(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _run_backward(grad_y, x, weight)
        return (
            grad_x if ctx.needs_input_grad[0] else None,
            grad_w if ctx.needs_input_grad[1] else None,
        )


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight` over the last dim: `x[..., D]`, `weight[D]` -> `[...]`.

    fp32 / fp16 / bf16 with fp32 accumulation; any leading dims; strided `x` is read through its
    strides (copied only when its leading dims cannot be merged into one). Differentiable in both
    arguments; the backward reads x once.
    """
    checks.check_tensor("x", x, min_dim=1)
    checks.check_tensor("weight", weight, min_dim=1, max_dim=1)
    checks.check_same_dtype(x=x, weight=weight)
    checks.check_same_device(x=x, weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have x's last dim ({x.shape[-1]}) elements, got shape {tuple(weight.shape)}"
        )
    return WeightedSumFunction.apply(x, weight)

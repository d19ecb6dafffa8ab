"""softmax and log_softmax: checks, then the differentiable op (fk_runtime.ops.define).

Path of a call: metadata checks -> `fk::softmax` (eager: its autograd.Function straight into
`plan.forward`, a bound launch cached per shape, strides, dtype, device and flags) -> kernels.
The backward saves only the output: softmax's gradient needs y, log-softmax's needs exp(y).
Calls that autograd does not record go straight to their key's bound forward once a call of that
key passed the checks (`fk_runtime.ops.quiet_key`); calls it records, to the autograd.Function around
their key's bound forward.
"""

from __future__ import annotations

import torch
from fk_runtime import ahead
from fk_runtime import ops as fk_ops
from fk_runtime.launch import PlanCache

from . import plan


def _forward(x: torch.Tensor, dim: int, causal: bool, log: bool) -> torch.Tensor:
    return plan.forward(x, dim, causal, log)


def _forward_fake(x, dim, causal, log):
    return x.new_empty(x.shape)


def _backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return plan.backward(y, grad_y, dim, log)


def _backward_fake(y, grad_y, dim, log):
    return y.new_empty(y.shape)


SOFTMAX = fk_ops.define(
    "softmax",
    forward=_forward, forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake,
    save=lambda inputs, outputs: ((outputs[0],), (inputs[1], inputs[3])),
    backward_args=lambda saved, other, grads, needs: (saved[0], grads[0], *other),
    input_grads=lambda other, grad_x, needs: (grad_x, None, None, None),
    bound_inputs=1,
)


# What the kernels compile for, whose backward was bound and compiled ahead (`_backward_ahead`).
AHEAD = PlanCache()


def _backward_ahead(x: torch.Tensor, dim: int, log: bool) -> None:
    """On a call that autograd records, bind the backward now so that its kernel compiles in a
    thread while the forward's compiles (`fk_runtime.ahead`), for the upstream gradients a first
    backward brings: laid out like y, and one value broadcast over y (`y.sum().backward()`). Once
    per what the kernels compile for (dtype, row length, whether the rows are the last dim, device)."""
    key = (x.dtype, x.shape[dim], dim == x.dim() - 1, log, x.device)
    if not ahead.first(AHEAD, key, x):
        return
    y = x.new_empty(x.shape)
    with ahead.compile_ahead():
        for grad_y in ahead.upstream_gradients(y):
            plan.backward(y, grad_y, dim, log)


def _apply(x: torch.Tensor, dim, causal, log: bool) -> torch.Tensor:
    key, run = fk_ops.quiet_run(plan.BOUND, "log_softmax" if log else "softmax", (x,), (dim, causal))
    if run:
        return run(x)
    d = plan.check_dim(x, dim, causal)
    if x.dim() == 0:
        y = SOFTMAX.apply(x.reshape(1), 0, False, log).reshape(())
        return y if y.requires_grad else y.detach()  # a tensor of its own, as torch's (not a view)
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: plan.bound_forward(x, d, bool(causal), log),
                            lambda: _recorded(x, d, bool(causal), log))
    if run:  # checked: this key's calls go straight to the plan, or to the autograd.Function
        return run(x)
    if torch.is_grad_enabled() and x.requires_grad:
        _backward_ahead(x, d, log)
    return SOFTMAX.apply(x, d, bool(causal), log)


def _recorded(x: torch.Tensor, dim: int, causal: bool, log: bool):
    """run(x) of a call that autograd records (`fk_runtime.ops.quiet_key`), whose checks passed:
    the autograd.Function around the forward bound for its key; the first call binds the backward ahead."""
    _backward_ahead(x, dim, log)
    bound = plan.bound_forward(x, dim, causal, log)
    return lambda x: SOFTMAX.bound(bound, x, dim, causal, log)


def softmax(x: torch.Tensor, dim: int = -1, causal: bool = False) -> torch.Tensor:
    """`torch.softmax(x, dim)`, optionally masking x[..., i, j] for j > i (`causal`, last dim only).

    fp32/fp16/bf16 with fp32 math, any row length, any dim, strided inputs; the output is
    contiguous in x's shape, in x's dtype (also under `torch.autocast`, where torch's CUDA softmax
    returns fp32); the backward saves only the output."""
    return _apply(x, dim, causal, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.log_softmax(x, dim)`, same coverage as `softmax`."""
    return _apply(x, dim, False, True)

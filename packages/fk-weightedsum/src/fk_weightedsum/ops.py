"""weighted_sum: checks, then the differentiable op (fk_runtime.ops.define).

Path of a call: metadata checks -> `fk::weighted_sum` (eager: its autograd.Function straight into
`plan.forward`, a bound launch cached per shape, strides, dtype and device) -> kernel. The
backward saves x and weight (no copies) and reads x once for both gradients; it computes only the
gradients autograd asks for (a frozen weight: x is not read at all). Calls that autograd does not
record go straight to their key's bound forward once a call of that key passed the checks
(`fk_runtime.ops.quiet_key`); calls it records, to the autograd.Function around their key's bound forward.
"""

from __future__ import annotations

import torch
from fk_runtime import checks
from fk_runtime import ops as fk_ops

from . import plan


def _forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return plan.forward(x, weight)


def _backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool = True,
              need_w: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return plan.backward(grad_y, x, weight, need_x, need_w)


WEIGHTED_SUM = fk_ops.define(
    "weighted_sum",
    forward=_forward,
    forward_fake=lambda x, weight: x.new_empty(x.shape[:-1]),
    backward=_backward,
    backward_fake=lambda grad_y, x, weight, need_x=True, need_w=True: (
        x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_w else (0,))),
    save=lambda inputs, outputs: (inputs, None),
    backward_args=lambda saved, other, grads, needs: (grads[0], *saved, bool(needs[0]), bool(needs[1])),
    input_grads=lambda other, grads, needs: tuple(g if need else None for g, need in zip(grads, needs, strict=True)),
)


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight` over the last dim: `x[..., D]`, `weight[D]` -> `[...]`.

    fp32 / fp16 / bf16 with fp32 accumulation; any leading dims; strided `x` is read through its
    strides (copied only when its leading dims cannot be merged into one). Differentiable in both
    arguments; the backward reads x once. Under `torch.autocast` both in its dtype, as `x @ weight`.
    """
    key, run = fk_ops.quiet_run(plan.BOUND, "weighted_sum", (x, weight), ())
    if run:
        return run(x, weight)
    checks.check_tensor("x", x, min_dim=1)
    checks.check_tensor("weight", weight, min_dim=1, max_dim=1)
    x, weight = fk_ops.autocast(x, weight)
    plan.check_inputs(x, weight)
    # checked: this key's calls go straight to the plan, or (recorded) to the autograd.Function
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: _quiet(x, weight), lambda: _recorded(x, weight))
    if run:
        return run(x, weight)
    return WEIGHTED_SUM.apply(x, weight)


def _recorded(x: torch.Tensor, weight: torch.Tensor):
    """run(x, weight) -> y of a call that autograd records (`fk_runtime.ops.quiet_key`) whose checks
    passed: the autograd.Function around the forward bound for its key."""
    bound = plan.bound_forward(x, weight)
    return lambda x, weight: WEIGHTED_SUM.bound(bound, x, weight)


def _quiet(x: torch.Tensor, weight: torch.Tensor):
    """run(x, weight) -> y of a quiet call (`fk_runtime.ops.quiet_key`) whose checks passed: the
    bound forward, its output (a row of a buffer, reshaped) a tensor of its own, as torch's."""
    run = plan.bound_forward(x, weight)
    return lambda x, weight: run(x, weight).detach()

"""layer_norm and rms_norm: checks, then the differentiable op (fk_runtime.ops.define).

Path of a call: metadata checks -> `fk::norm` (eager: its autograd.Function straight into
`plan.forward`, a bound launch cached per shape, strides, dtypes, device and flags) -> kernels.
The forward writes per-row statistics only when autograd will need them; the backward saves x
itself (no copy), the parameters and those statistics. Calls that autograd does not record go
straight to their key's bound forward once a call of that key passed the checks
(`fk_runtime.ops.quiet_key`); calls it records, to the autograd.Function around their key's bound forward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from fk_runtime import ahead, checks
from fk_runtime import ops as fk_ops
from fk_runtime.launch import PlanCache

from . import plan


def _forward(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,  # noqa: UP045
    is_rms: bool, stable: bool, save_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return plan.forward(x, weight, bias, eps, is_rms, stable, save_stats)


def _forward_fake(x, weight, bias, eps, is_rms, stable, save_stats):
    n_rows = math.prod(x.shape[:-1])
    return x.new_empty(x.shape), x.new_empty(plan.stats_shape(n_rows, is_rms, stable, save_stats),
                                             dtype=torch.float32)


def _backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],  # noqa: UP045
    bias: Optional[torch.Tensor], stats: torch.Tensor, is_rms: bool, stable: bool,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan.backward(grad_y, x, weight, bias, stats, is_rms, stable)


def _backward_fake(grad_y, x, weight, bias, stats, is_rms, stable):
    return (x.new_empty(x.shape), x.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            x.new_empty(0) if bias is None else bias.new_empty(bias.shape))


def _save(inputs, outputs):
    x, weight, bias, _, is_rms, stable, _ = inputs
    return (x, weight, bias, outputs[1]), (is_rms, stable, weight is not None, bias is not None)


def _input_grads(other, grads, needs):
    grad_x, grad_w, grad_b = grads
    _, _, has_w, has_b = other
    return grad_x, grad_w if has_w else None, grad_b if has_b else None, None, None, None, None


NORM = fk_ops.define(
    "norm",
    forward=_forward, forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake,
    save=_save,
    backward_args=lambda saved, other, grads, needs: (grads[0], *saved, other[0], other[1]),
    input_grads=_input_grads,
    non_differentiable=(1,),
    bound_inputs=3,
)


def _needs_stats(*tensors) -> bool:
    """Whether autograd will call the backward (which reads the statistics)."""
    if fk_ops.transforms_active():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# What the kernels compile for, whose backward was bound and compiled ahead (`_backward_ahead`).
AHEAD = PlanCache()


def _backward_ahead(x, weight, bias, is_rms: bool, stable: bool) -> None:
    """On a call that autograd records, bind the backward now so that its kernels compile in
    threads while the forward's compiles (`fk_runtime.ahead`), for the upstream gradients a first
    backward brings: laid out like x (a model's), and one value broadcast over x (`y.sum().backward()`,
    whose zero strides the kernel compiles apart). Once per what the kernels compile for (dtypes,
    row length, flags, device)."""
    key = (x.dtype, x.shape[-1], None if weight is None else weight.dtype, None if bias is None else bias.dtype,
           is_rms, stable, x.device)
    if not ahead.first(AHEAD, key, x, weight, bias):
        return
    stats = x.new_empty(plan.stats_shape(math.prod(x.shape[:-1]), is_rms, stable, True), dtype=torch.float32)
    with ahead.compile_ahead():
        for grad_y in ahead.upstream_gradients(x):
            plan.backward(grad_y, x, weight, bias, stats, is_rms, stable)


def _norm(x, weight, bias, eps, is_rms: bool, stable: bool) -> torch.Tensor:
    needs = _needs_stats(x, weight, bias)
    if needs:
        _backward_ahead(x, weight, bias, is_rms, stable)
    y, _ = NORM.apply(x, weight, bias, float(eps), is_rms, stable, needs)
    return y


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, stable: bool = False) -> torch.Tensor:
    """LayerNorm over the last dim (`torch.nn.functional.layer_norm(x, x.shape[-1:], ...)`).

    `stable=True` divides each row by its largest magnitude max|x| first (an all-zero row by 1),
    with the gradient flowing through the division: LayerNorm is unchanged by that positive scale
    but for eps, and no sum overflows. fp32 statistics for every dtype; a row whose sums overflow
    fp32 is normalised again from x / max|x| where the row fits in registers, else comes back NaN
    (see `fk_layernorm.kernels`)."""
    key, run = fk_ops.quiet_run(plan.BOUND, "layer_norm", (x, weight, bias), (eps, stable))
    if run:
        return run(x, weight, bias)
    plan.check_inputs(x, weight, bias, eps)
    stable = checks.check_flag("stable", stable)
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: _quiet(x, weight, bias, eps, False, stable),
                            lambda: _recorded(x, weight, bias, eps, False, stable))
    if run:  # checked: this key's calls go straight to the plan, or to the autograd.Function
        return run(x, weight, bias)
    return _norm(x, weight, bias, eps, False, stable)


def default_rms_eps(x: torch.Tensor) -> float:
    """torch's RMSNorm epsilon when none is given: the machine epsilon of the math dtype, fp32
    for 16-bit inputs (not the input dtype's own, which is 7.8e-3 for bf16)."""
    return torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


def rms_norm(x, weight=None, eps: float | None = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (`torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)`).
    The default eps is 1e-6 (Llama's), not torch's functional default: `eps=None` gives that
    (`default_rms_eps`, as the `RMSNorm` module and torch's do by default)."""
    key, run = fk_ops.quiet_run(plan.BOUND, "rms_norm", (x, weight), (eps,))
    if run:
        return run(x, weight, None)
    if eps is None and isinstance(x, torch.Tensor):
        eps = default_rms_eps(x)
    plan.check_inputs(x, weight, None, eps)
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: _quiet(x, weight, None, eps, True, False),
                            lambda: _recorded(x, weight, None, eps, True, False))
    if run:
        return run(x, weight, None)
    return _norm(x, weight, None, eps, True, False)


def _params_contiguous(weight, bias) -> bool:
    """Whether the parameters are laid out as the kernels read them (their strides are in the call's key)."""
    return all(p is None or p.is_contiguous() for p in (weight, bias))


def _recorded(x, weight, bias, eps, is_rms: bool, stable: bool):
    """run(x, weight, bias) -> y of a call that autograd records (`fk_runtime.ops.quiet_key`) whose
    checks passed: the autograd.Function around the forward bound for its key (where the parameters
    are contiguous, as the kernels read them), statistics saved; the first call binds the backward ahead."""
    _backward_ahead(x, weight, bias, is_rms, stable)
    eps = float(eps)
    if not _params_contiguous(weight, bias):
        return lambda x, w, b: NORM.recorded(x, w, b, eps, is_rms, stable, True)[0]
    bound = plan.bound_forward(x, weight, bias, eps, is_rms, stable, True)
    return lambda x, w, b: NORM.bound(bound, x, w, b, eps, is_rms, stable, True)[0]


def _quiet(x, weight, bias, eps, is_rms: bool, stable: bool):
    """run(x, weight, bias) -> y of a quiet call (`fk_runtime.ops.quiet_key`) whose checks passed:
    the bound forward, no statistics saved (nothing records a backward)."""
    if _params_contiguous(weight, bias):
        return plan.bound_forward(x, weight, bias, float(eps), is_rms, stable, False, y_only=True)
    run = plan.bound_forward(x, None if weight is None else weight.contiguous(),
                             None if bias is None else bias.contiguous(), float(eps), is_rms, stable, False, True)
    return lambda x, w, b: run(x, None if w is None else w.contiguous(), None if b is None else b.contiguous())

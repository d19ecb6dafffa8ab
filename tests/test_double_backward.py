"""Every op's gradients are first-order only, and say so: with `create_graph=True` they come out
the same as without, and differentiating through them (a gradient penalty) raises instead of
treating the backward kernels' outputs as constants (a silently wrong second-order gradient)."""

import pytest
import torch
from fk_runtime.harness import testing

from fk_attention import attention
from fk_layernorm import layer_norm, rms_norm
from fk_softmax import log_softmax, softmax
from fk_weightedsum import weighted_sum


def _attention_op(q, k, v):
    """The registered op itself (its own autograd formula), as other code may call it."""
    return torch.ops.fk.attention(q, k, v, q.shape[-1] ** -0.5, [-1.0, -1.0, 0.0, 0.0])[0]


def _inputs(name):
    x = testing.randn((4, 48), requires_grad=True)
    w = testing.randn((48,), shift=1.0, requires_grad=True)
    qkv = [testing.randn((1, 2, 20, 16), requires_grad=True) for _ in range(3)]
    return {
        "softmax": (softmax, [x]),
        "log_softmax": (log_softmax, [x]),
        "layer_norm": (layer_norm, [x, w, testing.randn((48,), requires_grad=True)]),
        "rms_norm": (rms_norm, [x, w]),
        "weighted_sum": (weighted_sum, [x, w]),
        "attention": (attention, qkv),
        "attention op": (_attention_op, qkv),
    }[name]


NAMES = ["softmax", "log_softmax", "layer_norm", "rms_norm", "weighted_sum", "attention", "attention op"]


@pytest.mark.parametrize("mode", testing.compile_modes())
@pytest.mark.parametrize("name", NAMES)
def test_gradient_of_gradient_raises(name, mode):
    fn, inputs = _inputs(name)
    fn = testing.maybe_compile(fn, mode)
    y = fn(*inputs)
    gy = testing.randn(y.shape)
    plain = torch.autograd.grad(y, inputs, gy, retain_graph=True)
    recorded = torch.autograd.grad(y, inputs, gy, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded, strict=True))
    penalty = sum((g.float() ** 2).sum() for g in recorded)
    # Compiled graphs: PyTorch refuses first ("torch.compile with aot_autograd does not currently
    # support double backward"); fk's own message stands behind it.
    expected = "first-order gradients only" + ("" if mode == "eager" else "|double backward")
    # Naming the inputs (the usual way) walks only the paths to them: the guard must lie on those.
    for last in inputs:
        with pytest.raises(RuntimeError, match=expected):
            torch.autograd.grad(penalty, [last], retain_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match=expected):
        penalty.backward()


def test_hessian_raises():
    x = testing.randn((6, 5))
    w = testing.randn((5,), requires_grad=True)
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.functional.hessian(lambda w: (weighted_sum(x, w) ** 2).sum(), w)


def test_registered_backward_op_raises_when_differentiated():
    """What compiled graphs call: the backward op's own autograd formula refuses."""
    x = testing.randn((3, 8), requires_grad=True)
    w = testing.randn((8,), requires_grad=True)
    grad_x, grad_w = torch.ops.fk.weighted_sum_backward(testing.randn((3,)), x, w)
    with pytest.raises(RuntimeError, match="fk::weighted_sum_backward computes first-order gradients only"):
        (grad_x.sum() + grad_w.sum()).backward()

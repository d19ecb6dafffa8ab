"""How an op's Python entry reaches its kernels: directly in eager mode, through `torch.library`
while `torch.compile` traces.

A `torch.library.custom_op` call costs tens of microseconds of dispatcher work on the host, more
than a memory-bound kernel on a few MB takes on the GPU, so eager calls run the implementation
directly. Under `torch.compile` the registered op is what the graph holds: opaque, with a fake
implementation for shapes, so there is no graph break and the same kernels run.

Gradients are first-order only: the backward kernels are not differentiable themselves. When
autograd records the backward (`create_graph=True`, e.g. for a gradient penalty), the gradients
they return carry a node that raises if anything differentiates through them, instead of counting
as constants (`gradients_eager_or_op`). `once_differentiable` would not do: it marks gradients
only when the incoming gradient requires grad (not when the saved inputs do), and hangs its node
on fresh leaves, which `autograd.grad(penalty, [weight])` never reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


# Tensor types the implementation may touch directly (data pointers, strides of real memory).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _traced(args) -> bool:
    """Whether a tracer is running: Dynamo says so, but AOTAutograd tracing a backward registered
    with `register_autograd` does not; its tensors are fake / functional subclasses, so any
    tensor that is not plain sends the call through the registered op."""
    return torch.compiler.is_compiling() or any(
        isinstance(a, torch.Tensor) and type(a) not in PLAIN_TENSOR_TYPES for a in args
    )


def eager_or_op(op: Callable, impl: Callable) -> Callable:
    """A callable running `impl` in eager mode and the registered `op` while compiling."""

    def call(*args):
        if _traced(args):
            return op(*args)
        return impl(*args)

    call.__name__ = getattr(impl, "__name__", "call")
    return call


def _not_differentiable_message(name: str) -> str:
    return (f"{name} computes first-order gradients only: differentiating through them "
            "(create_graph=True and a second backward, e.g. a gradient penalty) is not supported")


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on gradients whose backward raises. Its inputs include the backward's own inputs
    that require grad (x, weight, an upstream gradient), so the node lies on every path from the
    gradients to them: also `autograd.grad(penalty, [weight])`, Hessians and meta-gradients."""

    @staticmethod
    def forward(ctx, name, gradients, *inputs):
        ctx.name = name
        return tuple(g.detach() for g in gradients)  # aliases, not views: no copy, no in-place ban

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_not_differentiable_message(ctx.name))


def _first_order_only(outputs, args, name: str):
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not inputs:
        return outputs
    single = isinstance(outputs, torch.Tensor)
    marked = _FirstOrderOnly.apply(name, (outputs,) if single else tuple(outputs), *inputs)
    return marked[0] if single else tuple(marked)


def gradients_eager_or_op(op, impl: Callable, name: str) -> Callable:
    """`eager_or_op` for an op computing gradients (registered as `name`). When autograd records
    the backward (grad mode on inside it: create_graph=True), eager results carry a node that
    raises if differentiated; so does the registered op, through its autograd formula."""

    def backward(ctx, *grads):
        raise RuntimeError(_not_differentiable_message(name))

    op.register_autograd(backward)
    plain = eager_or_op(op, impl)

    def call(*args):
        if _traced(args) or not torch.is_grad_enabled():
            return plain(*args)
        with torch.no_grad():
            outputs = impl(*args)
        return _first_order_only(outputs, args, name)

    call.__name__ = plain.__name__
    return call

"""How an op's Python entry reaches its kernels: directly in eager mode, through `torch.library`
while `torch.compile` traces.

A `torch.library.custom_op` call costs tens of microseconds of dispatcher work on the host, more
than a memory-bound kernel on a few MB takes on the GPU, so eager calls run the implementation
directly. Under `torch.compile` the registered op is what the graph holds: opaque, with a fake
implementation for shapes, so there is no graph break and the same kernels run.
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

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


def eager_or_op(op: Callable, impl: Callable) -> Callable:
    """A callable running `impl` in eager mode and the registered `op` while compiling."""

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return impl(*args)

    call.__name__ = getattr(impl, "__name__", "call")
    return call

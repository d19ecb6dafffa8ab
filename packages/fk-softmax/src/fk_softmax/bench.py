"""fk-softmax's check and benchmark sweep, run by `python -m fk_runtime`.

Peers in the same run: torch.softmax, torch.compile(torch.softmax), Liger (when installed; it
refuses rows past 65536 columns, which the table reports). Bytes counted: forward reads x and
writes y (2 tensors); backward reads y and grad_y and writes grad_x (3 tensors). Host time per
call (`host_cases`): one tiny bf16 input against torch.softmax and Liger.
"""

from __future__ import annotations

import functools

import torch
from fk_runtime.harness import bench, testing

from .ops import log_softmax, softmax

FULL_SHAPES = [(16384, 1024), (8192, 4096), (4096, 16384), (1024, 65536), (256, 262144), (64, 1048576)]
# The interpreter: one fused shape, one split over sibling programs.
SMALL_SHAPES = [(64, 128), (4, 40000)]
DTYPES = [torch.bfloat16, torch.float32]
HOST_SHAPE = (4, 4096)


def _torch_softmax(x):
    return torch.softmax(x, -1)


def _torch_causal(x):
    keep = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
    return torch.softmax(x.masked_fill(~keep, -torch.inf), -1)


@functools.cache
def _peers() -> dict:
    peers = {"torch": _torch_softmax, **bench.compiled_peer(_torch_softmax)}
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        peers["liger"] = LigerSoftmaxFunction.apply
    except ImportError:
        pass
    return peers


def checks(full: bool):
    """Every path (fused, split with either chunk width, two-pass) in every dtype, both ops, plus
    causal and dim 0; bounds widen to twice PyTorch's own error in the same dtype."""
    shapes = [(1, 1), (5, 17), (7, 4097), (3, 40000), (3, 36000), (2, 66001)]
    if full:
        shapes += [(2, 1_000_000), (256, 262144), (2, 2_200_001)]
    # Input scale per op: wide logits, except for causal rows, which see as few as 1-2 columns
    # here (the first rows of each matrix): at scale 3 their gradient y0 * y1 * (g1 - g0), computed
    # as y1 * (g1 - sum(y * g)), cancels so badly that fk's and PyTorch's rounding errors (the
    # bound is twice PyTorch's) differ by chance: fp32, 2 x 70001, worst error / bound 0.94 in 9
    # H100 runs (2026-11-23); 0.48 at scale 3 and 0.07 at scale 1 in 12 interpreter runs each.
    ops = [("softmax", softmax, _torch_softmax, 3.0),
           ("log_softmax", log_softmax, lambda t: torch.log_softmax(t, -1), 3.0),
           ("causal softmax", lambda t: softmax(t, causal=True), _torch_causal, 1.0),
           ("softmax dim 0", lambda t: softmax(t, 0), lambda t: torch.softmax(t, 0), 3.0)]
    for shape in shapes:
        for dtype in DTYPES + [torch.float16]:
            for name, fn, ref, scale in ops:
                def check(shape=shape, dtype=dtype, fn=fn, ref=ref, scale=scale):
                    x = testing.randn(shape, dtype, scale=scale, requires_grad=True)
                    return testing.check_against_reference(fn, ref, [x], dtype=dtype, names=["x"],
                                                           baseline_fn=ref)

                yield f"{name} {shape} {str(dtype).removeprefix('torch.')}", check


def cases(full: bool) -> list[bench.Case]:
    out = []
    variants = {"fk": softmax, **_peers()}
    for rows, cols in FULL_SHAPES if full else SMALL_SHAPES:
        for dtype in DTYPES:
            tensor_bytes = rows * cols * dtype.itemsize

            def make_inputs(rows=rows, cols=cols, dtype=dtype):
                return [testing.randn((rows, cols), dtype, requires_grad=True)]

            for direction, wrap, tensors in [("fwd", bench.forward, 2), ("bwd", bench.backward, 3)]:
                out.append(bench.Case(
                    op="softmax", direction=direction, shape=f"{rows}×{cols}", dtype=dtype,
                    unit=bench.GBPS, work=tensors * tensor_bytes, make_inputs=make_inputs,
                    variants={name: wrap(fn) for name, fn in variants.items()},
                    input_bytes=tensor_bytes,
                ))
    return out


def host_cases() -> list[bench.HostCase]:
    """A tiny input, where a call's cost is its host work, against torch.softmax and Liger."""
    rows, cols = HOST_SHAPE
    peers = {k: v for k, v in _peers().items() if k != bench.TORCH_COMPILE}
    return [bench.HostCase(
        op="softmax", shape=f"{rows}×{cols}", dtype=torch.bfloat16,
        make_inputs=lambda: [testing.randn((rows, cols), torch.bfloat16, requires_grad=True)],
        variants={"fk": softmax, **peers},
    )]

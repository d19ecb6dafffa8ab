"""fk-weightedsum's check and benchmark sweep, run by `python -m fk_runtime`.

Peers, measured in the same run: torch (`x @ w` with autograd) and
`torch.compile((x * w).sum(-1))`. Bytes counted: forward reads x and w and writes y; backward
reads x, w and grad_y and writes grad_x and grad_w. Host time per call (`host_cases`): one tiny
bf16 input against `x @ w`.
"""

from __future__ import annotations

import functools

import torch
from fk_runtime.harness import bench, testing

from .ops import weighted_sum

FULL_SHAPES = [(65536, 1024), (16384, 4096), (4096, 16384), (262144, 256), (1048576, 128)]
SMALL_SHAPES = [(64, 128), (17, 1000)]
DTYPES = [torch.float32, torch.bfloat16]
HOST_SHAPE = (4, 4096)


def _torch_matmul(x, w):
    return x @ w


@functools.cache
def _elementwise_sum(x, w):
    return (x * w).sum(-1)


def _reference(x, w):
    return x @ w


def checks(full: bool):
    shapes = [(1, 1), (3, 17), (4097, 3), (2, 5, 1000)] + ([(65537, 128), (2, 1_000_000)] if full else [])
    for shape in shapes:
        for dtype in DTYPES + [torch.float16]:
            def check(shape=shape, dtype=dtype):
                x = testing.randn(shape, dtype, requires_grad=True)
                w = testing.randn(shape[-1:], dtype, requires_grad=True)
                return testing.check_against_reference(
                    weighted_sum, _reference, [x, w], dtype=dtype, names=["x", "weight"]
                )

            yield f"weighted_sum {shape} {str(dtype).removeprefix('torch.')}", check


def cases(full: bool) -> list[bench.Case]:
    out = []
    for rows, dim in FULL_SHAPES if full else SMALL_SHAPES:
        for dtype in DTYPES:
            size = torch.empty((), dtype=dtype).element_size()
            x_bytes = rows * dim * size
            vec_bytes = (rows + dim) * size

            def make_inputs(rows=rows, dim=dim, dtype=dtype):
                x = testing.randn((rows, dim), dtype, requires_grad=True)
                w = testing.randn((dim,), dtype, requires_grad=True)
                return [x, w]

            variants = {"fk": weighted_sum, "torch": _torch_matmul, **bench.compiled_peer(_elementwise_sum)}
            for direction, wrap, work in [
                ("fwd", bench.forward, x_bytes + vec_bytes),
                ("bwd", bench.backward, 2 * x_bytes + 2 * vec_bytes),
            ]:
                out.append(
                    bench.Case(
                        op="weightedsum", direction=direction, shape=f"{rows}×{dim}", dtype=dtype,
                        unit=bench.GBPS, work=work, make_inputs=make_inputs,
                        variants={name: wrap(fn) for name, fn in variants.items()},
                        input_bytes=x_bytes,
                    )
                )
    return out


def host_cases() -> list[bench.HostCase]:
    """A tiny input, where a call's cost is its host work, against torch's `x @ w`."""
    rows, dim = HOST_SHAPE

    def make_inputs():
        return [testing.randn((rows, dim), torch.bfloat16, requires_grad=True),
                testing.randn((dim,), torch.bfloat16, requires_grad=True)]

    return [bench.HostCase(op="weighted_sum", shape=f"{rows}×{dim}", dtype=torch.bfloat16,
                           make_inputs=make_inputs, variants={"fk": weighted_sum, "torch": _torch_matmul})]

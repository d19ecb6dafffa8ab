"""fk-attention's check and benchmark sweep, run by `python -m fk_runtime`.

16384 tokens per batch (B * N), H * D = 2048, against SDPA's cuDNN and flash backends in the same
run. TFLOP/s counts 4 * B * H * N^2 * D for the forward (half when causal), 2.5x that backward.
Peak memory is recorded at N = 16384.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from fk_runtime import bench, testing

from .ops import attention

TOKENS = 16384
MODEL_DIM = 2048
FULL_LENGTHS = [1024, 4096, 16384]
HEAD_DIMS = [64, 128]
DTYPES = [torch.bfloat16, torch.float16]
MEMORY_LENGTH = 16384


def _sdpa(backend_name: str, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def checks(full: bool):
    shapes = [(1, 2, 1, 33, 47, 40), (2, 4, 2, 64, 64, 64)]
    if full:
        shapes += [(1, 8, 2, 4097, 4097, 128), (1, 4, 4, 1000, 1000, 96)]
    dtypes = [torch.float16] + ([torch.bfloat16] if full else [torch.float32])
    for shape in shapes:
        for dtype in dtypes:
            for causal in (False, True):
                def check(shape=shape, dtype=dtype, causal=causal):
                    b, hq, hk, nq, nk, d = shape
                    q = testing.randn((b, hq, nq, d), dtype, requires_grad=True)
                    k = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    v = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    ref = functools.partial(F.scaled_dot_product_attention, is_causal=causal, enable_gqa=True)
                    return testing.check_against_reference(
                        functools.partial(attention, causal=causal), ref, [q, k, v], dtype=dtype,
                        names=["q", "k", "v"], baseline_fn=None if dtype == torch.float32 else ref,
                    )

                yield f"attention {shape} {str(dtype).removeprefix('torch.')} causal={causal}", check


def cases(full: bool) -> list[bench.Case]:
    out = []
    grid = [(n, d, dt, c) for n in FULL_LENGTHS for d in HEAD_DIMS for dt in DTYPES for c in (False, True)]
    if not full:
        grid = [(32, 16, torch.float32, c) for c in (False, True)]
    for n, d, dtype, causal in grid:
        b, h = max(1, (TOKENS if full else 64) // n), (MODEL_DIM if full else 32) // d
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)

        def make_inputs(b=b, h=h, n=n, d=d, dtype=dtype):
            return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

        variants = {"fk": functools.partial(attention, causal=causal)}
        if not full:
            variants["sdpa"] = functools.partial(F.scaled_dot_product_attention, is_causal=causal)
        if full:
            variants["sdpa cudnn"] = _sdpa("CUDNN_ATTENTION", causal)
            variants["sdpa flash"] = _sdpa("FLASH_ATTENTION", causal)
        label = f"N{n} d{d}{' causal' if causal else ''}"
        for direction, wrap, work in [("fwd", bench.forward, flops), ("bwd", bench.backward, 2.5 * flops)]:
            out.append(bench.Case(
                op="attention", direction=direction, shape=label, dtype=dtype, unit=bench.TFLOPS,
                work=work, make_inputs=make_inputs,
                variants={name: wrap(fn) for name, fn in variants.items()},
                memory=direction == "bwd" and n == MEMORY_LENGTH,
            ))
    return out

"""fk-attention's check and benchmark sweep, run by `python -m fk_runtime`.

Full sweep (GPU): 16384 tokens per batch (B * N), H * D = 2048 (32 heads of 64, 16 of 128),
N in {1024, 4096, 16384}, bf16 and fp16, causal and not, forward and backward, against SDPA's
cuDNN and flash backends in the same run (PyTorch's own attention kernels: torch.compile of SDPA
calls the same ones, and Liger has no attention kernel). TFLOP/s counts 4 * B * H * N^2 * D for
the forward (half when causal) and 2.5x that for the backward; peak memory is recorded at
N = 16384. Small sweep (interpreter): one tiny fp32 shape against SDPA's default. Host time per
call (`host_cases`): one tiny causal bf16 input against SDPA's default backend (named "torch",
PyTorch's own op, like the other ops' host rows).
"""

from __future__ import annotations

import functools
import math

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
# Small sweep: (B, H, N, D) in fp32.
SMALL_SHAPE = (2, 2, 32, 16)
# Host time per call: (B, H, N, D), causal. fp32 on the interpreter, where bf16 tl.dot is unreliable
# (and the numbers mean nothing anyway).
HOST_SHAPE = (1, 8, 128, 64)
# Backward flops per forward flop: five N x N x D matmuls (scores recomputed, dP, dV, dK, dQ)
# against the forward's two, FlashAttention's convention (fk's split backward does seven).
BACKWARD_FLOP_FACTOR = 2.5


def _sdpa(backend_name: str | None, causal: bool):
    """SDPA on one backend; the backend is picked inside the call, as the timed work runs it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend_name is None:
        return functools.partial(F.scaled_dot_product_attention, is_causal=causal)
    chosen = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, -1) @ v


def checks(full: bool):
    """Forward and every gradient against float64 (bounds widened by SDPA's own error in half
    precision): odd lengths, Nq != Nk, GQA, padded head dims."""
    shapes = [(1, 2, 1, 33, 47, 40), (2, 4, 2, 64, 64, 64)]
    if full:
        shapes += [(1, 8, 2, 4097, 4097, 128), (1, 4, 4, 1000, 1000, 96)]
    dtypes = [torch.bfloat16, torch.float16] if full else [torch.float32, torch.float16]
    for shape in shapes:
        for dtype in dtypes:
            for causal in (False, True):
                def check(shape=shape, dtype=dtype, causal=causal):
                    b, hq, hk, nq, nk, d = shape
                    q = testing.randn((b, hq, nq, d), dtype, requires_grad=True)
                    k = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    v = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    baseline = functools.partial(F.scaled_dot_product_attention, is_causal=causal,
                                                 enable_gqa=True)
                    return testing.check_against_reference(
                        functools.partial(attention, causal=causal),
                        functools.partial(_reference, causal=causal), [q, k, v], dtype=dtype,
                        names=["q", "k", "v"], baseline_fn=None if dtype == torch.float32 else baseline,
                    )

                yield f"attention {shape} {str(dtype).removeprefix('torch.')} causal={causal}", check


def cases(full: bool) -> list[bench.Case]:
    if full:
        grid = [(TOKENS // n, MODEL_DIM // d, n, d, dtype, causal)
                for n in FULL_LENGTHS for d in HEAD_DIMS for dtype in DTYPES for causal in (False, True)]
    else:
        b, h, n, d = SMALL_SHAPE
        grid = [(b, h, n, d, torch.float32, causal) for causal in (False, True)]
    out = []
    for b, h, n, d, dtype, causal in grid:
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)

        def make_inputs(b=b, h=h, n=n, d=d, dtype=dtype):
            return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

        variants = {"fk": functools.partial(attention, causal=causal)}
        if full:
            variants["sdpa cudnn"] = _sdpa("CUDNN_ATTENTION", causal)
            variants["sdpa flash"] = _sdpa("FLASH_ATTENTION", causal)
        else:
            variants["sdpa"] = _sdpa(None, causal)
        label = f"B{b} H{h} N{n} d{d}{' causal' if causal else ''}"
        for direction, wrap, work in [("fwd", bench.forward, flops),
                                      ("bwd", bench.backward, BACKWARD_FLOP_FACTOR * flops)]:
            out.append(bench.Case(
                op="attention", direction=direction, shape=label, dtype=dtype, unit=bench.TFLOPS,
                work=work, make_inputs=make_inputs,
                variants={name: wrap(fn) for name, fn in variants.items()},
                input_bytes=3 * b * h * n * d * dtype.itemsize,
                memory=n == MEMORY_LENGTH,
            ))
    return out


def host_cases() -> list[bench.HostCase]:
    """A tiny causal input, where a call's cost is its host work, against SDPA's default."""
    b, h, n, d = HOST_SHAPE
    dtype = torch.bfloat16 if testing.on_gpu() else torch.float32

    def make_inputs():
        return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

    return [bench.HostCase(op="attention", shape=f"B{b} H{h} N{n} d{d} causal", dtype=dtype,
                           make_inputs=make_inputs,
                           variants={"fk": functools.partial(attention, causal=True),
                                     "torch": _sdpa(None, True)})]

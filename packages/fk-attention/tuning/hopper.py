"""The Hopper forward in Gluon (hopper.py) against the tl kernels (autotuned, as they ran before it)
and SDPA's cuDNN backend: forward TFLOP/s, do_bench medians on one H100 (TUNING.md: Hopper forward).

    bash shared/from-source.sh python packages/fk-attention/tuning/hopper.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from fk_attention import attention, hopper
from fk_attention import plan as table

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (8, 16, 2048, 96, True), (16, 16, 1024, 128, False), (16, 16, 1024, 128, True)]


def tflops(fn, flops: float) -> float:
    fn()
    return flops / do_bench(fn, warmup=50, rep=300) / 1e9


def row(b: int, h: int, n: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    gluon = tflops(lambda: attention(q, k, v, causal=causal), flops)
    head_dims, hopper.HEAD_DIMS = hopper.HEAD_DIMS, ()  # the Gluon path off: the tl plan, tuned once
    table.BOUND.clear()
    try:
        tl = tflops(lambda: attention(q, k, v, causal=causal), flops)
    finally:
        hopper.HEAD_DIMS = head_dims
        table.BOUND.clear()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = tflops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flops)
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | {gluon:.0f} | {tl:.0f} | "
            f"{cudnn:.0f} | {gluon / cudnn:.2f}x | {gluon / tl:.2f}x |")


if __name__ == "__main__":
    print("| shape | dtype | fk Gluon TFLOP/s | fk tl TFLOP/s | cuDNN TFLOP/s | Gluon / cuDNN | Gluon / tl |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            print(row(*shape, dtype), flush=True)

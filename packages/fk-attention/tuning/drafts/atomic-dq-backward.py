"""The backward two ways, deterministic (a dQ kernel, then dK/dV: 7 matmuls a block pair) and with
dQ added by the dK/dV kernel in fp32 atomics (5 matmuls), both autotuned, against SDPA's cuDNN
backend: backward TFLOP/s (5 matmuls counted), do_bench medians on one H100 (TUNING.md: Backward
with atomic dQ).

    git apply packages/fk-attention/tuning/drafts/atomic-dq.patch   # the draft, on 1b3073b
    bash shared/from-source.sh python packages/fk-attention/tuning/drafts/atomic-dq-backward.py
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from fk_attention import plan
from fk_attention import config as fk_config, mask as fk_mask

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (4, 32, 4096, 64, False), (4, 32, 4096, 64, True),
          (1, 32, 16384, 64, False), (1, 32, 16384, 64, True), (8, 16, 2048, 96, True), (4, 8, 4096, 256, True),
          (16, 16, 1024, 128, False), (16, 32, 1024, 64, True)]


def tflops(fn, flops: float) -> float:
    fn()
    return flops / do_bench(fn, warmup=50, rep=300) / 1e9


def row(b: int, h: int, n: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
    mask, scale = (fk_mask.CAUSAL if causal else fk_mask.FULL), 1 / math.sqrt(d)
    out, lse = plan.forward(q, k, v, mask, scale)
    flops = 10 * b * h * n * n * d / (2 if causal else 1)
    rates, grads = [], []
    for atomic in (False, True):
        run = plan.bind_backward(do, None, q, k, v, out, lse, mask, scale, atomic=atomic)
        grads.append(run(do, None, q, k, v, out, lse))
        rates.append(tflops(lambda run=run: run(do, None, q, k, v, out, lse), flops))
    gap = max(((a.float() - g.float()).norm() / g.float().norm()).item() for a, g in zip(grads[1], grads[0], strict=True))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        cudnn = tflops(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), flops)
    det, atom = rates
    tuned = [c for (key, _), c in plan.WINNERS.items() if key[0] is fk_config.Kind.DKDV_DQ and key[1] == d]
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | {det:.0f} | {atom:.0f} | "
            f"{cudnn:.0f} | {det / cudnn:.2f}x | {atom / cudnn:.2f}x | {gap:.1e} | {tuned[-1:]} |")


if __name__ == "__main__":
    print("| shape | dtype | deterministic TFLOP/s | atomic dQ TFLOP/s | cuDNN TFLOP/s | det / cuDNN | atomic / cuDNN "
          "| atomic vs det gap | atomic tile |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            print(row(*shape, dtype), flush=True)
            plan.WINNERS.clear()

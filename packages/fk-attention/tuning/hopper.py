"""The Hopper kernels in Gluon (hopper.py, hopper_backward.py) against the tl kernels (at their default
tiles, as they run where Gluon does not) and SDPA's cuDNN backend, do_bench medians of eager calls on one
GPU (TUNING.md: Hopper forward, Hopper backward).

    bash shared/from-source.sh python packages/fk-attention/tuning/hopper.py            # forward TFLOP/s
    bash shared/from-source.sh python packages/fk-attention/tuning/hopper.py backward   # backward
    bash shared/from-source.sh python packages/fk-attention/tuning/hopper.py backward 256  # those head dims

The backward's TFLOP/s count its 5 matmuls (2.5x the forward's work), whatever each side runs;
below each row, the backward's kernel times (torch.profiler, ms per call) of both fk sides.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from fk_attention import attention
from fk_attention import config as fk_config, plan
from fk_attention import mask as fk_mask
from fk_attention.layout import padded_head_dim

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (8, 16, 2048, 96, True), (16, 16, 1024, 128, False), (16, 16, 1024, 128, True),
          (8, 16, 2048, 256, True), (8, 16, 2048, 256, False), (4, 16, 4096, 256, True), (4, 16, 4096, 256, False),
          (16, 16, 1024, 256, False), (8, 16, 2048, 192, True)]


def ms(fn) -> float:
    fn()
    return do_bench(fn, warmup=50, rep=300)


def kernel_ms(fn, calls: int = 5) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / calls / 1000 for e in prof.key_averages()
             if e.device_type.name == "CUDA" and e.count}
    return ", ".join(f"{name} {t:.3f}" for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:3])


def tl_only(fn):
    """fn's result with the Gluon kernels off (the tl plan at its default tiles)."""
    patched = {"GLUON_HEAD_DIMS": (), "GLUON_FUSED_HEAD_DIMS": (), "GLUON_FORWARD_TILES": ()}  # what serves,
    saved = {name: getattr(fk_config, name) for name in patched}  # fused_serves and takes read
    vars(fk_config).update(patched)
    plan.BOUND.cache_clear()
    try:
        return fn()
    finally:
        vars(fk_config).update(saved)
        plan.BOUND.cache_clear()


def forward_row(b: int, h: int, n: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    work = 4 * b * h * n * n * d / (2 if causal else 1) / 1e9
    gluon = work / ms(lambda: attention(q, k, v, causal=causal))
    tl = work / tl_only(lambda: ms(lambda: attention(q, k, v, causal=causal)))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = work / ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | {gluon:.0f} | {tl:.0f} | "
            f"{cudnn:.0f} | {gluon / cudnn:.2f}x | {gluon / tl:.2f}x |")


def backward_row(b: int, h: int, n: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    mask, scale = (fk_mask.CAUSAL if causal else fk_mask.FULL), d ** -0.5
    out, lse = plan.forward(q, k, v, mask, scale)
    grad_out = torch.randn_like(out)
    work = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1) / 1e9

    def fk():
        return plan.backward(grad_out, None, q, k, v, out, lse, mask, scale)

    gluon, gluon_split = work / ms(fk), kernel_ms(fk)
    tl, tl_split = tl_only(lambda: (work / ms(fk), kernel_ms(fk)))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        cudnn = work / ms(lambda: torch.autograd.grad(o, (qs, ks, vs), grad_out, retain_graph=True))
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | {gluon:.0f} | {tl:.0f} | "
            f"{cudnn:.0f} | {gluon / cudnn:.2f}x | {gluon / tl:.2f}x |\n"
            f"    fk with Gluon dK/dV: {gluon_split}\n    fk tl: {tl_split}")


if __name__ == "__main__":
    backward = sys.argv[1:2] == ["backward"]
    head_dims = {int(d) for d in sys.argv[2:]}  # padded head dims to time (all if none)
    print(f"{torch.cuda.get_device_name()}, {'backward' if backward else 'forward'}")
    print("| shape | dtype | fk Gluon TFLOP/s | fk tl TFLOP/s | cuDNN TFLOP/s | Gluon / cuDNN | Gluon / tl |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            if not head_dims or padded_head_dim(shape[3]) in head_dims:
                print((backward_row if backward else forward_row)(*shape, dtype), flush=True)

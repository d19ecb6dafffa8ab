"""Eager host time of fk attention (B1 H8 N128 d64 causal bf16) with `fk_runtime.launch`'s own TMA
descriptor expansion and with Triton 3.6's per-call wrapper, plans rebuilt at each switch, rounds
interleaved in one process; SDPA beside them. GPU only (Hopper, triton 3.6):

    bash shared/from-source.sh python shared/tuning/host_descriptors.py
"""
import time

import torch
import torch.nn.functional as F

from fk_attention import attention
from fk_attention import plan as table
from fk_runtime import launch

real = launch._tensordesc_fast_path
b, h, n, d = 1, 8, 128, 64
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)


def fwd():
    with torch.no_grad():
        return attention(q, k, v, causal=True)


def fwdbwd():
    return torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), g)


def sdpa():
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_fb():
    return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)


def per_call(fn, reps=1000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps * 1e6)
    return best


for rnd in range(3):
    for mode in ("fk expansion", "triton wrapper"):
        launch._tensordesc_fast_path = real if mode == "fk expansion" else (lambda *a, **k: None)
        table.BOUND.clear()
        print(f"round {rnd} {mode}: fwd {per_call(fwd):.1f} us, fwd+bwd {per_call(fwdbwd):.1f} us; "
              f"sdpa fwd {per_call(sdpa):.1f} us, fwd+bwd {per_call(sdpa_fb):.1f} us", flush=True)

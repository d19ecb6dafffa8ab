"""The softcap's tanh on a GPU (TUNING.md: Softcaps): `kernels.tanh_approx` (the GPU's tanh.approx.f32) and tanh
from exp2 against float64 tanh, then causal softcapped attention, forward and backward, against float64 with each
(`config.SOFTCAP_APPROX_DTYPES` as shipped, and empty), beside torch's eager attention in the same dtype (fp32
softcap and softmax).

    bash shared/from-source.sh python packages/fk-attention/tuning/softcap_tanh.py [OUT.json]

Prints tanh's largest errors and, per case, the relative errors of (out, dq, dk, dv).
"""

import json
import math
import sys

import torch
import triton
import triton.language as tl

from fk_runtime.harness.testing import rel_error

from fk_attention import attention, config, kernels, plan


@triton.jit
def _tanh_kernel(x_ptr, approx_ptr, exp2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(approx_ptr + offs, kernels.tanh_approx(x), mask=offs < n)
    tl.store(exp2_ptr + offs, kernels.capped(x, 1.0, kernels.TANH_EXP2), mask=offs < n)


def tanh_errors() -> dict:
    """Largest absolute and relative errors over [-12, 12] and small arguments (normal, sd 0.05)."""
    x = torch.cat([torch.linspace(-12, 12, 1 << 22, device="cuda"), torch.randn(1 << 20, device="cuda") * 0.05])
    approx, exp2 = torch.empty_like(x), torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, approx, exp2, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    errors = {}
    for name, got in (("approx", approx), ("exp2", exp2)):
        err = (got.double() - want).abs()
        errors[name] = {"max_abs": err.max().item(), "max_rel": (err / want.abs())[want.abs() > 1e-6].max().item()}
    return errors


def reference(q, k, v, cap, dtype=None):
    """Causal softcapped attention: float64 throughout (dtype None), or the scores in dtype, softcap and softmax in
    fp32, the weights cast back (torch's eager attention)."""
    scale = 1 / math.sqrt(q.shape[-1])
    if dtype is None:
        q, k, v = (t.double() for t in (q, k, v))
        s = q @ k.transpose(-1, -2) * scale
    else:
        s = (q @ k.transpose(-1, -2)).float() * scale
    s = cap * torch.tanh(s / cap)
    n = q.shape[-2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v if dtype is None else p.to(v.dtype) @ v


def attention_errors() -> list[dict]:
    """(out, dq, dk, dv) errors of fk with each tanh and of torch's eager attention, B2 H8 N1024; `spread` scales q
    (8: scores reach the cap, where it bends them)."""
    rows = []
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for cap, spread in ((50.0, 1.0), (50.0, 8.0), (20.0, 4.0)):
                q, k, v = (torch.randn(2, 8, 1024, d, device="cuda", dtype=dtype) for _ in range(3))
                q = (q.float() * spread).to(dtype)
                do = torch.randn_like(q)
                exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
                want = reference(*exact, cap)
                wants = [want, *torch.autograd.grad(want, exact, do.double())]
                row = {"d": d, "dtype": str(dtype).removeprefix("torch."), "cap": cap, "spread": spread}
                for name, dtypes in (("fk approx", config.SOFTCAP_APPROX_DTYPES), ("fk exp2", ())):
                    shipped, config.SOFTCAP_APPROX_DTYPES = config.SOFTCAP_APPROX_DTYPES, dtypes
                    plan.BOUND.cache_clear()
                    try:
                        ins = [t.detach().requires_grad_() for t in (q, k, v)]
                        out = attention(*ins, causal=True, softcap=cap)
                        got = [out, *torch.autograd.grad(out, ins, do)]
                    finally:
                        config.SOFTCAP_APPROX_DTYPES = shipped
                        plan.BOUND.cache_clear()
                    row[name] = [rel_error(g, w) for g, w in zip(got, wants, strict=True)]
                ins = [t.detach().requires_grad_() for t in (q, k, v)]
                out = reference(*ins, cap, dtype)
                row["torch"] = [rel_error(g, w) for g, w in zip([out, *torch.autograd.grad(out, ins, do)], wants,
                                                               strict=True)]
                rows.append(row)
                print(f"d{d} {row['dtype']} cap {cap} spread {spread}: " + "; ".join(
                    f"{name} " + " ".join(f"{x:.2e}" for x in row[name]) for name in ("fk approx", "fk exp2", "torch")),
                    flush=True)
    return rows


if __name__ == "__main__":
    torch.manual_seed(0)
    result = {"triton": triton.__version__, "tanh": tanh_errors()}
    print("tanh:", result["tanh"], flush=True)
    result["attention"] = attention_errors()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)

"""attention: checks, then the differentiable op (fk_runtime.ops.define).

Path of a call: metadata checks -> `fk::attention` (eager: its autograd.Function straight into
`plan.forward`, bound once per shapes, strides, dtype, device and flags: a fixed config or the
autotuner's winner, TMA descriptors or pointers) -> forward kernel (saves O and the fp32 row
log-sum-exp) -> backward: dQ kernel (also writes the row term delta = rowsum(dO * O)), then dK/dV
kernel (per KV head, summed over its query heads). Nothing N x N is ever stored.
"""

from __future__ import annotations

import math

import torch
from fk_runtime import checks
from fk_runtime import ops as fk_ops

from . import plan as table

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *table.FP8_DTYPES)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return table.forward(q, k, v, causal, sm_scale)


def _forward_fake(q, k, v, causal, sm_scale):
    return table.fake_like(q, table.output_dtype(q.dtype)), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return table.backward(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale)


def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale):
    return table.fake_like(q), table.fake_like(k), table.fake_like(v)


def _backward_args(saved, other, grads):
    q, k, v, out, lse = saved
    grad_out, grad_lse = grads
    if grad_out is None:  # only the log-sum-exp was used
        grad_out = torch.zeros_like(out)
    return (grad_out, grad_lse, q, k, v, out, lse, *other)


# Both outputs are differentiable (the log-sum-exp's gradient folds into the backward's delta);
# q, k, v are saved as the caller's tensors (no copies), with the output and the log-sum-exp.
ATTENTION = fk_ops.define(
    "attention",
    forward=_forward, forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake,
    save=lambda inputs, outputs: ((*inputs[:3], *outputs), inputs[3:]),
    backward_args=_backward_args,
    input_grads=lambda other, grads, needs: (*grads, None, None),
    materialize_grads=False,
)


def _check(q, k, v, sm_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=ATTENTION_DTYPES, min_dim=4, max_dim=4)
    checks.check_same_dtype(q=q, k=k, v=v)
    checks.check_same_device(q=q, k=k, v=v)
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(f"q, k, v must share the head dim, got {d}, {k.shape[3]}, {v.shape[3]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hk = k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hk})")
    table.check_head_dim(d)
    if sm_scale is not None:
        checks.check_positive("sm_scale", sm_scale)
    if q.dtype in table.FP8_DTYPES and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("fp8 attention is forward-only (inference): q, k, v must not require grad")


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, return_lse: bool = False):
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True)`.

    q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) with Hq a multiple of Hk (GQA/MQA), D a multiple of 8
    from 16 to 256; any strides (e.g. (B, N, H, D) tensors transposed), any lengths. fp16, bf16,
    fp32 (fp32 math inside, fp32 products); fp8 (e5m2, e4m3fn) forward only, on CUDA GPUs of
    compute capability >= 8.9, with a bf16 output. `causal` masks key j for query i when j > i
    (SDPA's top-left alignment when Nq != Nk). `sm_scale` > 0 defaults to 1 / sqrt(D).

    `return_lse=True` returns (out, lse) with lse the fp32 row log-sum-exp (B, Hq, Nq) of the
    scaled scores, natural log: what merging partial attentions needs. It is differentiable too.
    The output is laid out like q ((B, N, H, D) storage for such a view)."""
    _check(q, k, v, sm_scale)
    causal = checks.check_flag("causal", causal)
    return_lse = checks.check_flag("return_lse", return_lse)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = ATTENTION.apply(q, k, v, causal, scale)
    return (out, lse) if return_lse else out

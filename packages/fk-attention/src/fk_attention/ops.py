"""Launchers, `torch.library` ops and autograd for attention.

Path of a call: checks (fk_runtime) -> autograd.Function -> blocks (fk_runtime.tuning.attention)
-> forward kernel (saves O and the row log-sum-exp) -> backward: delta, dK/dV (per KV head,
summed over its query heads), dQ. Nothing N x N is ever stored. Eager calls reach the launchers
directly; under `torch.compile` they go through the registered ops (fk_runtime.dispatch).
"""

from __future__ import annotations

import math

import torch
from fk_runtime import alloc, checks, dispatch
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import attention as table

from . import kernels

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (tf32 would cost them ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(q, k, v, causal: bool, sm_scale: float):
    checks.check_kernel_device("q", q)
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    out = alloc.empty((b, hq, n_q, d), dtype=q.dtype, device=q.device)
    lse = alloc.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    blk = table.blocks(d, backward=False)
    kernels.attn_fwd_kernel[(fk_sizing.cdiv(n_q, blk.block_m), b * hq)](
        q, k, v, out, lse, sm_scale, n_q, n_k, hq, d,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        GROUP=hq // hk, CAUSAL=causal, BLOCK_M=blk.block_m, BLOCK_N=blk.block_n,
        BLOCK_D=table.padded_head_dim(d), PRECISION=_precision(q.dtype),
        **fk_sizing.launch_options(blk.num_warps, blk.num_stages),
    )
    return out, lse


def _backward(grad_out, q, k, v, out, lse, causal: bool, sm_scale: float):
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    dq = alloc.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    blk = table.blocks(d, backward=True)
    block_d = table.padded_head_dim(d)
    opts = fk_sizing.launch_options(blk.num_warps, blk.num_stages)
    delta = torch.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    kernels.attn_bwd_delta_kernel[(fk_sizing.cdiv(n_q, blk.block_m), b * hq)](
        out, grad_out, delta, n_q, hq, d, *_strides(out), *_strides(grad_out),
        BLOCK_M=blk.block_m, BLOCK_D=block_d, **fk_sizing.launch_options(blk.num_warps),
    )
    common = dict(GROUP=hq // hk, CAUSAL=causal, BLOCK_M=blk.block_m, BLOCK_N=blk.block_n,
                  BLOCK_D=block_d, PRECISION=_precision(q.dtype), **opts)
    kernels.attn_bwd_dkdv_kernel[(fk_sizing.cdiv(n_k, blk.block_n), b * hk)](
        q, k, v, grad_out, lse, delta, dk, dv, sm_scale, n_q, n_k, hk, d,
        *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out),
        *_strides(dk)[:3], *_strides(dv)[:3], **common,
    )
    kernels.attn_bwd_dq_kernel[(fk_sizing.cdiv(n_q, blk.block_m), b * hq)](
        q, k, v, grad_out, lse, delta, dq, sm_scale, n_q, n_k, hq, d,
        *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dq)[:3], **common,
    )
    return dq, dk, dv


@torch.library.custom_op("fk::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, sm_scale)


@attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fk::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_out, q, k, v, out, lse, causal, sm_scale)


@attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, causal, sm_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_run_forward = dispatch.eager_or_op(attention_op, _forward)
_run_backward = dispatch.eager_or_op(attention_backward_op, _backward)


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v (the caller's tensors), the output and the fp32 row log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = _run_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=ATTENTION_DTYPES, min_dim=4, max_dim=4)
    checks.check_same_dtype(q=q, k=k, v=v)
    checks.check_same_device(q=q, k=k, v=v)
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k, v must share the batch size: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(f"q, k, v must share the head dim: {d}, {k.shape[3]}, {v.shape[3]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hk = k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hk})")
    if not (table.MIN_HEAD_DIM <= d <= table.MAX_HEAD_DIM and d % table.HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head dim must be a multiple of {table.HEAD_DIM_STEP} from {table.MIN_HEAD_DIM} "
            f"to {table.MAX_HEAD_DIM}, got {d}"
        )


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, return_lse: bool = False):
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True)`.

    q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) with Hq a multiple of Hk; any strides; fp16, bf16 or
    fp32 (fp32 math inside). `causal` masks key j for query i when j > i (SDPA's alignment).
    `return_lse=True` also returns the fp32 row log-sum-exp (B, Hq, Nq), natural log, which gets
    no gradient."""
    _check(q, k, v)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = AttentionFunction.apply(q, k, v, bool(causal), scale)
    return (out, lse) if return_lse else out

"""FlashAttention 2's public functions on fk's kernels: changing the import is the port.

    from fk_attention.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Signatures, defaults, layouts and return values are `flash_attn.flash_attn_interface`'s:
(batch, seqlen, heads, headdim) tensors, packed (total, heads, headdim) ones with int32
`cu_seqlens`; masks aligned to the bottom-right corner where Nq != Nk (causal and
`window_size`, -1 for an unbounded side); `softcap` 0.0 for none; the default scale
1 / sqrt(headdim); rows that see no key give a zero output and a log-sum-exp of +inf; GQA/MQA by
fewer key/value heads; any head dim up to 256 (fk masks the padding inside, as FlashAttention
pads); `alibi_slopes` ((nheads,) or (batch, nheads) fp32) added as FlashAttention adds them,
-slope * |i + seqlen_k - seqlen_q - j| on the scaled scores. `deterministic=True` as
FlashAttention's: the backward gives the same bits on every run (fk's default one does too but for
the dense calls' 5-matmul backward on Hopper, Triton >= 3.8, head dims 33-128); fk picks its own key
slicing (`num_splits` changes nothing).

`cache_leftpad` as FlashAttention's (dense and paged caches). `dropout_p` > 0: attention dropout
as FlashAttention applies it (whenever passed; its callers pass it in training only), fk's
`attention(dropout_p=...)`: the seed is drawn per call from torch's default CPU generator, so
`torch.manual_seed(s)` before a call repeats its mask (FlashAttention reads the CUDA generator's
Philox state instead: same semantics, other bits). `block_table` in the varlen call: paged
KV, forward only (no dropout, no ALiBi with it). `return_attn_probs=True` returns (out,
softmax_lse, None): no probabilities (nor dropout mask).
"""

from __future__ import annotations

import math
import numbers

import torch
from fk_runtime import checks

from .layout import DTYPES
from .ops import attention, attention_varlen, attention_with_kvcache

# FlashAttention's alignment of every mask where Nq != Nk.
ALIGN = "lower_right"
# FlashAttention's window_size for no window.
UNBOUNDED = (-1, -1)


def _side(name: str, value) -> int | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point():
            raise TypeError(f"{name} must be an int (or a one-element integer tensor), got {value!r}")
        value = int(value.item())
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (-1: unbounded), got {type(value).__name__}")
    if value < -1:
        raise ValueError(f"{name} must be >= 0, or -1 for unbounded, got {value}")
    return None if value < 0 else int(value)


def _window(window_size) -> tuple[int | None, int | None] | None:
    """fk's `window` from FlashAttention's `window_size` (a pair, or a 2-element tensor)."""
    if type(window_size) is tuple and window_size == UNBOUNDED:  # the default, at no parsing cost
        return None
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.reshape(-1).tolist() if window_size.numel() == 2 else window_size
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, got {window_size!r}")
    left, right = _side("window_size[0]", window_size[0]), _side("window_size[1]", window_size[1])
    return None if left is None and right is None else (left, right)


def _scale(softmax_scale, head_dim: int) -> float | None:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention's log-sum-exp of a row that sees no key is +inf (fk's, -inf)."""
    return lse.masked_fill(lse == -math.inf, math.inf)


def _dims(name: str, t, dims: int) -> None:
    # The full check (its error names the argument) only where a quick look finds something off:
    # fk's call checks dtypes and devices again, and this layer must cost the host next to nothing.
    if type(t) is not torch.Tensor or t.dim() != dims or t.dtype not in DTYPES:
        checks.check_tensor(name, t, dtypes=DTYPES, min_dim=dims, max_dim=dims)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=UNBOUNDED, softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn.flash_attn_func`: q (batch, seqlen_q, nheads, headdim), k and v (batch,
    seqlen_k, nheads_k, headdim); out like q, and with `return_attn_probs` (out, softmax_lse
    (batch, nheads, seqlen_q), None). Differentiable in q, k and v."""
    # One quick look at the three (this layer's host cost is measured against fk's own call);
    # the full checks, whose errors name the argument, only where it finds something off.
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.dtype in DTYPES):
        for name, t in (("q", q), ("k", k), ("v", v)):
            _dims(name, t, 4)
    window = None if window_size is UNBOUNDED else _window(window_size)
    # positionally, in `attention`'s order (causal, sm_scale, return_lse, window, softcap, align,
    # alibi_slopes, dropout_p, generator, deterministic): keywords cost this layer a measurable share
    # of a quiet call
    result = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, softmax_scale,
                       bool(return_attn_probs), window, softcap, ALIGN, alibi_slopes, dropout_p, None,
                       bool(deterministic))
    if not return_attn_probs:
        return result.transpose(1, 2)
    out, lse = result
    return out.transpose(1, 2), _lse(lse), None


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn.flash_attn_kvpacked_func`: kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    _dims("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got shape {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn.flash_attn_qkvpacked_func`: qkv (batch, seqlen, 3, nheads, headdim)."""
    _dims("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """`flash_attn.flash_attn_varlen_func`: q (total_q, nheads, headdim), k and v (total_k,
    nheads_k, headdim), int32 `cu_seqlens_q` / `cu_seqlens_k` (batch + 1,); out (total_q,
    nheads, headdim), and with `return_attn_probs` (out, softmax_lse (nheads, total_q), None).
    Paged KV (`block_table` int32 (batch, blocks per sequence)): k and v are caches (num_blocks,
    page_block_size, nheads_k, headdim) and cu_seqlens_k counts each sequence's cached keys;
    forward only (fk's `attention_varlen(..., block_table=...)`: one launch for prefill and decode)."""
    paged = block_table is not None
    _dims("q", q, 3)
    for name, t in (("k", k), ("v", v)):
        if paged and isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{name} must be a paged cache (num_blocks, page_block_size, nheads_k, headdim) with "
                             f"block_table, got shape {tuple(t.shape)}")
        _dims(name, t, 4 if paged else 3)
    if paged:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # fk's (pages, heads_k, rows, headdim) order
    result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                              sm_scale=_scale(softmax_scale, q.shape[-1]), window=_window(window_size),
                              softcap=softcap, return_lse=bool(return_attn_probs), align=ALIGN,
                              alibi_slopes=alibi_slopes, dropout_p=dropout_p, block_table=block_table)
    out, lse = result if return_attn_probs else (result, None)
    return (out, _lse(lse), None) if return_attn_probs else out


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn.flash_attn_varlen_kvpacked_func`: kv (total_k, 2, nheads_k, headdim)."""
    _dims("kv", kv, 4)
    if kv.shape[1] != 2:
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got shape {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """`flash_attn.flash_attn_varlen_qkvpacked_func`: qkv (total, 3, nheads, headdim)."""
    _dims("qkv", qkv, 4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, headdim) with its first 2 * cos.shape[1] features rotated at
    `positions` (batch, seqlen), in fp32 as FlashAttention's rotary kernel; positions past the
    table are left as they are (cos 1, sin 0)."""
    half = cos.shape[1]
    inside = positions < cos.shape[0]
    index = positions.clamp(max=cos.shape[0] - 1).long()
    c = torch.where(inside[..., None], cos[index].float(), 1.0)[:, :, None]  # (batch, seqlen, 1, half)
    s = torch.where(inside[..., None], sin[index].float(), 0.0)[:, :, None]
    rotated, rest = x[..., :2 * half].float(), x[..., 2 * half:]
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:  # GPT-NeoX: the first half with the second
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """`flash_attn.flash_attn_with_kvcache`: q (batch, seqlen_q, nheads, headdim); caches
    (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size,
    nheads_k, headdim) with `block_table` (batch, blocks per sequence) int32 (any page size);
    new rows k, v (batch, seqlen_new, nheads_k, headdim) written into the caches in place at
    `cache_seqlens` (an int, or int32 (batch,)); `cache_batch_idx` int32 (batch,) picks each
    sequence's cache row; `rotary_cos` / `rotary_sin` (seqlen_ro, rotary_dim / 2) rotate the new
    keys at cache_seqlens + j and q at cache_seqlens + i (causal or windowed) or cache_seqlens
    (neither), interleaved (GPT-J) or not (GPT-NeoX). Forward only. out like q, and with
    `return_softmax_lse` (out, softmax_lse (batch, nheads, seqlen_q))."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _dims(name, t, 4)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new rows for both caches) or both be None")
    batch = q.shape[0]
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx picks rows of a dense cache: it cannot go with a block_table")
    caches = [k_cache.transpose(1, 2), v_cache.transpose(1, 2)]  # (rows or pages, heads_k, rows, headdim)
    if cache_batch_idx is not None:  # each sequence one page: its cache row, as a page of the whole length
        checks.check_tensor("cache_batch_idx", cache_batch_idx, dtypes=(torch.int32,), min_dim=1, max_dim=1)
        if cache_batch_idx.shape[0] != batch:
            raise ValueError(f"cache_batch_idx must hold one index per batch row ({batch}), got shape "
                             f"{tuple(cache_batch_idx.shape)}")
        block_table = cache_batch_idx[:, None]
    capacity = (block_table.shape[1] * k_cache.shape[1]) if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: the new rows k, v need the lengths they are written at")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or k is None:
            raise ValueError("rotary_cos and rotary_sin go together, and with new rows k, v")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _dims(name, t, 2)
        if rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > q.shape[-1]:
            raise ValueError(f"rotary_cos and rotary_sin must share a shape (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= headdim ({q.shape[-1]}), got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")
        start = cache_seqlens.to(torch.int64)[:, None]
        k = _rotary(k, rotary_cos, rotary_sin, start + torch.arange(k.shape[1], device=q.device), rotary_interleaved)
        moving = causal or _window(window_size) is not None
        q_positions = start + torch.arange(q.shape[1], device=q.device) if moving else start.expand(-1, q.shape[1])
        q = _rotary(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
    result = attention_with_kvcache(q.transpose(1, 2), *caches, cache_seqlens,
                                    None if k is None else k.transpose(1, 2), None if v is None else v.transpose(1, 2),
                                    block_table=block_table, causal=causal, sm_scale=_scale(softmax_scale, q.shape[-1]),
                                    window=_window(window_size), softcap=softcap,
                                    return_lse=bool(return_softmax_lse), alibi_slopes=alibi_slopes,
                                    cache_leftpad=cache_leftpad)
    out, lse = result if return_softmax_lse else (result, None)
    out = out.transpose(1, 2)
    return (out, _lse(lse)) if return_softmax_lse else out

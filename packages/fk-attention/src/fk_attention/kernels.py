"""Triton kernels for attention, FlashAttention-2 style: one idea each.

Tensors are (B, H, N, D) with any strides. GQA: query head h reads key/value head h // GROUP.
Causal masking is SDPA's top-left alignment: query i sees keys j <= i. Head dims are padded to
BLOCK_D (a power of two) with masked loads; sequence ends are masked, so no length rule applies.
Softmax statistics are fp32; the forward works in base 2 (exp2), and saves the natural-log
log-sum-exp per query row for the backward and for callers merging partial attentions.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _valid(offs_m, offs_n, n_q, n_k, CAUSAL: tl.constexpr):
    valid = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_k)
    if CAUSAL:
        valid &= offs_n[None, :] <= offs_m[:, None]
    return valid


@triton.jit
def _causal_end(start_m, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key any query of this block may see."""
    if CAUSAL:
        return tl.minimum(n_k, start_m + BLOCK_M)
    return n_k


@triton.jit
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sm_scale, n_q, n_k, n_heads, head_dim,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of queries against all the keys it may see: online softmax, O = P V."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < n_q) & d_mask[None, :], other=0.0)
    scale = sm_scale * LOG2E
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, _causal_end(start_m, n_k, BLOCK_M, CAUSAL), BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < n_k) & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(_valid(offs_m, cols, n_q, n_k, CAUSAL), s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing valid yet (padding rows) keep m = -inf; shift them by 0, not NaN.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    row_ok = offs_m < n_q
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_base = o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None] * son + offs_d[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_mask[None, :])
    lse = (m_i + tl.log2(l_safe)) * LN2
    tl.store(lse_ptr + bh.to(tl.int64) * n_q + offs_m, lse, mask=row_ok)


@triton.jit
def attn_bwd_delta_kernel(
    o_ptr, do_ptr, delta_ptr, n_q, n_heads, head_dim,
    sob, soh, son, sod, sdob, sdoh, sdon, sdod,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta = rowsum(dO * O), the softmax backward's per-row term."""
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < head_dim)
    o = tl.load(o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son
                + offs_d[None, :] * sod, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdon
                 + offs_d[None, :] * sdod, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * n_q + offs_m, tl.sum(o * do, axis=1), mask=offs_m < n_q)


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    sm_scale, n_q, n_k, n_heads_k, head_dim,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
    sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK and dV of one key block of one KV head, summed over every query head of its GQA group
    inside this program (no atomics: the same bits every run)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
    k = tl.load(k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn
                + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn
                + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # Causal: only query blocks that reach this key block contribute.
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * (n_heads_k * GROUP) + h
        q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = do_ptr + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
        for start_m in range(lo, n_q, BLOCK_M):
            offs_m = start_m + offs_m0
            q_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
            q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdon + offs_d[None, :] * sdod, mask=q_mask, other=0.0)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
            delta = tl.load(delta_ptr + bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
            p = tl.where(_valid(offs_m, offs_n, n_q, n_k, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk *= sm_scale
    out_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
    tl.store(dk_ptr + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn
             + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptr + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn
             + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    sm_scale, n_q, n_k, n_heads, head_dim,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
    sdqb, sdqh, sdqn,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """dQ of one query block: walks the key blocks it saw in the forward (no atomics)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn
                + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdon
                 + offs_d[None, :] * sdod, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, _causal_end(start_m, n_k, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        p = tl.where(_valid(offs_m, offs_n, n_q, n_k, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq *= sm_scale
    tl.store(dq_ptr + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqn
             + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=q_mask)

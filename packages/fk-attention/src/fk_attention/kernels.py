"""Triton kernels for attention, FlashAttention-2 style: one idea each.

Tensors are (B, H, N, D) with any strides; a program sees one (batch, head) as an (N, D) matrix
read in row blocks, either through a 4-D tensor descriptor built on the host (TMA, `USE_DESC`:
Hopper; passed as a kernel parameter, so no program builds one; zero fill past the matrix) or
through pointers with masks. (The `*_ptr` operands of the kernels are those descriptors when
USE_DESC is set.) Head dims are padded to HEAD_DIM_PADDED (a power of
two) with zeros, sequence ends are masked, so no length rule applies. GQA: query head h reads
key/value head h // group. Causal masking is SDPA's top-left alignment: query i sees keys j <= i.

Softmax works in base 2 (exp2 of scores scaled by sm_scale * log2(e)) with fp32 statistics; the
row log-sum-exp is saved in natural log (what callers merging partial attentions use) and turned
back into base 2 by the backward. Grids are 1-D (no 65535 limit on B * H), query or key blocks
fastest so that neighbouring programs share one head's K/V (or Q/dO) in L2.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _source(t, b, h, stride_b, stride_h, USE_DESC: tl.constexpr):
    """Head (b, h) of a (B, H, N, D) operand: the whole tensor's descriptor (its loads and stores
    name b and h; out-of-range rows and the head-dim padding read as zeros, writes there are
    dropped) or a pointer to the head's first row."""
    if USE_DESC:
        return t
    else:
        return t + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _load(src, b, h, start, n_rows, stride_n, stride_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
          HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Rows [start, start + BLOCK) of head (b, h) as a BLOCK x HEAD_DIM_PADDED tile, zeros outside
    the matrix. Pointer loads mask only what may be out of range (CHECK_ROWS, head-dim padding),
    so full tiles stay unmasked vector loads."""
    if USE_DESC:
        tile = src.load([b, h, start, 0]).reshape(BLOCK, HEAD_DIM_PADDED)
    else:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM_PADDED)
        # The block's offset in 64 bits (long sequences of wide rows), the tile's in 32.
        ptrs = src + start.to(tl.int64) * stride_n + rows[:, None] * stride_n + cols[None, :] * stride_d
        if CHECK_ROWS:
            if HEAD_DIM == HEAD_DIM_PADDED:
                tile = tl.load(ptrs, mask=(start + rows)[:, None] < n_rows, other=0.0)
            else:
                tile = tl.load(ptrs, mask=((start + rows)[:, None] < n_rows) & (cols[None, :] < HEAD_DIM),
                               other=0.0)
        else:
            if HEAD_DIM == HEAD_DIM_PADDED:
                tile = tl.load(ptrs)
            else:
                tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store(dst, tile, b, h, start, n_rows, stride_n, stride_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
           HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr):
    """Write a BLOCK x HEAD_DIM_PADDED fp32 tile, cast to the destination's dtype, to rows
    [start, start + BLOCK) of head (b, h), dropping what lies outside the matrix."""
    if USE_DESC:
        dst.store([b, h, start, 0], tile.to(dst.dtype).reshape(1, 1, BLOCK, HEAD_DIM_PADDED))
    else:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM_PADDED)
        ptrs = dst + start.to(tl.int64) * stride_n + rows[:, None] * stride_n + cols[None, :] * stride_d
        mask = (start + rows)[:, None] < n_rows
        if HEAD_DIM != HEAD_DIM_PADDED:
            mask = mask & (cols[None, :] < HEAD_DIM)
        tl.store(ptrs, tile.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _key_range(start_m, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query block at start_m: keys [0, full_end) need no mask (every row sees them all),
    keys [full_end, end) need one (sequence end, causal diagonal); none past end are seen."""
    if CAUSAL:
        end = tl.minimum(n_k, start_m + BLOCK_M)
        full_end = (tl.minimum(n_k, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        end = n_k
        full_end = (n_k // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def _key_mask(offs_m, cols, n_k, CAUSAL: tl.constexpr):
    valid = cols[None, :] < n_k
    if CAUSAL:
        valid = valid & (cols[None, :] <= offs_m[:, None])
    return valid


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_src, v_src, b, hk, lo, hi, offs_m, n_k, qk_scale,
               skn, skd, svn, svd,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key blocks [lo, hi): running max m, running sum l, O accumulator."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load(k_src, b, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            valid = _key_mask(offs_m, start_n + tl.arange(0, BLOCK_N), n_k, CAUSAL)
            s = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_shift[:, None])
            alpha = tl.exp2(m_i - m_shift)
        else:
            # Unmasked: scale inside the max (sm_scale > 0), then one FMA per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_src, b, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sm_scale, n_q, n_k, n_heads, group,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    n_q_key, n_k_key, bh_key, dtype_key,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    USE_DESC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block of queries against every key it sees: O = softmax(Q K^T * scale) V, and the row
    log-sum-exp. Causal: the blocks that see the most keys start first (shorter ones fill the
    tail). n_*_key, bh_key, dtype_key: autotuning keys only."""
    n_blocks = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    block = pid % n_blocks
    if CAUSAL:
        block = n_blocks - 1 - block
    start_m = block * BLOCK_M
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    q_src = _source(q_ptr, b, h, sqb, sqh, USE_DESC)
    k_src = _source(k_ptr, b, hk, skb, skh, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, USE_DESC)
    o_dst = _source(o_ptr, b, h, sob, soh, USE_DESC)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(q_src, b, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    full_end, end = _key_range(start_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, b, hk, 0, full_end, offs_m, n_k, qk_scale,
                               skn, skd, svn, svd, CAUSAL, False, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED,
                               USE_DESC, PRECISION)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, b, hk, full_end, end, offs_m, n_k, qk_scale,
                               skn, skd, svn, svd, CAUSAL, True, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED,
                               USE_DESC, PRECISION)
    # Every row sees key 0 (n_k == 0 never reaches the kernel), so l > 0; the guard is cheap.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    _store(o_dst, out, b, h, start_m, n_q, son, sod,
           BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)
    lse = (m_i + tl.log2(l_safe)) * LN2
    tl.store(lse_ptr + bh.to(tl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_src, v_src, b, hk, lo, hi, offs_m, n_k, qk_scale,
              skn, skd, svn, svd,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr):
    """dQ += dS K over the key blocks [lo, hi), P recomputed from the saved log-sum-exp."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load(k_src, b, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        v = _load(v_src, b, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None]
        if MASKED:
            z = tl.where(_key_mask(offs_m, start_n + tl.arange(0, BLOCK_N), n_k, CAUSAL), z, float("-inf"))
        p = tl.exp2(z)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr,
    sm_scale, n_q, n_k, n_heads, group,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    sdob, sdoh, sdon, sdod, sdlb, sdlh, sdln, sdqb, sdqh, sdqn, sdqd,
    n_q_key, n_k_key, bh_key, dtype_key,
    CAUSAL: tl.constexpr, HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ of one query block, walking the keys it saw (no atomics: one writer per element).

    It first computes the softmax backward's row term delta = rowsum(dO * O) (minus the
    log-sum-exp's own gradient when the caller used it: d lse / d s = P, so that gradient enters
    dS = P (dP - delta) exactly like delta) and stores it for the dK/dV kernel, which runs next:
    no separate pass over O and dO."""
    n_blocks = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    block = pid % n_blocks
    if CAUSAL:
        block = n_blocks - 1 - block
    start_m = block * BLOCK_M
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    q_src = _source(q_ptr, b, h, sqb, sqh, USE_DESC)
    o_src = _source(o_ptr, b, h, sob, soh, USE_DESC)
    do_src = _source(do_ptr, b, h, sdob, sdoh, USE_DESC)
    k_src = _source(k_ptr, b, hk, skb, skh, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, USE_DESC)
    dq_dst = _source(dq_ptr, b, h, sdqb, sdqh, USE_DESC)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_q
    q = _load(q_src, b, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    do = _load(do_src, b, h, start_m, n_q, sdon, sdod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    o = _load(o_src, b, h, start_m, n_q, son, sod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        dlse = tl.load(dlse_ptr + b.to(tl.int64) * sdlb + h.to(tl.int64) * sdlh + offs_m * sdln,
                       mask=row_ok, other=0.0)
        delta -= dlse
    tl.store(delta_ptr + bh.to(tl.int64) * n_q + offs_m, delta, mask=row_ok)
    # Rows past n_q: q = dO = 0 and lse = 0 give P = 1, dP = 0, delta = 0, so dS = 0 there.
    lse2 = tl.load(lse_ptr + bh.to(tl.int64) * n_q + offs_m, mask=row_ok, other=0.0) * LOG2E
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    full_end, end = _key_range(start_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, b, hk, 0, full_end, offs_m, n_k, qk_scale,
                   skn, skd, svn, svd, CAUSAL, False, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC,
                   PRECISION)
    dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, b, hk, full_end, end, offs_m, n_k, qk_scale,
                   skn, skd, svn, svd, CAUSAL, True, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC,
                   PRECISION)
    dq = dq * sm_scale
    _store(dq_dst, dq, b, h, start_m, n_q, sdqn, sdqd,
           BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_src, do_src, b, h, lse_ptr, delta_ptr, lo, hi, offs_n, n_q, qk_scale,
                sqn, sqd, sdon, sdod,
                CAUSAL_MASK: tl.constexpr, CHECK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr,
                PRECISION: tl.constexpr):
    """dV += P^T dO and dK += dS^T Q over the query blocks [lo, hi), computed transposed (keys as
    rows) so that the key block's accumulators never move. Rows past n_q read q = dO = 0 (CHECK_ROWS,
    or the descriptor's zero fill) and lse = delta = 0, which contributes exactly 0."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(q_src, b, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC,
                  CHECK_ROWS)
        # lse and delta are always masked (a few bytes): the descriptor path walks the last
        # partial block without CHECK_ROWS.
        lse2 = tl.load(lse_ptr + offs_m, mask=offs_m < n_q, other=0.0) * LOG2E
        zt = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :]
        if CAUSAL_MASK:
            zt = tl.where(offs_m[None, :] >= offs_n[:, None], zt, float("-inf"))
        pt = tl.exp2(zt)
        do = _load(do_src, b, h, start_m, n_q, sdon, sdod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC,
                   CHECK_ROWS)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < n_q, other=0.0)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    sm_scale, n_q, n_k, n_heads_k, group,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    n_q_key, n_k_key, bh_key, dtype_key,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    USE_DESC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV of one key block of one KV head, summed over every query head of its GQA group
    inside this program: no atomics, the same bits every run.

    Per query head, three walks over the query blocks: the causal diagonal (masked), the blocks
    below it (no mask at all), and the last partial block (row checks; TMA zero-fills it, so the
    descriptor path folds it into the second walk)."""
    n_blocks = tl.cdiv(n_k, BLOCK_N)
    pid = tl.program_id(0)
    bhk = pid // n_blocks
    start_n = (pid % n_blocks) * BLOCK_N
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    k_src = _source(k_ptr, b, hk, skb, skh, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, USE_DESC)
    k = _load(k_src, b, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    v = _load(v_src, b, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros((BLOCK_N, HEAD_DIM_PADDED), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_PADDED), tl.float32)
    qk_scale = sm_scale * LOG2E
    if CAUSAL:
        # Queries before start_n see none of these keys; past the diagonal they see all.
        lo = (start_n // BLOCK_M) * BLOCK_M
        diag_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_q)
        body_end = tl.maximum(diag_end, (n_q // BLOCK_M) * BLOCK_M)
    else:
        diag_end = 0
        body_end = (n_q // BLOCK_M) * BLOCK_M
    if USE_DESC:
        body_end = n_q
    # Not pipelined itself (num_stages=1): the walks inside are.
    for g in tl.range(0, group, num_stages=1):
        h = hk * group + g
        bh = (b * n_heads_k * group + h).to(tl.int64)
        q_src = _source(q_ptr, b, h, sqb, sqh, USE_DESC)
        do_src = _source(do_ptr, b, h, sdob, sdoh, USE_DESC)
        lse_h = lse_ptr + bh * n_q
        delta_h = delta_ptr + bh * n_q
        if CAUSAL:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, b, h, lse_h, delta_h, lo, diag_end, offs_n,
                                 n_q, qk_scale, sqn, sqd, sdon, sdod, True, True, BLOCK_M, HEAD_DIM,
                                 HEAD_DIM_PADDED, USE_DESC, PRECISION)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, b, h, lse_h, delta_h, diag_end, body_end, offs_n,
                             n_q, qk_scale, sqn, sqd, sdon, sdod, False, False, BLOCK_M, HEAD_DIM,
                             HEAD_DIM_PADDED, USE_DESC, PRECISION)
        if not USE_DESC:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, b, h, lse_h, delta_h, body_end, n_q, offs_n,
                                 n_q, qk_scale, sqn, sqd, sdon, sdod, False, True, BLOCK_M, HEAD_DIM,
                                 HEAD_DIM_PADDED, USE_DESC, PRECISION)
    dk = dk * sm_scale
    dk_dst = _source(dk_ptr, b, hk, sdkb, sdkh, USE_DESC)
    dv_dst = _source(dv_ptr, b, hk, sdvb, sdvh, USE_DESC)
    _store(dk_dst, dk, b, hk, start_n, n_k, sdkn, sdkd,
           BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)
    _store(dv_dst, dv, b, hk, start_n, n_k, sdvn, sdvd,
           BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)

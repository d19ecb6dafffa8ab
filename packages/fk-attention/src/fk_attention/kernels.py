"""Triton kernels for attention, FlashAttention-2 style: one idea each.

Tensors are (B, H, N, D) with any strides; a program sees one (batch, head) as an (N, D) matrix
read in row blocks, either through a 4-D tensor descriptor built on the host (TMA, `USE_DESC`:
Hopper; passed as a kernel parameter, so no program builds one; zero fill past the matrix) or
through pointers with masks. (The `*_ptr` operands of the kernels are those descriptors when
USE_DESC is set; in the decode kernel, k and v only.) USE_DESC = 2 (packed sequences): descriptors for the inputs only, over the whole
(1, H, total, D) tensor: a tile past a sequence's end reads the next one's rows, to which the
masked walks give zero weight (their scores are masked, or in dK/dV meet padded scratch rows;
zeroing the tiles instead cost 1.5x on the dK/dV kernel); outputs are written through pointers
with masks (a TMA box would cross into the next sequence). Head dims are padded to HEAD_DIM_PADDED
(a power of two) with zeros, sequence ends are masked, so no length rule applies. GQA: query head h reads
key/value head h // group.

Masks (WINDOW): query i sees key j when -left <= j - (i + shift) <= right, shift = Nk - Nq for
lower-right alignment (`lower_right` = 1), else 0; causal is right = 0, an unbounded side a bound
past every length. WINDOW 1 builds a window whose left side is unbounded (causal's) without its
compares, 2 one bounded on the left (`mask.Mask.window_build`). Key (or query) blocks no row sees are skipped, and blocks every row sees fully
run without a mask. SOFTCAP: scores s * scale become cap * tanh(s * scale / cap), tanh from exp2 or, built
TANH_APPROX, the GPU's approximation (`mask.Mask.softcap_build`). DROPOUT: each P[i, j] kept with probability
1 - p and scaled by 1 / (1 - p) (`dropout_scale`: Philox bits of (seed, b, h, i, j)
only, which the dQ and dK/dV kernels regenerate); the lse stays the un-dropped softmax's. VARLEN: packed
sequences, (1, H, total, D) operands, sequence b's rows [cu[b], cu[b + 1]) (dense tensors use
b as the batch index and start every sequence at row 0).

Softmax works in base 2 (exp2 of scores scaled by sm_scale * log2(e)) with fp32 statistics; the
row log-sum-exp is saved in natural log (what callers merging partial attentions use) and turned
back into base 2 by the backward. Grids are 1-D (no 65535 limit on B * H), query or key blocks
fastest so that neighbouring programs share one head's K/V (or Q/dO) in L2.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Backward scratch rows start on and pad to a multiple of this (>= dK/dV's BLOCK_M: its packed reads are unmasked).
STATS_ALIGN = tl.constexpr(64)
# Arguments that move with the lengths (kernels add their lse strides): never specialized (no recompiles).
LENGTHS = ["n_q", "n_k", "total_q", "total_k", "n_q_key", "n_k_key", "bh_key"]


@triton.jit
def _source(t, b, h, stride_b, stride_h, first, stride_n, USE_DESC: tl.constexpr):
    """Head (b, h) of a (B, H, N, D) operand: the whole tensor's descriptor (its loads and stores
    name b and h; out-of-range rows and the head-dim padding read as zeros, writes there are
    dropped) or a pointer to the head's first row (row `first`: where a packed sequence starts).
    Packed descriptor loads (USE_DESC = 2) take the sequence's first row as `b` instead."""
    if USE_DESC:
        return t
    else:
        return t + tl.cast(b, tl.int64) * stride_b + tl.cast(h, tl.int64) * stride_h + tl.cast(first, tl.int64) * stride_n


@triton.jit
def _load(src, b, h, start, n_rows, stride_n, stride_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
          HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, CHECK_ROWS: tl.constexpr,
          HALF: tl.constexpr = False):
    """Rows [start, start + BLOCK) of head (b, h) as a BLOCK x HEAD_DIM_PADDED tile, zeros outside
    the matrix. Pointer loads mask only what may be out of range (CHECK_ROWS, head-dim padding),
    so full tiles stay unmasked vector loads. Packed descriptors (USE_DESC = 2, b = the sequence's
    first row) read the next sequence's rows past n_rows. HALF: the descriptors' tiles are 2 BLOCK
    rows; the first half is kept."""
    if USE_DESC:
        if USE_DESC == 2:
            tile = src.load([0, h, b + start, 0])
        else:
            tile = src.load([b, h, start, 0])
        if HALF:
            tile, _ = tl.split(tile.reshape(2, BLOCK, HEAD_DIM_PADDED).permute(1, 2, 0))
        else:
            tile = tile.reshape(BLOCK, HEAD_DIM_PADDED)
    else:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM_PADDED)
        # The block's offset in 64 bits (long sequences of wide rows), the tile's in 32.
        ptrs = src + tl.cast(start, tl.int64) * stride_n + rows[:, None] * stride_n + cols[None, :] * stride_d
        tile = tile_load(ptrs, start + rows, n_rows, cols, HEAD_DIM, HEAD_DIM_PADDED, CHECK_ROWS)
    return tile


@triton.jit
def tile_load(ptrs, rows, n_rows, cols, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A pointer tile, zeros in rows at or past n_rows (CHECK_ROWS) and in the head-dim padding;
    masks only where needed, so full tiles stay unmasked vector loads."""
    if CHECK_ROWS:
        if HEAD_DIM == HEAD_DIM_PADDED:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
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
    [start, start + BLOCK) of head (b, h), dropping what lies outside the matrix (packed
    sequences, USE_DESC = 2, store through pointers)."""
    if USE_DESC == 1:
        dst.store([b, h, start, 0], tile.to(dst.dtype).reshape(1, 1, BLOCK, HEAD_DIM_PADDED))
    else:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM_PADDED)
        ptrs = dst + tl.cast(start, tl.int64) * stride_n + rows[:, None] * stride_n + cols[None, :] * stride_d
        mask = (start + rows)[:, None] < n_rows
        if HEAD_DIM != HEAD_DIM_PADDED:
            mask = mask & (cols[None, :] < HEAD_DIM)
        tl.store(ptrs, tile.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _sequence(cu_ptr, b, n_fixed, total, VARLEN: tl.constexpr):
    """(first row, length) of sequence b: packed ones from the int32 prefix sums, clamped to [0, total] (bad
    bounds give wrong rows, never an out-of-range access); a dense batch's start at row 0, all one length."""
    if VARLEN:
        first = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), first), total)
        return first, end - first
    return 0, n_fixed


# SOFTCAP builds (`mask.Mask.softcap_build`): tanh from exp2, or the GPU's tanh.approx.f32
TANH_EXP2 = tl.constexpr(1)
TANH_APPROX = tl.constexpr(2)
TANH_APPROX_ASM = tl.constexpr("tanh.approx.f32 $0, $1;")


@triton.jit
def tanh_approx(x):
    """The GPU's tanh.approx.f32: one MUFU op (FlashAttention's softcap); at most 7.8e-6 off tanh (H200)."""
    return tl.inline_asm_elementwise(TANH_APPROX_ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tanh(x, SOFTCAP: tl.constexpr):
    """tanh: TANH_APPROX `tanh_approx`; else from exp2 (the interpreter has no libdevice or inline asm),
    1 - 2 / (e^2x + 1), exact at +-inf."""
    if SOFTCAP == TANH_APPROX:
        t = tanh_approx(x)
    else:
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t


@triton.jit
def capped(s, cap_scale, SOFTCAP: tl.constexpr):
    """Scores before the base-2 scale: tanh(s * sm_scale / cap) with softcap (qk_scale holds cap * log2(e)), else s."""
    if SOFTCAP:
        return _tanh(s * cap_scale, SOFTCAP)
    return s


@triton.jit
def score_scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_scale, cap_scale): the base-2 factor applied to the (capped) scores, and what the raw
    scores are multiplied by inside tanh (`capped`)."""
    if SOFTCAP:
        return softcap * LOG2E, sm_scale / softcap
    return sm_scale * LOG2E, 1.0


@triton.jit
def head_slope(alibi_ptr, b, h, sab, sah, qk_scale, ALIBI: tl.constexpr):
    """ALiBi's slope of head (b, h) over qk_scale (the bias lands on the scaled scores, as in FA)."""
    slope = 0.0  # one return: the compiler types them all, and the decode kernel's per-row h gives a block
    if ALIBI:
        slope = tl.load(alibi_ptr + tl.cast(b, tl.int64) * sab + tl.cast(h, tl.int64) * sah) * (LOG2E / qk_scale)
    return slope


@triton.jit
def alibi_bias(s, rows, cols, shift, slope, ALIBI: tl.constexpr):
    """Scores s[i, j] plus ALiBi's -slope * |j - (i + shift)| (`head_slope`'s, or one per row as a column)."""
    if ALIBI:
        s = s - slope * tl.abs(cols[None, :] - (rows[:, None] + shift)).to(tl.float32)
    return s


@triton.jit
def call_seed(seed_ptr, DROPOUT: tl.constexpr):
    """The call's 64-bit dropout seed (an int64 on the device, drawn on the host per call); 0 without dropout."""
    seed = tl.cast(0, tl.int64)  # one return (every branch typed alike)
    if DROPOUT:
        seed = tl.load(seed_ptr)
    return seed


@triton.jit
def dropout_scale(seed, dropout_p, bh, rows, cols):
    """Dropout's factor on P[i, j] (query rows i, key columns j, broadcast against each other): 1 / (1 - p)
    kept, 0 dropped. Philox on (seed; j, i, b * H + h, 0) alone: no tile size enters, so the backward's
    kernels regenerate the forward's mask; four 32-bit counters, no index product to overflow."""
    zero = rows * 0 + cols * 0
    bits, _, _, _ = tl.philox(seed, cols + zero, rows + zero, zero + bh, zero)
    u = (bits >> 8).to(tl.int32).to(tl.float32) * (1.0 / 16777216.0)  # 24 bits: exact in fp32, in [0, 1)
    return tl.where(u >= dropout_p, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def _key_range(start_m, n_k, shift, left, right, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key blocks of the query block at start_m: [lo, full_lo) and [full_hi, hi) need a mask,
    [full_lo, full_hi) none (every row sees every key there); keys outside [lo, hi) are seen by no
    row and skipped. WINDOW: row i sees keys j with -left <= j - (i + shift) <= right (WINDOW 1:
    left unbounded, as causal's)."""
    if WINDOW:
        lo = (tl.maximum(start_m + shift - left, 0) // BLOCK_N) * BLOCK_N if WINDOW == 2 else 0
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + shift + right), lo)
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + shift - left, 0), BLOCK_N) * BLOCK_N if WINDOW == 2 else 0
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = (tl.maximum(start_m + shift + right + 1, 0) // BLOCK_N) * BLOCK_N
        full_hi = tl.maximum(tl.minimum(full_hi, (n_k // BLOCK_N) * BLOCK_N), full_lo)
    else:
        lo = 0
        full_lo = 0
        full_hi = (n_k // BLOCK_N) * BLOCK_N
        hi = n_k
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(start_n, n_q, shift, left, right, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, ROWS_PAST_END: tl.constexpr):
    """`_key_range` seen from the key block at start_n: query blocks [lo, full_lo) and
    [full_hi, hi) need a mask (and row checks), [full_lo, full_hi) neither. ROWS_PAST_END: loads
    read zeros past n_q by themselves (TMA), so the unmasked walk may take the last partial block.
    Every bound is a multiple of BLOCK_M (the walks visit the same blocks): with n_q unspecialized,
    an unaligned end cost the pipelined walks their 16-byte copies (TUNING.md, "Scratch rows")."""
    n_q_up = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
    body_end = n_q_up if ROWS_PAST_END else (n_q // BLOCK_M) * BLOCK_M
    if WINDOW:
        lo = (tl.maximum(start_n - shift - right, 0) // BLOCK_M) * BLOCK_M
        edge = tl.cdiv(start_n + BLOCK_N - shift + left, BLOCK_M) * BLOCK_M
        hi = tl.maximum(tl.minimum(n_q_up, edge) if WINDOW == 2 else n_q_up, lo)
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift - right, 0), BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = (tl.maximum(start_n - shift + left + 1, 0) // BLOCK_M) * BLOCK_M if WINDOW == 2 else body_end
        full_hi = tl.maximum(tl.minimum(full_hi, body_end), full_lo)
    else:
        lo = 0
        full_lo = 0
        full_hi = body_end
        hi = n_q_up
    return lo, full_lo, full_hi, hi


@triton.jit
def _visible(offs_m, cols, n_k, shift, left, right, WINDOW: tl.constexpr):
    """Which keys each query row sees: j < n_k and, with a window, -left <= j - (i + shift) <= right."""
    valid = cols[None, :] < n_k
    if WINDOW:
        d = cols[None, :] - (offs_m[:, None] + shift)
        valid = valid & (d <= right)
        if WINDOW == 2:
            valid = valid & (d >= -left)
    return valid


@triton.jit
def softmax_step(s, m_i, offs_m, start_n, n_k, shift, left, right, qk_scale, WINDOW: tl.constexpr,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step over the scores s of keys [start_n, start_n + BLOCK_N) for query
    rows at positions offs_m: (p in base 2, the rescale alpha of what came before, the new max)."""
    if MASKED:
        valid = _visible(offs_m, start_n + tl.arange(0, BLOCK_N), n_k, shift, left, right, WINDOW)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
    else:
        # Unmasked: scale inside the max (qk_scale > 0), then one FMA per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_src, v_src, b, hk, lo, hi, offs_m, n_k, shift, left, right,
               qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr,
               PRECISION: tl.constexpr, HALF: tl.constexpr = False):
    """Online softmax over the key blocks [lo, hi): running max m, running sum l, O accumulator.
    HALF: BLOCK_N is half the descriptors' key tile (`_load`)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load(k_src, b, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED, HALF)
        s = capped(tl.dot(q, tl.trans(k), input_precision=PRECISION), cap_scale, SOFTCAP)
        s = alibi_bias(s, offs_m, start_n + tl.arange(0, BLOCK_N), shift, slope, ALIBI)
        p, alpha, m_new = softmax_step(s, m_i, offs_m, start_n, n_k, shift, left, right, qk_scale, WINDOW,
                                        MASKED, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)  # the un-dropped sum: the lse is the softmax's, as in FA
        if DROPOUT:
            p = p * dropout_scale(seed, dropout_p, bh, offs_m[:, None], (start_n + tl.arange(0, BLOCK_N))[None, :])
        v = _load(v_src, b, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED, HALF)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_block(q_src, k_src, v_src, o_dst, lse_row, bq, bk, h, hk, start_m, n_q, n_k, shift, left, right,
               qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, skn, skd, svn, svd, son, sod,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_TAIL: tl.constexpr):
    """Rows [start_m, start_m + BLOCK_M) of one (sequence, head): the output and the row
    log-sum-exp. A row that sees no key gets 0 and -inf (the log-sum-exp of nothing). bq, bk:
    the batch index (dense) or the sequences' first rows (packed) for descriptor loads.
    HALF_TAIL: a window's last key block, when at most half of it is seen, in a half-width step
    (where BLOCK_N is 2 BLOCK_M)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(q_src, bq, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    lo, full_lo, full_hi, hi = _key_range(start_m, n_k, shift, left, right, WINDOW, BLOCK_M, BLOCK_N)
    if WINDOW == 2:  # the left edge (causal's is empty)
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, bk, hk, lo, full_lo, offs_m, n_k, shift,
                                   left, right, qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, True,
                                   BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, bk, hk, full_lo, full_hi, offs_m, n_k, shift, left,
                               right, qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, False,
                               BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION)
    tail_hi = hi
    if HALF_TAIL and WINDOW and BLOCK_N == 2 * BLOCK_M:
        # Every other query block ends half-way into its last key block: that half is walked alone.
        rem = (hi - full_hi) % BLOCK_N
        tail_hi = tl.where((rem > 0) & (rem <= BLOCK_N // 2), hi - rem, hi)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, bk, hk, full_hi, tail_hi, offs_m, n_k, shift, left,
                               right, qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, True,
                               BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION)
    if HALF_TAIL and WINDOW and BLOCK_N == 2 * BLOCK_M:
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_src, v_src, bk, hk, tail_hi, hi, offs_m, n_k, shift, left,
                                   right, qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI,
                                   DROPOUT, True, BLOCK_N // 2, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, True)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    _store(o_dst, out, bq, h, start_m, n_q, son, sod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(lse_row + offs_m, lse, mask=offs_m < n_q)


@triton.jit(do_not_specialize=LENGTHS + ["slb", "slh"])
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, alibi_ptr, seed_ptr, dropout_p, sm_scale, softcap,
    n_q, n_k, n_heads, group, lower_right, left, right, total_q, total_k,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, slb, slh, sab, sah,
    n_q_key, n_k_key, bh_key, dtype_key,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HALF_TAIL: tl.constexpr = False,
):
    """One block of queries against every key it sees: O = softmax(Q K^T * scale) V, and the row
    log-sum-exp. With a window (causal included) the blocks that see the most keys start first
    (shorter ones fill the tail). VARLEN: b is a packed sequence, n_q / n_k the longest lengths
    the grid was sized for; a longer sequence's extra blocks are walked by its programs in turn
    (without HALF_TAIL: its half step in that loop cost the packed d64 forward 1.25x the time);
    the grid's last sequence of programs fills the rows past the last sequence (`_spare_rows`).
    n_*_key, bh_key, dtype_key: autotuning keys only."""
    n_blocks = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    block = pid % n_blocks
    if WINDOW:
        block = n_blocks - 1 - block
    b = bh // n_heads
    h = bh % n_heads
    if VARLEN:
        sequences = tl.num_programs(0) // (n_blocks * n_heads) - 1
        if b == sequences:
            head = tl.cast(h, tl.int64)
            _spare_rows(o_ptr + head * soh, cu_q_ptr, sequences, total_q, son, sod, HEAD_DIM, 0.0, block * BLOCK_M,
                        n_blocks * BLOCK_M, BLOCK_M, HEAD_DIM_PADDED)
            _spare_rows(lse_ptr + head * slh, cu_q_ptr, sequences, total_q, 1, 0, 1, float("-inf"), block * BLOCK_M,
                        n_blocks * BLOCK_M, BLOCK_M, 2)
            return
    hk = h // group
    q_first, n_q_b = _sequence(cu_q_ptr, b, n_q, total_q, VARLEN)
    k_first, n_k_b = _sequence(cu_k_ptr, b, n_k, total_k, VARLEN)
    shift = lower_right * (n_k_b - n_q_b)
    q_src = _source(q_ptr, b, h, sqb, sqh, q_first, sqn, USE_DESC)
    k_src = _source(k_ptr, b, hk, skb, skh, k_first, skn, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, k_first, svn, USE_DESC)
    o_dst = _source(o_ptr, b, h, sob, soh, q_first, son, USE_DESC == 1)
    lse_row = lse_ptr + tl.cast(b, tl.int64) * slb + tl.cast(h, tl.int64) * slh + q_first
    qk_scale, cap_scale = score_scales(sm_scale, softcap, SOFTCAP)
    slope = head_slope(alibi_ptr, b, h, sab, sah, qk_scale, ALIBI)
    seed = call_seed(seed_ptr, DROPOUT)
    if VARLEN:
        for start_m in range(block * BLOCK_M, n_q_b, n_blocks * BLOCK_M):
            _fwd_block(q_src, k_src, v_src, o_dst, lse_row, q_first, k_first, h, hk, start_m, n_q_b, n_k_b, shift,
                       left, right, qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, skn, skd, svn, svd, son, sod, WINDOW,
                       SOFTCAP, ALIBI, DROPOUT, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, BLOCK_M, BLOCK_N, False)
    else:
        _fwd_block(q_src, k_src, v_src, o_dst, lse_row, b, b, h, hk, block * BLOCK_M, n_q, n_k, shift, left, right,
                   qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, skn, skd, svn, svd, son, sod, WINDOW, SOFTCAP, ALIBI, DROPOUT,
                   HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, BLOCK_M, BLOCK_N, HALF_TAIL)


@triton.jit
def _spare_rows(t_ptr, cu_ptr, sequences, total, stride_r, stride_c, n_cols, value, start, step,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [cu[sequences], total) of one head's (rows, n_cols) slice of a packed tensor set to value: a padded
    buffer's rows past its last sequence (the bound clamped as `_sequence` clamps), BLOCK_R rows from `start`
    on, every `step` rows (a head's programs share them)."""
    first = tl.minimum(tl.maximum(tl.load(cu_ptr + sequences), 0), total)
    for r in range(first + start, total, step):
        rows = r + tl.arange(0, BLOCK_R)
        _fill_rows(t_ptr, rows, rows < total, n_cols, stride_r, stride_c, value, BLOCK_C)


@triton.jit
def _row_lse2(lse_row, offs_m, n_q):
    """Saved row log-sum-exps in base 2; +inf for a row that saw no key (lse -inf), so that its
    recomputed P is 0, and 0 past n_q (those rows hold q = dO = 0: they contribute nothing)."""
    lse = tl.load(lse_row + offs_m, mask=offs_m < n_q, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _stats_first(b, q_first, VARLEN: tl.constexpr):
    """Where sequence b's rows start in the backward's scratch rows (delta, base-2 lse): packed,
    its first row rounded up to STATS_ALIGN plus STATS_ALIGN per sequence before it, so that every
    sequence's rows, padded to a multiple of STATS_ALIGN, start aligned and stay clear of the next
    sequence's; dense, row 0."""
    if VARLEN:
        return (tl.cdiv(q_first, STATS_ALIGN) + b) * STATS_ALIGN
    return 0


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_src, v_src, b, hk, lo, hi, offs_m, n_k, shift, left, right,
              qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr,
              PRECISION: tl.constexpr):
    """dQ += dS K over the key blocks [lo, hi), P recomputed from the saved log-sum-exp; with
    softcapping dS also carries the cap's derivative, 1 - tanh^2."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load(k_src, b, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        v = _load(v_src, b, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        t = capped(tl.dot(q, tl.trans(k), input_precision=PRECISION), cap_scale, SOFTCAP)
        z = alibi_bias(t, offs_m, start_n + tl.arange(0, BLOCK_N), shift, slope, ALIBI) * qk_scale - lse2[:, None]
        if MASKED:
            valid = _visible(offs_m, start_n + tl.arange(0, BLOCK_N), n_k, shift, left, right, WINDOW)
            z = tl.where(valid, z, float("-inf"))
        p = tl.exp2(z)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:  # dP of the kept weights, scaled as the forward scaled them
            dp = dp * dropout_scale(seed, dropout_p, bh, offs_m[:, None], (start_n + tl.arange(0, BLOCK_N))[None, :])
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_block(q_src, k_src, v_src, o_src, do_src, dq_dst, lse_row, dlse_row, delta_row, lse2_row, bq, bk, h,
              hk,
              start_m,
              n_q, n_k, shift, left, right, sm_scale, qk_scale, cap_scale, slope, seed, dropout_p, bh,
              sqn, sqd, skn, skd, svn, svd, son, sod, sdon, sdod, sdln, sdqn, sdqd,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of rows [start_m, start_m + BLOCK_M), after their row term delta and base-2 lse (stored
    for dK/dV)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_q
    q = _load(q_src, bq, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    do = _load(do_src, bq, h, start_m, n_q, sdon, sdod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    o = _load(o_src, bq, h, start_m, n_q, son, sod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_row + offs_m * sdln, mask=row_ok, other=0.0)
    tl.store(delta_row + offs_m, delta, mask=row_ok)
    lse2 = _row_lse2(lse_row, offs_m, n_q)
    tl.store(lse2_row + offs_m, lse2, mask=row_ok)
    dq = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    lo, full_lo, full_hi, hi = _key_range(start_m, n_k, shift, left, right, WINDOW, BLOCK_M, BLOCK_N)
    if WINDOW == 2:  # the left edge (causal's is empty)
        dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, bk, hk, lo, full_lo, offs_m, n_k, shift, left, right,
                       qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, True, BLOCK_N, HEAD_DIM,
                       HEAD_DIM_PADDED, USE_DESC, PRECISION)
    dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, bk, hk, full_lo, full_hi, offs_m, n_k, shift, left, right,
                   qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, False, BLOCK_N, HEAD_DIM,
                   HEAD_DIM_PADDED, USE_DESC, PRECISION)
    dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, bk, hk, full_hi, hi, offs_m, n_k, shift, left, right,
                   qk_scale, cap_scale, slope, seed, dropout_p, bh, skn, skd, svn, svd, WINDOW, SOFTCAP, ALIBI, DROPOUT, True, BLOCK_N, HEAD_DIM,
                   HEAD_DIM_PADDED, USE_DESC, PRECISION)
    _store(dq_dst, dq * sm_scale, bq, h, start_m, n_q, sdqn, sdqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)


@triton.jit(do_not_specialize=LENGTHS + ["slb", "slh", "sdlb", "sdlh"])
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
    alibi_ptr, seed_ptr, dropout_p, sm_scale, softcap, n_q, n_k, n_heads, group, lower_right, left, right, total_q, total_k,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    sdob, sdoh, sdon, sdod, sdlb, sdlh, sdln, sdqb, sdqh, sdqn, sdqd, slb, slh, ssb, ssh, sab, sah,
    n_q_key, n_k_key, bh_key, dtype_key,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, REST: tl.constexpr,
):
    """dQ of one query block, walking the keys it saw (no atomics: one writer per element).

    It first computes the softmax backward's row term delta = rowsum(dO * O) (minus the
    log-sum-exp's own gradient when the caller used it: d lse / d s = P, so that gradient enters
    dS = P (dP - delta) exactly like delta) and stores it, with the row's base-2 log-sum-exp, in
    aligned scratch rows for the dK/dV kernel, which runs next: no separate pass over O and dO.
    Blocks and sequences as in the forward, except that a packed sequence's blocks past the grid go
    to a second launch (REST: one program per sequence and head), as in `attn_bwd_dkdv_kernel`, whose last
    sequence of programs sets dQ's rows past the last sequence to 0."""
    n_blocks = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid if REST else pid // n_blocks
    block = 0 if REST else pid % n_blocks
    if WINDOW:
        block = n_blocks - 1 - block
    b = bh // n_heads
    h = bh % n_heads
    if REST:
        if b == tl.num_programs(0) // n_heads - 1:
            _spare_rows(dq_ptr + tl.cast(h, tl.int64) * sdqh, cu_q_ptr, b, total_q, sdqn, sdqd, HEAD_DIM, 0.0, 0,
                        BLOCK_M, BLOCK_M, HEAD_DIM_PADDED)
            return
    hk = h // group
    q_first, n_q_b = _sequence(cu_q_ptr, b, n_q, total_q, VARLEN)
    k_first, n_k_b = _sequence(cu_k_ptr, b, n_k, total_k, VARLEN)
    shift = lower_right * (n_k_b - n_q_b)
    q_src = _source(q_ptr, b, h, sqb, sqh, q_first, sqn, USE_DESC)
    o_src = _source(o_ptr, b, h, sob, soh, q_first, son, USE_DESC)
    do_src = _source(do_ptr, b, h, sdob, sdoh, q_first, sdon, USE_DESC)
    k_src = _source(k_ptr, b, hk, skb, skh, k_first, skn, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, k_first, svn, USE_DESC)
    dq_dst = _source(dq_ptr, b, h, sdqb, sdqh, q_first, sdqn, USE_DESC == 1)
    stat_offset = tl.cast(b, tl.int64) * slb + tl.cast(h, tl.int64) * slh + q_first
    dlse_row = dlse_ptr + tl.cast(b, tl.int64) * sdlb + tl.cast(h, tl.int64) * sdlh + q_first * sdln
    scratch = tl.cast(b, tl.int64) * ssb + tl.cast(h, tl.int64) * ssh + _stats_first(b, q_first, VARLEN)
    qk_scale, cap_scale = score_scales(sm_scale, softcap, SOFTCAP)
    slope = head_slope(alibi_ptr, b, h, sab, sah, qk_scale, ALIBI)
    seed = call_seed(seed_ptr, DROPOUT)
    if REST:
        for start_m in range(n_blocks * BLOCK_M, n_q_b, BLOCK_M):
            _dq_block(q_src, k_src, v_src, o_src, do_src, dq_dst, lse_ptr + stat_offset, dlse_row,
                      delta_ptr + scratch, lse2_ptr + scratch, q_first, k_first, h, hk, start_m, n_q_b, n_k_b,
                      shift, left, right, sm_scale,
                      qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, skn, skd, svn, svd, son, sod, sdon, sdod, sdln, sdqn,
                      sdqd, WINDOW, SOFTCAP, ALIBI, DROPOUT, HAS_DLSE, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, BLOCK_M,
                      BLOCK_N)
    else:
        if block == 0:
            # Scratch rows past the sequence's end, to the next STATS_ALIGN: delta 0 and lse2 +inf,
            # so that dK/dV reads them unmasked (a mask on an unspecialized n_q costs it vectorized
            # loads, and the Gluon kernel spills) and gives them zero weight.
            pad = n_q_b + tl.arange(0, STATS_ALIGN)
            pad_ok = pad < tl.cdiv(n_q_b, STATS_ALIGN) * STATS_ALIGN
            tl.store(delta_ptr + scratch + pad, tl.zeros((STATS_ALIGN,), tl.float32), mask=pad_ok)
            tl.store(lse2_ptr + scratch + pad, tl.full((STATS_ALIGN,), float("inf"), tl.float32), mask=pad_ok)
        bq, bk = q_first, k_first  # where the sources start: a packed sequence's first rows, a dense batch
        if not VARLEN:
            bq, bk = b, b
        if block * BLOCK_M < n_q_b:  # packed blocks past the sequence's end have no rows
            _dq_block(q_src, k_src, v_src, o_src, do_src, dq_dst, lse_ptr + stat_offset, dlse_row,
                      delta_ptr + scratch, lse2_ptr + scratch, bq, bk, h, hk, block * BLOCK_M, n_q_b,
                      n_k_b, shift, left, right, sm_scale, qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, skn, skd, svn, svd,
                      son, sod, sdon, sdod, sdln, sdqn, sdqd, WINDOW, SOFTCAP, ALIBI, DROPOUT, HAS_DLSE, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION,
                      BLOCK_M, BLOCK_N)


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_src, do_src, b, h, lse2_row, delta_row, lo, hi, offs_n, n_q, shift, left, right,
                qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, sdon, sdod,
                WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                USE_DESC: tl.constexpr, PRECISION: tl.constexpr, PART: tl.constexpr):
    """dV += P^T dO and dK += dS^T Q over the query blocks [lo, hi), computed transposed (keys as
    rows) so that the key block's accumulators never move (PART 1: dV alone, 2: dK alone, 0: both).
    MASKED walks apply the window and check rows. Rows past n_q meet the scratch's padding, lse2 =
    +inf: zero weight, no row mask (dense ones read q = dO = 0 there; packed descriptor tiles read
    the next sequence's)."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(q_src, b, h, start_m, n_q, sqn, sqd, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        # lse2 and delta unmasked: the dQ kernel padded their rows to STATS_ALIGN (a mask on the
        # length costs registers and vectorized loads).
        lse2 = tl.load(lse2_row + offs_m)
        tt = capped(tl.dot(k, tl.trans(q), input_precision=PRECISION), cap_scale, SOFTCAP)
        # Keys as rows: -shift puts ALiBi's |j - (i + shift)| on the transposed scores.
        zt = alibi_bias(tt, offs_n, offs_m, -shift, slope, ALIBI) * qk_scale - lse2[None, :]
        if MASKED:
            if WINDOW:
                d = offs_n[:, None] - (offs_m[None, :] + shift)
                keep = d <= right
                if WINDOW == 2:
                    keep = keep & (d >= -left)
                zt = tl.where(keep, zt, float("-inf"))
        pt = tl.exp2(zt)
        do = _load(do_src, b, h, start_m, n_q, sdon, sdod, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, MASKED)
        if DROPOUT:  # transposed: key j as the row, query i as the column
            kept = dropout_scale(seed, dropout_p, bh, offs_m[None, :], offs_n[:, None])
        if PART != 2:
            if DROPOUT:
                dv = tl.dot((pt * kept).to(do.dtype), do, dv, input_precision=PRECISION)
            else:
                dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        if PART != 1:
            delta = tl.load(delta_row + offs_m)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            if DROPOUT:
                dpt = dpt * kept
            dst = pt * (dpt - delta[None, :])
            if SOFTCAP:
                dst = dst * (1.0 - tt * tt)
            dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_block(q_ptr, k_src, v_src, do_ptr, dk_dst, dv_dst, lse2_ptr, delta_ptr, b, bq, bk, hk, q_first,
                start_n,
                n_q, n_k, n_heads_k, group, shift, left, right, sm_scale, qk_scale, cap_scale, alibi_ptr, sab, sah, seed, dropout_p,
                sqb, sqh, sqn, sqd, skn, skd, svn, svd, sdob, sdoh, sdon, sdod, sdkn, sdkd, sdvn, sdvd, ssb, ssh,
                WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr):
    """dK and dV (PART 1: dV alone, 2: dK alone) of keys [start_n, start_n + BLOCK_N) of KV head hk,
    summed over its query heads.
    Per query head three walks: the window's edges (masked, rows checked) around the blocks
    that see every key (no mask); without a window the last partial block is the masked walk
    (TMA zero-fills it, so the dense descriptor path folds it into the unmasked one). b: the batch
    index; bq, bk: what descriptor loads take (`_fwd_block`)."""
    k = _load(k_src, bk, hk, start_n, n_k, skn, skd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    v = k  # unread by PART 1
    if PART != 1:
        v = _load(v_src, bk, hk, start_n, n_k, svn, svd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, True)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros((BLOCK_N, HEAD_DIM_PADDED), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_PADDED), tl.float32)
    lo, full_lo, full_hi, hi = _query_range(start_n, n_q, shift, left, right, WINDOW, BLOCK_M, BLOCK_N, USE_DESC == 1)
    # Not pipelined itself (num_stages=1): the walks inside are.
    for g in tl.range(0, group, num_stages=1):
        h = hk * group + g
        q_src = _source(q_ptr, b, h, sqb, sqh, q_first, sqn, USE_DESC)
        do_src = _source(do_ptr, b, h, sdob, sdoh, q_first, sdon, USE_DESC)
        scratch = tl.cast(b, tl.int64) * ssb + tl.cast(h, tl.int64) * ssh + _stats_first(b, q_first, VARLEN)
        lse2_row = lse2_ptr + scratch
        delta_row = delta_ptr + scratch
        slope = head_slope(alibi_ptr, b, h, sab, sah, qk_scale, ALIBI)
        bh = b * n_heads_k * group + h  # the query head's (dropout's counter)
        if WINDOW:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, bq, h, lse2_row, delta_row, lo, full_lo, offs_n, n_q,
                                 shift, left, right, qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, sdon, sdod, WINDOW,
                                 SOFTCAP, ALIBI, DROPOUT, True, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, PART)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, bq, h, lse2_row, delta_row, full_lo, full_hi, offs_n, n_q,
                             shift, left, right, qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, sdon, sdod, WINDOW,
                             SOFTCAP, ALIBI, DROPOUT, False, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, PART)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, bq, h, lse2_row, delta_row, full_hi, hi, offs_n, n_q,
                             shift, left, right, qk_scale, cap_scale, slope, seed, dropout_p, bh, sqn, sqd, sdon, sdod, WINDOW,
                             SOFTCAP, ALIBI, DROPOUT, True, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, PART)
    if PART != 1:
        _store(dk_dst, dk * sm_scale, bk, hk, start_n, n_k, sdkn, sdkd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)
    if PART != 2:
        _store(dv_dst, dv, bk, hk, start_n, n_k, sdvn, sdvd, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC)


@triton.jit(do_not_specialize=LENGTHS)
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, alibi_ptr, seed_ptr, dropout_p,
    sm_scale, softcap, n_q, n_k, n_heads_k, group, lower_right, left, right, total_q, total_k,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, ssb, ssh, sab, sah,
    n_q_key, n_k_key, bh_key, dtype_key,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, USE_DESC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, REST: tl.constexpr, PART: tl.constexpr = 0,
):
    """dK and dV of one key block of one KV head, summed over every query head of its GQA group
    inside this program: no atomics, the same bits every run. PART 1 computes dV alone, 2 dK alone: two
    launches of one accumulator each, where two would not fit the registers (`config.dkdv_parts`).
    Sequences as in the forward, except that a packed sequence longer than the grid's n_k has its
    further blocks walked by a second launch (REST), one program per sequence and KV head looping over
    them: a loop around the block here would cost every call, and a REST grid as large as the first one
    costs 8-15 us of programs that exit at once (TUNING.md); its last sequence of programs sets the rows
    past the last sequence of dK and dV (of the one it computes) to 0."""
    if VARLEN:
        tl.static_assert(BLOCK_M <= STATS_ALIGN, "packed dK/dV reads BLOCK_M scratch rows past a sequence")
    n_blocks = tl.cdiv(n_k, BLOCK_N)
    pid = tl.program_id(0)
    bhk = pid if REST else pid // n_blocks
    block = 0 if REST else pid % n_blocks
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    if REST:
        if b == tl.num_programs(0) // n_heads_k - 1:
            head = tl.cast(hk, tl.int64)
            if PART != 2:
                _spare_rows(dv_ptr + head * sdvh, cu_k_ptr, b, total_k, sdvn, sdvd, HEAD_DIM, 0.0, 0, BLOCK_N,
                            BLOCK_N, HEAD_DIM_PADDED)
            if PART != 1:
                _spare_rows(dk_ptr + head * sdkh, cu_k_ptr, b, total_k, sdkn, sdkd, HEAD_DIM, 0.0, 0, BLOCK_N,
                            BLOCK_N, HEAD_DIM_PADDED)
            return
    q_first, n_q_b = _sequence(cu_q_ptr, b, n_q, total_q, VARLEN)
    k_first, n_k_b = _sequence(cu_k_ptr, b, n_k, total_k, VARLEN)
    shift = lower_right * (n_k_b - n_q_b)
    k_src = _source(k_ptr, b, hk, skb, skh, k_first, skn, USE_DESC)
    v_src = _source(v_ptr, b, hk, svb, svh, k_first, svn, USE_DESC)
    dk_dst = _source(dk_ptr, b, hk, sdkb, sdkh, k_first, sdkn, USE_DESC == 1)
    dv_dst = _source(dv_ptr, b, hk, sdvb, sdvh, k_first, sdvn, USE_DESC == 1)
    qk_scale, cap_scale = score_scales(sm_scale, softcap, SOFTCAP)
    seed = call_seed(seed_ptr, DROPOUT)
    if REST:
        for start_n in range(n_blocks * BLOCK_N, n_k_b, BLOCK_N):
            _dkdv_block(q_ptr, k_src, v_src, do_ptr, dk_dst, dv_dst, lse2_ptr, delta_ptr, b, q_first, k_first, hk,
                        q_first, start_n,
                        n_q_b, n_k_b, n_heads_k, group, shift, left, right, sm_scale, qk_scale, cap_scale,
                        alibi_ptr, sab, sah, seed, dropout_p, sqb, sqh, sqn, sqd, skn, skd, svn, svd, sdob, sdoh, sdon, sdod, sdkn,
                        sdkd, sdvn, sdvd, ssb, ssh, WINDOW, SOFTCAP, ALIBI, DROPOUT, VARLEN, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION,
                        BLOCK_M, BLOCK_N, PART)
    elif VARLEN:
        if block * BLOCK_N < n_k_b:
            _dkdv_block(q_ptr, k_src, v_src, do_ptr, dk_dst, dv_dst, lse2_ptr, delta_ptr, b, q_first, k_first, hk,
                        q_first, block * BLOCK_N,
                        n_q_b, n_k_b, n_heads_k, group, shift, left, right, sm_scale, qk_scale, cap_scale,
                        alibi_ptr, sab, sah, seed, dropout_p, sqb, sqh, sqn, sqd, skn, skd, svn, svd, sdob, sdoh, sdon, sdod, sdkn,
                        sdkd, sdvn, sdvd, ssb, ssh, WINDOW, SOFTCAP, ALIBI, DROPOUT, VARLEN, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION,
                        BLOCK_M, BLOCK_N, PART)
    else:
        _dkdv_block(q_ptr, k_src, v_src, do_ptr, dk_dst, dv_dst, lse2_ptr, delta_ptr, b, b, b, hk, q_first,
                    block * BLOCK_N, n_q, n_k, n_heads_k, group, shift, left, right, sm_scale, qk_scale, cap_scale,
                    alibi_ptr, sab, sah, seed, dropout_p, sqb, sqh, sqn, sqd, skn, skd, svn, svd, sdob, sdoh, sdon, sdod, sdkn, sdkd,
                    sdvn, sdvd, ssb, ssh, WINDOW, SOFTCAP, ALIBI, DROPOUT, VARLEN, HEAD_DIM, HEAD_DIM_PADDED, USE_DESC, PRECISION, BLOCK_M,
                    BLOCK_N, PART)


@triton.jit(do_not_specialize=["n_q", "slb", "slh", "sdlb", "sdlh"])
def attn_bwd_prep_kernel(o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr, dq_sum_ptr, n_q, n_heads, n_sum,
                         sob, soh, son, sod, sdob, sdoh, sdon, sdod, slb, slh, sdlb, sdlh, sdln, ssb, ssh,
                         HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """Before the 5-matmul backward (`hopper_backward.attn_bwd_hopper_kernel`), rows [start, start + BLOCK_M)
    of one dense (batch, head): the row terms delta = rowsum(dO * O) (minus dlse) and the base-2 lse
    in the scratch rows (past n_q, to their STATS_ALIGN padding: delta 0, lse2 +inf, as the dQ
    kernel leaves them), and the rows of the fp32 dQ sum (B, H, n_sum, HEAD_DIM_PADDED), contiguous,
    cleared for the TMA adds (all n_sum, whole Q blocks: `hopper_backward.dq_sum_rows`; the grid covers them)."""
    n_blocks = tl.cdiv(n_sum, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    b = bh // n_heads
    h = bh % n_heads
    offs_m = (pid % n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    o = tile_load(o_ptr + tl.cast(b, tl.int64) * sob + tl.cast(h, tl.int64) * soh + offs_m[:, None] * son
                  + cols[None, :] * sod, offs_m, n_q, cols, HEAD_DIM, HEAD_DIM_PADDED, True)
    do = tile_load(do_ptr + tl.cast(b, tl.int64) * sdob + tl.cast(h, tl.int64) * sdoh + offs_m[:, None] * sdon
                   + cols[None, :] * sdod, offs_m, n_q, cols, HEAD_DIM, HEAD_DIM_PADDED, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + tl.cast(b, tl.int64) * sdlb + tl.cast(h, tl.int64) * sdlh + offs_m * sdln,
                         mask=offs_m < n_q, other=0.0)
    lse2 = _row_lse2(lse_ptr + tl.cast(b, tl.int64) * slb + tl.cast(h, tl.int64) * slh, offs_m, n_q)
    lse2 = tl.where(offs_m < n_q, lse2, float("inf"))
    scratch = tl.cast(b, tl.int64) * ssb + tl.cast(h, tl.int64) * ssh + offs_m
    in_scratch = offs_m < tl.cdiv(n_q, STATS_ALIGN) * STATS_ALIGN
    tl.store(delta_ptr + scratch, delta, mask=in_scratch)
    tl.store(lse2_ptr + scratch, lse2, mask=in_scratch)
    dq_rows = dq_sum_ptr + (tl.cast(bh, tl.int64) * n_sum + offs_m[:, None]) * HEAD_DIM_PADDED + cols[None, :]
    tl.store(dq_rows, tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32), mask=offs_m[:, None] < n_sum)


@triton.jit(do_not_specialize=["n_q", "n_sum"])
def attn_bwd_dq_cast_kernel(dq_sum_ptr, dq_ptr, n_q, n_heads, n_sum, sqb, sqh, sqn, sqd,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, FRAGMENTS: tl.constexpr):
    """After the 5-matmul backward, one Q block (64 rows) of one (batch, head): its fp32 dQ sum, in order or
    (FRAGMENTS) in fragment rows (`hopper_backward.dq_sum_fields`: the block's floats as 256 rows of
    HEAD_DIM_PADDED / 4, row half x 128 + thread of a warpgroup's accumulator, 4 floats of a (row, row + 8)
    column pair each) put back in order, cast into dQ (B, H, n_q, HEAD_DIM), any strides."""
    n_blocks = n_sum // 64
    pid = tl.program_id(0)
    bh = pid // n_blocks
    start = (pid % n_blocks) * 64
    block = dq_sum_ptr + (tl.cast(bh, tl.int64) * n_sum + start) * HEAD_DIM_PADDED
    c = tl.arange(0, HEAD_DIM_PADDED)
    if FRAGMENTS:
        quarter: tl.constexpr = HEAD_DIM_PADDED // 4
        frag = tl.load(block + tl.arange(0, 256)[:, None] * quarter + tl.arange(0, quarter)[None, :])
        # fragment rows: half, warp, lane // 4, lane % 4; columns: 8-column group, row + 8, column pair
        parts = tl.reshape(frag, [2, 4, 8, 4, HEAD_DIM_PADDED // 16, 2, 2])
        # rows: warp, row + 8, lane // 4; columns: half, 8-column group, lane % 4, column pair
        dq = tl.reshape(tl.permute(parts, (1, 5, 2, 0, 4, 3, 6)), [64, HEAD_DIM_PADDED])
    else:
        dq = tl.load(block + tl.arange(0, 64)[:, None] * HEAD_DIM_PADDED + c[None, :])
    rows = start + tl.arange(0, 64)
    at = (tl.cast(bh // n_heads, tl.int64) * sqb + tl.cast(bh % n_heads, tl.int64) * sqh
          + tl.cast(rows[:, None], tl.int64) * sqn + c[None, :] * sqd)
    tl.store(dq_ptr + at, dq.to(dq_ptr.dtype.element_ty), mask=(rows[:, None] < n_q) & (c[None, :] < HEAD_DIM))


# ---- packed sequences: the rows of a padded buffer past its last sequence -------------------------


@triton.jit
def _fill_rows(t_ptr, rows, keep, n_cols, stride_r, stride_c, value, BLOCK_C: tl.constexpr):
    for c in range(0, n_cols, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        at = tl.cast(rows[:, None], tl.int64) * stride_r + tl.cast(cols[None, :], tl.int64) * stride_c
        fill = tl.full((rows.shape[0], BLOCK_C), value, tl.float32)
        tl.store(t_ptr + at, fill.to(t_ptr.dtype.element_ty), mask=keep[:, None] & (cols[None, :] < n_cols))


@triton.jit(do_not_specialize=["n_seq", "total", "a_cols", "a_stride_r", "a_stride_c", "b_cols", "b_stride_r",
                             "b_stride_c"])
def fill_tail_kernel(a_ptr, b_ptr, cu_ptr, n_seq, total, a_cols, a_stride_r, a_stride_c, a_value,
                     b_cols, b_stride_r, b_stride_c, b_value, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token rows [cu[n_seq], total) of two tensors (a, b) set to a value each: the rows of a padded buffer past
    its last sequence, which the Gluon forward leaves in its output and log-sum-exp (the tl forward and the
    backward fill their own, `_spare_rows`). The bound is read here (clamped to [0, total], as the kernels
    clamp); a program whose rows all belong to sequences stores nothing."""
    start = tl.program_id(0) * BLOCK_R
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + n_seq), 0), total)
    if start + BLOCK_R > end:
        rows = start + tl.arange(0, BLOCK_R)
        keep = (rows >= end) & (rows < total)
        _fill_rows(a_ptr, rows, keep, a_cols, a_stride_r, a_stride_c, a_value, BLOCK_C)
        _fill_rows(b_ptr, rows, keep, b_cols, b_stride_r, b_stride_c, b_value, BLOCK_C)

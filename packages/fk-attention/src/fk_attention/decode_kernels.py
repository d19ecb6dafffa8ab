"""Triton kernels for few query rows against many keys (split-KV decode, KV caches), on the
prefill kernels' helpers (`kernels`): scores, caps, ALiBi and the online-softmax step.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from .kernels import LN2, LOG2E, alibi_bias, capped, head_slope, score_scales, softmax_step, tile_load

# ---- decode: few query rows against many keys (split-KV, "flash decoding"), KV caches -------------
#
# A program takes one (batch, KV head), every query row of that head's GQA group (row r is query
# head hk * group + r // Nq, position r % Nq; the group reads its K/V once) in blocks of BLOCK_M,
# and one of `n_splits` slices of the keys the block sees: the slices of a sequence's own length
# (read on the GPU for a cache), so every program has real keys. With one slice it writes the
# output; with several, fp32 partial outputs and log-sum-exps that `attn_decode_merge_kernel`
# combines. K/V come from a dense (B, Hk, N, D) tensor or a paged cache (PAGED): pages of
# PAGE_SIZE rows, (pages, Hk, PAGE_SIZE, D), sequence b's key j in page table[b, j // PAGE_SIZE].


@triton.jit
def _pages(table_row, slice_pages, first_page, start_n, n_k, last_page, BLOCK_N: tl.constexpr,
           PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SLICE_PAGES: tl.constexpr, ROW_PAGES: tl.constexpr):
    """The cache pages of keys [start_n, start_n + BLOCK_N), clamped to the cache: one per row
    (ROW_PAGES: full grids, pages smaller than a block, long slices), else the block's one page,
    picked from the slice's SLICE_PAGES pages held in registers; 0 unpaged."""
    if PAGED:
        if ROW_PAGES:
            rows = start_n + tl.arange(0, BLOCK_N)
            page = tl.load(table_row + rows // PAGE_SIZE, mask=rows < n_k, other=0)
            page = tl.minimum(tl.maximum(page, 0), last_page)
        else:
            slot = start_n // PAGE_SIZE - first_page
            page = tl.sum(tl.where(tl.arange(0, SLICE_PAGES) == slot, slice_pages, 0), 0)
    else:
        page = 0
    return page


@triton.jit
def _kv_tile(src, page, b, hk, start_n, n_k, stride_n, stride_d, stride_page, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
             MASKED: tl.constexpr, USE_DESC: tl.constexpr, ROW_PAGES: tl.constexpr):
    """Keys (or values) [start_n, start_n + BLOCK_N) of one (sequence, KV head), zeros past n_k.
    `src` points at the head's row 0 (dense) or the cache's row 0 of the head (paged: `page` from
    `_pages`), or is the whole (B, Hk, N, D) / (pages, Hk, PAGE_SIZE, D) tensor's descriptor
    (USE_DESC; paged only where a block lies in one page)."""
    rows = start_n + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    if USE_DESC:
        if PAGED:
            tile = src.load([page, hk, start_n % PAGE_SIZE, 0]).reshape(BLOCK_N, HEAD_DIM_PADDED)
        else:
            tile = src.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PADDED)
        if MASKED:  # a cache's rows past the sequence hold anything (NaN too): zeros, as pointer loads give
            tile = tl.where(rows[:, None] < n_k, tile, tl.zeros_like(tile))
    else:
        if PAGED and not ROW_PAGES:  # one page: a dense tile
            ptrs = src + tl.cast(page, tl.int64) * stride_page + tl.cast(start_n % PAGE_SIZE, tl.int64) * stride_n \
                + (tl.arange(0, BLOCK_N) * stride_n)[:, None] + cols[None, :] * stride_d
        elif PAGED:
            offsets = tl.cast(page, tl.int64) * stride_page + (rows % PAGE_SIZE) * stride_n
            ptrs = src + offsets[:, None] + cols[None, :] * stride_d
        else:
            ptrs = src + tl.cast(start_n, tl.int64) * stride_n + (tl.arange(0, BLOCK_N) * stride_n)[:, None] \
                + cols[None, :] * stride_d
        tile = tile_load(ptrs, rows, n_k, cols, HEAD_DIM, HEAD_DIM_PADDED, MASKED)
    return tile


@triton.jit
def key_split(lo, hi, full_lo, full_hi, n_splits, split, BLOCK_N: tl.constexpr):
    """Split `split` of `n_splits` over the keys [lo, hi) some row sees, in whole key blocks:
    (s_lo, s_hi), and (mid_lo, mid_hi) its part inside [full_lo, full_hi), the keys every row sees."""
    lo = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
    s_lo = tl.minimum(lo + split * chunk, hi)
    s_hi = tl.minimum(s_lo + chunk, hi)
    mid_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), s_hi)
    return s_lo, s_hi, mid_lo, mid_hi


@triton.jit
def _decode_steps(acc, l_i, m_i, q, k_src, v_src, table_row, slice_pages, first_page, b, hk, lo, hi, pos, n_k,
                  shift, left, right, qk_scale, cap_scale, slope, skn, skd, skp, svn, svd, svp, last_page,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, SLICE_PAGES: tl.constexpr, PRECISION: tl.constexpr,
                  USE_DESC: tl.constexpr, ROW_PAGES: tl.constexpr):
    """`_fwd_steps` over dense or paged K/V; `pos` holds each row's query position."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        page = _pages(table_row, slice_pages, first_page, start_n, n_k, last_page, BLOCK_N, PAGED, PAGE_SIZE,
                      SLICE_PAGES, ROW_PAGES)
        k = _kv_tile(k_src, page, b, hk, start_n, n_k, skn, skd, skp, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, PAGED,
                     PAGE_SIZE, MASKED, USE_DESC, ROW_PAGES)
        s = capped(tl.dot(q, tl.trans(k), input_precision=PRECISION), cap_scale, SOFTCAP)
        s = alibi_bias(s, pos, start_n + tl.arange(0, BLOCK_N), shift, slope, ALIBI)
        p, alpha, m_new = softmax_step(s, m_i, pos, start_n, n_k, shift, left, right, qk_scale, WINDOW,
                                        MASKED, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_src, page, b, hk, start_n, n_k, svn, svd, svp, BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, PAGED,
                     PAGE_SIZE, MASKED, USE_DESC, ROW_PAGES)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_k", "n_new", "n_splits", "last_page", "n_part", "stb"])
def attn_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, seqlens_ptr, table_ptr, alibi_ptr, leftpad_ptr, sm_scale, softcap,
    n_q, n_k, n_new, n_heads_k, group, lower_right, left, right, n_splits, last_page, n_part,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, slb, slh, sln, stb, sab, sah,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LEFTPAD: tl.constexpr, SEQLENS: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SLICE_PAGES: tl.constexpr, SLICED: tl.constexpr, PDL: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr, ROW_PAGES: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """One slice of the keys seen by a block of a GQA group's query rows: with one slice the
    output and lse; with several (SLICED) the slice's fp32 partial output and log-sum-exp, to
    part: (B, Hq, Nq, slices, D) then from n_part on (B, Hq, Nq, slices), contiguous, which
    `attn_decode_merge_kernel` merges (PDL: launched as this grid's programmatic dependent, so its
    launch overlaps this grid's tail). SEQLENS: sequence b has
    min(seqlens[b] + n_new, n_k) keys (a cache: n_k its capacity), else n_k. Paged K/V strides:
    skb / svb step pages, stb the page table's rows. LEFTPAD: sequence b's keys start at row
    leftpad[b] (rows before it are seen by no query; positions stay the cache's rows). USE_DESC: k_ptr / v_ptr are TMA descriptors
    (`_kv_tile`). STORE_LSE: the lse is stored (else nothing is written through lse_ptr). Masks
    are windows, left / right UNBOUNDED for an open side: a build without the window's code ran
    5-20% slower on full grids of one query row per KV head (TUNING.md: decode)."""
    if PDL:
        tl_cuda.gdc_launch_dependents()
    m_blocks = tl.cdiv(group * n_q, BLOCK_M)
    pid = tl.program_id(0)
    # Row blocks fastest, then slices: programs reading the same keys run side by side (L2).
    block = pid % m_blocks
    split = (pid // m_blocks) % n_splits
    bhk = pid // (m_blocks * n_splits)
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * n_q
    pos = rows % n_q
    h = hk * group + rows // n_q
    if SEQLENS:
        n_k_b = tl.minimum(tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 0), n_k) + n_new, n_k)
    else:
        n_k_b = n_k
    shift = lower_right * (n_k_b - n_q)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    q_rows = tl.cast(b, tl.int64) * sqb + tl.cast(h, tl.int64) * sqh + tl.cast(pos, tl.int64) * sqn
    q = tl.load(q_ptr + q_rows[:, None] + cols[None, :] * sqd, mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM),
                other=0.0)
    if USE_DESC:
        k_src = k_ptr
        v_src = v_ptr
    elif PAGED:
        k_src = k_ptr + tl.cast(hk, tl.int64) * skh
        v_src = v_ptr + tl.cast(hk, tl.int64) * svh
    else:
        k_src = k_ptr + tl.cast(b, tl.int64) * skb + tl.cast(hk, tl.int64) * skh
        v_src = v_ptr + tl.cast(b, tl.int64) * svb + tl.cast(hk, tl.int64) * svh
    table_row = table_ptr + tl.cast(b, tl.int64) * stb
    qk_scale, cap_scale = score_scales(sm_scale, softcap, SOFTCAP)
    # Each row its own head's slope (the rows span the group's heads).
    slope = head_slope(alibi_ptr, b, tl.where(row_ok, h, 0), sab, sah, qk_scale, ALIBI)
    if ALIBI:
        slope = slope[:, None]
    # Keys some row of the block sees, [lo, hi), and those every row sees, [full_lo, full_hi).
    first = tl.min(tl.where(row_ok, pos, n_q), 0)
    last = tl.max(tl.where(row_ok, pos, 0), 0)
    if LEFTPAD:
        # Keys before the sequence's first row: each row's window's left side stops there.
        first_key = tl.minimum(tl.maximum(tl.load(leftpad_ptr + b), 0), n_k_b)
        mask_left = tl.minimum(left, pos + shift - first_key)[:, None]
    else:
        first_key = 0
        mask_left = left
    lo = tl.maximum(first + shift - left, first_key)
    hi = tl.maximum(tl.minimum(n_k_b, last + shift + right + 1), lo)
    full_lo = tl.cdiv(tl.maximum(last + shift - left, first_key), BLOCK_N) * BLOCK_N
    full_hi = (tl.maximum(first + shift + right + 1, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(full_hi, (n_k_b // BLOCK_N) * BLOCK_N)
    s_lo, s_hi, mid_lo, mid_hi = key_split(lo, hi, full_lo, full_hi, n_splits, split, BLOCK_N)
    if SLICE_PAGES:
        first_page = s_lo // PAGE_SIZE
        ids = first_page + tl.arange(0, SLICE_PAGES)
        slice_pages = tl.load(table_row + ids, mask=ids * PAGE_SIZE < s_hi, other=0)
        slice_pages = tl.minimum(tl.maximum(slice_pages, 0), last_page)
    else:
        first_page = 0
        slice_pages = 0
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    acc, l_i, m_i = _decode_steps(acc, l_i, m_i, q, k_src, v_src, table_row, slice_pages, first_page, b, hk, s_lo,
                                  mid_lo, pos, n_k_b, shift, mask_left, right, qk_scale, cap_scale, slope, skn, skd, skb,
                                  svn, svd, svb, last_page, 2, SOFTCAP, ALIBI, True, BLOCK_N, HEAD_DIM,
                                  HEAD_DIM_PADDED, PAGED, PAGE_SIZE, SLICE_PAGES, PRECISION, USE_DESC, ROW_PAGES)
    acc, l_i, m_i = _decode_steps(acc, l_i, m_i, q, k_src, v_src, table_row, slice_pages, first_page, b, hk, mid_lo,
                                  mid_hi, pos, n_k_b, shift, mask_left, right, qk_scale, cap_scale, slope, skn, skd, skb,
                                  svn, svd, svb, last_page, 2, SOFTCAP, ALIBI, False, BLOCK_N, HEAD_DIM,
                                  HEAD_DIM_PADDED, PAGED, PAGE_SIZE, SLICE_PAGES, PRECISION, USE_DESC, ROW_PAGES)
    acc, l_i, m_i = _decode_steps(acc, l_i, m_i, q, k_src, v_src, table_row, slice_pages, first_page, b, hk, mid_hi,
                                  s_hi, pos, n_k_b, shift, mask_left, right, qk_scale, cap_scale, slope, skn, skd, skb,
                                  svn, svd, svb, last_page, 2, SOFTCAP, ALIBI, True, BLOCK_N, HEAD_DIM,
                                  HEAD_DIM_PADDED, PAGED, PAGE_SIZE, SLICE_PAGES, PRECISION, USE_DESC, ROW_PAGES)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    cols_ok = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    if SLICED:
        slice0 = ((tl.cast(b, tl.int64) * n_heads_k * group + h) * n_q + pos) * n_splits
        tl.store(part_ptr + (slice0 + split)[:, None] * HEAD_DIM + cols[None, :], out, mask=cols_ok)
        tl.store(part_ptr + n_part + slice0 + split, lse, mask=row_ok)
    else:
        _store_rows(o_ptr, lse_ptr, out, lse, b, h, pos, row_ok, cols, sob, soh, son, sod, slb, slh, sln, HEAD_DIM,
                    STORE_LSE)


@triton.jit
def _store_rows(o_ptr, lse_ptr, out, lse, b, h, pos, row_ok, cols, sob, soh, son, sod, slb, slh, sln,
                HEAD_DIM: tl.constexpr, STORE_LSE: tl.constexpr):
    """Decode rows' outputs (cast to the output's dtype) and, STORE_LSE, log-sum-exps."""
    o_rows = tl.cast(b, tl.int64) * sob + tl.cast(h, tl.int64) * soh + tl.cast(pos, tl.int64) * son
    tl.store(o_ptr + o_rows[:, None] + cols[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM))
    if STORE_LSE:
        tl.store(lse_ptr + tl.cast(b, tl.int64) * slb + tl.cast(h, tl.int64) * slh + tl.cast(pos, tl.int64) * sln,
                 lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_splits", "n_part"])
def attn_decode_merge_kernel(
    part_ptr, o_ptr, lse_ptr, n_heads, n_q, n_splits, n_part,
    sob, soh, son, sod, slb, slh, sln,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """One query row's output from its slices' partial outputs (contiguous (rows, slices, D) fp32)
    and log-sum-exps (from n_part on, (rows, slices)): out = sum_s exp(lse_s - lse) out_s, lse = log sum_s exp(lse_s). A row that
    saw no key (every lse_s = -inf) gets 0 and -inf (the lse stored where STORE_LSE). PDL: launched
    early, it waits for the partials here."""
    if PDL:
        tl_cuda.gdc_wait()
    row = tl.program_id(0)
    i = row % n_q
    h = (row // n_q) % n_heads
    b = row // (n_q * n_heads)
    s = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    base = tl.cast(row, tl.int64) * n_splits
    part_lse = tl.load(part_ptr + n_part + base + s, mask=s < n_splits, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((part_lse - m_safe) * LOG2E)
    total = tl.sum(w, 0)
    parts = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + cols[None, :],
                    mask=(s[:, None] < n_splits) & (cols[None, :] < HEAD_DIM), other=0.0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(parts * w[:, None], 0) / total_safe
    o_row = tl.cast(b, tl.int64) * sob + tl.cast(h, tl.int64) * soh + tl.cast(i, tl.int64) * son
    tl.store(o_ptr + o_row + cols * sod, out.to(o_ptr.dtype.element_ty), mask=cols < HEAD_DIM)
    if STORE_LSE:
        lse = tl.where(total > 0.0, m_safe + tl.log2(total_safe) * LN2, float("-inf"))
        tl.store(lse_ptr + tl.cast(b, tl.int64) * slb + tl.cast(h, tl.int64) * slh + tl.cast(i, tl.int64) * sln, lse)


@triton.jit(do_not_specialize=["n_new", "capacity", "last_page"])
def kv_append_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, seqlens_ptr, table_ptr, n_new, n_heads_k, capacity, last_page,
    skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scn, scd, swb, swh, swn, swd, stb,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Rows [0, n_new) of new keys and values of one (sequence, KV head) written into the cache at
    rows seqlens[b] + r; rows at or past the capacity are dropped (never an out-of-range write)."""
    r_blocks = tl.cdiv(n_new, BLOCK_R)
    pid = tl.program_id(0)
    block = pid % r_blocks
    bhk = pid // r_blocks
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    pos = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 0), capacity) + r  # clamped first: no int32 wrap
    ok = (r < n_new) & (pos < capacity)
    mask = ok[:, None] & (cols[None, :] < HEAD_DIM)
    if PAGED:
        page = tl.load(table_ptr + tl.cast(b, tl.int64) * stb + pos // PAGE_SIZE, mask=ok, other=0)
        page = tl.cast(tl.minimum(tl.maximum(page, 0), last_page), tl.int64)
        k_dst = page * scb + tl.cast(pos % PAGE_SIZE, tl.int64) * scn
        v_dst = page * swb + tl.cast(pos % PAGE_SIZE, tl.int64) * swn
    else:
        k_dst = tl.cast(b, tl.int64) * scb + tl.cast(pos, tl.int64) * scn
        v_dst = tl.cast(b, tl.int64) * swb + tl.cast(pos, tl.int64) * swn
    k_src = tl.cast(b, tl.int64) * skb + tl.cast(hk, tl.int64) * skh + tl.cast(r, tl.int64) * skn
    v_src = tl.cast(b, tl.int64) * svb + tl.cast(hk, tl.int64) * svh + tl.cast(r, tl.int64) * svn
    k = tl.load(k_ptr + k_src[:, None] + cols[None, :] * skd, mask=mask)
    v = tl.load(v_ptr + v_src[:, None] + cols[None, :] * svd, mask=mask)
    tl.store(kc_ptr + (k_dst + tl.cast(hk, tl.int64) * sch)[:, None] + cols[None, :] * scd, k, mask=mask)
    tl.store(vc_ptr + (v_dst + tl.cast(hk, tl.int64) * swh)[:, None] + cols[None, :] * swd, v, mask=mask)

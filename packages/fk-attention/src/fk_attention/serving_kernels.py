"""Triton kernels for a serving batch in one launch: packed sequences of any query length (prefill
chunks and decode tokens together) against a paged KV cache, on the prefill kernels' helpers
(`kernels`): scores, caps and the online-softmax step.

A work item is (sequence, KV head, row tile, key split). A tile's rows are (query token, query head
of the GQA group) pairs, token-major (row r: token r // group, head hk * group + r % group), so the
group's heads share each K/V tile read. A sequence whose rows fit SHORT_M ("short": decode tokens)
is cut along its visible keys into splits of about `chunk` keys (at most `max_splits`); their fp32
partial outputs and log-sum-exps go to scratch and `attn_paged_merge_kernel` merges them (one split:
written directly). A longer sequence ("long": a prefill chunk) takes one program per BLOCK_M-row
tile over every key it sees. Items are numbered per class (sequence-major, then KV head, then split
or tile, the heaviest tiles first) and the grid interleaves the classes, short and long in turn
while both last: memory-bound decode splits and compute-bound prefill tiles share the GPU. Every
program finds its item from the sequence bounds (read on the GPU: no host sync) and exits at once
without one. Sequence b holds L_b = cu_k[b + 1] - cu_k[b] keys (clamped to its pages) and Q_b query
rows, its query i at key position L_b - Q_b + i (lower-right); key j in page table[b, j // PAGE_SIZE],
row j % PAGE_SIZE, page indices clamped to the cache. Masks are windows (left / right UNBOUNDED for
an open side), as in the decode kernel.
"""

import triton
import triton.language as tl

from .decode_kernels import key_split
from .kernels import LN2, LOG2E, capped, score_scales, softmax_step, tile_load


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b, ok, total_q, capacity):
    """(first query row, query rows, keys) of sequences b (a vector, or a scalar with ok True),
    clamped: rows inside [0, total_q), keys inside [0, capacity] (wrong rows, never out of range)."""
    first = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b, mask=ok, other=0), 0), total_q)
    end = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1, mask=ok, other=0), first), total_q)
    n_k = tl.load(cu_k_ptr + b + 1, mask=ok, other=0) - tl.load(cu_k_ptr + b, mask=ok, other=0)
    return first, end - first, tl.minimum(tl.maximum(n_k, 0), capacity)


@triton.jit
def _items(n_q, n_k, ok, group, n_heads_k, left, right, chunk, max_splits, SHORT_M: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """(splits, short items, long items) of sequences of n_q query rows and n_k keys: a short one's
    visible keys cut into splits of about `chunk`, times the KV heads; a long one's row tiles."""
    rows = n_q * group
    short = ok & (n_q > 0) & (rows <= SHORT_M)
    shift = n_k - n_q
    lo = tl.maximum(shift - left, 0)
    hi = tl.minimum(n_k, n_q + shift + right)
    splits = tl.minimum(tl.maximum(tl.cdiv(hi - lo, chunk), 1), max_splits)
    short_items = tl.where(short, splits * n_heads_k, 0)
    long_items = tl.where(ok & (n_q > 0) & (rows > SHORT_M), tl.cdiv(rows, BLOCK_M) * n_heads_k, 0)
    return splits, short_items, long_items


@triton.jit
def _work_item(pid, cu_q_ptr, cu_k_ptr, n_seqs, total_q, capacity, group, n_heads_k, left, right, chunk,
               max_splits, SHORT_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program pid's item: (short, index in its class, whether it has one, sequence, index inside the
    sequence's items). Two passes over the sequences, BLOCK_S at a time: the class totals, then the
    sequence whose items hold the index (prefix sums)."""
    n_short = pid * 0
    n_long = pid * 0
    for s0 in range(0, n_seqs, BLOCK_S):
        b = s0 + tl.arange(0, BLOCK_S)
        ok = b < n_seqs
        first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, b, ok, total_q, capacity)
        splits, short_items, long_items = _items(n_q, n_k, ok, group, n_heads_k, left, right, chunk, max_splits,
                                                 SHORT_M, BLOCK_M)
        n_short += tl.sum(short_items, 0)
        n_long += tl.sum(long_items, 0)
    # Short and long in turn while both last (decode reads overlap prefill math), then the rest.
    pair = tl.minimum(n_short, n_long)
    short = tl.where(pid < 2 * pair, pid % 2 == 0, n_short > n_long)
    idx = tl.where(pid < 2 * pair, pid // 2, pid - pair)
    has = idx < tl.where(short, n_short, n_long)
    seq = pid * 0
    base = pid * 0
    before = pid * 0
    for s0 in range(0, n_seqs, BLOCK_S):
        b = s0 + tl.arange(0, BLOCK_S)
        ok = b < n_seqs
        first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, b, ok, total_q, capacity)
        splits, short_items, long_items = _items(n_q, n_k, ok, group, n_heads_k, left, right, chunk, max_splits,
                                                 SHORT_M, BLOCK_M)
        items = tl.where(short, short_items, long_items)
        inclusive = tl.cumsum(items, 0) + before
        hit = (inclusive - items <= idx) & (idx < inclusive)
        seq += tl.sum(tl.where(hit, b, 0), 0)
        base += tl.sum(tl.where(hit, inclusive - items, 0), 0)
        before += tl.sum(items, 0)
    return short, idx, has, seq, idx - base


@triton.jit
def _page_tile(src, table_row, start_n, n_k, last_page, stride_n, stride_d, stride_page, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PAGE_SIZE: tl.constexpr,
               MASKED: tl.constexpr):
    """Keys (or values) [start_n, start_n + BLOCK_N) of one (sequence, KV head) from its pages,
    zeros at or past n_k; `src` points at the head's row 0 of page 0."""
    rows = start_n + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    if PAGE_SIZE % BLOCK_N == 0:  # blocks start on a block: the block lies in one page, a dense tile
        page = tl.minimum(tl.maximum(tl.load(table_row + start_n // PAGE_SIZE), 0), last_page)
        ptrs = src + tl.cast(page, tl.int64) * stride_page + tl.cast(start_n % PAGE_SIZE, tl.int64) * stride_n \
            + (tl.arange(0, BLOCK_N) * stride_n)[:, None] + cols[None, :] * stride_d
    else:  # pages smaller than a block, or not a multiple of it: each row's own page
        page = tl.load(table_row + rows // PAGE_SIZE, mask=rows < n_k, other=0)
        page = tl.minimum(tl.maximum(page, 0), last_page)
        offsets = tl.cast(page, tl.int64) * stride_page + (rows % PAGE_SIZE) * stride_n
        ptrs = src + offsets[:, None] + cols[None, :] * stride_d
    return tile_load(ptrs, rows, n_k, cols, HEAD_DIM, HEAD_DIM_PADDED, MASKED)


@triton.jit
def _steps(acc, l_i, m_i, q, k_src, v_src, table_row, lo, hi, pos, n_k, shift, left, right, qk_scale, cap_scale,
           last_page, skn, skd, skp, svn, svd, svp, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
           BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PAGE_SIZE: tl.constexpr,
           PRECISION: tl.constexpr):
    """Online softmax over the paged key blocks [lo, hi); `pos` holds each row's query index."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _page_tile(k_src, table_row, start_n, n_k, last_page, skn, skd, skp, BLOCK_N, HEAD_DIM,
                       HEAD_DIM_PADDED, PAGE_SIZE, MASKED)
        s = capped(tl.dot(q, tl.trans(k), input_precision=PRECISION), cap_scale, SOFTCAP)
        p, alpha, m_new = softmax_step(s, m_i, pos, start_n, n_k, shift, left, right, qk_scale, 2, MASKED, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _page_tile(v_src, table_row, start_n, n_k, last_page, svn, svd, svp, BLOCK_N, HEAD_DIM,
                       HEAD_DIM_PADDED, PAGE_SIZE, MASKED)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_rows(o_ptr, lse_ptr, out, lse, first, pos, h, row_ok, cols, son, soh, sod, slh, sln,
                HEAD_DIM: tl.constexpr):
    """Rows' outputs (cast to the output's dtype) and log-sum-exps at packed row first + pos, head h."""
    o_rows = tl.cast(first + pos, tl.int64) * son + tl.cast(h, tl.int64) * soh
    tl.store(o_ptr + o_rows[:, None] + cols[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(lse_ptr + tl.cast(h, tl.int64) * slh + tl.cast(first + pos, tl.int64) * sln, lse, mask=row_ok)


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, sm_scale, softcap, b, hk, first, n_q, n_k,
            tile, split, n_splits, slot, group, left, right, last_page, n_part,
            sqn, sqh, sqd, skp, skh, skn, skd, svp, svh, svn, svd, son, soh, sod, slh, sln, stb,
            SOFTCAP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAY_SPLIT: tl.constexpr):
    """One work item: rows [tile * BLOCK_M, + BLOCK_M) of sequence b's (token, group head) rows at
    KV head hk, against split `split` of n_splits of the keys they see; the output and lse, or
    (n_splits > 1) the split's fp32 partials to scratch slot `slot`."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q * group
    pos = rows // group
    h = hk * group + rows % group
    shift = n_k - n_q  # lower-right: query i sits at key position i + shift
    cols = tl.arange(0, HEAD_DIM_PADDED)
    q_rows = tl.cast(first + pos, tl.int64) * sqn + tl.cast(h, tl.int64) * sqh
    q = tl.load(q_ptr + q_rows[:, None] + cols[None, :] * sqd, mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM),
                other=0.0)
    k_src = k_ptr + tl.cast(hk, tl.int64) * skh
    v_src = v_ptr + tl.cast(hk, tl.int64) * svh
    table_row = table_ptr + tl.cast(b, tl.int64) * stb
    qk_scale, cap_scale = score_scales(sm_scale, softcap, SOFTCAP)
    # Keys some row sees, [lo, hi), and those every row sees, [full_lo, full_hi).
    first_pos = (tile * BLOCK_M) // group
    last_pos = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // group, n_q - 1)
    lo = tl.maximum(first_pos + shift - left, 0)
    hi = tl.maximum(tl.minimum(n_k, last_pos + shift + right + 1), lo)
    full_lo = tl.cdiv(tl.maximum(last_pos + shift - left, 0), BLOCK_N) * BLOCK_N
    full_hi = (tl.maximum(first_pos + shift + right + 1, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(full_hi, (n_k // BLOCK_N) * BLOCK_N)
    s_lo, s_hi, mid_lo, mid_hi = key_split(lo, hi, full_lo, full_hi, n_splits, split, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q, k_src, v_src, table_row, s_lo, mid_lo, pos, n_k, shift, left, right,
                           qk_scale, cap_scale, last_page, skn, skd, skp, svn, svd, svp, SOFTCAP, True, BLOCK_N,
                           HEAD_DIM, HEAD_DIM_PADDED, PAGE_SIZE, PRECISION)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q, k_src, v_src, table_row, mid_lo, mid_hi, pos, n_k, shift, left, right,
                           qk_scale, cap_scale, last_page, skn, skd, skp, svn, svd, svp, SOFTCAP, False, BLOCK_N,
                           HEAD_DIM, HEAD_DIM_PADDED, PAGE_SIZE, PRECISION)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q, k_src, v_src, table_row, mid_hi, s_hi, pos, n_k, shift, left, right,
                           qk_scale, cap_scale, last_page, skn, skd, skp, svn, svd, svp, SOFTCAP, True, BLOCK_N,
                           HEAD_DIM, HEAD_DIM_PADDED, PAGE_SIZE, PRECISION)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    if MAY_SPLIT:
        if n_splits > 1:
            part_rows = tl.cast(slot, tl.int64) * BLOCK_M + rows
            tl.store(part_ptr + part_rows[:, None] * HEAD_DIM + cols[None, :], out,
                     mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM))
            tl.store(part_ptr + n_part + part_rows, lse, mask=row_ok)
        else:
            _store_rows(o_ptr, lse_ptr, out, lse, first, pos, h, row_ok, cols, son, soh, sod, slh, sln, HEAD_DIM)
    else:
        _store_rows(o_ptr, lse_ptr, out, lse, first, pos, h, row_ok, cols, son, soh, sod, slh, sln, HEAD_DIM)


@triton.jit(do_not_specialize=["total_q", "n_seqs", "capacity", "last_page", "chunk", "max_splits", "n_part"])
def attn_paged_varlen_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, cu_q_ptr, cu_k_ptr, table_ptr, sm_scale, softcap,
    total_q, n_seqs, n_heads_k, group, left, right, capacity, last_page, chunk, max_splits, n_part,
    sqn, sqh, sqd, skp, skh, skn, skd, svp, svh, svn, svd, son, soh, sod, slh, sln, stb,
    SOFTCAP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHORT_M: tl.constexpr,
    SHORT_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Every sequence's attention in one grid (module docstring): program pid takes its work item,
    a short sequence's key split (SHORT_M x SHORT_N tiles; partials to part: (slots, SHORT_M, D)
    fp32, then from n_part on their lse (slots, SHORT_M)) or a long one's row tile (BLOCK_M x
    BLOCK_N). Paged K/V strides: skp / svp step pages, stb the page table's rows; q and the output
    (total_q, Hq, D), the lse (Hq, total_q)."""
    pid = tl.program_id(0)
    short, idx, has, b, j = _work_item(pid, cu_q_ptr, cu_k_ptr, n_seqs, total_q, capacity, group, n_heads_k, left,
                                       right, chunk, max_splits, SHORT_M, BLOCK_M, BLOCK_S)
    if has:
        first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, b, True, total_q, capacity)
        splits, short_items, long_items = _items(n_q, n_k, True, group, n_heads_k, left, right, chunk, max_splits,
                                                 SHORT_M, BLOCK_M)
        if short:  # split fastest: a sequence's splits run side by side
            _attend(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, sm_scale, softcap, b, j // splits,
                    first, n_q, n_k, 0, j % splits, splits, idx, group, left, right, last_page, n_part,
                    sqn, sqh, sqd, skp, skh, skn, skd, svp, svh, svn, svd, son, soh, sod, slh, sln, stb,
                    SOFTCAP, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PADDED, PRECISION, SHORT_M, SHORT_N, True)
        else:  # tiles fastest (one head's K/V in L2), the last ones (most keys under causal) first
            tiles = tl.cdiv(n_q * group, BLOCK_M)
            _attend(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, sm_scale, softcap, b, j // tiles,
                    first, n_q, n_k, tiles - 1 - j % tiles, 0, 1, idx, group, left, right, last_page, n_part,
                    sqn, sqh, sqd, skp, skh, skn, skd, svp, svh, svn, svd, son, soh, sod, slh, sln, stb,
                    SOFTCAP, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PADDED, PRECISION, BLOCK_M, BLOCK_N, False)


@triton.jit(do_not_specialize=["total_q", "n_seqs", "capacity", "chunk", "max_splits", "n_part"])
def attn_paged_merge_kernel(
    part_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, total_q, n_seqs, n_heads_k, group, left, right, capacity, chunk,
    max_splits, n_part, son, soh, sod, slh, sln,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, SHORT_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (sequence, KV head): a short sequence's split partials merged by their log-sum-exps,
    out = sum_s exp(lse_s - lse) out_s; other sequences (and a short one of one split) exit. Its
    slots follow the short items before it (the attention kernel's numbering)."""
    pid = tl.program_id(0)
    b = pid // n_heads_k
    hk = pid % n_heads_k
    base = pid * 0
    for s0 in range(0, n_seqs, BLOCK_S):
        seqs = s0 + tl.arange(0, BLOCK_S)
        ok = seqs < n_seqs
        first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, seqs, ok, total_q, capacity)
        splits, short_items, long_items = _items(n_q, n_k, ok, group, n_heads_k, left, right, chunk, max_splits,
                                                 SHORT_M, BLOCK_M)
        base += tl.sum(tl.where(seqs < b, short_items, 0), 0)
    first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, b, True, total_q, capacity)
    splits, short_items, long_items = _items(n_q, n_k, True, group, n_heads_k, left, right, chunk, max_splits,
                                             SHORT_M, BLOCK_M)
    if (short_items > 0) & (splits > 1):
        rows = tl.arange(0, SHORT_M)
        row_ok = rows < n_q * group
        cols = tl.arange(0, HEAD_DIM_PADDED)
        cols_ok = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
        m = tl.full((SHORT_M,), float("-inf"), tl.float32)
        total = tl.zeros((SHORT_M,), tl.float32)
        acc = tl.zeros((SHORT_M, HEAD_DIM_PADDED), tl.float32)
        for s in range(0, splits):
            part_rows = tl.cast(base + hk * splits + s, tl.int64) * SHORT_M + rows
            part_lse = tl.load(part_ptr + n_part + part_rows, mask=row_ok, other=float("-inf"))
            part = tl.load(part_ptr + part_rows[:, None] * HEAD_DIM + cols[None, :], mask=cols_ok, other=0.0)
            m_new = tl.maximum(m, part_lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2((m - m_safe) * LOG2E)
            w = tl.exp2((part_lse - m_safe) * LOG2E)
            acc = acc * alpha[:, None] + part * w[:, None]
            total = total * alpha + w
            m = m_new
        total_safe = tl.where(total > 0.0, total, 1.0)
        out = acc / total_safe[:, None]
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(total > 0.0, m_safe + tl.log2(total_safe) * LN2, float("-inf"))
        _store_rows(o_ptr, lse_ptr, out, lse, first, rows // group, hk * group + rows % group, row_ok, cols,
                    son, soh, sod, slh, sln, HEAD_DIM)


@triton.jit(do_not_specialize=["total_q", "n_seqs", "capacity", "last_page"])
def paged_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, cu_q_ptr, cu_k_ptr, table_ptr, total_q, n_seqs, n_heads_k, capacity, last_page,
    skn, skh, skd, svn, svh, svd, scp, sch, scn, scd, swp, swh, swn, swd, stb,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """New key and value rows (packed like q: (total_q, Hk, D)) of one KV head, BLOCK_R packed rows,
    written into the pages: row i of sequence b (cu_q[b] <= i < cu_q[b + 1]) at key position
    L_b - Q_b + (i - cu_q[b]); rows of no sequence, or landing outside [0, L_b), are dropped."""
    pid = tl.program_id(0)
    hk = pid % n_heads_k
    r = (pid // n_heads_k) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = r * 0
    for s0 in range(0, n_seqs, BLOCK_S):  # a row's sequence: how many end at or before it
        seqs = s0 + tl.arange(0, BLOCK_S)
        ends = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seqs + 1, mask=seqs < n_seqs, other=0), 0), total_q)
        b += tl.sum(((ends[None, :] <= r[:, None]) & (seqs < n_seqs)[None, :]).to(tl.int32), 1)
    ok = (r < total_q) & (b < n_seqs)
    first, n_q, n_k = _sequence(cu_q_ptr, cu_k_ptr, b, ok, total_q, capacity)
    t = r - first
    pos = n_k - n_q + t
    ok = ok & (t >= 0) & (t < n_q) & (pos >= 0) & (pos < n_k)
    page = tl.load(table_ptr + tl.cast(b, tl.int64) * stb + pos // PAGE_SIZE, mask=ok, other=0)
    page = tl.cast(tl.minimum(tl.maximum(page, 0), last_page), tl.int64)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    mask = ok[:, None] & (cols[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + (tl.cast(r, tl.int64) * skn + hk * skh)[:, None] + cols[None, :] * skd, mask=mask)
    v = tl.load(v_ptr + (tl.cast(r, tl.int64) * svn + hk * svh)[:, None] + cols[None, :] * svd, mask=mask)
    k_dst = page * scp + tl.cast(pos % PAGE_SIZE, tl.int64) * scn + hk * sch
    v_dst = page * swp + tl.cast(pos % PAGE_SIZE, tl.int64) * swn + hk * swh
    tl.store(kc_ptr + k_dst[:, None] + cols[None, :] * scd, k, mask=mask)
    tl.store(vc_ptr + v_dst[:, None] + cols[None, :] * swd, v, mask=mask)

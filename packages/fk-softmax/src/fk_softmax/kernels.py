"""Triton kernels for softmax and log-softmax over rows: one idea each.

Row r is x3[r // inner, :, r % inner] of an (outer, n_cols, inner) view of the input (inner = 1
when the softmax dim is last), so any dim and any strides are read in place. Outputs (y forward,
grad_x backward) are written contiguously in the same layout: row stride `out_outer` per outer
index, column stride `inner`. Math in fp32. `LOG` selects log-softmax; `CAUSAL` masks column j
of row r when j > r % seq_rows (the row's index in its seq_rows x n_cols matrix).
"""

import triton
import triton.language as tl
from fk_runtime.siblings import await_row, chunk_columns, claim_abandoned, lane, partials, publish

@triton.jit
def _row_offsets(rows, inner, s_outer, s_inner):
    """int64 offsets of rows' first elements (rows: scalar or vector)."""
    r = rows.to(tl.int64)
    outer = r // inner
    return outer * s_outer + (r - outer * inner) * s_inner


@triton.jit
def _row_output(x, LOG: tl.constexpr):
    """softmax / log-softmax of whole rows along axis 1. An all -inf row gives NaN, as torch does;
    masked padding (-inf) gives 0 / -inf and never NaN next to a finite entry."""
    shifted = x - tl.max(x, axis=1)[:, None]
    e = tl.exp(shifted)
    total = tl.sum(e, axis=1)
    if LOG:
        return shifted - tl.log(total)[:, None]
    return e * (1.0 / total)[:, None]


@triton.jit(do_not_specialize=["n_rows", "seq_rows"])
def softmax_fwd_rows_kernel(
    x_ptr, y_ptr, n_rows, n_cols, inner, seq_rows, sx_outer, sx_col, sx_inner, out_outer,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Whole rows in registers, BLOCK_R rows per program: one read and one write."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    keep = inside
    if CAUSAL:
        keep &= cols[None, :] <= (rows % seq_rows)[:, None]
    x_off = _row_offsets(rows, inner, sx_outer, sx_inner)[:, None] + cols.to(tl.int64)[None, :] * sx_col
    x = tl.load(x_ptr + x_off, mask=keep, other=-float("inf")).to(tl.float32)
    y = _row_output(x, LOG)
    y_off = _row_offsets(rows, inner, out_outer, 1)[:, None] + cols.to(tl.int64)[None, :] * inner
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _grad(y, g, total, LOG: tl.constexpr):
    """softmax: gx = y * (g - sum(y * g)); log-softmax: gx = g - exp(y) * sum(g)."""
    if LOG:
        return g - tl.exp(y) * total
    return y * (g - total)


@triton.jit(do_not_specialize=["n_rows"])
def softmax_bwd_rows_kernel(
    y_ptr, g_ptr, gx_ptr, n_rows, n_cols, inner, sy_outer, sy_col, sy_inner,
    sg_outer, sg_col, sg_inner, out_outer,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOG: tl.constexpr,
):
    """Whole rows in registers: read y and grad_y once, reduce, write grad_x."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)[None, :].to(tl.int64)
    inside = (rows < n_rows)[:, None] & (cols < n_cols)
    y = tl.load(y_ptr + _row_offsets(rows, inner, sy_outer, sy_inner)[:, None] + cols * sy_col,
                mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + _row_offsets(rows, inner, sg_outer, sg_inner)[:, None] + cols * sg_col,
                mask=inside, other=0.0).to(tl.float32)
    total = tl.sum(g if LOG else y * g, axis=1)[:, None]
    gx = _grad(y, g, total, LOG)
    tl.store(gx_ptr + _row_offsets(rows, inner, out_outer, 1)[:, None] + cols * inner,
             gx.to(gx_ptr.dtype.element_ty), mask=inside)


# ---- long rows: chunks of CHUNK columns, one program each ----


@triton.jit
def _load_raw(row_ptr, chunk, n_cols, s_col, last_col, other, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    """A chunk of a row in the input's dtype: what a program holds across its siblings' wait
    (16-bit inputs take half the registers of fp32 there)."""
    cols, keep = chunk_columns(chunk, n_cols, CHUNK)
    if CAUSAL:
        keep &= cols <= last_col
    return tl.load(row_ptr + cols.to(tl.int64) * s_col, mask=keep, other=other)


@triton.jit
def _load_chunk(row_ptr, chunk, n_cols, s_col, last_col, other, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    return _load_raw(row_ptr, chunk, n_cols, s_col, last_col, other, CHUNK, CAUSAL).to(tl.float32)


@triton.jit
def _store_chunk(row_ptr, chunk, n_cols, s_col, values, CHUNK: tl.constexpr):
    cols, inside = chunk_columns(chunk, n_cols, CHUNK)
    tl.store(row_ptr + cols.to(tl.int64) * s_col, values.to(row_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _chunk_stats(x):
    """A chunk's max m, e = exp(x - m) and sum(e). A chunk with no finite entry gets e = 0 and
    sum 0 (not NaN), so it cannot poison a row that has finite entries elsewhere."""
    m = tl.max(x, axis=0)
    e = tl.exp(x - tl.where(m == -float("inf"), 0.0, m))
    return m, e, tl.sum(e, axis=0)


@triton.jit
def _chunk_output(x, e, m, row_max, row_sum, LOG: tl.constexpr):
    """softmax / log-softmax of a chunk from its own max m and its row's max and sum. An all -inf
    row has row_max = -inf and gives NaN, as torch does."""
    if LOG:
        return x - row_max - tl.log(row_sum)
    return e * (tl.exp(m - row_max) / row_sum)


@triton.jit
def _row_stats(stats_ptr, chunks, CHUNKS_P2: tl.constexpr):
    """A row's max and sum of exp(x - max) from its chunks' (max, sum) pairs, in a fixed order."""
    m = partials(stats_ptr, chunks, 2, -float("inf"), CHUNKS_P2)
    s = partials(stats_ptr + 1, chunks, 2, 0.0, CHUNKS_P2)
    row_max = tl.max(m, axis=0)
    return row_max, tl.sum(s * tl.exp(m - row_max), axis=0)


@triton.jit
def _row_total(part_ptr, chunks, CHUNKS_P2: tl.constexpr):
    """Sum of a row's per-chunk partials, in a fixed order (deterministic)."""
    return tl.sum(partials(part_ptr, chunks, 1, 0.0, CHUNKS_P2), axis=0)


@triton.jit(do_not_specialize=["seq_rows"])
def softmax_fwd_split_kernel(
    x_ptr, y_ptr, stats_ptr, arrived_ptr, state_ptr,
    n_cols, inner, seq_rows, sx_outer, sx_col, sx_inner, out_outer, chunks, spin_limit,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Long rows, one program per (row, chunk), chunk held in registers throughout: publish the
    chunk's (max, sum), wait until the row's siblings have too, combine, write. One read, one
    write, like the fused path, for rows of any length the GPU's programs can hold together."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    x_row = x_ptr + _row_offsets(row, inner, sx_outer, sx_inner)
    y_row = y_ptr + _row_offsets(row, inner, out_outer, 1)
    last_col = row % seq_rows
    x = _load_chunk(x_row, chunk, n_cols, sx_col, last_col, -float("inf"), CHUNK, CAUSAL)
    m, e, s = _chunk_stats(x)
    slot = row * chunks + chunk
    publish(stats_ptr + 2 * slot, m)
    publish(stats_ptr + 2 * slot + 1, s)
    ready, last = await_row(arrived_ptr + row, state_ptr + slot, chunks, spin_limit)
    row_stats = stats_ptr + 2 * row * chunks
    if ready:
        row_max, row_sum = _row_stats(row_stats, chunks, CHUNKS_P2)
        _store_chunk(y_row, chunk, n_cols, inner, _chunk_output(x, e, m, row_max, row_sum, LOG), CHUNK)
    if last:
        won = claim_abandoned(state_ptr + row * chunks, chunk, chunks, CHUNKS_P2)
        if tl.max(won.to(tl.int32), axis=0) > 0:
            row_max, row_sum = _row_stats(row_stats, chunks, CHUNKS_P2)
            for other in range(chunks):
                if lane(won, other, CHUNKS_P2):
                    xo = _load_chunk(x_row, other, n_cols, sx_col, last_col, -float("inf"), CHUNK, CAUSAL)
                    mo, eo, _ = _chunk_stats(xo)
                    _store_chunk(y_row, other, n_cols, inner,
                                 _chunk_output(xo, eo, mo, row_max, row_sum, LOG), CHUNK)


@triton.jit
def softmax_bwd_split_kernel(
    y_ptr, g_ptr, gx_ptr, part_ptr, arrived_ptr, state_ptr,
    n_cols, inner, sy_outer, sy_col, sy_inner, sg_outer, sg_col, sg_inner, out_outer, chunks, spin_limit,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr,
):
    """Backward of the split path: publish the chunk's sum(y * g) (log-softmax: sum(g)), wait for
    the row's siblings, write grad_x from the y and grad_y chunks still in registers (held in
    their own dtype through the wait, converted again after it)."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    y_row = y_ptr + _row_offsets(row, inner, sy_outer, sy_inner)
    g_row = g_ptr + _row_offsets(row, inner, sg_outer, sg_inner)
    gx_row = gx_ptr + _row_offsets(row, inner, out_outer, 1)
    y_raw = _load_raw(y_row, chunk, n_cols, sy_col, 0, 0.0, CHUNK, False)
    g_raw = _load_raw(g_row, chunk, n_cols, sg_col, 0, 0.0, CHUNK, False)
    slot = row * chunks + chunk
    g = g_raw.to(tl.float32)
    publish(part_ptr + slot, tl.sum(g if LOG else y_raw.to(tl.float32) * g, axis=0))
    ready, last = await_row(arrived_ptr + row, state_ptr + slot, chunks, spin_limit)
    if ready:
        total = _row_total(part_ptr + row * chunks, chunks, CHUNKS_P2)
        _store_chunk(gx_row, chunk, n_cols, inner, _grad(y_raw.to(tl.float32), g_raw.to(tl.float32), total, LOG),
                     CHUNK)
    if last:
        won = claim_abandoned(state_ptr + row * chunks, chunk, chunks, CHUNKS_P2)
        if tl.max(won.to(tl.int32), axis=0) > 0:
            total = _row_total(part_ptr + row * chunks, chunks, CHUNKS_P2)
            for other in range(chunks):
                if lane(won, other, CHUNKS_P2):
                    yo = _load_chunk(y_row, other, n_cols, sy_col, 0, 0.0, CHUNK, False)
                    go = _load_chunk(g_row, other, n_cols, sg_col, 0, 0.0, CHUNK, False)
                    _store_chunk(gx_row, other, n_cols, inner, _grad(yo, go, total, LOG), CHUNK)


@triton.jit(do_not_specialize=["seq_rows"])
def softmax_fwd_partials_kernel(
    x_ptr, stats_ptr, n_cols, inner, seq_rows, sx_outer, sx_col, sx_inner, chunks,
    CHUNK: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Two-pass path, pass 1: one chunk's (max, sum of exp(x - max))."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    x_row = x_ptr + _row_offsets(row, inner, sx_outer, sx_inner)
    x = _load_chunk(x_row, chunk, n_cols, sx_col, row % seq_rows, -float("inf"), CHUNK, CAUSAL)
    m, _, s = _chunk_stats(x)
    tl.store(stats_ptr + 2 * pid, m.to(tl.int32, bitcast=True))
    tl.store(stats_ptr + 2 * pid + 1, s.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["seq_rows"])
def softmax_fwd_combine_kernel(
    x_ptr, y_ptr, stats_ptr, n_cols, inner, seq_rows, sx_outer, sx_col, sx_inner, out_outer, chunks,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Two-pass path, pass 2: combine the row's partials, re-read this chunk and write it."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    x_row = x_ptr + _row_offsets(row, inner, sx_outer, sx_inner)
    x = _load_chunk(x_row, chunk, n_cols, sx_col, row % seq_rows, -float("inf"), CHUNK, CAUSAL)
    m, e, _ = _chunk_stats(x)
    row_max, row_sum = _row_stats(stats_ptr + 2 * row * chunks, chunks, CHUNKS_P2)
    _store_chunk(y_ptr + _row_offsets(row, inner, out_outer, 1), chunk, n_cols, inner,
                 _chunk_output(x, e, m, row_max, row_sum, LOG), CHUNK)


@triton.jit
def softmax_bwd_partials_kernel(
    y_ptr, g_ptr, part_ptr, n_cols, inner, sy_outer, sy_col, sy_inner, sg_outer, sg_col, sg_inner, chunks,
    CHUNK: tl.constexpr, LOG: tl.constexpr,
):
    """Two-pass backward, pass 1: one chunk's sum(y * g) (log-softmax: sum(g))."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    g = _load_chunk(g_ptr + _row_offsets(row, inner, sg_outer, sg_inner), chunk, n_cols, sg_col, 0, 0.0,
                    CHUNK, False)
    if LOG:
        part = tl.sum(g, axis=0)
    else:
        y = _load_chunk(y_ptr + _row_offsets(row, inner, sy_outer, sy_inner), chunk, n_cols, sy_col, 0, 0.0,
                        CHUNK, False)
        part = tl.sum(y * g, axis=0)
    tl.store(part_ptr + pid, part.to(tl.int32, bitcast=True))


@triton.jit
def softmax_bwd_combine_kernel(
    y_ptr, g_ptr, gx_ptr, part_ptr, n_cols, inner, sy_outer, sy_col, sy_inner, sg_outer, sg_col, sg_inner,
    out_outer, chunks,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr,
):
    """Two-pass backward, pass 2: sum the row's partials, re-read this chunk, write grad_x."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    y = _load_chunk(y_ptr + _row_offsets(row, inner, sy_outer, sy_inner), chunk, n_cols, sy_col, 0, 0.0,
                    CHUNK, False)
    g = _load_chunk(g_ptr + _row_offsets(row, inner, sg_outer, sg_inner), chunk, n_cols, sg_col, 0, 0.0,
                    CHUNK, False)
    total = _row_total(part_ptr + row * chunks, chunks, CHUNKS_P2)
    _store_chunk(gx_ptr + _row_offsets(row, inner, out_outer, 1), chunk, n_cols, inner,
                 _grad(y, g, total, LOG), CHUNK)

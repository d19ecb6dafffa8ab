"""Triton kernels for softmax and log-softmax over rows: one idea each.

Rows are (n_rows, n_cols) views with arbitrary strides; math in fp32. `LOG` selects
log-softmax. `CAUSAL` masks column j of row i when j > i, where i is the row's index inside its
(seq_rows x n_cols) matrix (rows are flattened from [..., seq_rows, n_cols]).
"""

import triton
import triton.language as tl


@triton.jit
def _row_mask(rows, cols, n_rows, n_cols, seq_rows, CAUSAL: tl.constexpr):
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    if CAUSAL:
        mask &= cols[None, :] <= (rows % seq_rows)[:, None]
    return mask


@triton.jit
def softmax_fwd_rows_kernel(
    x_ptr, y_ptr, n_rows, n_cols, seq_rows,
    stride_xr, stride_xc, stride_yr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Whole rows in registers: max, exp, sum, normalise, one read and one write."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = _row_mask(rows, cols, n_rows, n_cols, seq_rows, CAUSAL)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :] * stride_xc, mask=mask,
                other=-float("inf"), eviction_policy="evict_first").to(tl.float32)
    x_max = tl.max(x, axis=1)
    # All--inf rows give x_max = -inf and NaN below, as torch does.
    shifted = x - x_max[:, None]
    e = tl.exp(shifted)
    total = tl.sum(e, axis=1)
    if LOG:
        y = shifted - tl.log(total)[:, None]
    else:
        y = e / total[:, None]
    in_rows = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(y_ptr + rows64 * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=in_rows)


@triton.jit
def softmax_bwd_rows_kernel(
    y_ptr, gy_ptr, gx_ptr, n_rows, n_cols,
    stride_yr, stride_gyr, stride_gyc, stride_gxr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOG: tl.constexpr,
):
    """softmax: gx = y * (g - sum(y * g)); log-softmax: gx = g - exp(y) * sum(g)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    y = tl.load(y_ptr + rows64 * stride_yr + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    g = tl.load(gy_ptr + rows64 * stride_gyr + cols[None, :] * stride_gyc, mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    if LOG:
        gx = g - tl.exp(y) * tl.sum(g, axis=1)[:, None]
    else:
        gx = y * (g - tl.sum(y * g, axis=1)[:, None])
    tl.store(gx_ptr + rows64 * stride_gxr + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_fwd_chunk_stats_kernel(
    x_ptr, max_ptr, sum_ptr, n_cols, seq_rows, stride_xr, stride_xc, chunks,
    CHUNK: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Long rows, pass 1: the (max, sum of exp(x - max)) of one chunk of one row."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    if CAUSAL:
        mask &= cols <= row % seq_rows
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + cols * stride_xc, mask=mask,
                other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    # A chunk with no valid entry contributes sum 0 (not NaN) so it cannot poison the row.
    s = tl.where(m == -float("inf"), 0.0, tl.sum(tl.exp(x - m), axis=0))
    tl.store(max_ptr + row * chunks + chunk, m)
    tl.store(sum_ptr + row * chunks + chunk, s)


@triton.jit
def _combine_stats(max_ptr, sum_ptr, row, chunks, CHUNKS_P2: tl.constexpr):
    """The row's max and sum of exp(x - max) from its chunks' partials (fixed order)."""
    idx = tl.arange(0, CHUNKS_P2)
    valid = idx < chunks
    m = tl.load(max_ptr + row * chunks + idx, mask=valid, other=-float("inf"))
    s = tl.load(sum_ptr + row * chunks + idx, mask=valid, other=0.0)
    row_max = tl.max(m, axis=0)
    scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - row_max))
    return row_max, tl.sum(s * scale, axis=0)


@triton.jit
def _output(x, row_max, total, LOG: tl.constexpr):
    """softmax or log-softmax of x given its row's max and sum of exp(x - max)."""
    shifted = x - row_max
    if LOG:
        return shifted - tl.log(total)
    return tl.exp(shifted) / total


@triton.jit
def softmax_fwd_chunk_write_kernel(
    x_ptr, y_ptr, max_ptr, sum_ptr, n_cols, seq_rows, stride_xr, stride_xc, stride_yr, chunks,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Long rows, pass 2: combine the row's partials and write this chunk of the output."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    row_max, total = _combine_stats(max_ptr, sum_ptr, row, chunks, CHUNKS_P2)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < n_cols
    mask = in_row
    if CAUSAL:
        mask &= cols <= row % seq_rows
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + cols * stride_xc, mask=mask,
                other=-float("inf"), eviction_policy="evict_first").to(tl.float32)
    y = _output(x, row_max, total, LOG)
    tl.store(y_ptr + row.to(tl.int64) * stride_yr + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_bwd_chunk_dot_kernel(
    y_ptr, gy_ptr, dot_ptr, n_cols, stride_yr, stride_gyr, stride_gyc, chunks,
    CHUNK: tl.constexpr, LOG: tl.constexpr,
):
    """Long rows, backward pass 1: this chunk's sum(y * g) (softmax) or sum(g) (log-softmax)."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    g = tl.load(gy_ptr + row.to(tl.int64) * stride_gyr + cols * stride_gyc, mask=mask,
                other=0.0).to(tl.float32)
    if LOG:
        part = tl.sum(g, axis=0)
    else:
        y = tl.load(y_ptr + row.to(tl.int64) * stride_yr + cols, mask=mask, other=0.0).to(tl.float32)
        part = tl.sum(y * g, axis=0)
    tl.store(dot_ptr + row * chunks + chunk, part)


@triton.jit
def softmax_bwd_chunk_write_kernel(
    y_ptr, gy_ptr, gx_ptr, dot_ptr, n_cols, stride_yr, stride_gyr, stride_gyc, stride_gxr, chunks,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, LOG: tl.constexpr,
):
    """Long rows, backward pass 2: sum the row's partials (fixed order) and write this chunk."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    idx = tl.arange(0, CHUNKS_P2)
    dot = tl.sum(tl.load(dot_ptr + row * chunks + idx, mask=idx < chunks, other=0.0), axis=0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row.to(tl.int64) * stride_yr + cols, mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    g = tl.load(gy_ptr + row.to(tl.int64) * stride_gyr + cols * stride_gyc, mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    if LOG:
        gx = g - tl.exp(y) * dot
    else:
        gx = y * (g - dot)
    tl.store(gx_ptr + row.to(tl.int64) * stride_gxr + cols, gx.to(gx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_fwd_looped_kernel(
    x_ptr, y_ptr, n_cols, seq_rows, stride_xr, stride_xc, stride_yr,
    CHUNK: tl.constexpr, LOG: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Rows too long for registers, but many of them: one program per row walks it twice. Pass 1
    keeps an online (max, sum) per lane, rescaling the sum when the max grows; pass 2 re-reads the
    row, which the program has just read, from the L2 cache, and writes the output."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xr
    lane_max = tl.full((CHUNK,), -float("inf"), tl.float32)
    lane_sum = tl.zeros((CHUNK,), tl.float32)
    for c0 in range(0, n_cols, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < n_cols
        if CAUSAL:
            mask &= cols <= row % seq_rows
        x = tl.load(x_row + cols * stride_xc, mask=mask, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # Lanes that have seen only -inf keep sum 0 instead of exp(-inf - -inf) = NaN.
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    scale = tl.where(lane_max == -float("inf"), 0.0, tl.exp(lane_max - row_max))
    total = tl.sum(lane_sum * scale, axis=0)
    for c0 in range(0, n_cols, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        in_row = cols < n_cols
        mask = in_row
        if CAUSAL:
            mask &= cols <= row % seq_rows
        x = tl.load(x_row + cols * stride_xc, mask=mask, other=-float("inf"),
                    eviction_policy="evict_first").to(tl.float32)
        y = _output(x, row_max, total, LOG)
        tl.store(y_ptr + row.to(tl.int64) * stride_yr + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_bwd_looped_kernel(
    y_ptr, gy_ptr, gx_ptr, n_cols, stride_yr, stride_gyr, stride_gyc, stride_gxr,
    CHUNK: tl.constexpr, LOG: tl.constexpr,
):
    """Rows too long for registers, but many of them: pass 1 sums y * g (or g) over the row,
    pass 2 re-reads the row from the L2 cache and writes grad_x."""
    row = tl.program_id(0)
    y_row = y_ptr + row.to(tl.int64) * stride_yr
    g_row = gy_ptr + row.to(tl.int64) * stride_gyr
    acc = tl.zeros((CHUNK,), tl.float32)
    for c0 in range(0, n_cols, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < n_cols
        g = tl.load(g_row + cols * stride_gyc, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            acc += g
        else:
            acc += tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32) * g
    dot = tl.sum(acc, axis=0)
    for c0 in range(0, n_cols, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        g = tl.load(g_row + cols * stride_gyc, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if LOG:
            gx = g - tl.exp(y) * dot
        else:
            gx = y * (g - dot)
        tl.store(gx_ptr + row.to(tl.int64) * stride_gxr + cols, gx.to(gx_ptr.dtype.element_ty), mask=mask)

"""Triton kernels for LayerNorm and RMSNorm over the last dim: one idea each.

Means multiply by `inv_n_cols` (1/n computed on the host): the fp32 `/` Triton emits is an
approximate division, whose rounding LayerNorm's 1/sqrt(var + eps) would amplify.

Shared flags: IS_RMS (RMSNorm: no mean, no bias), STABLE (`stable=True`: rows divided by their
largest magnitude first, 1 for an all-zero row), HAS_W / HAS_B (affine parameters). Statistics
are fp32; per row we keep `mean` (LayerNorm), `rstd`, and `row_max` (STABLE: the max |x|) for
the backward.

Rows whose sums overflow fp32 (|x| past ~1e19): rows held whole are normalised again from
x / max |x| (right results); split and looped rows come back NaN (flagged, never a plausible row).
"""

import triton
import triton.language as tl
from fk_runtime.siblings import await_row, chunk_columns, claim_abandoned, lane, partials, publish, widen_held

# fp32 partials a split row's chunk publishes: (sum, sum of squares centred on the chunk's own
# mean (RMSNorm: not centred), max) forward; (sum of x-hat * w*dy, sum of w*dy) backward.
FWD_PARTIALS = tl.constexpr(3)
BWD_PARTIALS = tl.constexpr(2)


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, col_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    y = xhat
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _abs_max(x, mask, axis):
    """max |x| over `axis`, 1 where every entry is 0 (nothing to scale)."""
    m = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=axis)
    return tl.where(m > 0.0, m, 1.0)


@triton.jit
def _sign(x):
    return tl.where(x < 0.0, -1.0, 1.0)


@triton.jit
def _rescaled_rows(x_row_ptrs, mask, inv_n_cols, eps, IS_RMS: tl.constexpr):
    """(x-hat, mean, rstd) of rows whose sum of squares overflowed: the statistics of x / max|x|,
    scaled back (x re-read: the common path keeps no second copy in registers)."""
    x = tl.load(x_row_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = _abs_max(x, mask, 1)
    x = x / scale[:, None]
    mean = tl.zeros_like(scale)
    if not IS_RMS:
        mean = tl.sum(x, axis=1) * inv_n_cols
        x = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) * inv_n_cols + eps / (scale * scale))
    return x * rstd[:, None], mean * scale, rstd / scale


@triton.jit(do_not_specialize=["n_rows"])
def norm_fwd_fused_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, max_ptr,
    n_rows, n_cols, inv_n_cols, stride_xr, stride_xc, stride_yr, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SAVE_STATS: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Whole rows in registers (BLOCK_R of them): statistics, normalise, affine; one read and one
    write of the row, plus per-row statistics when autograd needs them. EVEN_D: the row is
    BLOCK_D wide (its column mask is known true, and the compiler keeps no predicates for it)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    if EVEN_D:
        col_mask = cols < BLOCK_D
    else:
        col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x_ptrs = x_ptr + rows64 * stride_xr + cols[None, :].to(tl.int64) * stride_xc
    x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if STABLE:
        row_max = _abs_max(x, mask, 1)
        x = x / row_max[:, None]
        if SAVE_STATS:
            tl.store(max_ptr + rows, row_max, mask=row_mask)
    mean = tl.zeros((BLOCK_R,), tl.float32)
    if not IS_RMS:
        mean = tl.sum(x, axis=1) * inv_n_cols
        x = tl.where(mask, x - mean[:, None], 0.0)
    squares = tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(squares * inv_n_cols + eps)
    xhat = x * rstd[:, None]
    if not STABLE:
        # A sum of squares past fp32 (or NaN): normalise those rows again, from x / max|x|.
        overflow = ~(squares < float("inf"))
        if tl.max(overflow.to(tl.int32), axis=0) > 0:
            xhat_r, mean_r, rstd_r = _rescaled_rows(x_ptrs, mask, inv_n_cols, eps, IS_RMS)
            xhat = tl.where(overflow[:, None], xhat_r, xhat)
            mean = tl.where(overflow, mean_r, mean)
            rstd = tl.where(overflow, rstd_r, rstd)
    if SAVE_STATS and not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    if SAVE_STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = _affine(xhat, w_ptr, b_ptr, cols, col_mask, HAS_W, HAS_B)
    tl.store(y_ptr + rows64 * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_fwd_looped_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, max_ptr,
    n_cols, inv_n_cols, stride_xr, stride_xc, stride_yr, eps,
    BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SAVE_STATS: tl.constexpr,
):
    """Rows too long for registers: one program per row walks it in chunks, once per statistic
    (max, mean, centred variance) and once to write; the re-reads of one row hit the L2 cache."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xr
    row_max = 1.0
    if STABLE:
        acc_max = tl.zeros((1, BLOCK_D), tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)[None, :]
            x = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=cols < n_cols, other=0.0)
            acc_max = tl.maximum(acc_max, tl.abs(x.to(tl.float32)))
        row_max = tl.max(tl.max(acc_max, axis=1), axis=0)
        row_max = tl.where(row_max > 0.0, row_max, 1.0)
        if SAVE_STATS:
            tl.store(max_ptr + row, row_max)
    mean = 0.0
    if not IS_RMS:
        acc = tl.zeros((1, BLOCK_D), tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)[None, :]
            chunk = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=cols < n_cols, other=0.0)
            acc += chunk.to(tl.float32)
        mean = tl.sum(tl.sum(acc, axis=1), axis=0) / row_max * inv_n_cols
        if SAVE_STATS:
            tl.store(mean_ptr + row, mean)
    acc = tl.zeros((1, BLOCK_D), tl.float32)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)[None, :]
        mask = cols < n_cols
        x = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=mask, other=0.0).to(tl.float32) / row_max
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    var = tl.sum(tl.sum(acc, axis=1), axis=0) * inv_n_cols
    # A variance past fp32 comes back NaN (flagged), not as rstd = 0 (the bias alone).
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if SAVE_STATS:
        tl.store(rstd_ptr + row, rstd)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        col_mask = cols < n_cols
        x = tl.load(x_row + cols[None, :].to(tl.int64) * stride_xc, mask=col_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32) / row_max
        y = _affine((x - mean) * rstd, w_ptr, b_ptr, cols, col_mask, HAS_W, HAS_B)
        tl.store(y_ptr + row.to(tl.int64) * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=col_mask[None, :])


@triton.jit
def _total(x):
    """Sum of a (1, CHUNK) chunk."""
    return tl.sum(tl.sum(x, axis=1), axis=0)


@triton.jit
def _chunk_partials(x, mask, n_in_chunk, IS_RMS: tl.constexpr):
    """A chunk's sum and its sum of squares, centred on the chunk's own mean for LayerNorm (so
    that combining chunks never subtracts two large sums: Chan's parallel variance)."""
    total = _total(x)
    if IS_RMS:
        return total, _total(x * x)
    d = tl.where(mask, x - total / n_in_chunk, 0.0)
    return total, _total(d * d)


@triton.jit
def _split_row_stats(part_ptr, chunks, n_cols, inv_n_cols, eps,
                     CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, IS_RMS: tl.constexpr,
                     STABLE: tl.constexpr):
    """(mean, rstd, row_max) of a split row from its chunks' partials, combined in a fixed order.
    STABLE statistics are those of x / row_max: the mean scales by 1/row_max, the variance by
    1/row_max^2."""
    sums = partials(part_ptr, chunks, FWD_PARTIALS, 0.0, CHUNKS_P2)
    squares = partials(part_ptr + 1, chunks, FWD_PARTIALS, 0.0, CHUNKS_P2)
    mean = 0.0
    if IS_RMS:
        var = tl.sum(squares, axis=0) * inv_n_cols
    else:
        mean = tl.sum(sums, axis=0) * inv_n_cols
        idx = tl.arange(0, CHUNKS_P2)
        n_in = tl.minimum(tl.maximum(n_cols - idx * CHUNK, 0), CHUNK).to(tl.float32)
        between = n_in * (sums / tl.maximum(n_in, 1.0) - mean) * (sums / tl.maximum(n_in, 1.0) - mean)
        var = (tl.sum(squares, axis=0) + tl.sum(between, axis=0)) * inv_n_cols
    row_max = 1.0
    if STABLE:
        row_max = tl.max(partials(part_ptr + 2, chunks, FWD_PARTIALS, 0.0, CHUNKS_P2), axis=0)
        row_max = tl.where(row_max > 0.0, row_max, 1.0)
        mean = mean / row_max
        var = var / (row_max * row_max)
    # A variance past fp32 comes back NaN (flagged), not as rstd = 0 (the bias alone).
    return mean, tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan")), row_max


@triton.jit
def _write_split_chunk(x, y_row, w_ptr, b_ptr, cols, col_mask, mean, rstd, row_max,
                       STABLE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    if STABLE:
        x = x / row_max
    y = _affine((x - mean) * rstd, w_ptr, b_ptr, cols, col_mask, HAS_W, HAS_B)
    tl.store(y_row + cols[None, :], y.to(y_row.dtype.element_ty), mask=col_mask[None, :])


@triton.jit
def norm_fwd_split_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, max_ptr, part_ptr, arrived_ptr, state_ptr,
    n_cols, inv_n_cols, stride_xr, stride_xc, stride_yr, eps, chunks, spin_limit,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SAVE_STATS: tl.constexpr,
):
    """Long rows, one program per (row, chunk) (fk_runtime.siblings): publish the chunk's
    partials, wait for the row's siblings, combine, write the chunk still in registers (held in
    its own dtype through the wait). One read and one write; the row's last program saves its
    statistics."""
    pid = tl.program_id(0)
    row = pid // chunks
    chunk = pid - row * chunks
    x_row = x_ptr + row.to(tl.int64) * stride_xr
    y_row = y_ptr + row.to(tl.int64) * stride_yr
    cols, col_mask = chunk_columns(chunk, n_cols, CHUNK)
    x_raw = tl.load(x_row + cols[None, :].to(tl.int64) * stride_xc, mask=col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
    x = x_raw.to(tl.float32)
    slot = row * chunks + chunk
    total, squares = _chunk_partials(x, col_mask[None, :], tl.minimum(n_cols - chunk * CHUNK, CHUNK),
                                     IS_RMS)
    publish(part_ptr + FWD_PARTIALS * slot, total)
    publish(part_ptr + FWD_PARTIALS * slot + 1, squares)
    if STABLE:
        publish(part_ptr + FWD_PARTIALS * slot + 2, tl.max(tl.max(tl.where(col_mask[None, :], tl.abs(x), 0.0),
                                                                   axis=1), axis=0))
    ready, last = await_row(arrived_ptr + row, state_ptr + slot, chunks, spin_limit)
    row_parts = part_ptr + FWD_PARTIALS * row * chunks
    if ready:
        mean, rstd, row_max = _split_row_stats(row_parts, chunks, n_cols, inv_n_cols, eps,
                                               CHUNK, CHUNKS_P2, IS_RMS, STABLE)
        _write_split_chunk(widen_held(x_raw), y_row, w_ptr, b_ptr, cols, col_mask, mean, rstd, row_max,
                           STABLE, HAS_W, HAS_B)
    if last:
        mean, rstd, row_max = _split_row_stats(row_parts, chunks, n_cols, inv_n_cols, eps,
                                               CHUNK, CHUNKS_P2, IS_RMS, STABLE)
        if SAVE_STATS:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)
            if STABLE:
                tl.store(max_ptr + row, row_max)
        won = claim_abandoned(state_ptr + row * chunks, chunk, chunks, CHUNKS_P2)
        if tl.max(won.to(tl.int32), axis=0) > 0:
            for other in range(chunks):
                if lane(won, other, CHUNKS_P2):
                    ocols, omask = chunk_columns(other, n_cols, CHUNK)
                    xo = tl.load(x_row + ocols[None, :].to(tl.int64) * stride_xc, mask=omask[None, :],
                                 other=0.0).to(tl.float32)
                    _write_split_chunk(xo, y_row, w_ptr, b_ptr, ocols, omask, mean, rstd, row_max,
                                       STABLE, HAS_W, HAS_B)


@triton.jit
def _saved_stats(mean_ptr, rstd_ptr, row, IS_RMS: tl.constexpr):
    """A row's (mean, rstd) as the forward saved them (mean 0 for RMSNorm)."""
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)
    return mean, tl.load(rstd_ptr + row)


@triton.jit
def _weight(w_ptr, cols, col_mask, HAS_W: tl.constexpr):
    """The weight over a row's columns in fp32 (1.0 without one)."""
    return tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) if HAS_W else 1.0


@triton.jit
def _normalized(x, mean, rstd, row_max, IS_RMS: tl.constexpr, STABLE: tl.constexpr):
    """Recompute x-hat from the saved statistics (x is never saved normalised)."""
    if STABLE:
        x = x / row_max
    if IS_RMS:
        return x * rstd
    return (x - mean) * rstd


@triton.jit
def _bwd_rows(x_ptr, dy_ptr, mean_ptr, rstd_ptr, max_ptr, rows, row_end, cols, col_mask,
              stride_xr, stride_xc, stride_dyr, stride_dyc, IS_RMS: tl.constexpr, STABLE: tl.constexpr):
    """One step's rows of the fused backward: x and dy in their own dtype (what a prefetched step
    holds), and the rows' saved (mean, rstd, row_max); rows at or past row_end read as zeros."""
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0,
                eviction_policy="evict_first")
    dy = tl.load(dy_ptr + rows64 * stride_dyr + cols[None, :].to(tl.int64) * stride_dyc, mask=mask,
                 other=0.0, eviction_policy="evict_first")
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    mean = tl.zeros_like(rstd)
    if not IS_RMS:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    row_max = tl.full(rstd.shape, 1.0, tl.float32)
    if STABLE:
        row_max = tl.load(max_ptr + rows, mask=row_mask, other=1.0)
    return x, dy, mean, rstd, row_max


@triton.jit(do_not_specialize=["n_rows", "rows_per_group"])
def norm_bwd_fused_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, max_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, PREFETCH: tl.constexpr, RECOMPUTE: tl.constexpr,
    REREAD_W: tl.constexpr,
):
    """Rows that fit: program g walks its group of rows once, writing dx and summing
    dy * x-hat and dy into dweight / dbias partials for its group (reduced later in a fixed order).
    dx = rstd * (w*dy - x-hat * mean(x-hat * w*dy) - mean(w*dy)) (no mean term for RMSNorm),
    then through the division by the row max when STABLE. PREFETCH loads the next step's rows
    before working on this step's, so that each program keeps two steps of loads in flight;
    RECOMPUTE (wide 16-bit rows) widens x and dy again after the row sums instead of holding them
    in fp32; REREAD_W reads the weight again where a step uses it (from L1) instead of holding it."""
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    w = _weight(w_ptr, cols, col_mask, HAS_W and not REREAD_W)
    # Accumulators shaped like a step's tile, summed over its rows once at the end: a sum per
    # step would reduce across warps (through shared memory) twice a step on short rows.
    dw_acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    db_acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    if PREFETCH:
        x_next, dy_next, mean_next, rstd_next, max_next = _bwd_rows(
            x_ptr, dy_ptr, mean_ptr, rstd_ptr, max_ptr, row_begin + tl.arange(0, BLOCK_R), row_end, cols,
            col_mask, stride_xr, stride_xc, stride_dyr, stride_dyc, IS_RMS, STABLE)
    for r0 in range(row_begin, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        if PREFETCH:
            x_raw, dy_raw, mean, rstd, row_max_1d = x_next, dy_next, mean_next, rstd_next, max_next
            x_next, dy_next, mean_next, rstd_next, max_next = _bwd_rows(
                x_ptr, dy_ptr, mean_ptr, rstd_ptr, max_ptr, rows + BLOCK_R, row_end, cols, col_mask,
                stride_xr, stride_xc, stride_dyr, stride_dyc, IS_RMS, STABLE)
        else:
            x_raw, dy_raw, mean, rstd, row_max_1d = _bwd_rows(
                x_ptr, dy_ptr, mean_ptr, rstd_ptr, max_ptr, rows, row_end, cols, col_mask,
                stride_xr, stride_xc, stride_dyr, stride_dyc, IS_RMS, STABLE)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        row_max = row_max_1d[:, None]
        xhat = tl.where(mask, _normalized(x, mean[:, None], rstd[:, None], row_max, IS_RMS, STABLE), 0.0)
        wdy = dy * (_weight(w_ptr, cols, col_mask, HAS_W) if REREAD_W else w)
        if RECOMPUTE:
            if HAS_W:
                dw_acc += dy * xhat
            if HAS_B:
                db_acc += dy
        c1 = tl.sum(xhat * wdy, axis=1) * inv_n_cols
        if not IS_RMS:
            c2 = tl.sum(wdy, axis=1) * inv_n_cols
        if RECOMPUTE:
            # Hold only the 16-bit x and dy across the row sums above and widen them again
            # (widen_held: a copy the compiler cannot merge with the fp32 one, which would stay
            # live across the sums and spill); dweight / dbias took their sums before them.
            x = widen_held(x_raw)
            xhat = tl.where(mask, _normalized(x, mean[:, None], rstd[:, None], row_max, IS_RMS, STABLE), 0.0)
            wdy = widen_held(dy_raw) * (_weight(w_ptr, cols, col_mask, HAS_W) if REREAD_W else w)
        dz = wdy - xhat * c1[:, None]
        if not IS_RMS:
            dz -= c2[:, None]
        dz = dz * rstd[:, None]
        if STABLE:
            # z = x / m, m = max|x|: dx = dz / m, and the entries of largest magnitude get
            # sign(x) * -sum(dz * x) / m^2, shared between ties as torch.amax's gradient shares it.
            dx = dz / row_max
            is_max = mask & (tl.abs(x) == row_max)
            ties = tl.sum(is_max.to(tl.float32), axis=1)
            through_max = -tl.sum(tl.where(mask, dz * x, 0.0), axis=1) / (row_max_1d * row_max_1d)
            dx += tl.where(is_max, _sign(x) * (through_max / ties)[:, None], 0.0)
        else:
            dx = dz
        tl.store(dx_ptr + rows.to(tl.int64)[:, None] * stride_dxr + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        if not RECOMPUTE:
            if HAS_W:
                dw_acc += dy * xhat
            if HAS_B:
                db_acc += dy
    if HAS_W:
        tl.store(dw_part_ptr + group.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_B:
        tl.store(db_part_ptr + group.to(tl.int64) * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W: tl.constexpr):
    """One chunk of a row's x and w * dy, in fp32 (int64 offsets: a column stride times a long
    row can pass 2**31)."""
    offs = cols.to(tl.int64)
    x = tl.load(x_row + offs * stride_xc, mask=mask, other=0.0).to(tl.float32)
    wdy = tl.load(dy_row + offs * stride_dyc, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        wdy *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x, wdy


@triton.jit
def norm_bwd_looped_dx_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, max_ptr,
    n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr,
    BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr, HAS_W: tl.constexpr,
):
    """Rows too long for registers: dx of one row, walking it once for the two row sums (and once
    more for the max's share when STABLE), then once to write."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xr
    dy_row = dy_ptr + row.to(tl.int64) * stride_dyr
    mean, rstd = _saved_stats(mean_ptr, rstd_ptr, row, IS_RMS)
    row_max = 1.0
    if STABLE:
        row_max = tl.load(max_ptr + row)
    acc1 = tl.zeros((1, BLOCK_D), tl.float32)
    acc2 = tl.zeros((1, BLOCK_D), tl.float32)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)[None, :]
        mask = cols < n_cols
        x, wdy = _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W)
        xhat = tl.where(mask, _normalized(x, mean, rstd, row_max, IS_RMS, STABLE), 0.0)
        acc1 += xhat * wdy
        acc2 += wdy
    c1 = tl.sum(tl.sum(acc1, axis=1), axis=0) * inv_n_cols
    c2 = 0.0
    if not IS_RMS:
        c2 = tl.sum(tl.sum(acc2, axis=1), axis=0) * inv_n_cols
    through_max = 0.0
    ties = 1.0
    if STABLE:
        acc1 = tl.zeros((1, BLOCK_D), tl.float32)
        acc2 = tl.zeros((1, BLOCK_D), tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)[None, :]
            mask = cols < n_cols
            x, wdy = _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W)
            xhat = _normalized(x, mean, rstd, row_max, IS_RMS, STABLE)
            dz = (wdy - xhat * c1 - c2) * rstd
            acc1 += tl.where(mask, dz * x, 0.0)
            acc2 += (mask & (tl.abs(x) == row_max)).to(tl.float32)
        through_max = -tl.sum(tl.sum(acc1, axis=1), axis=0) / (row_max * row_max)
        ties = tl.sum(tl.sum(acc2, axis=1), axis=0)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)[None, :]
        mask = cols < n_cols
        x, wdy = _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W)
        xhat = _normalized(x, mean, rstd, row_max, IS_RMS, STABLE)
        dx = (wdy - xhat * c1 - c2) * rstd
        if STABLE:
            dx = dx / row_max + tl.where(tl.abs(x) == row_max, _sign(x) * (through_max / ties), 0.0)
        tl.store(dx_ptr + row.to(tl.int64) * stride_dxr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "rows_per_group"])
def norm_bwd_params_kernel(
    x_ptr, dy_ptr, mean_ptr, rstd_ptr, max_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    """Rows too long for registers: dweight / dbias partials of one (row group, column tile)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    dw_acc = tl.zeros((BLOCK_D,), tl.float32)
    db_acc = tl.zeros((BLOCK_D,), tl.float32)
    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    for r0 in range(row_begin, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + rows64 * stride_dyr + cols[None, :].to(tl.int64) * stride_dyc, mask=mask,
                     other=0.0).to(tl.float32)
        if HAS_W:
            x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask,
                        other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            mean = 0.0
            if not IS_RMS:
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            row_max = 1.0
            if STABLE:
                row_max = tl.load(max_ptr + rows, mask=row_mask, other=1.0)[:, None]
            dw_acc += tl.sum(dy * _normalized(x, mean, rstd, row_max, IS_RMS, STABLE), axis=0)
        if HAS_B:
            db_acc += tl.sum(dy, axis=0)
    if HAS_W:
        tl.store(dw_part_ptr + group.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    if HAS_B:
        tl.store(db_part_ptr + group.to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)


@triton.jit
def _split_dx(x, wdy, mean, rstd, c1, c2, IS_RMS: tl.constexpr):
    return (wdy - _normalized(x, mean, rstd, 1.0, IS_RMS, False) * c1 - c2) * rstd


@triton.jit
def _split_write_rows(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, part_ptr, first, end, chunk,
                      n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr, chunks,
                      CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """dx of one chunk of rows first..end-1, whose sums are all published: re-read x and dy (from
    L2, where the batch's first pass left them), combine the row's sums in a fixed order, write."""
    cols, col_mask = chunk_columns(chunk, n_cols, CHUNK)
    for row in range(first, end):
        row64 = tl.cast(row, tl.int64)  # a plain int on the interpreter
        row_parts = part_ptr + BWD_PARTIALS * row * chunks
        c1 = tl.sum(partials(row_parts, chunks, BWD_PARTIALS, 0.0, CHUNKS_P2), axis=0) * inv_n_cols
        c2 = 0.0
        if not IS_RMS:
            c2 = tl.sum(partials(row_parts + 1, chunks, BWD_PARTIALS, 0.0, CHUNKS_P2), axis=0) * inv_n_cols
        mean, rstd = _saved_stats(mean_ptr, rstd_ptr, row, IS_RMS)
        x, wdy = _load_x_wdy(x_ptr + row64 * stride_xr, dy_ptr + row64 * stride_dyr, w_ptr, cols, col_mask,
                             stride_xc, stride_dyc, HAS_W)
        dx = _split_dx(x, wdy, mean, rstd, c1, c2, IS_RMS)
        tl.store(dx_ptr + row64 * stride_dxr + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "groups"])
def norm_bwd_split_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr,
    part_ptr, arrived_ptr, state_ptr,
    n_rows, n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr,
    groups, chunks, spin_limit,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, BATCH_ROWS: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, REREAD_W: tl.constexpr,
):
    """Long rows (not STABLE): program (group, chunk) walks batches of BATCH_ROWS rows (batches
    group, group + groups, ...) with the batch's other chunks' programs as siblings
    (fk_runtime.siblings). First pass over the batch: publish each row's sums of x-hat * w*dy and
    w*dy for this chunk, and add dy * x-hat and dy to the dweight / dbias partials (which need
    only the saved statistics). One wait for the whole batch, then a second pass writes dx,
    re-reading the batch's chunks from L2: HBM sees one read of x and dy and one write of dx,
    and the siblings meet once per batch instead of once per row. The partials are reduced in
    a fixed order."""
    pid = tl.program_id(0)
    group = pid // chunks
    chunk = pid - group * chunks
    cols, col_mask = chunk_columns(chunk, n_cols, CHUNK)
    w = 1.0
    if HAS_W and not REREAD_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((CHUNK,), tl.float32)
    db_acc = tl.zeros((CHUNK,), tl.float32)
    x_offs = cols.to(tl.int64) * stride_xc
    dy_offs = cols.to(tl.int64) * stride_dyc
    for first in range(group * BATCH_ROWS, n_rows, groups * BATCH_ROWS):
        end = tl.minimum(first + BATCH_ROWS, n_rows)
        for row in range(first, end):
            row64 = tl.cast(row, tl.int64)
            # Kept in L2 for the second pass.
            x = tl.load(x_ptr + row64 * stride_xr + x_offs, mask=col_mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            dy = tl.load(dy_ptr + row64 * stride_dyr + dy_offs, mask=col_mask, other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
            mean, rstd = _saved_stats(mean_ptr, rstd_ptr, row, IS_RMS)
            xhat = tl.where(col_mask, _normalized(x, mean, rstd, 1.0, IS_RMS, False), 0.0)
            wdy = dy * w
            if HAS_W and REREAD_W:  # read again each row (L1 holds it), not held through the loop
                wdy = dy * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            slot = row * chunks + chunk
            publish(part_ptr + BWD_PARTIALS * slot, tl.sum(xhat * wdy, axis=0))
            publish(part_ptr + BWD_PARTIALS * slot + 1, tl.sum(wdy, axis=0))
            if HAS_W:
                dw_acc += dy * xhat
            if HAS_B:
                db_acc += dy
        ready, last = await_row(arrived_ptr + first, state_ptr + first * chunks + chunk, chunks, spin_limit)
        if ready:
            _split_write_rows(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, part_ptr, first, end, chunk,
                              n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr,
                              chunks, CHUNK, CHUNKS_P2, IS_RMS, HAS_W)
        if last:
            won = claim_abandoned(state_ptr + first * chunks, chunk, chunks, CHUNKS_P2)
            if tl.max(won.to(tl.int32), axis=0) > 0:
                for other in range(chunks):
                    if lane(won, other, CHUNKS_P2):
                        _split_write_rows(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, part_ptr, first,
                                          end, other, n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr,
                                          stride_dyc, stride_dxr, chunks, CHUNK, CHUNKS_P2, IS_RMS, HAS_W)
    if HAS_W:
        tl.store(dw_part_ptr + group.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    if HAS_B:
        tl.store(db_part_ptr + group.to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)

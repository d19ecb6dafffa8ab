"""Triton kernels for LayerNorm and RMSNorm over the last dim: one idea each.

Means multiply by `inv_n_cols` (1/n computed on the host): the fp32 `/` Triton emits is an
approximate division, whose rounding LayerNorm's 1/sqrt(var + eps) would amplify.

Shared flags: IS_RMS (RMSNorm: no mean, no bias), STABLE (rows divided by their max first, the
seed's `stable`), HAS_W / HAS_B (affine parameters). Statistics are fp32; per row we keep
`mean` (LayerNorm), `rstd`, and `row_max` (STABLE) for the backward.
"""

import triton
import triton.language as tl


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, col_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    y = xhat
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def norm_fwd_fused_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, max_ptr,
    n_rows, n_cols, inv_n_cols, stride_xr, stride_xc, stride_yr, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SAVE_STATS: tl.constexpr,
):
    """Whole rows in registers (BLOCK_R of them): statistics, normalise, affine; one read and one
    write of the row, plus per-row statistics when autograd needs them."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    if STABLE:
        row_max = tl.max(tl.where(mask, x, -float("inf")), axis=1)
        x = x / row_max[:, None]
        if SAVE_STATS:
            tl.store(max_ptr + rows, row_max, mask=row_mask)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) * inv_n_cols + eps)
        xhat = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) * inv_n_cols
        centered = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) * inv_n_cols + eps)
        xhat = centered * rstd[:, None]
        if SAVE_STATS:
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
        acc_max = tl.full((1, BLOCK_D), -float("inf"), tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)[None, :]
            x = tl.load(x_row + cols * stride_xc, mask=cols < n_cols, other=-float("inf"))
            acc_max = tl.maximum(acc_max, x.to(tl.float32))
        row_max = tl.max(tl.max(acc_max, axis=1), axis=0)
        if SAVE_STATS:
            tl.store(max_ptr + row, row_max)
    mean = 0.0
    if not IS_RMS:
        acc = tl.zeros((1, BLOCK_D), tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)[None, :]
            acc += tl.load(x_row + cols * stride_xc, mask=cols < n_cols, other=0.0).to(tl.float32)
        mean = tl.sum(tl.sum(acc, axis=1), axis=0) / row_max * inv_n_cols
        if SAVE_STATS:
            tl.store(mean_ptr + row, mean)
    acc = tl.zeros((1, BLOCK_D), tl.float32)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)[None, :]
        mask = cols < n_cols
        x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32) / row_max
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(acc, axis=1), axis=0) * inv_n_cols + eps)
    if SAVE_STATS:
        tl.store(rstd_ptr + row, rstd)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        col_mask = cols < n_cols
        x = tl.load(x_row + cols[None, :] * stride_xc, mask=col_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32) / row_max
        y = _affine((x - mean) * rstd, w_ptr, b_ptr, cols, col_mask, HAS_W, HAS_B)
        tl.store(y_ptr + row.to(tl.int64) * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=col_mask[None, :])


@triton.jit
def _normalized(x, mean, rstd, row_max, IS_RMS: tl.constexpr, STABLE: tl.constexpr):
    """Recompute x-hat from the saved statistics (x is never saved normalised)."""
    if STABLE:
        x = x / row_max
    if IS_RMS:
        return x * rstd
    return (x - mean) * rstd


@triton.jit
def norm_bwd_fused_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, max_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, inv_n_cols, stride_xr, stride_xc, stride_dyr, stride_dyc, stride_dxr, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IS_RMS: tl.constexpr, STABLE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    """Rows that fit: program g walks its group of rows once, writing dx and summing
    dy * x-hat and dy into dweight / dbias partials for its group (reduced later in a fixed order).
    dx = rstd * (w*dy - x-hat * mean(x-hat * w*dy) - mean(w*dy)) (no mean term for RMSNorm),
    then through the division by the row max when STABLE."""
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) if HAS_W else 1.0
    # One row of accumulators, each step's rows summed into it: a row-shaped accumulator per
    # step's rows would double the registers that whole rows of 8192 features already fill.
    dw_acc = tl.zeros((BLOCK_D,), tl.float32)
    db_acc = tl.zeros((BLOCK_D,), tl.float32)
    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    for r0 in range(row_begin, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * stride_dyr + cols[None, :] * stride_dyc, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        row_max = 1.0
        row_max_1d = 1.0
        if STABLE:
            row_max_1d = tl.load(max_ptr + rows, mask=row_mask, other=1.0)
            row_max = row_max_1d[:, None]
        xhat = tl.where(mask, _normalized(x, mean, rstd[:, None], row_max, IS_RMS, STABLE), 0.0)
        wdy = dy * w
        c1 = tl.sum(xhat * wdy, axis=1) * inv_n_cols
        dz = wdy - xhat * c1[:, None]
        if not IS_RMS:
            dz -= (tl.sum(wdy, axis=1) * inv_n_cols)[:, None]
        dz = dz * rstd[:, None]
        if STABLE:
            # z = x / max(x): dx = dz / m, and the max's entries get -sum(dz * x) / m^2, shared
            # between ties as torch.amax's gradient shares it.
            dx = dz / row_max
            is_max = mask & (x == row_max)
            ties = tl.sum(is_max.to(tl.float32), axis=1)
            through_max = -tl.sum(tl.where(mask, dz * x, 0.0), axis=1) / (row_max_1d * row_max_1d)
            dx += tl.where(is_max, (through_max / ties)[:, None], 0.0)
        else:
            dx = dz
        tl.store(dx_ptr + rows64 * stride_dxr + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_B:
            db_acc += tl.sum(dy, axis=0)
    if HAS_W:
        tl.store(dw_part_ptr + group.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    if HAS_B:
        tl.store(db_part_ptr + group.to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)


@triton.jit
def _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W: tl.constexpr):
    """One chunk of a row's x and w * dy, in fp32."""
    x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    wdy = tl.load(dy_row + cols * stride_dyc, mask=mask, other=0.0).to(tl.float32)
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
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)
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
            acc2 += (mask & (x == row_max)).to(tl.float32)
        through_max = -tl.sum(tl.sum(acc1, axis=1), axis=0) / (row_max * row_max)
        ties = tl.sum(tl.sum(acc2, axis=1), axis=0)
    for c0 in range(0, n_cols, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)[None, :]
        mask = cols < n_cols
        x, wdy = _load_x_wdy(x_row, dy_row, w_ptr, cols, mask, stride_xc, stride_dyc, HAS_W)
        xhat = _normalized(x, mean, rstd, row_max, IS_RMS, STABLE)
        dx = (wdy - xhat * c1 - c2) * rstd
        if STABLE:
            dx = dx / row_max + tl.where(x == row_max, through_max / ties, 0.0)
        tl.store(dx_ptr + row.to(tl.int64) * stride_dxr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
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
        dy = tl.load(dy_ptr + rows64 * stride_dyr + cols[None, :] * stride_dyc, mask=mask,
                     other=0.0).to(tl.float32)
        if HAS_W:
            x = tl.load(x_ptr + rows64 * stride_xr + cols[None, :] * stride_xc, mask=mask,
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

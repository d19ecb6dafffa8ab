"""Triton kernels for y = x @ w over the last dim: one idea each, read top to bottom."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows", "split_span"])
def weighted_sum_fwd_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, n_cols,
    stride_xr, stride_xd, stride_w, stride_out_split,
    split_span,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[split, r] = sum over this split's D range of x[r, d] * w[d].

    Program (i, j) owns row tile i and D split j. The product accumulates in a 2-D fp32 tile and
    is reduced over D once at the end, so the loop body is loads and FMAs only. With one split,
    `out` is y itself; with several, fp32 partials that the launcher sums.
    """
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    d_begin = split * split_span
    d_end = tl.minimum(d_begin + split_span, n_cols)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for d0 in range(d_begin, d_end, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        # Splits cover whole tiles, so only the last tile is partial. Masking against n_cols
        # (not d_end) keeps the mask's 16-element constancy visible: vector loads.
        col_mask = cols < n_cols
        # x is read exactly once: evict it first so it does not push w out of the cache.
        x = tl.load(x_rows + cols.to(tl.int64)[None, :] * stride_xd,
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        w = tl.load(w_ptr + cols.to(tl.int64) * stride_w, mask=col_mask, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    out = out_ptr + split.to(tl.int64) * stride_out_split + rows
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "rows_per_group"])
def weighted_sum_bwd_kernel(
    x_ptr, w_ptr, grad_y_ptr, grad_x_ptr, partial_grad_w_ptr,
    n_rows, n_cols,
    stride_xr, stride_xd, stride_w, stride_gy, stride_gxr,
    rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
):
    """One pass over x: grad_x = grad_y[:, None] * w, and per-group partial grad_w (NEED_DX / NEED_DW:
    only the gradients autograd asks for; without grad_w, x is not read).

    Program (g, j) walks the rows of group g in D tile j: it writes grad_x for them and sums
    x * grad_y over those rows into partial_grad_w[g, tile j]. The launcher reduces the groups in
    a fixed order, so grad_w has the same bits every run. The running sum is one D-tile vector
    (each step's tile reduced over its rows): a row-shaped accumulator would double the tile's
    registers and spill.
    """
    group = tl.program_id(0)
    d_tile = tl.program_id(1)
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols.to(tl.int64) * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows  # groups cover whole row tiles
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        gy = tl.load(grad_y_ptr + rows.to(tl.int64) * stride_gy, mask=row_mask, other=0.0).to(tl.float32)
        if NEED_DW:
            x = tl.load(x_ptr + rows64 * stride_xr + cols.to(tl.int64)[None, :] * stride_xd, mask=mask, other=0.0,
                        eviction_policy="evict_first")
            acc += tl.sum(x.to(tl.float32) * gy[:, None], axis=0)
        if NEED_DX:
            gx = gy[:, None] * w[None, :]
            tl.store(grad_x_ptr + rows64 * stride_gxr + cols[None, :],
                     gx.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(partial_grad_w_ptr + group.to(tl.int64) * n_cols + cols, acc, mask=col_mask)

"""fk-layernorm's plan, top to bottom: its numbers, the path and tiles of a shape, and the launch
code that binds them once per (shape, strides, dtypes, device, flags). LayerNorm and RMSNorm
share it.

Three paths (`fk_runtime.siblings.RowPath`), by row length:
- fused: rows that fit `sizing.fused_row_block` (backward: up to BACKWARD_FUSED_MAX_ELEMENTS, or
  BACKWARD_FUSED_MAX_ELEMENTS_RMS_16BIT for RMSNorm in 16 bits) are
  held whole in registers: several rows per program in the forward, and a persistent backward
  where each program walks a group of rows (16-bit rows to 8192 features: the next step's rows
  loaded ahead; wider 16-bit rows: x and dy widened again after the row sums) and keeps its
  dweight / dbias partial sums in registers;
- split: longer rows are cut into chunks whose programs meet as siblings (fk_runtime.siblings):
  one read and one write of HBM per tensor. The backward's programs are persistent over a group
  of rows, keeping dweight / dbias partials of their chunk in registers, and meet once per
  batch of rows (dx is written from a second read of the batch, which L2 still holds);
- long, looped: rows with more chunks than `siblings.max_siblings()` allows, and the STABLE
  backward of long rows: one program per row walks it in chunks (re-reading it from L2), dweight / dbias
  from a column-tiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from fk_runtime import alloc, backend, checks, partials, siblings, sizing, views
from fk_runtime.launch import PLAN_CACHE_SIZE, Launch, PlanCache, layout_key
from fk_runtime.siblings import RowPath as Path
from fk_runtime.siblings import PROGRAM_WARPS, max_siblings, spin_limit

from . import kernels

# Forward, short rows: a program takes whole rows until it holds about this many bytes of input,
# on `sizing.row_warps` warps. 8 KB: 32 KB tiles fell behind on bf16 rows of an H100 (TUNING.md).
FORWARD_ROW_TILE_BYTES = 8192
# ... except RMSNorm in 16 bits on rows padded to this many features (8193 to 16384), which takes
# the warps of a row twice as long (32, not 16): +8-21% there on an H100 (TUNING.md).
FORWARD_RMS_16BIT_WIDE_ROW = 16384
# The fused forward drops its column mask where a row is exactly its block wide (`Plan.even_cols`):
# no predicate per load then, which 3.8's compiler packed into a bitfield before its first load
# (4096x16384 fp32 on 3.8: 1.06x -> 1.00-1.02x 3.6's time; wide 16-bit rows 1-7% faster on 3.6-3.9).
# fp32 rows of this width keep the mask: 1.2-2.2% faster so on 3.6 and 3.8 (TUNING.md).
FORWARD_MASKED_32BIT_ROW = 8192
# Backward: rows held whole up to this many features; 16384 spilled at any warps (TUNING.md).
BACKWARD_FUSED_MAX_ELEMENTS = 8192
# RMSNorm in 16 bits holds fewer fp32 values per feature (no mean, no bias sum): rows of up to
# this many features still fit one 16-warp program: it beat split on every shape (TUNING.md).
BACKWARD_FUSED_MAX_ELEMENTS_RMS_16BIT = 16384
# Backward, short rows: rows per loop step, as bytes of one input tile, and row groups per
# multiprocessor: as many as fill BACKWARD_WARPS_PER_SM warps, each group on the warps of one row
# (`sizing.row_warps`: 4 up to 2048 features, 8 at 4096, 16 at 8192). 16-bit rows of up to
# BACKWARD_SHORT_16BIT_MAX_ELEMENTS features take half the groups (two 4-warp groups per
# multiprocessor, each step 4 rows of 1024 features or 32 of 128).
# These: best or within 4% of it on every H100 row tried (TUNING.md).
BACKWARD_ROW_TILE_BYTES = 8192
BACKWARD_WARPS_PER_SM = 16
BACKWARD_SHORT_16BIT_MAX_ELEMENTS = 2048
BACKWARD_SHORT_16BIT_WARPS_PER_SM = 8
# One stage: the loop's loads gain nothing from pipelining (1 and 2 stages tied).
BACKWARD_NUM_STAGES = 1
# 16-bit rows of up to BACKWARD_PREFETCH_MAX_ELEMENTS features: the fused backward loads the
# next step's rows before working on this step's (two steps of loads in flight per program).
# +3-9% in bf16 on an H100; fp32 did not gain and wider bf16 rows spilled (TUNING.md).
BACKWARD_PREFETCH_MAX_ELEMENTS = 8192
# Wider 16-bit rows (fused: RMSNorm's 8193-16384 features) take no prefetch; a step widens its x
# and dy again after the row sums instead of holding fp32 copies across them (`recompute`).
# Only these rows: there it is faster, elsewhere it cost up to 5% (TUNING.md).
# The dweight / dbias partial buffers (fp32, groups x features, one per parameter present) stay
# under this many bytes together (sized for both).
PARTIAL_BYTES_BUDGET = 32 << 20
# Element size of the fp16 / bf16 inputs (and narrower) that the 16-bit rules above apply to.
SIXTEEN_BIT_ITEMSIZE = 2
# Long rows: chunk walked per loop step, and the column tile of the parameter-gradient kernel.
LOOPED_CHUNK_BYTES = 16384
PARAMS_TILE_BYTES = 16384
PARAMS_MAX_BLOCK_D = 512
# Split rows: each program's chunk, on the sibling protocol's PROGRAM_WARPS warps. The forward
# holds its chunk in the input's dtype through the wait (bf16 widened after it by a shift,
# `siblings.widen_held`). These sizes beat half-size chunks on every H100 row (TUNING.md).
SPLIT_FORWARD_CHUNK_BYTES = 16384
SPLIT_BACKWARD_CHUNK_ELEMENTS = 4096
# Backward: a split program takes a batch of rows per meeting with its siblings, this many bytes
# of each input (x, dy) in all: it reads the batch's chunks once for the row sums and once more,
# from L2, to write dx. LayerNorm gained most on the longest rows, RMSNorm tied (TUNING.md).
SPLIT_BACKWARD_BATCH_BYTES = 32768
# fp32 rows: the split backward reads its weight chunk again for each row instead of holding it
# through the loop: 4-warp chunks then fit 255 registers (held, 24-48 B spilled on Triton 3.8 / 3.9),
# 3-6% faster on 3.6 too; 16-bit rows (no spill) held it 1-2% faster (TUNING.md).
SPLIT_BACKWARD_REREAD_W_32BIT = True

# Numbers that differ by Triton release, where a newer compiler's build of a kernel ran slower than
# 3.6's on an H100 (each measured beside 3.6 in one run; TUNING.md, "Triton releases"):
# - from 3.9, the 16-bit fused forward of these (RMSNorm, padded row) launches is capped at the
#   registers 3.6 and 3.8 take on their own (maxnreg): 3.9 took 72-77, one program less per
#   multiprocessor, 1.14x 3.6's time (32768x1024 on an H100); a cap on other rows raises their count
#   (ptxas spends what it may: LayerNorm's 4096 and 8192 rows 40 -> 47, 1.29x the time of 8192x8192
#   on 3.6). The 16384-feature rows need none since they drop their column mask;
FORWARD_16BIT_REGISTER_CAPS = {(False, 512): 64, (False, 1024): 64}
FORWARD_16BIT_REGISTER_CAPS_FROM = (3, 9)
# - from 3.9, RMSNorm's 16-bit split forward on rows longer than this takes 32 KB chunks, not 16
#   (256x262144: 1.07x -> 1.00x; 3.6 and 3.8 lose 1%); shorter split rows were not tried so;
SPLIT_FORWARD_RMS_16BIT_LONG_ROW = 131072
SPLIT_FORWARD_RMS_16BIT_LONG_CHUNK_BYTES = 32768
SPLIT_FORWARD_RMS_16BIT_LONG_FROM = (3, 9)
# - on 3.8 alone, LayerNorm's fused backward of 16-bit rows up to BACKWARD_SHORT_16BIT_MAX_ELEMENTS
#   takes 4 KB steps and 16 warps per multiprocessor (32768x1024: 1.08x -> 1.04x; 3.6 loses 3%;
#   RMSNorm's, at 1.02x, was not tried so); these rows and the 16-bit fused backward rows that
#   recompute (RMSNorm's 8193-16384 features) read the weight again each step instead of holding
#   it: 3.8's ptxas issued the last of a row's loads after the row's first math (on an H200,
#   4096x16384: 1.18x 3.6's time -> 1.00x, 3.9 2% slower with it, 3.6 unchanged; 32768x1024:
#   1.07x -> 1.01x, 3.6 and 3.9 8% and 2% slower with it); RMSNorm's fp32 fused forward on
#   rows padded to 8192 features is capped at 3.6's 56 registers: 3.8's ptxas took 40 with 8 B
#   spilled and a third program per multiprocessor (8192x8192 on an H200: 1.045x 3.6's time ->
#   1.01x; 3.6 and 3.9 not helped).
TRITON_3_8 = (3, 8)
FORWARD_32BIT_REGISTER_CAPS_3_8 = {(True, 8192): 56}
BACKWARD_SHORT_16BIT_ROW_TILE_BYTES_3_8 = 4096
BACKWARD_SHORT_16BIT_WARPS_PER_SM_3_8 = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    path: Path
    block_rows: int
    block_cols: int  # the padded row (fused) or one chunk (split, looped)
    num_warps: int
    groups: int = 1  # backward: row groups (partial rows of dweight / dbias)
    rows_per_group: int = 0
    chunks: int = 1  # split: chunks per row, and that rounded up to a power of two
    chunks_p2: int = 1
    spin_limit: int = 0
    batch_rows: int = 1  # split backward: rows per meeting of the siblings
    col_tiles: int = 1  # backward, long rows: column tiles of the parameter kernel
    params_block_rows: int = 1
    params_block_cols: int = 1
    params_num_warps: int = sizing.MIN_WARPS
    prefetch: bool = False  # fused backward: next step's rows loaded ahead
    recompute: bool = False  # fused backward: 16-bit x, dy widened again after the row sums
    reread_w: bool = False  # backward: the weight read again each row (split; fused on some rows)
    max_registers: int | None = None  # forward: a cap on each thread's registers (maxnreg)
    even_cols: bool = False  # fused forward: rows exactly block_cols wide, no column mask


def _is_16bit(dtype: torch.dtype) -> bool:
    """fp16 / bf16: the inputs for which the 16-bit rules of this table hold."""
    return sizing.element_size(dtype) <= SIXTEEN_BIT_ITEMSIZE


def _groups(n_rows: int, n_cols: int, block_rows: int, programs_per_sm: int) -> tuple[int, int]:
    row_tiles = sizing.cdiv(n_rows, block_rows)
    by_memory = max(1, PARTIAL_BYTES_BUDGET // (2 * 4 * max(n_cols, 1)))
    wanted = backend.multiprocessor_count() * programs_per_sm
    groups = max(1, min(row_tiles, wanted, by_memory))
    rows_per_group = sizing.cdiv(row_tiles, groups) * block_rows
    return sizing.cdiv(n_rows, rows_per_group), rows_per_group


def _split_chunks(n_cols: int, chunk: int) -> int | None:
    chunks = sizing.cdiv(n_cols, chunk)
    return chunks if chunks <= max_siblings() else None


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def forward_plan(n_rows: int, n_cols: int, dtype: torch.dtype, is_rms: bool = False) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None:
        rows = sizing.rows_per_program(n_rows, block, dtype, FORWARD_ROW_TILE_BYTES)
        elements = rows * block
        if is_rms and _is_16bit(dtype) and elements == FORWARD_RMS_16BIT_WIDE_ROW:
            elements *= 2
        warps = sizing.row_warps(elements)
        even = n_cols == block and (_is_16bit(dtype) or block != FORWARD_MASKED_32BIT_ROW)
        cap = None
        if _is_16bit(dtype):
            if backend.triton_at_least(FORWARD_16BIT_REGISTER_CAPS_FROM):
                cap = FORWARD_16BIT_REGISTER_CAPS.get((is_rms, block))
        elif backend.triton_release() == TRITON_3_8:
            cap = FORWARD_32BIT_REGISTER_CAPS_3_8.get((is_rms, block))
        return Plan(Path.FUSED, rows, block, warps, max_registers=cap, even_cols=even)
    chunk_bytes = SPLIT_FORWARD_CHUNK_BYTES
    if (is_rms and _is_16bit(dtype) and n_cols > SPLIT_FORWARD_RMS_16BIT_LONG_ROW
            and backend.triton_at_least(SPLIT_FORWARD_RMS_16BIT_LONG_FROM)):
        chunk_bytes = SPLIT_FORWARD_RMS_16BIT_LONG_CHUNK_BYTES
    chunk = chunk_bytes // sizing.element_size(dtype)
    chunks = _split_chunks(n_cols, chunk)
    if chunks is not None:
        return Plan(Path.SPLIT, 1, chunk, PROGRAM_WARPS, chunks=chunks,
                    chunks_p2=sizing.next_power_of_2(chunks), spin_limit=spin_limit())
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    return Plan(Path.LONG, 1, chunk, sizing.num_warps_for(chunk))


def _backward_fused_max(dtype: torch.dtype, is_rms: bool) -> int:
    if is_rms and _is_16bit(dtype):
        return BACKWARD_FUSED_MAX_ELEMENTS_RMS_16BIT
    return BACKWARD_FUSED_MAX_ELEMENTS


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype, stable: bool = False,
                  is_rms: bool = False) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None and block <= _backward_fused_max(dtype, is_rms):
        narrow = _is_16bit(dtype)
        short = narrow and block <= BACKWARD_SHORT_16BIT_MAX_ELEMENTS
        on_3_8 = backend.triton_release() == TRITON_3_8
        short_ln_3_8 = short and on_3_8 and not is_rms
        tile_bytes = BACKWARD_SHORT_16BIT_ROW_TILE_BYTES_3_8 if short_ln_3_8 else BACKWARD_ROW_TILE_BYTES
        warps_per_sm = BACKWARD_WARPS_PER_SM
        if short:
            warps_per_sm = BACKWARD_SHORT_16BIT_WARPS_PER_SM_3_8 if short_ln_3_8 else BACKWARD_SHORT_16BIT_WARPS_PER_SM
        warps = sizing.row_warps(block)
        rows = sizing.rows_per_program(n_rows, block, dtype, tile_bytes)
        groups, per_group = _groups(n_rows, n_cols, rows, max(1, warps_per_sm // warps))
        prefetch = narrow and block <= BACKWARD_PREFETCH_MAX_ELEMENTS
        recompute = narrow and not prefetch
        return Plan(Path.FUSED, rows, block, warps, groups, per_group, prefetch=prefetch,
                    recompute=recompute, reread_w=on_3_8 and (recompute or short_ln_3_8))
    chunks = None if stable else _split_chunks(n_cols, SPLIT_BACKWARD_CHUNK_ELEMENTS)
    if chunks is not None:
        # Every program of the launch is a sibling of the others in its group: all must be
        # resident together, so the groups share max_siblings() programs.
        chunk_bytes = SPLIT_BACKWARD_CHUNK_ELEMENTS * sizing.element_size(dtype)
        batch_rows = max(1, SPLIT_BACKWARD_BATCH_BYTES // chunk_bytes)
        batches = sizing.cdiv(n_rows, batch_rows)
        groups = max(1, min(batches, max_siblings() // chunks))
        return Plan(Path.SPLIT, 1, SPLIT_BACKWARD_CHUNK_ELEMENTS, PROGRAM_WARPS, groups,
                    chunks=chunks, chunks_p2=sizing.next_power_of_2(chunks), spin_limit=spin_limit(),
                    batch_rows=batch_rows, reread_w=SPLIT_BACKWARD_REREAD_W_32BIT and not _is_16bit(dtype))
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    tile = sizing.tile_2d(n_rows, n_cols, dtype, PARAMS_TILE_BYTES, PARAMS_MAX_BLOCK_D)
    col_tiles = sizing.cdiv(n_cols, tile.block_cols)
    groups, per_group = _groups(n_rows, n_cols, tile.block_rows, 1)
    return Plan(Path.LONG, 1, chunk, sizing.num_warps_for(chunk), groups, per_group,
                col_tiles=col_tiles, params_block_rows=tile.block_rows,
                params_block_cols=tile.block_cols, params_num_warps=tile.num_warps)


# ---- launch: a plan bound once per (shape, strides, dtypes, device, flags) ------------------------

BOUND = PlanCache()


def _flags(has_w: bool, has_b: bool, is_rms: bool, stable: bool) -> dict:
    return dict(IS_RMS=is_rms, STABLE=stable, HAS_W=has_w, HAS_B=has_b)


def stats_shape(n_rows: int, is_rms: bool, stable: bool, save: bool) -> tuple[int, int]:
    """Per-row statistics the backward reads, fp32: rstd, then the mean (LayerNorm), then the row
    max (`stable`); no rows when nothing is saved."""
    return 1 + (not is_rms) + stable, n_rows if save else 0


def _stat_rows(stats: torch.Tensor, is_rms: bool, stable: bool) -> tuple:
    """(mean, rstd, row max) rows of `stats` for the kernels' three pointers; an absent one gets
    the rstd row, which the kernels then never touch through it (IS_RMS, STABLE)."""
    rstd = stats[0]
    return (rstd if is_rms else stats[1]), rstd, (stats[-1] if stable else rstd)


def check_inputs(x, weight, bias, eps) -> None:
    """What the kernels take: x (..., D) of a float dtype, weight and bias (D,) or None of one dtype,
    all on one device, eps >= 0. The public calls check before launching; the binds check again,
    once per plan, for callers of the registered ops (`torch.ops.fk.norm`)."""
    checks.check_tensor("x", x, min_dim=1)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            checks.check_tensor(name, p, min_dim=1, max_dim=1)
            if p.shape[0] != x.shape[-1]:
                raise ValueError(
                    f"{name} must have x's last dim ({x.shape[-1]}) elements, got shape {tuple(p.shape)}"
                )
    checks.check_same_device(x=x, weight=weight, bias=bias)
    checks.check_same_dtype(weight=weight, bias=bias)
    checks.check_nonnegative("eps", eps)  # torch's norms take 0 (a constant row then gives NaN, as theirs)


def _check_backward(grad_y, x, weight, bias, stats, is_rms: bool, stable: bool) -> None:
    """The backward's inputs as the forward made them (registered-op callers: once per plan)."""
    check_inputs(x, weight, bias, 0.0)
    checks.check_tensor("grad_y", grad_y)
    if grad_y.shape != x.shape:
        raise ValueError(f"grad_y must have x's shape {tuple(x.shape)}, got {tuple(grad_y.shape)}")
    checks.check_tensor("stats", stats, dtypes=(torch.float32,))
    n_rows = math.prod(x.shape[:-1])
    if tuple(stats.shape) != stats_shape(n_rows, is_rms, stable, True):
        raise ValueError(f"stats must have shape {stats_shape(n_rows, is_rms, stable, True)} (the forward's "
                         f"statistics), got {tuple(stats.shape)}")


def _bind_forward(x, w, b, eps: float, is_rms: bool, stable: bool, save_stats: bool, y_only: bool = False):
    """The forward of one key: run(x, w, b) -> (y, stats), or y alone (`y_only`, nothing saved);
    w, b contiguous (x's rows stand in for an absent one: no load reaches it)."""
    check_inputs(x, w, b, eps)  # one device; weight and bias of one dtype
    for name, t in (("x", x), ("weight", w), ("bias", b)):
        if t is not None:
            checks.check_kernel_device(name, t)
    has_w, has_b = w is not None, b is not None
    shape, dtype, device = x.shape, x.dtype, x.device
    x2 = views.rows(x)
    is_view = views.in_place(x2, x)
    n_rows, n_cols = x2.shape
    stats_size = stats_shape(n_rows, is_rms, stable, save_stats)
    fp32 = torch.empty(0, dtype=torch.float32, device=device)

    def new_stats():
        return fp32.new_empty(stats_size)

    # Nothing saved: the kernels' statistics pointers are rows of one empty tensor, made here.
    unsaved = None if save_stats else _stat_rows(new_stats(), is_rms, stable)

    def stat_rows(stats):
        return unsaved or _stat_rows(stats, is_rms, stable)

    if y_only and x.numel() == 0:
        return lambda x, w, b: alloc.empty(shape, dtype=dtype, device=device)
    if x.numel() == 0:  # rows of no columns: statistics 0, defined (the backward gives zeros anyway)
        return lambda x, w, b: (alloc.empty(shape, dtype=dtype, device=device), new_stats().zero_())
    p = forward_plan(n_rows, n_cols, dtype, is_rms)
    meta = dict(**_flags(has_w, has_b, is_rms, stable), SAVE_STATS=save_stats,
                **sizing.launch_options(p.num_warps, max_registers=p.max_registers))
    strides = (x2.stride(0), x2.stride(1), n_cols)
    if p.path is Path.FUSED:
        fused = Launch(kernels.norm_fwd_fused_kernel, (sizing.cdiv(n_rows, p.block_rows),),
                       (n_rows, n_cols, 1.0 / n_cols, *strides, eps),
                       dict(BLOCK_R=p.block_rows, BLOCK_D=p.block_cols, EVEN_D=p.even_cols, **meta),
                       device)

        def launch(x2, w, b, y2, stats):
            fused(x2, w, b, y2, *stat_rows(stats))
    elif p.path is Path.SPLIT:
        split = Launch(kernels.norm_fwd_split_kernel, (n_rows * p.chunks,),
                       (n_cols, 1.0 / n_cols, *strides, eps, p.chunks, p.spin_limit),
                       dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, **meta), device)

        def launch(x2, w, b, y2, stats):
            arrived, states, parts = siblings.scratch(n_rows, p.chunks, kernels.FWD_PARTIALS.value, device)
            mean, rstd, row_max = stat_rows(stats)
            if is_rms and save_stats:  # the split kernel saves a mean for RMSNorm too, unread
                mean = fp32.new_empty(n_rows)
            split(x2, w, b, y2, mean, rstd, row_max, parts, arrived, states)
    else:
        looped = Launch(kernels.norm_fwd_looped_kernel, (n_rows,), (n_cols, 1.0 / n_cols, *strides, eps),
                        dict(BLOCK_D=p.block_cols, **meta), device)

        def launch(x2, w, b, y2, stats):
            looped(x2, w, b, y2, *stat_rows(stats))

    def run(x, w, b):
        y = alloc.new_empty(x, shape)
        stats = new_stats()
        x2 = x if is_view else views.rows(x)
        launch(x2, x2 if w is None else w, x2 if b is None else b, y, stats)
        return y, stats

    def run_y(x, w, b):
        y = alloc.new_empty(x, shape)
        x2 = x if is_view else views.rows(x)
        launch(x2, x2 if w is None else w, x2 if b is None else b, y, None)
        return y

    return run_y if y_only else run


def _absent(x: torch.Tensor) -> torch.Tensor:
    """Placeholder gradient for a parameter that is None (a custom op returns tensors only; each
    placeholder is its own tensor, since outputs may not alias)."""
    return x.new_empty(0)


def _bind_backward(grad_y, x, w_dtype, b_dtype, is_rms: bool, stable: bool):
    """The backward of one key: run(grad_y, x, w, stats) -> (grad_x, grad_w, grad_b)."""
    checks.check_kernel_device("x", x)
    checks.check_same_device(grad_y=grad_y, x=x)
    checks.check_same_dtype(grad_y=grad_y, x=x)
    shape, dtype, device = x.shape, x.dtype, x.device
    has_w, has_b = w_dtype is not None, b_dtype is not None
    x2, dy2 = views.rows(x), views.rows(grad_y)
    x_view, dy_view = views.in_place(x2, x), views.in_place(dy2, grad_y)
    n_rows, n_cols = x2.shape
    if x.numel() == 0:
        def empty(grad_y, x, w, stats):
            zeros = [torch.zeros(n_cols, dtype=d, device=device) if d is not None else _absent(x)
                     for d in (w_dtype, b_dtype)]
            return alloc.empty(shape, dtype=dtype, device=device), zeros[0], zeros[1]
        return empty
    p = backward_plan(n_rows, n_cols, dtype, stable, is_rms)
    flags = _flags(has_w, has_b, is_rms, stable)
    strides = (x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1), n_cols)
    n_params = has_w + has_b
    param_dtypes = tuple(d for d in (w_dtype, b_dtype) if d is not None)
    if p.path is Path.SPLIT:
        split = Launch(kernels.norm_bwd_split_kernel, (p.groups * p.chunks,),
                       (n_rows, n_cols, 1.0 / n_cols, *strides, p.groups, p.chunks, p.spin_limit),
                       dict(CHUNK=p.block_cols, CHUNKS_P2=p.chunks_p2, BATCH_ROWS=p.batch_rows,
                            IS_RMS=is_rms, HAS_W=has_w, HAS_B=has_b, REREAD_W=p.reread_w,
                            **sizing.launch_options(p.num_warps)),
                       device)

        def launch(x2, w, dy2, dx2, stats, w_parts, b_parts):
            arrived, states, sums = siblings.scratch(n_rows, p.chunks, kernels.BWD_PARTIALS.value, device)
            mean, rstd, _ = _stat_rows(stats, is_rms, stable)
            split(x2, w, dy2, dx2, mean, rstd, w_parts, b_parts, sums, arrived, states)
    elif p.path is Path.FUSED:
        fused = Launch(kernels.norm_bwd_fused_kernel, (p.groups,),
                       (n_rows, n_cols, 1.0 / n_cols, *strides, p.rows_per_group),
                       dict(BLOCK_R=p.block_rows, BLOCK_D=p.block_cols, PREFETCH=p.prefetch,
                            RECOMPUTE=p.recompute, REREAD_W=p.reread_w, **flags,
                            **sizing.launch_options(p.num_warps, BACKWARD_NUM_STAGES)), device)

        def launch(x2, w, dy2, dx2, stats, w_parts, b_parts):
            fused(x2, w, dy2, dx2, *_stat_rows(stats, is_rms, stable), w_parts, b_parts)
    else:
        looped = Launch(kernels.norm_bwd_looped_dx_kernel, (n_rows,), (n_cols, 1.0 / n_cols, *strides),
                        dict(BLOCK_D=p.block_cols, IS_RMS=is_rms, STABLE=stable, HAS_W=has_w,
                             **sizing.launch_options(p.num_warps)), device)
        params = Launch(kernels.norm_bwd_params_kernel, (p.groups, p.col_tiles),
                        (n_rows, n_cols, *strides[:4], p.rows_per_group),
                        dict(BLOCK_R=p.params_block_rows, BLOCK_D=p.params_block_cols, **flags,
                             **sizing.launch_options(p.params_num_warps)), device)

        def launch(x2, w, dy2, dx2, stats, w_parts, b_parts):
            rows = _stat_rows(stats, is_rms, stable)
            looped(x2, w, dy2, dx2, *rows)
            if n_params:
                params(x2, dy2, *rows, w_parts, b_parts)
    sum_parts = partials.bind_sum_rows(n_params, p.groups, n_cols, param_dtypes, device) if n_params else None

    def run(grad_y, x, w, stats):
        grad_x = alloc.new_empty(x, shape)
        x2 = x if x_view else views.rows(x)
        dy2 = grad_y if dy_view else views.rows(grad_y)
        # fp32 partial sums (groups x features) for the parameters there are; an absent one's
        # kernel argument is a stand-in fp32 tensor that no store reaches (HAS_W, HAS_B).
        parts = stats.new_empty((n_params, p.groups, n_cols)) if n_params else stats
        w_parts = parts[0] if has_w else stats
        b_parts = parts[n_params - 1] if has_b else stats
        launch(x2, x2 if w is None else w, dy2, grad_x, stats, w_parts, b_parts)
        if not n_params:
            return grad_x, _absent(x), _absent(x)
        # Group partials reduced in a fixed order: the same bits every run.
        sums = sum_parts(parts)
        return grad_x, sums[0] if has_w else _absent(x), sums[-1] if has_b else _absent(x)

    return run


def forward(x, weight, bias, eps: float, is_rms: bool, stable: bool, save_stats: bool):
    """(y, stats): y like x (contiguous), stats as `stats_shape` gives them."""
    w = weight.contiguous() if weight is not None else None  # the kernels read contiguous vectors
    b = bias.contiguous() if bias is not None else None
    return bound_forward(x, w, b, eps, is_rms, stable, save_stats)(x, w, b)


def bound_forward(x, w, b, eps: float, is_rms: bool, stable: bool, save_stats: bool, y_only: bool = False):
    """run(x, w, b) -> (y, stats), or y alone (`y_only`: nothing saved), for these inputs'
    layouts, w and b contiguous (or None)."""
    key = (*layout_key(x, w, b), eps, is_rms, stable, save_stats, y_only)
    return BOUND.get(key) or BOUND.get_or_build(
        key, lambda: _bind_forward(x, w, b, eps, is_rms, stable, save_stats, y_only))


def backward(grad_y, x, weight, bias, stats, is_rms: bool, stable: bool):
    """(grad_x, grad_weight, grad_bias); an absent parameter's gradient is an empty tensor."""
    w = weight.contiguous() if weight is not None else None
    stats = stats.contiguous()  # read as rows (a saved-tensor hook may hand back other strides)
    w_dtype = None if weight is None else weight.dtype
    b_dtype = None if bias is None else bias.dtype
    key = (*layout_key(x, grad_y, weight, bias, stats), is_rms, stable, "backward")

    def build():
        _check_backward(grad_y, x, weight, bias, stats, is_rms, stable)
        return _bind_backward(grad_y, x, w_dtype, b_dtype, is_rms, stable)

    run = BOUND.get(key) or BOUND.get_or_build(key, build)
    return run(grad_y, x, w, stats)

"""Launch table for fk-layernorm (LayerNorm and RMSNorm share it).

Three paths, by row length:
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
- looped: rows with more chunks than `siblings.max_siblings()` allows, and the STABLE backward
  of long rows: one program per row walks it in chunks (re-reading it from L2), dweight / dbias
  from a column-tiled kernel.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from .. import backend, sizing
from ..siblings import max_siblings, spin_limit

# Forward, short rows: a program takes whole rows until it holds about this many bytes of input,
# on `sizing.row_warps` warps. H100 sweep of 2026-11-22 (1024-16384 features, bf16 and fp32, 1-8
# rows on 4-32 warps): 8 KB tiles reached 2590-2900 GB/s; the 32 KB tiles of before fell to
# 1800 GB/s (bf16, 1024 features) and 2060 (bf16, 16384 features on 32 warps).
FORWARD_ROW_TILE_BYTES = 8192
# ... except RMSNorm in 16 bits on rows padded to this many features (8193 to 16384), which takes
# the warps of a row twice as long (32, not 16). H100, 2026-11-24, graph replays, bf16: 4096x16384
# 2558 -> 2774 GB/s, 8192x12288 2352 -> 2836, 2048x16384 2321 -> 2581 (Liger: 2811, 2881, 2626);
# LayerNorm there fell on 32 warps (2721 -> 2131 at 4096x16384), RMSNorm fp32 and 8192-feature
# rows did not gain.
FORWARD_RMS_16BIT_WIDE_ROW = 16384
# Backward: rows are held whole up to this many features. Same sweep: 8192 features (one row on
# 16 warps) ran at 2390 GB/s bf16 and 2740 fp32; 16384 spilled at any warp count (330 GB/s), so
# longer rows take the chunked kernels.
BACKWARD_FUSED_MAX_ELEMENTS = 8192
# RMSNorm in 16 bits holds fewer fp32 values per feature (no mean, no bias sum): rows of up to
# this many features still fit one 16-warp program. H100, 2026-11-23, backward as CUDA graph
# replays: RMSNorm bf16/fp16 fused beat split at every shape tried (4096-16384 rows x 12288 and
# 16384 features: 1886-2183 GB/s against 1826-1975); fused LayerNorm (192 GB/s bf16, 369 fp32)
# and RMSNorm fp32 (536; 2144 on 32 warps, against 2339 split) spill at 16384.
BACKWARD_FUSED_MAX_ELEMENTS_RMS_16BIT = 16384
# Backward, short rows: rows per loop step, as bytes of one input tile, and row groups per
# multiprocessor: as many as fill BACKWARD_WARPS_PER_SM warps, each group on the warps of one row
# (`sizing.row_warps`: 4 up to 2048 features, 8 at 4096, 16 at 8192). 16-bit rows of up to
# BACKWARD_SHORT_16BIT_MAX_ELEMENTS features take half the groups (two 4-warp groups per
# multiprocessor, each step 4 rows of 1024 features or 32 of 128). H100, 2026-11-24, graph
# replays, 32768 and 131072 rows of 128-8192 features, each step's dweight / dbias added into
# tile-shaped accumulators: 8 KB steps with these groups were the best or within 4% of it in
# every row tried (bf16 LayerNorm 131072x256 2323 GB/s, 32768x1024 2435, 32768x4096 2694; fp32
# 131072x256 2546, 32768x1024 2604); 8 warps per multiprocessor lost 10-35% on fp32 and on
# 16-bit rows of 4096 features, and 16 KB steps spilled on 16-bit rows.
BACKWARD_ROW_TILE_BYTES = 8192
BACKWARD_WARPS_PER_SM = 16
BACKWARD_SHORT_16BIT_MAX_ELEMENTS = 2048
BACKWARD_SHORT_16BIT_WARPS_PER_SM = 8
# One stage: the loop's loads gain nothing from pipelining (1 and 2 stages tied).
BACKWARD_NUM_STAGES = 1
# 16-bit rows of up to BACKWARD_PREFETCH_MAX_ELEMENTS features: the fused backward loads the
# next step's rows before working on this step's (two steps of loads in flight per program).
# H100, 2026-11-24, graph replays of the backward: LayerNorm bf16 1880-2240 GB/s became
# 1980-2440 (32768x1024, 16384x4096, 8192x8192), RMSNorm bf16 2180-2420 became 2245-2570; fp32
# (twice the registers a step) moved by -4% (8192x8192) to +2%, and RMSNorm bf16 rows of 16384
# features spilled (2074 -> 199 GB/s): both keep the plain loop.
BACKWARD_PREFETCH_MAX_ELEMENTS = 8192
# Wider 16-bit rows (fused: RMSNorm's 8193-16384 features) take no prefetch; a step widens its x
# and dy again after the row sums instead of holding fp32 copies across them (`recompute`):
# RMSNorm bf16 rows of 12288-16384 features (H100, 2026-11-24, graph replays) went 1863-2019 ->
# 2241-2496 GB/s (Liger 2048-2294). Applied to every fused row the same way, it cost LayerNorm
# fp32 8192x8192 5% (0.305 -> 0.322 ms), so only these rows take it.
# The dweight / dbias partial buffers (fp32, groups x features, one per parameter present) stay
# under this many bytes together (sized for both).
PARTIAL_BYTES_BUDGET = 32 << 20
# Element size of the fp16 / bf16 inputs (and narrower) that the 16-bit rules above apply to.
SIXTEEN_BIT_ITEMSIZE = 2
# Long rows: chunk walked per loop step, and the column tile of the parameter-gradient kernel.
LOOPED_CHUNK_BYTES = 16384
PARAMS_TILE_BYTES = 16384
PARAMS_MAX_BLOCK_D = 512
# Split rows: each program's chunk, on SPLIT_NUM_WARPS warps (4: a quarter of an SM's threads,
# so that siblings.SIBLINGS_PER_SM programs fit on a multiprocessor whatever their registers).
# H100 sweep of 2026-11-22 (1024x65536, 256x262144): forward 16 KB chunks (8192 bf16, 4096 fp32)
# reached 2010-2020 GB/s bf16 and 2360-2460 fp32, 8 KB chunks 1310-1520 and 2080-1980; backward
# (4096x16384 to 256x262144) 4096 columns 1150-1375 GB/s bf16 and 1670-2200 fp32, 2048 columns
# 740-950 and 1190-1490 (more siblings per SM, or 8-warp programs, did not help).
# The forward holds its chunk in the input's dtype through the wait (bf16 widened after it by a
# shift, `siblings.widen_held`). H100, 2026-11-24, graph replays, 16 KB chunks: bf16 LayerNorm
# 2091 -> 2221 GB/s (1024x65536) and 2054 -> 2152 (256x262144), RMSNorm 2289 -> 2281 and
# 2239 -> 2434; fp32 unchanged; 32 KB chunks lost in bf16 LayerNorm (1844, 1781).
SPLIT_FORWARD_CHUNK_BYTES = 16384
SPLIT_BACKWARD_CHUNK_ELEMENTS = 4096
# Backward: a split program takes a batch of rows per meeting with its siblings, this many bytes
# of each input (x, dy) in all: it reads the batch's chunks once for the row sums and once more,
# from L2, to write dx. H100, 2026-11-23, graph replays of the backward (4096x16384 to 256x262144
# and 1000x20000; batches of 1-8 rows): 32 KB (4 rows of bf16 chunks, 2 of fp32) gave LayerNorm
# bf16 1440-1760 GB/s against 1155-1570 for the row-at-a-time kernel of before (waiting on the
# siblings at every row, next row prefetched), fp32 1740-2230 against 1700-2300 (longest rows
# gain most: 256x262144 fp32 1960 against 1700); RMSNorm bf16 1410-1700 against 1460-1720.
SPLIT_BACKWARD_BATCH_BYTES = 32768
SPLIT_NUM_WARPS = 4
PLAN_CACHE_SIZE = 1024


class Path(str, enum.Enum):
    FUSED = "fused"
    SPLIT = "split"
    LOOPED = "looped"


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
        return Plan(Path.FUSED, rows, block, sizing.row_warps(elements))
    chunk = SPLIT_FORWARD_CHUNK_BYTES // sizing.element_size(dtype)
    chunks = _split_chunks(n_cols, chunk)
    if chunks is not None:
        return Plan(Path.SPLIT, 1, chunk, SPLIT_NUM_WARPS, chunks=chunks,
                    chunks_p2=sizing.next_power_of_2(chunks), spin_limit=spin_limit())
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    return Plan(Path.LOOPED, 1, chunk, sizing.num_warps_for(chunk))


def _backward_fused_max(dtype: torch.dtype, is_rms: bool) -> int:
    if is_rms and _is_16bit(dtype):
        return BACKWARD_FUSED_MAX_ELEMENTS_RMS_16BIT
    return BACKWARD_FUSED_MAX_ELEMENTS


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype, stable: bool = False,
                  is_rms: bool = False) -> Plan:
    block = sizing.fused_row_block(n_cols, dtype)
    if block is not None and block <= _backward_fused_max(dtype, is_rms):
        rows = sizing.rows_per_program(n_rows, block, dtype, BACKWARD_ROW_TILE_BYTES)
        warps = sizing.row_warps(block)
        narrow = _is_16bit(dtype)
        warps_per_sm = (BACKWARD_SHORT_16BIT_WARPS_PER_SM if narrow and block <= BACKWARD_SHORT_16BIT_MAX_ELEMENTS
                        else BACKWARD_WARPS_PER_SM)
        groups, per_group = _groups(n_rows, n_cols, rows, max(1, warps_per_sm // warps))
        prefetch = narrow and block <= BACKWARD_PREFETCH_MAX_ELEMENTS
        return Plan(Path.FUSED, rows, block, warps, groups, per_group, prefetch=prefetch,
                    recompute=narrow and not prefetch)
    chunks = None if stable else _split_chunks(n_cols, SPLIT_BACKWARD_CHUNK_ELEMENTS)
    if chunks is not None:
        # Every program of the launch is a sibling of the others in its group: all must be
        # resident together, so the groups share max_siblings() programs.
        chunk_bytes = SPLIT_BACKWARD_CHUNK_ELEMENTS * sizing.element_size(dtype)
        batch_rows = max(1, SPLIT_BACKWARD_BATCH_BYTES // chunk_bytes)
        batches = sizing.cdiv(n_rows, batch_rows)
        groups = max(1, min(batches, max_siblings() // chunks))
        return Plan(Path.SPLIT, 1, SPLIT_BACKWARD_CHUNK_ELEMENTS, SPLIT_NUM_WARPS, groups,
                    chunks=chunks, chunks_p2=sizing.next_power_of_2(chunks), spin_limit=spin_limit(),
                    batch_rows=batch_rows)
    chunk = LOOPED_CHUNK_BYTES // sizing.element_size(dtype)
    tile = sizing.tile_2d(n_rows, n_cols, dtype, PARAMS_TILE_BYTES, PARAMS_MAX_BLOCK_D)
    col_tiles = sizing.cdiv(n_cols, tile.block_cols)
    groups, per_group = _groups(n_rows, n_cols, tile.block_rows, 1)
    return Plan(Path.LOOPED, 1, chunk, sizing.num_warps_for(chunk), groups, per_group,
                col_tiles=col_tiles, params_block_rows=tile.block_rows,
                params_block_cols=tile.block_cols, params_num_warps=tile.num_warps)

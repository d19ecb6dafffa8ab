"""fk-attention's decode plan: few query rows against many keys (split-KV, "flash decoding"), and
the KV-cache call, top to bottom: when it is taken, tiles, how many key slices, the launches bound
once per (shapes, strides, dtype, device, mask).

A decode launch gives each (batch, KV head) program every query row of the head's GQA group (the
group reads its K/V once) and one slice of the keys; with several slices a small second launch
merges the partial outputs by their log-sum-exps (`decode_kernels.attn_decode_kernel`,
`attn_decode_merge_kernel`). The slices cut each sequence's own length (read on the GPU), so a
cache longer than what it holds costs nothing, and no host sync is needed (CUDA graphs). On
Hopper, where `gluon_block` and `gluon_takes` hold, the slices run on the Gluon kernel
(`decode_hopper`) with the same grid, partials and merge.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fk_runtime import alloc, backend, checks, sizing
from fk_runtime.launch import Descriptor, Launch, PlanCache, layout_key

from . import config, decode_hopper, decode_kernels, hopper
from .config import (APPEND_ROWS, CACHE_SIZE, DECODE_DESCRIPTOR_MIN_HEAD_DIM, DECODE_MAX_BLOCK_M,
                     DECODE_MAX_QUERIES, DECODE_MIN_BLOCK_M, DECODE_TILES_16BIT, DECODE_TILES_32BIT,
                     INTERPRETER_BLOCK, INTERPRETER_SLICED_PROGRAMS, INTERPRETER_SLICE_KEYS, MAX_SLICES,
                     MERGE_VALUES_PER_THREAD, MIN_SLICE_GAIN, MIN_SLICE_KEYS, ROW_PAGES_FILL, ROW_PAGES_GRID,
                     SHARED_RESERVE, SHORT_CACHE_KEYS, SLICE_PAGE_BUCKETS, SLICE_PAGES, WIDE_BLOCK_N, WIDE_PROGRAMS,
                     WIDE_STAGES, WIDE_WARPS, Config, decode_grids)
from .layout import (alibi_strides, bases_aligned, check_alibi, check_heads, check_inputs, descriptor_strides,
                     descriptors_may_serve, fit, heads_inside_tokens, is_hopper_or_newer, new_output, padded_head_dim,
                     precision, widened)
from .mask import Mask

# The decode path's bound plans (dense and KV-cache calls).
BOUND = PlanCache(CACHE_SIZE)

DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def takes(q: torch.Tensor) -> bool:
    """Whether `attention` runs these queries through the decode path."""
    return q.shape[2] <= DECODE_MAX_QUERIES and q.dtype in DECODE_DTYPES


def tiles(rows: int, head_dim: int, dtype: torch.dtype, programs: int, device_index: int,
          paged: bool = False) -> Config:
    """The tiles of a decode launch with `rows` query rows per KV head over `programs` programs."""
    block_m = min(max(sizing.next_power_of_2(rows), DECODE_MIN_BLOCK_M), DECODE_MAX_BLOCK_M)
    if backend.is_interpreter():
        return Config(block_m, INTERPRETER_BLOCK, sizing.MIN_WARPS, 1)
    padded = padded_head_dim(head_dim)
    rows_by_dim = DECODE_TILES_32BIT if dtype.itemsize > 2 else DECODE_TILES_16BIT
    block_n, warps, stages = next(entry for limit, entry in rows_by_dim if padded <= limit)
    if programs >= decode_grids(device_index, paged).shallow_pipeline * backend.multiprocessor_count(device_index):
        stages = max(stages - 1, 1)
    return Config(block_m, block_n, warps, stages)


def wide_blocks(rows: int, head_dim: int, dtype: torch.dtype, programs: int, page_size: int,
                device_index: int) -> bool:
    """Whether a decode launch of `programs` (batch, KV head) programs with `rows` query rows each
    over a dense cache (page_size 0) or pages of `page_size` rows takes WIDE_BLOCK_N-row key blocks
    (module constants)."""
    padded = padded_head_dim(head_dim)
    pages_fit = page_size == 0 or page_size % WIDE_BLOCK_N == 0
    if (backend.is_interpreter() or not pages_fit or dtype.itemsize != 2 or rows > DECODE_MIN_BLOCK_M
            or padded not in (64, 128) or programs >= backend.multiprocessor_count(device_index)):
        return False
    needed = WIDE_STAGES * 2 * WIDE_BLOCK_N * padded * dtype.itemsize + SHARED_RESERVE
    return backend.shared_memory_per_program(device_index) >= needed


def row_pages(grid: int, device_index: int) -> bool:
    """Whether a paged cache's key blocks read their page index per row in the walk (full grids)
    rather than from the slice's pages preloaded into registers."""
    return grid >= ROW_PAGES_GRID * backend.multiprocessor_count(device_index)


def preloaded_pages(spanned: int) -> int:
    """Page indices a slice spanning `spanned` pages (at most SLICE_PAGES) preloads: the smallest of
    SLICE_PAGE_BUCKETS that holds them (picking a block's page is a reduction over them: 128 where
    8 do cost the short rows 3-6%, TUNING.md: decode, preloaded pages)."""
    return next((n for n in SLICE_PAGE_BUCKETS if n >= spanned), SLICE_PAGES)


def merge_warps(slices: int, head_dim: int) -> int:
    """The merge launch's warps for `slices` partial outputs of a query row."""
    values = sizing.next_power_of_2(slices) * padded_head_dim(head_dim)
    return min(sizing.MIN_WARPS, max(1, values // (32 * MERGE_VALUES_PER_THREAD)))


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, grid: int, paged: bool = False) -> bool:
    """TMA (host descriptors) for K/V tiles where the forward takes them (Hopper or newer, 16- or
    32-bit K/V with aligned strides; bases are checked per call) and `descriptor_grid` holds."""
    return (descriptors_may_serve(k.device, (k, v))
            and descriptor_grid(k.shape[-1], grid, k.device.index or 0, paged))


def descriptor_grid(head_dim: int, grid: int, device_index: int, paged: bool = False) -> bool:
    """Whether a decode launch of `grid` programs at this head dim may read K/V through TMA: head
    dims padded to at least DECODE_DESCRIPTOR_MIN_HEAD_DIM, grids below the card's
    `descriptors_below` programs per multiprocessor."""
    return (padded_head_dim(head_dim) >= DECODE_DESCRIPTOR_MIN_HEAD_DIM
            and grid < decode_grids(device_index, paged).descriptors_below
            * backend.multiprocessor_count(device_index))


def sliced_programs(head_dim: int, device_index: int, fill: float = 1, paged: bool = False) -> float:
    """The programs a sliced decode launch wants (`fill` times the usual)."""
    if backend.is_interpreter():
        return INTERPRETER_SLICED_PROGRAMS * fill
    return (backend.multiprocessor_count(device_index) * decode_grids(device_index, paged).sliced_programs_d128
            * fill * 128 / padded_head_dim(head_dim))


def key_slices(programs: int, n_k: int, head_dim: int, device_index: int, fill: float = 1,
               min_keys: int = MIN_SLICE_KEYS, paged: bool = False) -> int:
    """How many slices of at least `min_keys` keys to cut each sequence's keys into, for
    `programs` (batch, KV head, row block) programs over up to n_k keys: the power of two nearest
    the wanted programs (`fill` times the usual) over these; none below MIN_SLICE_GAIN of them (a
    cache of fewer than SHORT_CACHE_KEYS keys: the card's `slice_min_gain`)."""
    if backend.is_interpreter():
        min_keys = INTERPRETER_SLICE_KEYS
    wanted = sliced_programs(head_dim, device_index, fill, paged)
    most = min(MAX_SLICES, max(1, n_k // min_keys))
    ratio = wanted / programs
    if ratio < (decode_grids(device_index, paged).slice_min_gain if n_k < SHORT_CACHE_KEYS else MIN_SLICE_GAIN):
        return 1
    nearest = 1 << round(math.log2(ratio))
    return max(1, min(nearest, most))


def gluon_block(head_dim: int, dtype: torch.dtype, rows: int, page_size: int, device_index: int) -> int | None:
    """BLOCK_N of the Gluon decode kernel (`decode_hopper`) for a launch of these shapes, else None (the
    `tl` kernel): a Hopper GPU and a Triton whose Gluon fk built on, 16-bit K/V in a dense cache, a padded
    head dim in `config.GLUON_DECODE_TILES`, at most DECODE_MIN_BLOCK_M query rows per KV head."""
    padded = padded_head_dim(head_dim)
    block_n = next((n for dim, n in config.GLUON_DECODE_TILES if dim == padded), None)
    if (block_n is None or page_size or rows > DECODE_MIN_BLOCK_M or dtype not in hopper.DTYPES
            or not hopper.gluon_device(device_index)):
        return None
    return block_n


def gluon_takes(k: torch.Tensor, v: torch.Tensor, rows: int, page_size: int, alibi, leftpad: bool,
                sm_scale: float) -> bool:
    """Whether the Gluon decode kernel takes these K/V: `gluon_block` holds, TMA takes their layout, no
    ALiBi or left pads, a positive scale."""
    return (sm_scale > 0 and alibi is None and not leftpad and k.numel() > 0
            and gluon_block(k.shape[-1], k.dtype, rows, page_size, k.device.index or 0) is not None
            and descriptors_may_serve(k.device, (k, v)))


def gluon_stages(grid: int, block_n: int, head_dim: int, dtype: torch.dtype, device_index: int) -> int:
    """The Gluon decode kernel's ring stages on a grid of `grid` programs (`config.GLUON_DECODE_STAGES`):
    the deep ring where the programs resident on a multiprocessor fit it in its shared memory, else the
    shallow one (two values: each is a compiled variant)."""
    shared = backend.shared_memory_per_multiprocessor(device_index)
    resident = sizing.cdiv(grid, backend.multiprocessor_count(device_index))
    stage = 2 * block_n * padded_head_dim(head_dim) * dtype.itemsize
    shallow, deep = config.GLUON_DECODE_STAGES
    return deep if (shared // resident - config.GLUON_DECODE_RESERVE) // stage >= deep else shallow


@dataclasses.dataclass(frozen=True)
class Split:
    """A decode launch's plan for its shapes: tiles, key slices per sequence, whether a paged cache's
    key blocks read their page per row (`row_pages`) or from `slice_pages` preloaded ones, the
    (batch, KV head, row block) programs before slicing, whether the cache is paged, and whether the
    Gluon kernel runs it (its tile: BLOCK_N keys a step, one warp, its ring's stages)."""

    tile: Config
    slices: int
    per_row: bool
    slice_pages: int
    programs: int
    paged: bool = False
    gluon: bool = False

    def variant(self, head_dim: int, device_index: int) -> tuple:
        """What picks the launches' compiled kernels (their constexprs and the grid's TMA choice,
        `kv_descriptors`): two plans with the same variant compile nothing new for each other."""
        tma = self.gluon or (not self.per_row
                             and descriptor_grid(head_dim, self.programs * self.slices, device_index, self.paged))
        merge = (sizing.next_power_of_2(self.slices), merge_warps(self.slices, head_dim)) if self.slices > 1 else None
        return self.tile, self.per_row, self.slice_pages, tma, merge


def split_plan(b: int, hk: int, rows: int, n_k: int, head_dim: int, dtype: torch.dtype, page_size: int,
               device_index: int, slices: int | None = None, gluon: bool | None = None) -> Split:
    """The plan of a decode launch over b sequences of hk KV heads, `rows` query rows per KV head,
    n_k keys (a paged cache's table width times `page_size`; 0: dense), `slices` forced or chosen
    (`key_slices`); on the Gluon kernel where `gluon` (None: where `gluon_block` holds) and the grid's
    programs per multiprocessor lie in `config.GLUON_DECODE_PROGRAMS_PER_SM`, or past it where each program
    reads at most `config.GLUON_DECODE_SHORT_KEYS` keys (from Triton `GLUON_DECODE_SHORT_FROM` on), but not a
    short cache that the tl kernel reads unsliced where the Gluon kernel would slice it
    (`config.GLUON_DECODE_KEEP_UNSLICED`)."""
    paged = page_size > 0
    m_blocks = sizing.cdiv(rows, tiles(rows, head_dim, dtype, 0, device_index).block_m)
    programs = b * hk * m_blocks
    planned = slices is None
    block_n = gluon_block(head_dim, dtype, rows, page_size, device_index)
    wide = wide_blocks(rows, head_dim, dtype, programs, page_size, device_index)
    if planned:
        slices = (key_slices(programs, n_k, head_dim, device_index, WIDE_PROGRAMS, WIDE_BLOCK_N, paged) if wide
                  else key_slices(programs, n_k, head_dim, device_index, paged=paged))
    if block_n is not None and gluon is not False:
        gluon_slices = key_slices(programs, n_k, head_dim, device_index) if planned else slices
        fewest, most = config.GLUON_DECODE_PROGRAMS_PER_SM
        grid = programs * gluon_slices
        per_sm = grid / backend.multiprocessor_count(device_index)
        short = (per_sm > most and sizing.cdiv(n_k, gluon_slices) <= config.GLUON_DECODE_SHORT_KEYS
                 and backend.triton_at_least(config.GLUON_DECODE_SHORT_FROM))
        unsliced = (config.GLUON_DECODE_KEEP_UNSLICED and planned and slices == 1 < gluon_slices
                    and n_k < SHORT_CACHE_KEYS)
        if (fewest < per_sm <= most or short) and not unsliced:
            stages = gluon_stages(grid, block_n, head_dim, dtype, device_index)
            return Split(Config(DECODE_MIN_BLOCK_M, block_n, 1, stages), gluon_slices, False, 0, programs, gluon=True)
    if wide:
        deep = (programs * slices <= sliced_programs(head_dim, device_index, WIDE_PROGRAMS, paged)
                and n_k > slices * WIDE_BLOCK_N)
        tile = Config(DECODE_MIN_BLOCK_M, WIDE_BLOCK_N, WIDE_WARPS, WIDE_STAGES - (not deep))
    else:
        tile = tiles(rows, head_dim, dtype, programs * slices, device_index, paged)
    full = row_pages(programs * slices, device_index)
    # a page index per row: full grids, pages smaller than a key block, slices of more pages than
    # preloaded (a slice starts on a key block: inside a page where pages are larger, one more page)
    per_row = paged and (full or page_size % tile.block_n != 0
                         or sizing.cdiv(n_k, slices) > (SLICE_PAGES - (page_size > tile.block_n)) * page_size)
    if per_row and not full and planned:
        slices = key_slices(programs, n_k, head_dim, device_index, fill=ROW_PAGES_FILL, paged=paged)
        tile = tiles(rows, head_dim, dtype, programs * slices, device_index, paged)
    # the pages a slice spans (one more where it may start inside a page)
    spanned = sizing.cdiv(sizing.cdiv(n_k, slices), page_size) + (page_size > tile.block_n) if paged else 0
    slice_pages = preloaded_pages(spanned) if paged and not per_row else 0
    return Split(tile, slices, per_row, slice_pages, programs, paged)


@dataclasses.dataclass(frozen=True)
class Cache:
    """A KV cache's launch-time facts: `n_new` rows appended per sequence before attending (0:
    none), `page_size` rows per page for a paged cache (0: dense)."""

    n_new: int = 0
    page_size: int = 0


def bind(q, k, v, mask: Mask, sm_scale: float, cache: Cache | None, slices: int | None,
          block_table=None, descriptors: bool | None = None, with_lse: bool = True, alibi=None,
          leftpad: bool = False):
    """run(q, k, v, seqlens, block_table, alibi, leftpad) -> (out, lse): out laid out like q, lse (B, Hq, Nq)
    fp32 (None without `with_lse`: nothing allocated or stored for it). Dense attention (cache
    None): k, v (B, Hk, Nk, D). A cache: k, v the cache tensors,
    dense (B, Hk, capacity, D) or paged (pages, Hk, page_size, D) with the (B, pages per
    sequence) int32 page table; sequence b holds seqlens[b] + cache.n_new keys. `descriptors`
    forces K/V through TMA on or off (tests; None: `kv_descriptors`)."""
    if cache is None:  # the registered ops can be called unchecked: once per plan, here (caches: `check_cache`)
        check_inputs(q, k, v)
        check_alibi(alibi, q, q.shape[0], q.shape[1])
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_kernel_device(name, t)
    b, hq, n_q, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    paged = cache is not None and cache.page_size > 0
    n_k = block_table.shape[1] * cache.page_size if paged else k.shape[2]
    last_page = k.shape[0] - 1 if paged else 0
    device, dtype = q.device, q.dtype
    out_proto = torch.empty(0, dtype=dtype, device=device)
    fp32 = torch.empty(0, dtype=torch.float32, device=device)
    bnhd = heads_inside_tokens(q)

    q_shape = q.shape  # (the plan outlives this call's tensors: it holds none of them)

    def new_outputs():
        out = new_output(q_shape, bnhd, out_proto)
        return out, alloc.new_empty(fp32, (b, hq, n_q)) if with_lse else None

    if q.numel() == 0:
        return lambda *args, **kwargs: new_outputs()
    index = device.index or 0
    page_size = cache.page_size if paged else 0
    # (tests forcing the tl kernel's descriptors on or off take the tl kernel)
    gluon = descriptors is None and gluon_takes(k, v, group * n_q, page_size, alibi, leftpad, sm_scale)
    split = split_plan(b, hk, group * n_q, n_k, d, dtype, page_size, index, slices, gluon)
    tile, slices, per_row, slice_pages, programs = (split.tile, split.slices, split.per_row, split.slice_pages,
                                                    split.programs)
    if split.gluon:  # the tl kernel's own tile where K/V's bases are off the TMA grid
        tile = tiles(group * n_q, d, dtype, programs * slices, index)
    padded = padded_head_dim(d)
    meta = {"SOFTCAP": mask.softcap_build(dtype), "ALIBI": alibi is not None, "LEFTPAD": leftpad,
            "SEQLENS": cache is not None,
            "PAGED": paged, "PAGE_SIZE": max(cache.page_size if paged else 1, 1), "SLICE_PAGES": slice_pages,
            "ROW_PAGES": per_row,
            "HEAD_DIM": d,
            "HEAD_DIM_PADDED": padded, "PRECISION": precision(dtype), "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n, "num_warps": tile.num_warps, "num_stages": tile.num_stages,
            "STORE_LSE": with_lse}
    softcap, lower_right, left, right = mask.kernel_args()
    (k_, k_ok), (v_, v_ok) = fit(k), fit(v)
    # TMA where a key block lies in one page (the descriptor's box), K/V used as given.
    # TMA descriptors take no empty dim: no keys go through pointers (they read nothing).
    use_desc = (not per_row and k_ok and v_ok and k.numel() > 0
                and (kv_descriptors(k, v, programs * slices, paged) if descriptors is None else descriptors))
    kv_block = [1, 1, tile.block_n, padded]
    # K's and V's Descriptor fields after their bases, built once
    k_tile, v_tile = ((list(t.shape), descriptor_strides(t), kv_block) for t in (k, v)) if use_desc else ((), ())
    out_example = new_outputs()[0]
    # Programmatic dependent launch of the merge (its launch overlaps the slices' tail): Hopper on.
    pdl = slices > 1 and is_hopper_or_newer(device)
    meta.update(SLICED=slices > 1, PDL=pdl)
    # The partial outputs (B, Hq, Nq, slices, D), then their log-sum-exps: one fp32 buffer.
    part_numel = b * hq * n_q * slices * d
    parts_numel = part_numel + b * hq * n_q * slices
    table_stride = block_table.stride(0) if paged else 0
    attend_args = ((programs * slices,),
                   (sm_scale, softcap, n_q, n_k, cache.n_new if cache else 0, hk, group, lower_right, left, right,
                    slices, last_page, part_numel, *q.stride(), *k_.stride(), *v_.stride(), *out_example.stride(),
                    hq * n_q, n_q, 1, table_stride, *alibi_strides(alibi)))
    attend = Launch(decode_kernels.attn_decode_kernel, *attend_args, {**meta, "USE_DESC": False}, device)
    attend_tma = Launch(decode_kernels.attn_decode_kernel, *attend_args, {**meta, "USE_DESC": True}, device) \
        if use_desc else None

    attend_gluon = _bind_gluon(q, k, v, mask, sm_scale, cache, group, split, part_numel, out_example,
                               with_lse) if split.gluon else None

    def kv(k, v):  # K/V as the launch takes them: descriptors where their bases are aligned
        if attend_gluon is not None and bases_aligned((k, v)):
            return attend_gluon, k, v
        if attend_tma is not None and bases_aligned((k, v)):
            return attend_tma, Descriptor(k, *k_tile), Descriptor(v, *v_tile)
        return attend, k if k_ok else k.contiguous(), v if v_ok else v.contiguous()
    merge = None
    if slices > 1:
        merge = Launch(decode_kernels.attn_decode_merge_kernel, (b * hq * n_q,),
                       (hq, n_q, slices, part_numel, *out_example.stride(), hq * n_q, n_q, 1),
                       {"HEAD_DIM": d, "HEAD_DIM_PADDED": padded, "BLOCK_S": sizing.next_power_of_2(slices),
                        "PDL": pdl, "STORE_LSE": with_lse, "num_warps": merge_warps(slices, d),
                        **({"launch_pdl": True} if pdl else {})}, device)

    def run(q, k, v, seqlens=None, block_table=None, alibi=None, leftpad=None):
        out, lse = new_outputs()
        unused = out if lse is None else lse  # stands in for pointers no launch follows
        seqlens = unused if seqlens is None else seqlens
        block_table = unused if block_table is None else block_table
        alibi = unused if alibi is None else alibi
        leftpad = seqlens if leftpad is None else leftpad
        attend, k, v = kv(k, v)
        if merge is None:
            attend(q, k, v, out, unused, unused, seqlens, block_table, alibi, leftpad)
            return out, lse
        parts = alloc.new_empty(fp32, (parts_numel,))
        attend(q, k, v, out, unused, parts, seqlens, block_table, alibi, leftpad)
        merge(parts, out, unused)
        return out, lse

    return run


def _bind_gluon(q, k, v, mask: Mask, sm_scale: float, cache: Cache | None, group: int, split: Split,
                part_numel: int, out_example: torch.Tensor, with_lse: bool):
    """attend(q, k, v, out, lse, parts, seqlens, *unused) through the Gluon decode kernel on `split`'s
    grid and tile (the caller checks K/V's bases per call): the `tl` kernel's slices and outputs (`bind`)."""
    b, hq, n_q, d = q.shape
    block_n = split.tile.block_n
    builds, (qk_scale, cap_scale, left, right) = hopper.forward_mask_args(mask, sm_scale, q.dtype)
    k_tile, v_tile = hopper.tile_descriptors((k, v), (block_n, block_n), padded_head_dim(d), k.dtype)
    launch = Launch(decode_hopper.attn_decode_tma_kernel, (split.programs * split.slices,),
                    (qk_scale, cap_scale, n_q, k.shape[2], cache.n_new if cache else 0, k.shape[1], group,
                     int(mask.lower_right), left, right, split.slices, part_numel, *q.stride(),
                     *out_example.stride(), hq * n_q, n_q, 1),
                    {"SOFTCAP": builds["SOFTCAP"], "SEQLENS": cache is not None, "SLICED": split.slices > 1,
                     "STORE_LSE": with_lse, "HEAD_DIM": d, "STAGES": split.tile.num_stages, "num_warps": 1},
                    q.device)

    def attend(q, k, v, out, lse, parts, seqlens, *unused):  # (no generator a call: 1 µs of 30)
        launch(q, Descriptor(k, *k_tile), Descriptor(v, *v_tile), out, lse, parts, seqlens)

    return attend


def forward(q, k, v, mask: Mask, sm_scale: float, slices: int | None = None,
            descriptors: bool | None = None, alibi=None):
    """(out, lse) of dense attention through the decode path; `slices` and `descriptors` override
    the plan's (tests; not cached); `alibi`: fp32 slopes, (Hq,) or (B, Hq)."""
    if widened(q.dtype):
        out, lse = forward(q.float(), k.float(), v.float(), mask, sm_scale, slices, descriptors, alibi)
        return out.to(q.dtype), lse
    if slices is not None or descriptors is not None:
        return bind(q, k, v, mask, sm_scale, None, slices, descriptors=descriptors, alibi=alibi)(
            q, k, v, alibi=alibi)
    return bound(q, k, v, mask, sm_scale, alibi=alibi)(q, k, v, alibi=alibi)


def bound(q, k, v, mask: Mask, sm_scale: float, with_lse: bool = True, alibi=None):
    """run(q, k, v, alibi=None) -> (out, lse): the decode plan bound for these inputs' layouts
    (not widened); lse None without `with_lse`."""
    key = ("decode", *layout_key(q, k, v, alibi), mask, sm_scale, with_lse)
    return BOUND.get(key) or BOUND.get_or_build(
        key, lambda: bind(q, k, v, mask, sm_scale, None, None, with_lse=with_lse, alibi=alibi))


def check_cache(q, k_cache, v_cache, cache_seqlens, k, v, block_table) -> None:
    """The layouts `attention_with_kvcache` documents: q (B, Hq, Nq, D), dense caches (B, Hk,
    capacity, D) or paged ones (pages, Hk, page_size, D) with an int32 (B, pages) table, int32 (B,)
    lengths, new rows k, v (B, Hk, Nnew, D) or None; one dtype and device; nothing requiring grad
    (an inference call)."""
    checks.check_tensor("q", q, dtypes=DECODE_DTYPES, min_dim=4, max_dim=4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_tensor(name, t, dtypes=DECODE_DTYPES, min_dim=4, max_dim=4)
    checks.check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), min_dim=1, max_dim=1)
    b = q.shape[0]
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must hold one length per batch row ({b}), got shape "
                         f"{tuple(cache_seqlens.shape)}")
    check_heads(q, k_cache, v_cache, 1, same=False)  # dtypes and devices: with k, v, lengths below
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new rows for both caches) or both be None")
    hk, d = k_cache.shape[1], q.shape[-1]
    if block_table is not None:
        checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), min_dim=2, max_dim=2)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must hold one row of pages per batch row ({b}), got shape "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[0] == 0 or k_cache.shape[2] == 0:
            raise ValueError(f"a paged k_cache (pages, Hk, page_size, D) needs pages and rows, got shape "
                             f"{tuple(k_cache.shape)}")
    elif k_cache.shape[0] != b:
        raise ValueError(f"k_cache must be (B, Hk, capacity, D) with B = q's batch ({b}), got shape "
                         f"{tuple(k_cache.shape)} (a paged cache needs block_table)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            checks.check_tensor(name, t, dtypes=DECODE_DTYPES, min_dim=4, max_dim=4)
            if t.shape[0] != b or t.shape[1] != hk or t.shape[3] != d:
                raise ValueError(f"{name} must be (B, Hk, Nnew, D) = ({b}, {hk}, Nnew, {d}), got shape "
                                 f"{tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    checks.check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    checks.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                             block_table=block_table)
    if any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        raise ValueError("attention_with_kvcache is forward-only (inference): its inputs must not require grad")


def layouts(q, k_cache, v_cache, seqlens, k_new, v_new, block_table) -> tuple:
    """Each input's (shape, strides, dtype, device, requires_grad), None where not given: what a
    KV-cache plan is specialized on and `check_cache` reads. Inputs that are not dense tensors
    fail that check here."""
    tensors = (q, k_cache, v_cache, seqlens, k_new, v_new, block_table)
    try:
        return layout_key(*tensors), tuple(t is not None and t.requires_grad for t in tensors)
    except (AttributeError, RuntimeError, TypeError):
        check_cache(*tensors)
        raise


def forward_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, mask: Mask, sm_scale: float,
                    facts: tuple | None = None, alibi=None, leftpad=None, with_lse: bool = True):
    """(out, lse) of q against a KV cache after writing k_new / v_new (may be None) into it at
    each sequence's length. One plan per `layouts` (`facts`, if the caller has them), mask, scale
    and the layouts of ALiBi slopes and left pads (int32 (B,): the row each sequence starts at),
    the inputs checked once as it is made (`check_cache`); lse None without `with_lse`."""
    run = bound_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, mask, sm_scale, facts, with_lse,
                        alibi=alibi, leftpad=leftpad)
    return run(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, alibi, leftpad)


def bound_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, mask: Mask, sm_scale: float,
                  facts: tuple | None = None, with_lse: bool = True, alibi=None, leftpad=None):
    """run(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, alibi=None, leftpad=None) ->
    (out, lse): the KV-cache plan of these inputs' `layouts` (`facts`, if the caller has them),
    mask, scale, slopes' and left pads' layouts, the inputs checked as it is made
    (`check_cache`); lse None without `with_lse`."""
    if facts is None:
        facts = layouts(q, k_cache, v_cache, seqlens, k_new, v_new, block_table)
    key = ("kvcache", facts, layout_key(alibi, leftpad), mask, sm_scale, with_lse)
    return BOUND.get(key) or BOUND.get_or_build(
        key, lambda: _bind_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, mask, sm_scale,
                                   with_lse, alibi, leftpad))


def _bind_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, mask: Mask, sm_scale: float,
                  with_lse: bool = True, alibi=None, leftpad=None):
    """run(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, alibi=None, leftpad=None) ->
    (out, lse): the append (if new rows come) and the attention launches of one KV-cache call's
    layouts."""
    check_cache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table)
    check_alibi(alibi, q, q.shape[0], q.shape[1])
    if leftpad is not None:
        checks.check_tensor("cache_leftpad", leftpad, dtypes=(torch.int32,), min_dim=1, max_dim=1)
        if leftpad.shape[0] != q.shape[0]:
            raise ValueError(f"cache_leftpad must hold one row per batch row ({q.shape[0]}), got shape "
                             f"{tuple(leftpad.shape)}")
        checks.check_same_device(q=q, cache_leftpad=leftpad)
    padded = leftpad is not None
    cache = Cache(0 if k_new is None else k_new.shape[2], 0 if block_table is None else k_cache.shape[2])
    append = None if k_new is None else _bind_append(k_cache, v_cache, k_new, v_new, block_table, cache)
    fp32_copies = widened(q.dtype)  # the interpreter's bf16 dot: fp32 copies
    if fp32_copies:
        attend = bind(q.float(), k_cache.float(), v_cache.float(), mask, sm_scale, cache, None, block_table,
                       with_lse=with_lse, alibi=alibi, leftpad=padded)
    else:
        attend = bind(q, k_cache, v_cache, mask, sm_scale, cache, None, block_table, with_lse=with_lse,
                      alibi=alibi, leftpad=padded)

    def run(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, alibi=None, leftpad=None):
        if append is not None:
            append(k_cache, v_cache, seqlens, k_new, v_new, block_table)
        if fp32_copies:
            out, lse = attend(q.float(), k_cache.float(), v_cache.float(), seqlens, block_table, alibi, leftpad)
            return out.to(q.dtype), lse
        return attend(q, k_cache, v_cache, seqlens, block_table, alibi, leftpad)

    return run


def _bind_append(k_cache, v_cache, k_new, v_new, block_table, cache: Cache):
    """run(k_cache, v_cache, seqlens, k_new, v_new, block_table): new rows written into the
    cache in place at rows seqlens[b] + r (dropped at or past the capacity)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k_new), ("v", v_new)):
        checks.check_kernel_device(name, t)
    b, hk, n_new, d = k_new.shape
    paged = cache.page_size > 0
    capacity = block_table.shape[1] * cache.page_size if paged else k_cache.shape[2]
    if k_new.numel() == 0:
        return lambda *args, **kwargs: None
    launch = Launch(decode_kernels.kv_append_kernel, (b * hk * sizing.cdiv(n_new, APPEND_ROWS),),
                    (n_new, hk, capacity, k_cache.shape[0] - 1 if paged else 0, *k_new.stride(), *v_new.stride(),
                     *k_cache.stride(), *v_cache.stride(), block_table.stride(0) if paged else 0),
                    {"PAGED": paged, "PAGE_SIZE": max(cache.page_size, 1), "HEAD_DIM": d,
                     "HEAD_DIM_PADDED": padded_head_dim(d), "BLOCK_R": APPEND_ROWS,
                     "num_warps": sizing.MIN_WARPS}, k_cache.device)

    def run(k_cache, v_cache, seqlens, k_new, v_new, block_table=None):
        launch(k_new, v_new, k_cache, v_cache, seqlens, seqlens if block_table is None else block_table)

    return run

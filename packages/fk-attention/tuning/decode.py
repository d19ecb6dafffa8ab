"""The decode path's sweeps behind `fk_attention.decode`'s tiles, slicing and paged reads (TUNING.md).

    bash shared/from-source.sh python packages/fk-attention/tuning/decode.py [SWEEP ...]

SWEEP: slices, descriptors, rows, fill, lengths, wide, wide_pages, wide_depth, slice_pages, merge
(all of them when none is named).

Times are `do_bench` medians of CUDA-graph replays (microseconds), bf16, one query row per head,
the cache full; SDPA's cuDNN backend beside them on the dense cache.
"""

import functools
import sys

import torch
import torch.nn.functional as F
from fk_runtime.harness import bench, testing
from fk_runtime.launch import PlanCache

testing.setup()

from fk_attention import attention, attention_with_kvcache, decode  # noqa: E402
from fk_attention import bench as attention_bench  # noqa: E402
from fk_attention import config as fk_config, mask as fk_mask  # noqa: E402

SLICE_SHAPES = [(1, 32, 8, 131072, 128), (16, 32, 8, 8192, 128), (1, 32, 32, 131072, 64), (1, 32, 8, 1024, 128),
                (16, 32, 8, 1024, 64), (64, 32, 8, 1024, 128), (64, 32, 32, 8192, 128), (1, 32, 8, 8192, 128),
                (1, 32, 32, 32768, 128)]  # (B, Hq, Hk, KV, D)
SLICE_TILES = [(64, 3), (32, 3), (64, 2), (128, 2)]  # (BLOCK_N, stages), 4 warps
SLICES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48, 64]


def graph_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        us = bench.time_ms(bench.graphed([fn], stream)) * 1e3
    torch.cuda.synchronize()
    return round(us, 1)


def cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def fixed_tiles(block_n, stages, *args):
    return fk_config.Config(16, block_n, 4, stages)


def slices_sweep():
    mask = fk_mask.Mask(right=0, lower_right=True)
    default_tiles = decode.tiles
    for b, hq, hk, n, d in SLICE_SHAPES:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v)), "plan's slices": decode.key_slices(b * hk, n, d, 0)}
        for block_n, stages in SLICE_TILES:
            decode.tiles = functools.partial(fixed_tiles, block_n, stages)
            for s in SLICES:
                if n // s >= block_n:
                    run = decode.bind(q, k, v, mask, d ** -0.5, decode.Cache(), s)
                    row[f"{block_n},{stages},{s}"] = graph_us(functools.partial(run, q, k, v, lengths))
        decode.tiles = default_tiles
        print(f"B{b} KV{n} {hq}:{hk} d{d}", row, flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def rule_times(q, k, v, lengths, pages, rule: str, variants: dict) -> dict:
    """fk's µs on the cache (k, v, lengths; `pages` None for a dense one) with `decode.<rule>`
    replaced by each variant (None: the plan's own), the plan's restored after."""
    plan = getattr(decode, rule)
    times = {}
    try:
        for name, variant in variants.items():
            setattr(decode, rule, variant or plan)
            decode.BOUND = PlanCache()
            times[name] = graph_us(functools.partial(attention_with_kvcache, q, k, v, lengths, block_table=pages,
                                                     causal=True))
    finally:
        setattr(decode, rule, plan)
    return times


def each_case(shapes, row) -> None:
    """row(b, hq, hk, n, d, q, k, v, lengths, k_paged, v_paged, pages) for each (B, Hq, Hk, KV, D) of
    `shapes` on the main job's decode inputs (bf16, the cache full, pages of 64 shuffled), the GPU's
    cache emptied after each (the inputs die with `row`'s frame)."""
    for b, hq, hk, n, d in shapes:
        row(b, hq, hk, n, d, *attention_bench._decode_case(b, hq, hk, n, d, torch.bfloat16, False).make_inputs())
        torch.cuda.empty_cache()


ROW_SHAPES = [(16, 32, 8, 32768, 64), (1, 32, 32, 131072, 128), (64, 32, 8, 1024, 128), (16, 32, 32, 1024, 128),
              (1, 32, 8, 131072, 128), (16, 32, 32, 8192, 64), (64, 32, 8, 8192, 128), (1, 32, 8, 8192, 128),
              (1, 32, 32, 131072, 64), (16, 32, 8, 1024, 64), (1, 32, 8, 1024, 128), (64, 32, 32, 8192, 64)]


def rows_sweep():
    """Paged caches (the table's pages of 64, shuffled): each block's page from the slice's pages
    preloaded, or read per row in the walk, whatever the grid (`decode.row_pages` forced)."""
    print("| B, Hq:Hk, KV, d | cuDNN | dense | paged preloaded | paged per row | per row / preloaded | cuDNN / per row |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def case(b, hq, hk, n, d, q, k, v, lengths, kp, vp, pages):
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v)),
               "dense": graph_us(functools.partial(attention_with_kvcache, q, k, v, lengths, causal=True))}
        row.update(rule_times(q, kp, vp, lengths, pages, "row_pages",
                              {per_row: lambda grid, device_index, per_row=per_row: per_row for per_row in (False, True)}))
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {row['cudnn']} | {row['dense']} | {row[False]} | {row[True]} | "
              f"{row[False] / row[True]:.2f}x | {row['cudnn'] / row[True]:.2f}x |", flush=True)

    each_case(ROW_SHAPES, case)


FILL_SHAPES = [(16, 32, 8, 32768, 64), (1, 32, 32, 131072, 64), (16, 32, 8, 32768, 128), (1, 32, 32, 32768, 128),
               (1, 32, 32, 131072, 128), (1, 32, 8, 131072, 128), (16, 32, 8, 8192, 128), (1, 32, 8, 32768, 64),
               (16, 32, 8, 1024, 64), (1, 32, 8, 8192, 64), (1, 32, 8, 1024, 128)]


def fill_sweep():
    """Paged caches (pages of 64, shuffled) on grids of few programs: the slice's pages preloaded,
    with as many slices as that needs (at most SLICE_PAGES pages a slice: the rule before
    `ROW_PAGES_FILL`), against a page per row with the dense cache's slices and with
    ROW_PAGES_FILL times them, and the plan."""
    rule = decode.row_pages
    mask = fk_mask.Mask(right=0, lower_right=True)
    print("| B, Hq:Hk, KV, d | cuDNN | dense | preloaded, slices it needs | per row, slices x1 | per row, "
          f"x{fk_config.ROW_PAGES_FILL} | plan | cuDNN / plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def case(b, hq, hk, n, d, q, k, v, lengths, kp, vp, pages):
        page = kp.shape[2]
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v)),
               "dense": graph_us(functools.partial(attention_with_kvcache, q, k, v, lengths, causal=True))}
        slices = decode.key_slices(b * hk, n, d, 0, paged=True)
        variants = {"preloaded": (False, max(slices, -(-n // (fk_config.SLICE_PAGES * page)))),
                    "x1": (True, slices),
                    "fill": (True, decode.key_slices(b * hk, n, d, 0, fill=fk_config.ROW_PAGES_FILL, paged=True))}
        for name, (per_row, s) in variants.items():
            decode.row_pages = lambda grid, device_index, per_row=per_row: per_row
            run = decode.bind(q, kp, vp, mask, d ** -0.5, decode.Cache(0, page), s, pages)
            row[name] = graph_us(functools.partial(run, q, kp, vp, lengths, pages))
        decode.row_pages = rule
        decode.BOUND = PlanCache()
        row["plan"] = graph_us(functools.partial(attention_with_kvcache, q, kp, vp, lengths, block_table=pages,
                                                 causal=True))
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {row['cudnn']} | {row['dense']} | {row['preloaded']} | {row['x1']} | "
              f"{row['fill']} | {row['plan']} | {row['cudnn'] / row['plan']:.2f}x |", flush=True)

    each_case(FILL_SHAPES, case)


LENGTH_SHAPES = [(16, 32, 8, 1024, 64), (1, 32, 8, 1024, 128), (1, 32, 32, 1024, 64), (16, 32, 8, 1024, 128),
                 (1, 32, 8, 8192, 64), (64, 32, 8, 1024, 64)]


def lengths_sweep():
    """The latency-bound rows: the dense decode without lengths (`attention`) and with them
    (`attention_with_kvcache`, each program's slice bounds wait on its sequence's length)."""
    print("| B, Hq:Hk, KV, d | cuDNN | attention (no lengths) | attention_with_kvcache (lengths) |")
    print("| --- | --- | --- | --- |")

    def case(b, hq, hk, n, d, q, k, v, lengths, *paged):
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {graph_us(functools.partial(cudnn, q, k, v))} | "
              f"{graph_us(functools.partial(attention, q, k, v))} | "
              f"{graph_us(functools.partial(attention_with_kvcache, q, k, v, lengths, causal=True))} |", flush=True)

    each_case(LENGTH_SHAPES, case)


WIDE_SHAPES = [(1, 32, 8, 1024, 128), (1, 32, 8, 8192, 128), (1, 32, 8, 32768, 128), (1, 32, 8, 131072, 128),
               (1, 32, 32, 1024, 128), (1, 32, 32, 8192, 128), (1, 32, 32, 32768, 128), (1, 32, 32, 131072, 128),
               (16, 32, 8, 1024, 128), (16, 32, 8, 8192, 128), (16, 32, 8, 32768, 128), (16, 32, 8, 131072, 128),
               (1, 32, 8, 1024, 64), (1, 32, 8, 8192, 64), (1, 32, 8, 32768, 64), (1, 32, 8, 131072, 64),
               (1, 32, 32, 1024, 64), (1, 32, 32, 8192, 64), (1, 32, 32, 32768, 64), (1, 32, 32, 131072, 64),
               (16, 32, 8, 1024, 64), (16, 32, 8, 8192, 64), (16, 32, 8, 32768, 64), (16, 32, 8, 131072, 64)]


# Pages that hold whole wide key blocks (the `wide_pages` sweep).
WIDE_PAGE = 256


def wide_sweep(page: int = 0):
    """Dense caches (or shuffled pages of `page` rows) at head dim 64 and 128 on grids of few
    programs: the plan's key blocks (`decode.wide_blocks`: 128 rows, slices for WIDE_PROGRAMS
    programs per multiprocessor) against the 64-row blocks and slices of the other rows
    (`wide_blocks` forced off)."""
    print("| B, Hq:Hk, KV, d | cuDNN | 64-row blocks | 128-row blocks (plan) | cuDNN / plan |")
    print("| --- | --- | --- | --- | --- |")

    def case(b, hq, hk, n, d, q, k, v, lengths, *table_pages):
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v))}
        pages = None
        if page:  # sequence b's page i at pages[b, i], shuffled
            pages = torch.randperm(b * n // page, device=q.device).to(torch.int32).view(b, n // page)
            k, v = attention_bench.paged_copy(k, page, pages), attention_bench.paged_copy(v, page, pages)
        row.update(rule_times(q, k, v, lengths, pages, "wide_blocks", {"narrow": lambda *args: False, "wide": None}))
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {row['cudnn']} | {row['narrow']} | {row['wide']} | "
              f"{row['cudnn'] / row['wide']:.2f}x |", flush=True)

    each_case(WIDE_SHAPES, case)


# Long dense rows on grids of few programs (the `wide_depth` sweep).
DEPTH_SHAPES = [(1, 32, 32, 131072, 64), (1, 32, 8, 131072, 64), (1, 32, 32, 32768, 64), (1, 32, 8, 32768, 64),
                (1, 32, 8, 8192, 64), (1, 32, 8, 131072, 128), (1, 32, 32, 131072, 128), (1, 32, 32, 32768, 128),
                (16, 32, 8, 131072, 64), (16, 32, 8, 32768, 128)]


def wide_depth_sweep():
    """Wide key blocks on long rows: slices for 0.5, 1 and 2 times the usual programs
    (`WIDE_PROGRAMS`) x 2, 3 and 4 stages (`WIDE_STAGES`), µs, against cuDNN."""

    def case(b, hq, hk, n, d, q, k, v, lengths, *paged):
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v))}
        for programs in (0.5, 1, 2):
            for stages in (2, 3, 4):
                decode.WIDE_PROGRAMS, decode.WIDE_STAGES = programs, stages  # as decode reads them
                decode.BOUND = PlanCache()
                try:
                    row[f"x{programs} s{stages}"] = graph_us(
                        functools.partial(attention_with_kvcache, q, k, v, lengths, causal=True))
                except Exception as exc:  # more stages than shared memory holds
                    row[f"x{programs} s{stages}"] = type(exc).__name__
        decode.WIDE_PROGRAMS, decode.WIDE_STAGES = fk_config.WIDE_PROGRAMS, fk_config.WIDE_STAGES
        print(f"B{b} KV{n} {hq}:{hk} d{d}", row, flush=True)

    each_case(DEPTH_SHAPES, case)


# Few-program rows of the main job's paged caches (the `slice_pages` sweep).
SLICE_PAGE_SHAPES = [(1, 32, 8, 1024, 64), (1, 32, 8, 8192, 64), (1, 32, 8, 32768, 64), (1, 32, 8, 131072, 64),
                     (16, 32, 8, 1024, 64), (16, 32, 8, 8192, 64), (1, 32, 8, 1024, 128), (1, 32, 8, 8192, 128),
                     (1, 32, 8, 32768, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 8192, 128), (1, 32, 32, 1024, 64),
                     (1, 32, 32, 8192, 64), (1, 32, 32, 1024, 128), (1, 32, 32, 8192, 128), (1, 32, 32, 32768, 128)]


def slice_pages_sweep():
    """Paged caches (pages of 64 rows, shuffled) on grids of few programs: each slice preloading
    the page indices it spans (`decode.preloaded_pages`, the plan) against SLICE_PAGES always, µs."""
    print("| B, Hq:Hk, KV, d | cuDNN (dense) | SLICE_PAGES always | as spanned (plan) | cuDNN / plan |")
    print("| --- | --- | --- | --- | --- |")

    def case(b, hq, hk, n, d, q, k, v, lengths, kp, vp, pages):
        row = {"cudnn": graph_us(functools.partial(cudnn, q, k, v))}
        row.update(rule_times(q, kp, vp, lengths, pages, "preloaded_pages",
                              {"all": lambda spanned: fk_config.SLICE_PAGES, "plan": None}))
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {row['cudnn']} | {row['all']} | {row['plan']} | "
              f"{row['cudnn'] / row['plan']:.2f}x |", flush=True)

    each_case(SLICE_PAGE_SHAPES, case)


MERGE_SHAPES = [(1, 32, 32, 1024, 64), (1, 32, 8, 1024, 64), (1, 32, 8, 8192, 64), (1, 32, 8, 32768, 64),
                (1, 32, 8, 131072, 64), (1, 32, 32, 8192, 64), (1, 32, 32, 131072, 64), (1, 32, 8, 1024, 128),
                (1, 32, 8, 131072, 128), (1, 32, 32, 1024, 128), (1, 32, 32, 32768, 128), (16, 32, 8, 8192, 128)]


def merge_sweep():
    """The merge launch's warps (`decode.merge_warps` forced to 4, 2, 1; the plan's), dense and
    paged caches (the table's pages of 64, shuffled), µs."""
    print("| B, Hq:Hk, KV, d | cuDNN | 4 warps | 2 | 1 | plan | paged 4 warps | paged plan | cuDNN / plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    warps = {w: lambda slices, head_dim, w=w: w for w in (4, 2, 1)}

    def case(b, hq, hk, n, d, q, k, v, lengths, kp, vp, pages):
        cudnn_us = graph_us(functools.partial(cudnn, q, k, v))
        dense = rule_times(q, k, v, lengths, None, "merge_warps", {**warps, "plan": None})
        paged = rule_times(q, kp, vp, lengths, pages, "merge_warps", {4: warps[4], "plan": None})
        print(f"| {b}, {hq}:{hk}, {n}, {d} | {cudnn_us} | {dense[4]} | {dense[2]} | {dense[1]} | {dense['plan']} | "
              f"{paged[4]} | {paged['plan']} | {cudnn_us / dense['plan']:.2f}x |", flush=True)

    each_case(MERGE_SHAPES, case)


def _bound(paged: bool, descriptors: bool):
    """A decode-table variant bound with K/V through TMA or pointers, dense or paged."""
    def prepare(inputs):
        q, k, v, lengths, kp, vp, pages = inputs
        kk, vv, tt = (kp, vp, pages) if paged else (k, v, None)
        run = decode.bind(q, kk, vv, fk_mask.Mask(right=0, lower_right=True), q.shape[-1] ** -0.5,
                           decode.Cache(0, kp.shape[2] if paged else 0), None, tt, descriptors=descriptors)
        return functools.partial(run, q, kk, vv, lengths, tt)
    return prepare


def descriptors_sweep():
    """Every row of the main job's attention-decode table, K/V through TMA and through pointers."""
    ceilings = bench.measure_ceilings()
    for case in attention_bench.decode_cases(full=True):
        case.variants = {"tma": _bound(False, True), "pointers": _bound(False, False),
                         "paged tma": _bound(True, True), "paged pointers": _bound(True, False),
                         "cudnn": case.variants["sdpa cudnn"], "flash": case.variants["sdpa flash"]}
        row = {r.variant: round(r.ms * 1e3, 1) if r.ms else r.error for r in bench.run_case(case, ceilings)}
        print(case.shape, row, flush=True)


SWEEPS = {"slices": slices_sweep, "descriptors": descriptors_sweep, "rows": rows_sweep, "fill": fill_sweep,
          "lengths": lengths_sweep, "wide": wide_sweep, "wide_pages": functools.partial(wide_sweep, WIDE_PAGE),
          "wide_depth": wide_depth_sweep, "slice_pages": slice_pages_sweep, "merge": merge_sweep}

if __name__ == "__main__":
    for name in sys.argv[1:] or SWEEPS:
        SWEEPS[name]()

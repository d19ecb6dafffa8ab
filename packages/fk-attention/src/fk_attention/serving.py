"""fk-attention's serving plan: packed sequences (prefill chunks and decode tokens mixed) against a
paged KV cache in one attention launch (`attention_varlen(..., block_table=...)`), top to bottom:
the checks, tiles, key splits, and the launches bound once per (shapes, strides, dtype, device,
mask): the optional page write of the new rows, the attention (`serving_kernels`), and the merge
of short sequences' key splits. Grids come from host-known numbers only (total query rows,
sequences, max_seqlen_k, page size, multiprocessors): no host sync, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from fk_runtime import alloc, backend, checks, sizing
from fk_runtime.launch import Launch, PlanCache, layout_key

from . import serving_kernels
from .config import (CACHE_SIZE, SERVING_BLOCK_S, SERVING_INTERPRETER_PROGRAMS, SERVING_INTERPRETER_SPLIT_KEYS,
                     SERVING_INTERPRETER_TILES, SERVING_MAX_SHORT_M, SERVING_MAX_SPLIT_ITEMS, SERVING_MAX_SPLITS,
                     SERVING_MIN_SHORT_M, SERVING_MIN_SPLIT_KEYS, SERVING_SPLIT_PROGRAMS_PER_SM,
                     SERVING_TILES_16BIT, SERVING_TILES_32BIT, SERVING_WRITE_BLOCK_S, SERVING_WRITE_ROWS)
from .layout import TILE_OFFSET_LIMIT, check_heads, padded_head_dim, precision, widened
from .mask import Mask

# The serving path's bound plans.
BOUND = PlanCache(CACHE_SIZE)

SERVING_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged(q, k, v, cu_q, cu_k, block_table, k_new, v_new) -> None:
    """What a paged varlen call takes: q (total_q, Hq, D); k, v paged caches (pages, Hk, page_size,
    D) of one shape; block_table int32 (S, pages per sequence), S + 1 = len(cu_seqlens); k_new,
    v_new (total_q, Hk, D) or both None; one dtype (fp16, bf16, fp32) and device."""
    checks.check_tensor("q", q, dtypes=SERVING_DTYPES, min_dim=3, max_dim=3)
    for name, t in (("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=SERVING_DTYPES)
        if t.dim() != 4:
            raise ValueError(f"{name} must be a paged cache (pages, Hk, page_size, D) with block_table "
                             f"(FlashAttention's (pages, page_size, Hk, D) as .transpose(1, 2)), got shape "
                             f"{tuple(t.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share the page_size (dim 2), got {k.shape[2]} and {v.shape[2]}")
    check_heads(q, k, v, 1, same=False)
    if k.shape[0] == 0 or k.shape[2] == 0:
        raise ValueError(f"a paged k (pages, Hk, page_size, D) needs pages and rows, got shape {tuple(k.shape)}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.check_tensor(name, cu, dtypes=(torch.int32,), min_dim=1, max_dim=1)
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must hold at least one entry (0), got shape {tuple(cu.shape)}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one shape (sequences + 1), got "
                         f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), min_dim=2, max_dim=2)
    if block_table.shape[0] != cu_q.shape[0] - 1:
        raise ValueError(f"block_table must hold one row of pages per sequence ({cu_q.shape[0] - 1}), got shape "
                         f"{tuple(block_table.shape)}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (new rows for both caches) or both be None")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            checks.check_tensor(name, t, dtypes=SERVING_DTYPES, min_dim=3, max_dim=3)
            if tuple(t.shape) != (q.shape[0], k.shape[1], q.shape[2]):
                raise ValueError(f"{name} must be (total_q, Hk, D) = ({q.shape[0]}, {k.shape[1]}, {q.shape[2]}), "
                                 f"packed like q, got shape {tuple(t.shape)}")
    checks.check_same_dtype(q=q, k=k, v=v, k_new=k_new, v_new=v_new)
    checks.check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=block_table,
                             k_new=k_new, v_new=v_new)
    for name, t in (("k", k), ("v", v)):  # a page's in-tile offsets are 32-bit
        if (t.shape[2] - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3)) >= TILE_OFFSET_LIMIT:
            raise ValueError(f"{name}'s page rows stride {t.stride(2)} elements: a page's offsets overflow 32 bits")


def tiles(head_dim: int, dtype: torch.dtype, group: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SHORT_M, SHORT_N, warps, stages) of the attention launch: SHORT_M the
    power of two holding a GQA group's rows (a decode token), at least the dot's 16."""
    short_m = min(max(sizing.next_power_of_2(group), SERVING_MIN_SHORT_M), SERVING_MAX_SHORT_M)
    if backend.is_interpreter():
        block_m, block_n, short_n, warps, stages = SERVING_INTERPRETER_TILES
    else:
        padded = padded_head_dim(head_dim)
        by_dim = SERVING_TILES_32BIT if dtype.itemsize > 2 else SERVING_TILES_16BIT
        block_m, block_n, short_n, warps, stages = next(entry for limit, entry in by_dim if padded <= limit)
    return max(block_m, short_m), block_n, short_m, short_n, warps, stages


def key_splits(items: int, max_k: int, device_index: int) -> tuple[int, int]:
    """(max splits, keys per split) of short sequences whose (sequence, KV head) items number at
    most `items`, over at most max_k keys (module constants of config)."""
    if backend.is_interpreter():
        wanted, min_keys = SERVING_INTERPRETER_PROGRAMS, SERVING_INTERPRETER_SPLIT_KEYS
    else:
        wanted = SERVING_SPLIT_PROGRAMS_PER_SM * backend.multiprocessor_count(device_index)
        min_keys = SERVING_MIN_SPLIT_KEYS
    most = max(1, min(SERVING_MAX_SPLITS, max_k // min_keys, SERVING_MAX_SPLIT_ITEMS // max(items, 1)))
    splits = max(1, min(sizing.next_power_of_2(sizing.cdiv(wanted, max(items, 1))), most))
    return splits, sizing.cdiv(max(max_k, 1), splits)


def bind_write(k, v, cu_q, cu_k, block_table, k_new, v_new):
    """write(k, v, cu_q, cu_k, block_table, k_new, v_new): the new rows (packed like q) written into
    the pages in place at each sequence's last Q_b key positions; None where there are none."""
    if k_new is None or k_new.shape[0] == 0 or cu_q.shape[0] < 2:
        return None
    for name, t in (("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new), ("block_table", block_table)):
        checks.check_kernel_device(name, t)
    total_q, hk, d = k_new.shape
    n_seqs = cu_q.shape[0] - 1
    launch = Launch(serving_kernels.paged_write_kernel, (sizing.cdiv(total_q, SERVING_WRITE_ROWS) * hk,),
                    (total_q, n_seqs, hk, block_table.shape[1] * k.shape[2], k.shape[0] - 1, *k_new.stride(),
                     *v_new.stride(), *k.stride(), *v.stride(), block_table.stride(0)),
                    {"PAGE_SIZE": k.shape[2], "HEAD_DIM": d, "HEAD_DIM_PADDED": padded_head_dim(d),
                     "BLOCK_R": SERVING_WRITE_ROWS,
                     "BLOCK_S": min(sizing.next_power_of_2(n_seqs), SERVING_WRITE_BLOCK_S),
                     "num_warps": sizing.MIN_WARPS}, k.device)

    def write(k, v, cu_q, cu_k, block_table, k_new, v_new):
        launch(k_new, v_new, k, v, cu_q, cu_k, block_table)

    return write


def bind(q, k, v, cu_q, cu_k, block_table, max_k: int, mask: Mask, sm_scale: float):
    """run(q, k, v, cu_q, cu_k, block_table) -> (out (total_q, Hq, D), lse (Hq, total_q) fp32): the
    attention launch and the merge of short sequences' key splits, for these layouts."""
    for name, t in (("q", q), ("k", k), ("v", v), ("block_table", block_table)):
        checks.check_kernel_device(name, t)
    total_q, hq, d = q.shape
    hk, page_size = k.shape[1], k.shape[2]
    group = hq // hk
    n_seqs = cu_q.shape[0] - 1
    device = q.device
    out_proto = torch.empty(0, dtype=q.dtype, device=device)
    fp32 = torch.empty(0, dtype=torch.float32, device=device)

    def new_outputs():
        return alloc.new_empty(out_proto, (total_q, hq, d)), alloc.new_empty(fp32, (hq, total_q))

    if q.numel() == 0 or n_seqs == 0:
        def empty(*args):
            out, lse = new_outputs()
            return out.zero_(), lse.fill_(float("-inf"))
        return empty
    block_m, block_n, short_m, short_n, warps, stages = tiles(d, q.dtype, group)
    seqs_bound = min(n_seqs, total_q)  # only sequences with query rows have items
    max_splits, chunk = key_splits(seqs_bound * hk, max_k, device.index or 0)
    # Items per KV head: each long sequence's tiles, at most its rows / BLOCK_M + 1, each short
    # one's splits.
    grid = hk * (total_q * group // block_m + seqs_bound * max_splits)
    slots = hk * seqs_bound * max_splits if max_splits > 1 else 0
    part_numel = slots * short_m * d
    softcap, _, left, right = mask.kernel_args()
    block_s = min(sizing.next_power_of_2(n_seqs), SERVING_BLOCK_S)
    capacity = block_table.shape[1] * page_size
    out_strides = new_outputs()[0].stride()
    padded = padded_head_dim(d)
    attend = Launch(serving_kernels.attn_paged_varlen_kernel, (grid,),
                    (sm_scale, softcap, total_q, n_seqs, hk, group, left, right, capacity, k.shape[0] - 1, chunk,
                     max_splits, part_numel, *q.stride(), *k.stride(), *v.stride(), *out_strides, total_q, 1,
                     block_table.stride(0)),
                    {"SOFTCAP": mask.softcap_build(q.dtype), "PAGE_SIZE": page_size, "HEAD_DIM": d,
                     "HEAD_DIM_PADDED": padded, "PRECISION": precision(q.dtype), "BLOCK_M": block_m,
                     "BLOCK_N": block_n, "SHORT_M": short_m, "SHORT_N": short_n, "BLOCK_S": block_s,
                     "num_warps": warps, "num_stages": stages}, device)
    merge = None
    if slots:
        merge = Launch(serving_kernels.attn_paged_merge_kernel, (n_seqs * hk,),
                       (total_q, n_seqs, hk, group, left, right, capacity, chunk, max_splits, part_numel,
                        *out_strides, total_q, 1),
                       {"HEAD_DIM": d, "HEAD_DIM_PADDED": padded, "SHORT_M": short_m, "BLOCK_M": block_m,
                        "BLOCK_S": block_s, "num_warps": sizing.MIN_WARPS}, device)

    def run(q, k, v, cu_q, cu_k, block_table):
        out, lse = new_outputs()
        if merge is None:
            attend(q, k, v, out, lse, lse, cu_q, cu_k, block_table)  # (no scratch: lse stands in, never read)
            return out, lse
        parts = alloc.new_empty(fp32, (part_numel + slots * short_m,))
        attend(q, k, v, out, lse, parts, cu_q, cu_k, block_table)
        merge(parts, out, lse, cu_q, cu_k)
        return out, lse

    return run


def bound(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k: int, mask: Mask, sm_scale: float):
    """run(q, k, v, cu_q, cu_k, block_table, k_new, v_new) -> (out, lse): the plan of these layouts,
    mask and scale, the inputs checked as it is made (`check_paged`)."""
    key = ("paged varlen", *layout_key(q, k, v, cu_q, cu_k, block_table, k_new, v_new), max_k, mask, sm_scale)
    run = BOUND.get(key)
    if run is None:
        check_paged(q, k, v, cu_q, cu_k, block_table, k_new, v_new)
        run = BOUND.get_or_build(key, lambda: _bind_plan(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k, mask,
                                                          sm_scale))
    return run


def _bind_plan(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k: int, mask: Mask, sm_scale: float):
    """The write, then the attention: on fp32 copies taken after the write where the interpreter
    widens bf16 (its bf16 dot is wrong)."""
    write = bind_write(k, v, cu_q, cu_k, block_table, k_new, v_new)
    fp32_copies = widened(q.dtype)
    if fp32_copies:
        attend = bind(q.float(), k.float(), v.float(), cu_q, cu_k, block_table, max_k, mask, sm_scale)
    else:
        attend = bind(q, k, v, cu_q, cu_k, block_table, max_k, mask, sm_scale)

    def run(q, k, v, cu_q, cu_k, block_table, k_new=None, v_new=None):
        if write is not None:
            write(k, v, cu_q, cu_k, block_table, k_new, v_new)
        if fp32_copies:
            out, lse = attend(q.float(), k.float(), v.float(), cu_q, cu_k, block_table)
            return out.to(q.dtype), lse
        return attend(q, k, v, cu_q, cu_k, block_table)

    return run


def forward(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k: int, mask: Mask, sm_scale: float):
    """(out, lse) of a paged varlen call: k_new / v_new (may be None) written into the pages at
    each sequence's last Q_b key positions, then every sequence's queries against its keys."""
    return bound(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k, mask, sm_scale)(
        q, k, v, cu_q, cu_k, block_table, k_new, v_new)

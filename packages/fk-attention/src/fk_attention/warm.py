"""Compile ahead of time what a model's attention calls need, so that a server or a training job
starts warm: one small call per (dtype, mask, path) on the device puts every kernel those calls
launch into Triton's cache (in this process, and on disk for the next one). Launches take fixed
configs (config.py) and the prefill kernels do not specialize on lengths (kernels.py), so later
prefill calls of any length compile nothing more; what compiles apart is the dtype, head dim, head
counts, mask, and each path (dense, packed, KV cache), as `warmup`'s arguments name them, and on
Hopper the causal forward past `config.GLUON_PERSISTENT_CAUSAL_N` query rows (one tile a program
there: `hopper.length_buckets`), which the warm-up calls too. A decode
step's launches also follow the batch size and the cache's length (split-KV slices, tiles, pages
preloaded: `decode.split_plan`): `max_batch` and `cache_rows` name the range, and one step per
compiled variant in it is made.

    python -m fk_attention.warm --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --causal
"""

from __future__ import annotations

import argparse
import itertools

import torch
from fk_runtime import ahead, backend, checks, sizing

from . import decode, hopper, ops
from . import mask as fk_mask
from .config import DECODE_MAX_QUERIES
from .layout import softmax_scale

# Rows per warm-up sequence: past config.DECODE_MAX_QUERIES (the prefill kernels, not decode) and
# two key blocks of every default tile.
ROWS = 256
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def warmup(heads: int, kv_heads: int | None = None, head_dim: int = 128, dtypes=(torch.bfloat16,),
           causal=(True,), window=None, softcap: float | None = None, backward: bool = True,
           varlen: bool = False, kvcache: bool = False, page_size: int | None = None,
           device=None, rows: int = ROWS, max_batch: int = 1, cache_rows: int | None = None) -> int:
    """Run each call a model with these heads, head dim, dtypes and masks will make, once, on small
    inputs; returns the number of calls made. `causal`: the causal settings to warm (each as
    `attention` takes it); `window` / `softcap` as `attention` takes them (one setting each);
    `backward`: also the gradients; `varlen`: `attention_varlen` too; `kvcache`:
    `attention_with_kvcache` with one new token (decode) and with `rows` (prefill), in a dense cache
    or, with `page_size`, a paged one; `rows` per sequence (more than config.DECODE_MAX_QUERIES);
    with it, a decode step for every compiled variant that batches of 1 to `max_batch` sequences
    reach on a dense cache of `cache_rows` rows (its capacity) or a paged one whose tables reach
    `cache_rows` keys (default: 2 `rows`). Nothing is timed or returned but the count."""
    heads = checks.check_size("heads", heads, minimum=1)
    kv_heads = heads if kv_heads is None else checks.check_size("kv_heads", kv_heads, minimum=1)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    head_dim = checks.check_size("head_dim", head_dim, minimum=1)
    rows = checks.check_size("rows", rows, minimum=DECODE_MAX_QUERIES + 1)
    max_batch = checks.check_size("max_batch", max_batch, minimum=1)
    cache_rows = 2 * rows if cache_rows is None else checks.check_size("cache_rows", cache_rows, minimum=1)
    if page_size is not None:
        page_size = checks.check_size("page_size", page_size, minimum=1)
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if isinstance(causal, (bool, str)):
        causal = (causal,)
    device = torch.device(device) if device is not None else backend.default_device()
    calls = 0
    for dtype, c in itertools.product(dtypes, causal):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtypes must hold torch dtypes, got {dtype!r}")
        mask = {"causal": c, "window": window, "softcap": softcap}
        grad = backward and dtype.itemsize > 1

        def new(h, grad=grad, dtype=dtype, rows=rows):
            return torch.randn(1, rows, h, head_dim, device=device, dtype=dtype).requires_grad_(grad)

        q, k, v = new(heads), new(kv_heads), new(kv_heads)
        out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **mask)
        if grad:
            out.sum().backward()
        calls += 1
        calls += _past_buckets(q, k, v, mask, new)
        if varlen:
            cu = torch.tensor([0, rows // 2, rows], device=device, dtype=torch.int32)
            out = ops.attention_varlen(q[0], k[0], v[0], cu, cu, rows - rows // 2, rows - rows // 2, **mask)
            if grad:
                out.sum().backward()
            calls += 1
        if kvcache:
            calls += _kvcache(q, k, v, kv_heads, page_size, mask)
            calls += _decode_steps(q, kv_heads, page_size or 0, max_batch, cache_rows, mask)
    return calls


def _past_buckets(q, k, v, mask, new) -> int:
    """A forward past each length at which the dense forward of these inputs compiles another
    variant (`hopper.length_buckets`: the causal persistent grid's limit on Hopper)."""
    views = [t.detach().transpose(1, 2) for t in (q, k, v)]
    as_mask = fk_mask.from_op_args(fk_mask.op_args(mask["causal"], mask["window"], mask["softcap"]))
    calls = 0
    for bound in hopper.length_buckets(*views, as_mask, softmax_scale(None, q.shape[-1])):
        longer = [new(t.shape[2], grad=False, rows=bound + 1).transpose(1, 2) for t in (q, k, v)]
        ops.attention(*longer, **mask)
        calls += 1
    return calls


def _kvcache(q, k, v, kv_heads, page_size, mask) -> int:
    """A prefill chunk and a decode step against a cache of twice q's rows (paged with `page_size`)."""
    rows, head_dim = q.shape[1], q.shape[-1]
    capacity = 2 * rows
    if page_size is None:
        cache_shape, table = (1, kv_heads, capacity, head_dim), None
    else:
        pages = -(-capacity // page_size)
        cache_shape = (pages, kv_heads, page_size, head_dim)
        table = torch.arange(pages, device=q.device, dtype=torch.int32)[None]
    k_cache = torch.zeros(cache_shape, device=q.device, dtype=q.dtype)
    v_cache = torch.zeros(cache_shape, device=q.device, dtype=q.dtype)
    lengths = torch.zeros(1, device=q.device, dtype=torch.int32)
    q, k, v = (t.detach().transpose(1, 2) for t in (q, k, v))
    for n in (rows, 1):
        ops.attention_with_kvcache(q[:, :, :n], k_cache, v_cache, lengths, k[:, :, :n], v[:, :, :n],
                                   block_table=table, **mask)
    return 2


def decode_variant(b: int, n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
                   index: int) -> tuple:
    """What a one-row decode step of b sequences over n keys (a dense cache's rows, a paged table's
    keys) compiles: its split's variant and, for a dense cache, whether the rows' stride is a
    multiple of 16 (Triton keys on it)."""
    split = decode.split_plan(b, kv_heads, heads // kv_heads, n, head_dim, dtype, page_size, index)
    return split.variant(head_dim, index), page_size or (n * head_dim) % 16 == 0


def _decode_variants(heads, kv_heads, head_dim, dtype, page_size, max_batch, cache_rows, index) -> list:
    """(batch, keys) of one decode step per compiled variant (`decode_variant`) that batches of
    1..max_batch reach on a dense cache of cache_rows rows, or on tables of up to cache_rows keys of
    a paged one: each variant's step on the fewest cache rows that reach it."""

    def variant(b, n):
        return decode_variant(b, n, heads, kv_heads, head_dim, dtype, page_size, index)

    if page_size:
        widths = [p * page_size for p in range(1, sizing.cdiv(cache_rows, page_size) + 1)]
    else:
        widths = sorted({cache_rows, *(1 << i for i in range(6, cache_rows.bit_length()))})
    steps: dict = {}
    for b in range(1, max_batch + 1):
        if page_size:
            for n in widths:
                steps.setdefault(variant(b, n), (b, n))
        else:
            wanted = variant(b, cache_rows)
            n = next(n for n in widths if variant(b, n) == wanted)
            if wanted not in steps or b * n < steps[wanted][0] * steps[wanted][1]:
                steps[wanted] = (b, n)
    return list(steps.values())


def _decode_steps(q, kv_heads, page_size, max_batch, cache_rows, mask) -> int:
    """A decode step (`attention_with_kvcache`, one query row, nothing appended, empty sequences:
    nothing is read) per `_decode_variants` step, compiles made side by side (`ahead`)."""
    heads, head_dim, dtype, device = q.shape[2], q.shape[-1], q.dtype, q.device
    steps = _decode_variants(heads, kv_heads, head_dim, dtype, page_size, max_batch, cache_rows, device.index or 0)
    with ahead.compile_ahead():
        for b, n in steps:
            query = torch.zeros(b, heads, 1, head_dim, device=device, dtype=dtype)
            seqlens = torch.zeros(b, device=device, dtype=torch.int32)
            if page_size:
                k_cache = torch.zeros(1, kv_heads, page_size, head_dim, device=device, dtype=dtype)
                table = torch.zeros(b, n // page_size, device=device, dtype=torch.int32)
            else:
                k_cache, table = torch.zeros(b, kv_heads, n, head_dim, device=device, dtype=dtype), None
            ops.attention_with_kvcache(query, k_cache, k_cache, seqlens, block_table=table, **mask)
    ahead.finish()
    return len(steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fk_attention.warm", description=warmup.__doc__)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["bfloat16"])
    parser.add_argument("--causal", action="store_true", help="causal masks (default: full)")
    parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"))
    parser.add_argument("--softcap", type=float)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--varlen", action="store_true")
    parser.add_argument("--kvcache", action="store_true")
    parser.add_argument("--page-size", type=int)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--max-batch", type=int, default=1, help="decode: batches of 1 to this many sequences")
    parser.add_argument("--cache-rows", type=int, help="decode: a dense cache's rows, a paged one's longest table")
    args = parser.parse_args(argv)
    calls = warmup(args.heads, args.kv_heads, args.head_dim, [DTYPES[d] for d in args.dtype], (args.causal,),
                   args.window, args.softcap, not args.no_backward, args.varlen, args.kvcache, args.page_size,
                   rows=args.rows, max_batch=args.max_batch, cache_rows=args.cache_rows)
    print(f"fk-attention: {calls} warm-up calls made")


if __name__ == "__main__":
    main()

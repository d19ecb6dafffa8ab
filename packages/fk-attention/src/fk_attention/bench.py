"""fk-attention's check and benchmark sweep, run by `python -m fk_runtime`.

Full sweep (GPU): 16384 tokens per batch (B * N), H * D = 2048 (32 heads of 64, 16 of 128),
N in {1024, 4096, 16384}, bf16 and fp16, causal and not, forward and backward, against SDPA's
cuDNN and flash backends in the same run (PyTorch's own attention kernels: torch.compile of SDPA
calls the same ones, and Liger has no attention kernel). TFLOP/s counts 4 * B * H * N^2 * D for
the forward (half when causal) and 2.5x that for the backward; peak memory is recorded at
N = 16384. Small sweep (interpreter): one tiny fp32 shape against SDPA's default. Host time per
call (`host_cases`): one tiny causal bf16 input against SDPA's default backend (named "torch",
PyTorch's own op, like the other ops' host rows).

Three more tables (`feature_cases`), TFLOP/s of real work (visible scores only) for every column
of a row, so a peer's rate is fk's work over the peer's time and `fk / peer` the speedup:
- attention-varlen: 16384 tokens packed as documents (equal lengths, and random lengths with a
  fixed seed), causal, against fk's dense kernel on the same documents (equal lengths: the same
  batch; random: padded to the longest) and SDPA on the whole packed sequence with the equivalent
  block-diagonal causal mask (its backends that take a mask).
- attention-window: a causal sliding window, and a causal softcap (Gemma 2's), at N = 16384, d64 and
  d128, against fk's full causal.
- attention-head-dims: head dims 64, 96, 128, 256 at one shape (d96 runs padded to 128 in `tl`).

attention-serving (`serving_cases`): a serving batch against a paged cache, device time of the mixed
batch in ONE `attention_varlen(..., block_table=...)` call ("fk") against the same work as two
`attention_with_kvcache` calls ("prefill + decode": its "fk / prefill + decode" column is
(prefill + decode) / mixed, at least 1 where one call is no slower than two) and each alone.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fk_runtime import backend, sizing
from fk_runtime.harness import bench, testing

from .flash_attn import flash_attn_func
from .ops import attention, attention_varlen, attention_with_kvcache

TOKENS = 16384
MODEL_DIM = 2048
FULL_LENGTHS = [1024, 4096, 16384]
HEAD_DIMS = [64, 128]
DTYPES = [torch.bfloat16, torch.float16]
MEMORY_LENGTH = 16384
# Small sweep: (B, H, N, D) in fp32.
SMALL_SHAPE = (2, 2, 32, 16)
# Host time per call: (B, H, N, D), causal. fp32 on the interpreter, where bf16 tl.dot is unreliable
# (and the numbers mean nothing anyway).
HOST_SHAPE = (1, 8, 128, 64)
# The interpreter's stand-in: HOST_SHAPE's calls took about a minute there (CI runs the main job).
SMALL_HOST_SHAPE = (1, 2, 32, 16)
# One decode step against a KV cache (B, Hq, Hk, cache length, D), and the interpreter's stand-in.
HOST_DECODE, SMALL_HOST_DECODE = (1, 32, 8, 1024, 128), (1, 4, 2, 32, 16)
# Backward flops per forward flop: five N x N x D matmuls (scores recomputed, dP, dV, dK, dQ)
# against the forward's two, FlashAttention's convention (fk's split backward does seven).
BACKWARD_FLOP_FACTOR = 2.5
# Packed documents: TOKENS tokens, H * D = MODEL_DIM, causal. Random lengths: uniform in
# [PACKED_MIN, PACKED_MAX] (the last one cut to fit), drawn from PACKED_SEED so every run packs the
# same documents; equal: PACKED_EQUAL tokens each.
PACKED_HEAD_DIMS = [64, 128]
PACKED_MIN, PACKED_MAX, PACKED_SEED = 64, 4096, 0
PACKED_EQUAL = 2048
# Sliding window: (B, H, N, D) causal, WINDOW keys to the left; each shape also softcapped.
WINDOW_SHAPES, WINDOW = ((1, 16, 16384, 128), (1, 32, 16384, 64)), 1024
SOFTCAP = 50.0  # Gemma 2's attention logit cap
# Head dims at one causal shape: (B, H, N), head dims.
HEAD_DIM_SHAPE, HEAD_DIM_SWEEP = (8, 16, 2048), [64, 96, 128, 256]
# SDPA backends that take an arbitrary mask (flash takes none).
MASKED_SDPA = {"sdpa cudnn (mask)": "CUDNN_ATTENTION", "sdpa efficient (mask)": "EFFICIENT_ATTENTION"}
# One-token decode (`decode_cases`), bf16: batches x cache lengths x (Hq, Hk) x head dims, the
# cache full to its length; rows whose K and V exceed DECODE_MAX_KV_BYTES are left out (each
# row holds a dense and a paged copy). Paged copies in pages of DECODE_PAGE rows, shuffled, laid
# out (pages, Hk, page, D). On a GPU, "kv read" and "paged read" (`kv_read`) only read the same K
# and V, dense and through the same page table: each row's read ceiling, and what paging costs a
# pure read.
DECODE_BATCHES = [1, 16, 64]
DECODE_LENGTHS = [1024, 8192, 32768, 131072]
DECODE_HEADS = [(32, 8), (32, 32)]
DECODE_HEAD_DIMS = [64, 128]
DECODE_PAGE = 64
DECODE_MAX_KV_BYTES = 16 << 30
SMALL_DECODE = (2, 4, 2, 48, 16)  # (B, Hq, Hk, length, D)
# `kv_read`: blocks of at least KV_READ_ROWS rows and KV_READ_TILE elements; programs per
# multiprocessor (on the interpreter: programs in all). On an H200, 64-row blocks at d64 with 4
# programs per SM read 12% below fk's decode and 16% below cuDNN's at B64 KV32768 H32:8 d64.
KV_READ_ROWS, KV_READ_TILE, KV_READ_PROGRAMS_PER_SM, KV_READ_INTERPRETER_PROGRAMS = 64, 8192, 8, 8
# Interpreter stand-ins: documents, window and head dims small enough for the CPU.
SMALL_PACKED, SMALL_HEADS, SMALL_HEAD_DIM = [5, 16, 11], 2, 16
SMALL_WINDOW_SHAPE, SMALL_WINDOW = (1, 2, 48, 16), 8
# A serving batch (`serving_cases`), causal, bf16: PREFILL sequences of (new rows, cached rows),
# DECODE sequences of one new row onto cached rows uniform in [low, high] (drawn from SERVING_SEED),
# Hq:Hk heads of head dim d, pages of SERVING_PAGE rows, shuffled; and the interpreter's stand-in
# (fp32). The new rows are in the cache already: the timed calls only read it.
SERVING_PREFILL, SERVING_DECODE, SERVING_HEADS, SERVING_PAGE = (8, 512, 2048), (56, 4096, 16384), (32, 8, 128), 256
SMALL_SERVING_PREFILL, SMALL_SERVING_DECODE, SMALL_SERVING_HEADS, SMALL_SERVING_PAGE = (2, 8, 8), (2, 20, 40), \
    (4, 2, 16), 8
SERVING_SEED = 0


def _sdpa(backend_name: str | None, causal: bool):
    """SDPA on one backend; the backend is picked inside the call, as the timed work runs it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend_name is None:
        return functools.partial(F.scaled_dot_product_attention, is_causal=causal)
    chosen = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, -1) @ v


def _masked_sdpa(backend_name: str, mask: torch.Tensor):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def checks(full: bool):
    """Forward and every gradient against float64 (bounds widened by SDPA's own error in half
    precision): odd lengths, Nq != Nk, GQA, padded head dims."""
    shapes = [(1, 2, 1, 33, 47, 40), (2, 4, 2, 64, 64, 64)]
    if full:
        shapes += [(1, 8, 2, 4097, 4097, 128), (1, 4, 4, 1000, 1000, 96)]
    dtypes = [torch.bfloat16, torch.float16] if full else [torch.float32, torch.float16]
    for shape in shapes:
        for dtype in dtypes:
            for causal in (False, True):
                def check(shape=shape, dtype=dtype, causal=causal):
                    b, hq, hk, nq, nk, d = shape
                    q = testing.randn((b, hq, nq, d), dtype, requires_grad=True)
                    k = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    v = testing.randn((b, hk, nk, d), dtype, requires_grad=True)
                    baseline = functools.partial(F.scaled_dot_product_attention, is_causal=causal,
                                                 enable_gqa=True)
                    return testing.check_against_reference(
                        functools.partial(attention, causal=causal),
                        functools.partial(_reference, causal=causal), [q, k, v], dtype=dtype,
                        names=["q", "k", "v"], baseline_fn=None if dtype == torch.float32 else baseline,
                    )

                yield f"attention {shape} {str(dtype).removeprefix('torch.')} causal={causal}", check


def cases(full: bool) -> list[bench.Case]:
    if full:
        grid = [(TOKENS // n, MODEL_DIM // d, n, d, dtype, causal)
                for n in FULL_LENGTHS for d in HEAD_DIMS for dtype in DTYPES for causal in (False, True)]
    else:
        b, h, n, d = SMALL_SHAPE
        grid = [(b, h, n, d, torch.float32, causal) for causal in (False, True)]
    out = []
    for b, h, n, d, dtype, causal in grid:
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)

        def make_inputs(b=b, h=h, n=n, d=d, dtype=dtype):
            return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

        variants = {"fk": functools.partial(attention, causal=causal)}
        if full:
            variants["sdpa cudnn"] = _sdpa("CUDNN_ATTENTION", causal)
            variants["sdpa flash"] = _sdpa("FLASH_ATTENTION", causal)
        else:
            variants["sdpa"] = _sdpa(None, causal)
        label = f"B{b} H{h} N{n} d{d}{' causal' if causal else ''}"
        for direction, wrap, work in [("fwd", bench.forward, flops),
                                      ("bwd", bench.backward, BACKWARD_FLOP_FACTOR * flops)]:
            out.append(bench.Case(
                op="attention", direction=direction, shape=label, dtype=dtype, unit=bench.TFLOPS,
                work=work, make_inputs=make_inputs,
                variants={name: wrap(fn) for name, fn in variants.items()},
                input_bytes=3 * b * h * n * d * dtype.itemsize,
                memory=n == MEMORY_LENGTH,
            ))
    return out + feature_cases(full)


def causal_flops(lengths, heads: int, head_dim: int) -> float:
    """Visible scores' flops of causal attention over documents of these lengths (FlashAttention's
    count: half the square)."""
    return sum(2.0 * heads * n * n * head_dim for n in lengths)


def packed_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths uniform in [low, high] from `seed`, the last cut to fill `tokens`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        drawn = int(torch.randint(low, high + 1, (1,), generator=generator))
        lengths.append(min(drawn, tokens - sum(lengths)))
    return lengths


def _rebuilt(build, fn, direction: str):
    """A variant that first lays the packed inputs out another way (`build(q, k, v)` -> new leaf
    tensors, untimed), then times `fn` on them, forward or backward."""
    wrap = bench.forward if direction == "fwd" else bench.backward
    return lambda inputs: wrap(fn)(build(*inputs[:3]))


def _leaves(*tensors):
    return [t.detach().contiguous().requires_grad_() for t in tensors]


def _varlen_cases(lengths, heads: int, head_dim: int, dtype, label: str, full: bool) -> list[bench.Case]:
    total, longest = sum(lengths), max(lengths)
    device = testing.device()
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    # Packed row t of document s sits at row t - cu[s] of batch entry s in the padded layout.
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    pos = torch.arange(total, device=device) - cu[:-1].long()[doc]

    def make_inputs():
        return [testing.randn((total, heads, head_dim), dtype, requires_grad=True) for _ in range(3)]

    def padded(q, k, v):
        out = []
        for t in (q, k, v):
            dense = t.new_zeros(len(lengths), longest, heads, head_dim)
            dense[doc, pos] = t.detach()
            out.append(dense.transpose(1, 2).requires_grad_())
        return out

    def whole(q, k, v):
        return _leaves(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))

    packed = functools.partial(attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                               max_seqlen_k=longest, causal=True)
    dense = functools.partial(attention, causal=True)
    flops = causal_flops(lengths, heads, head_dim)
    out = []
    for direction, work in [("fwd", flops), ("bwd", BACKWARD_FLOP_FACTOR * flops)]:
        variants = {"fk": (bench.forward if direction == "fwd" else bench.backward)(packed),
                    "fk dense": _rebuilt(padded, dense, direction)}
        if full:
            keep = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool,
                                                               device=device).tril()
            for name, backend_name in MASKED_SDPA.items():
                variants[name] = _rebuilt(whole, _masked_sdpa(backend_name, keep), direction)
        out.append(bench.Case(
            op="attention-varlen", direction=direction, shape=f"{label} H{heads} d{head_dim} causal",
            dtype=dtype, unit=bench.TFLOPS, work=work, make_inputs=make_inputs, variants=variants,
            input_bytes=3 * total * heads * head_dim * dtype.itemsize,
        ))
    return out


def _window_cases(shape, window: int | None, dtype, softcap: float | None = None) -> list[bench.Case]:
    b, h, n, d = shape
    # Query i sees min(i, window) + 1 keys.
    visible = sum(min(i, n if window is None else window) + 1 for i in range(n))
    flops = 4.0 * b * h * d * visible

    def make_inputs():
        return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

    variants = {"fk": functools.partial(attention, causal=True, window=None if window is None else (window, 0),
                                        softcap=softcap),
                "fk full causal": functools.partial(attention, causal=True)}
    label = "".join(f" {name} {x}" for name, x in (("window", window), ("softcap", softcap)) if x is not None)
    return [bench.Case(op="attention-window", direction=direction, shape=f"B{b} H{h} N{n} d{d} causal{label}",
                       dtype=dtype, unit=bench.TFLOPS, work=factor * flops,
                       make_inputs=make_inputs, variants={k: wrap(fn) for k, fn in variants.items()},
                       input_bytes=3 * b * h * n * d * dtype.itemsize)
            for direction, wrap, factor in [("fwd", bench.forward, 1.0),
                                            ("bwd", bench.backward, BACKWARD_FLOP_FACTOR)]]


def _head_dim_cases(shape, head_dims, dtype) -> list[bench.Case]:
    b, h, n = shape
    out = []
    for d in head_dims:
        flops = 2.0 * b * h * n * n * d

        def make_inputs(d=d):
            return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

        variants = {"fk": functools.partial(attention, causal=True),
                    "sdpa cudnn": _sdpa("CUDNN_ATTENTION", True),
                    "sdpa flash": _sdpa("FLASH_ATTENTION", True)}
        for direction, wrap, factor in [("fwd", bench.forward, 1.0),
                                        ("bwd", bench.backward, BACKWARD_FLOP_FACTOR)]:
            out.append(bench.Case(op="attention-head-dims", direction=direction,
                                  shape=f"B{b} H{h} N{n} d{d} causal", dtype=dtype, unit=bench.TFLOPS,
                                  work=factor * flops, make_inputs=make_inputs,
                                  variants={k: wrap(fn) for k, fn in variants.items()},
                                  input_bytes=3 * b * h * n * d * dtype.itemsize))
    return out


def feature_cases(full: bool) -> list[bench.Case]:
    """Packed documents, a sliding window and head dims (module docstring); tiny on the interpreter."""
    if not full:
        return (_varlen_cases(SMALL_PACKED, SMALL_HEADS, SMALL_HEAD_DIM, torch.float32, "small", full)
                + _window_cases(SMALL_WINDOW_SHAPE, SMALL_WINDOW, torch.float32)
                + _window_cases(SMALL_WINDOW_SHAPE, None, torch.float32, SOFTCAP) + decode_cases(full)
                + serving_cases(full))
    dtype = torch.bfloat16
    out = []
    for d in PACKED_HEAD_DIMS:
        heads = MODEL_DIM // d
        out += _varlen_cases([PACKED_EQUAL] * (TOKENS // PACKED_EQUAL), heads, d, dtype,
                             f"{TOKENS // PACKED_EQUAL}x{PACKED_EQUAL} equal", full)
        lengths = packed_lengths(TOKENS, PACKED_MIN, PACKED_MAX, PACKED_SEED)
        out += _varlen_cases(lengths, heads, d, dtype,
                             f"{len(lengths)} docs random {PACKED_MIN}-{PACKED_MAX}", full)
    for shape in WINDOW_SHAPES:
        out += _window_cases(shape, WINDOW, dtype) + _window_cases(shape, None, dtype, SOFTCAP)
    return out + _head_dim_cases(HEAD_DIM_SHAPE, HEAD_DIM_SWEEP, dtype) + decode_cases(full) + serving_cases(full)


@triton.jit
def kv_read_kernel(k_ptr, v_ptr, lengths_ptr, table_ptr, out_ptr, chunk_rows,
                   skb, skh, skn, skd, svb, svh, svn, svd, stb, stp,
                   HK: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Sums K + V over rows [chunk start, chunk end) of sequence b's rows [0, lengths[b]) at KV
    head h, into out[(b * HK + h) * CHUNKS + chunk]. Paged: skb/svb are the page strides and row j
    sits in page table[b, j // PAGE_SIZE], at row j % PAGE_SIZE."""
    pid = tl.program_id(0)
    bh, chunk = pid // CHUNKS, pid % CHUNKS
    b, h = bh // HK, bh % HK
    lo = chunk * chunk_rows
    hi = tl.minimum(lo + chunk_rows, tl.load(lengths_ptr + b))
    cols = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    page_table = table_ptr + b * stb
    if PAGED and PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(page_table + (lo // PAGE_SIZE) * stp, mask=lo < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        mask = (rows < hi)[:, None]
        if PAGED and PAGE_SIZE % BLOCK_N == 0:  # chunks start on a block: the block lies in one page
            k_rows = page * skb + (start % PAGE_SIZE + tl.arange(0, BLOCK_N)) * skn
            v_rows = page * svb + (start % PAGE_SIZE + tl.arange(0, BLOCK_N)) * svn
            # The next block's page, loaded now: its latency overlaps this block's tiles.
            page = tl.load(page_table + ((start + BLOCK_N) // PAGE_SIZE) * stp, mask=start + BLOCK_N < hi,
                           other=0).to(tl.int64)
        elif PAGED:  # pages smaller than a block: each row's own page
            page = tl.load(page_table + (rows // PAGE_SIZE) * stp, mask=rows < hi, other=0).to(tl.int64)
            k_rows = page * skb + (rows % PAGE_SIZE) * skn
            v_rows = page * svb + (rows % PAGE_SIZE) * svn
        else:
            k_rows = b.to(tl.int64) * skb + rows * skn
            v_rows = b.to(tl.int64) * svb + rows * svn
        k = tl.load(k_ptr + h * skh + k_rows[:, None] + cols[None, :] * skd, mask=mask, other=0.0)
        v = tl.load(v_ptr + h * svh + v_rows[:, None] + cols[None, :] * svd, mask=mask, other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    # One value per program, stored: the compiler cannot drop the loads that feed it.
    tl.store(out_ptr + pid, tl.sum(acc))


def kv_read(k, v, n, block_table=None, page_size: int = 0, block_n: int = 0) -> torch.Tensor:
    """Reads sequence b's first n rows (an int, or a (B,) int32 tensor of lengths) of K and V at
    every KV head, dense (B, Hk, N, D) or paged ((pages, Hk, page_size, D) through `block_table`
    (B, pages per sequence)); returns the per-program sums, (B, Hk, chunks) fp32. A read ceiling for
    decode, not an op: chunks per (b, h) the fewest power of two giving KV_READ_PROGRAMS_PER_SM
    programs per multiprocessor (KV_READ_INTERPRETER_PROGRAMS on the interpreter), each chunk at
    least block_n rows (0: module constants)."""
    paged = block_table is not None
    d = k.shape[-1]
    if d != sizing.next_power_of_2(d):
        raise ValueError(f"kv_read reads power-of-two head dims (one tile a row), got {d}")
    block_n = block_n or max(KV_READ_ROWS, KV_READ_TILE // d)
    if paged:
        page_size = page_size or k.shape[2]
        b, hk, capacity = block_table.shape[0], k.shape[1], block_table.shape[1] * page_size
    else:
        b, hk, capacity = k.shape[0], k.shape[1], k.shape[2]
    if not isinstance(n, torch.Tensor):
        n = torch.full((b,), n, dtype=torch.int32, device=k.device)
    if backend.is_interpreter():
        wanted = KV_READ_INTERPRETER_PROGRAMS
    else:
        wanted = KV_READ_PROGRAMS_PER_SM * backend.multiprocessor_count(k.device.index or 0)
    most = max(1, sizing.cdiv(capacity, block_n))
    chunks = 1
    while b * hk * chunks < wanted and 2 * chunks <= most:
        chunks *= 2
    chunk_rows = sizing.cdiv(sizing.cdiv(capacity, chunks), block_n) * block_n
    out = torch.empty(b, hk, chunks, dtype=torch.float32, device=k.device)
    table = block_table if paged else n  # any int32 pointer when dense: never read
    table_strides = block_table.stride() if paged else (0, 0)
    kv_read_kernel[(b * hk * chunks,)](
        k, v, n, table, out, chunk_rows, *k.stride(), *v.stride(), *table_strides,
        HK=hk, CHUNKS=chunks, HEAD_DIM=d, BLOCK_N=block_n, PAGED=paged, PAGE_SIZE=max(page_size, 1),
        num_warps=4, num_stages=3)
    return out


def paged_copy(t: torch.Tensor, page: int, order: torch.Tensor) -> torch.Tensor:
    """t (B, Hk, N, D) as a paged cache, (pages, Hk, page, D): sequence b's page i at order[b, i]
    ((B, pages per sequence) int32), rows past N zero."""
    b, hk, n, d = t.shape
    per_seq = order.shape[1]
    pages = t.new_zeros(b * per_seq, hk, page, d)
    whole = F.pad(t, (0, 0, 0, per_seq * page - n))
    pages[order.flatten().long()] = whole.unflatten(2, (per_seq, page)).transpose(1, 2).flatten(0, 1)
    return pages


def _decode_case(b: int, hq: int, hk: int, n: int, d: int, dtype, full: bool) -> bench.Case:
    """One decode step (one query row per head) against a full cache of n rows: fk on a dense and
    on a paged cache, SDPA's backends on the dense K/V (GQA without copies: enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make_inputs():
        q = testing.randn((b, hq, 1, d), dtype)
        k, v = testing.randn((b, hk, n, d), dtype), testing.randn((b, hk, n, d), dtype)
        seqlens = torch.full((b,), n, dtype=torch.int32, device=q.device)
        per_seq = sizing.cdiv(n, DECODE_PAGE)
        order = torch.randperm(b * per_seq, device=q.device).to(torch.int32).view(b, per_seq)
        return [q, k, v, seqlens, paged_copy(k, DECODE_PAGE, order), paged_copy(v, DECODE_PAGE, order), order]

    def sdpa(name):
        def run(q, k, v, *rest):
            with sdpa_kernel(getattr(SDPBackend, name)):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return run

    variants = {"fk": lambda q, k, v, n, kp, vp, t: attention_with_kvcache(q, k, v, n, causal=True),
                "fk paged": lambda q, k, v, n, kp, vp, t: attention_with_kvcache(q, kp, vp, n, block_table=t,
                                                                                causal=True)}
    if full:
        variants.update({"sdpa cudnn": sdpa("CUDNN_ATTENTION"), "sdpa flash": sdpa("FLASH_ATTENTION"),
                         "kv read": lambda q, k, v, n, kp, vp, t: kv_read(k, v, n),
                         "paged read": lambda q, k, v, n, kp, vp, t: kv_read(kp, vp, n, block_table=t,
                                                                             page_size=DECODE_PAGE)})
    kv_bytes = 2 * b * hk * n * d * dtype.itemsize
    return bench.Case(op="attention-decode", direction="fwd", shape=f"B{b} KV{n} H{hq}:{hk} d{d}", dtype=dtype,
                      unit=bench.GBPS, work=kv_bytes, make_inputs=make_inputs,
                      variants={k: bench.forward(fn) for k, fn in variants.items()}, input_bytes=kv_bytes)


def decode_cases(full: bool) -> list[bench.Case]:
    """One-token decode against SDPA's cuDNN and flash backends (module constants)."""
    if not full:
        b, hq, hk, n, d = SMALL_DECODE
        return [_decode_case(b, hq, hk, n, d, torch.float32, full)]
    dtype = torch.bfloat16
    return [_decode_case(b, hq, hk, n, d, dtype, full)
            for (hq, hk) in DECODE_HEADS for d in DECODE_HEAD_DIMS for b in DECODE_BATCHES for n in DECODE_LENGTHS
            if 2 * b * hk * n * d * dtype.itemsize <= DECODE_MAX_KV_BYTES]


def serving_cases(full: bool) -> list[bench.Case]:
    """A serving batch (module constants): the mixed batch in one paged varlen call against the
    prefill and decode batches as two KV-cache calls."""
    (n_pre, new, cached), (n_dec, low, high), (hq, hk, d), page = (
        (SERVING_PREFILL, SERVING_DECODE, SERVING_HEADS, SERVING_PAGE) if full
        else (SMALL_SERVING_PREFILL, SMALL_SERVING_DECODE, SMALL_SERVING_HEADS, SMALL_SERVING_PAGE))
    dtype = torch.bfloat16 if full else torch.float32
    generator = torch.Generator().manual_seed(SERVING_SEED)
    decode_lengths = torch.randint(low, high + 1, (n_dec,), generator=generator).tolist()
    lengths = [cached + new] * n_pre + decode_lengths
    rows = [new] * n_pre + [1] * n_dec
    per_seq = sizing.cdiv(max(lengths), page)
    pages = sum(sizing.cdiv(n, page) for n in lengths)

    def make_inputs():
        dev = testing.device()
        order = torch.randperm(pages, device=dev).to(torch.int32)
        table = torch.zeros(len(lengths), per_seq, dtype=torch.int32, device=dev)
        used = 0
        for b, n in enumerate(lengths):  # each sequence its own pages, spread over the cache
            table[b, :sizing.cdiv(n, page)] = order[used:used + sizing.cdiv(n, page)]
            used += sizing.cdiv(n, page)
        k, v = testing.randn((pages, hk, page, d), dtype), testing.randn((pages, hk, page, d), dtype)
        q = testing.randn((sum(rows), hq, d), dtype)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=dev)  # noqa: E731
        cu_q, cu_k = as_tensor([0, *itertools.accumulate(rows)]), as_tensor([0, *itertools.accumulate(lengths)])
        q_pre = q[:n_pre * new].view(n_pre, new, hq, d).transpose(1, 2)
        q_dec = q[n_pre * new:].view(n_dec, 1, hq, d).transpose(1, 2)
        return [q, k, v, table, cu_q, cu_k, q_pre, q_dec, as_tensor(lengths)]

    def mixed(q, k, v, table, cu_q, cu_k, q_pre, q_dec, seqlens):
        return attention_varlen(q, k, v, cu_q, cu_k, new, max(lengths), causal=True, block_table=table)

    def prefill(q, k, v, table, cu_q, cu_k, q_pre, q_dec, seqlens):
        return attention_with_kvcache(q_pre, k, v, seqlens[:n_pre], block_table=table[:n_pre], causal=True)

    def decode(q, k, v, table, cu_q, cu_k, q_pre, q_dec, seqlens):
        return attention_with_kvcache(q_dec, k, v, seqlens[n_pre:], block_table=table[n_pre:], causal=True)

    variants = {"fk": mixed, "prefill + decode": lambda *a: (prefill(*a), decode(*a))}
    if full:  # (the interpreter: the two columns that show the path runs)
        variants.update({"prefill": prefill, "decode": decode})
    visible = n_pre * (new * cached + new * (new + 1) // 2) + sum(decode_lengths)  # scores, causal
    return [bench.Case(op="attention-serving", direction="fwd",
                       shape=f"{n_pre}x{new} on {cached} + {n_dec}x1 on {low}-{high} H{hq}:{hk} d{d} page{page}",
                       dtype=dtype, unit=bench.TFLOPS, work=4 * visible * hq * d, make_inputs=make_inputs,
                       variants={name: bench.forward(fn) for name, fn in variants.items()},
                       input_bytes=2 * pages * hk * page * d * dtype.itemsize)]


def host_cases() -> list[bench.HostCase]:
    """A tiny causal input, where a call's cost is its host work, against SDPA's default (packed: on the
    same sequences as a batch; on a GPU also the flash_attn layer against fk's own call)."""
    b, h, n, d = HOST_SHAPE if testing.on_gpu() else SMALL_HOST_SHAPE
    dtype = torch.bfloat16 if testing.on_gpu() else torch.float32

    def make_inputs():
        return [testing.randn((b, h, n, d), dtype, requires_grad=True) for _ in range(3)]

    db, dhq, dhk, dn, dd = HOST_DECODE if testing.on_gpu() else SMALL_HOST_DECODE

    def decode_inputs():
        lengths = torch.full((db,), dn, dtype=torch.int32, device=testing.device())
        return [testing.randn((db, dhq, 1, dd), dtype), testing.randn((db, dhk, dn, dd), dtype),
                testing.randn((db, dhk, dn, dd), dtype), lengths]

    def flash_layout_inputs():  # FlashAttention's (B, N, H, D)
        return [testing.randn((b, n, h, d), dtype, requires_grad=True) for _ in range(3)]

    def packed_inputs():  # three sequences of n tokens, packed, and their bounds
        tokens = [testing.randn((3 * n, h, d), dtype, requires_grad=True) for _ in range(3)]
        return [*tokens, torch.arange(0, 3 * n + 1, n, dtype=torch.int32, device=testing.device())]

    def packed_sdpa(q, k, v, cu):  # torch has no packed call: SDPA on the equal lengths as a batch
        q, k, v = (t.view(3, n, h, d).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(3 * n, h, d)

    def native(q, k, v):  # what the flash_attn layer stands for: fk's call on (B, H, N, D) views
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)

    cases = [bench.HostCase(op="attention", shape=f"B{b} H{h} N{n} d{d} causal", dtype=dtype,
                           make_inputs=make_inputs,
                           variants={"fk": functools.partial(attention, causal=True),
                                     "torch": _sdpa(None, True)}),
            bench.HostCase(op="attention_with_kvcache", shape=f"B{db} KV{dn} H{dhq}:{dhk} d{dd} decode", dtype=dtype,
                           make_inputs=decode_inputs, modes=("infer",),
                           variants={"fk": lambda q, k, v, lengths: attention_with_kvcache(q, k, v, lengths,
                                                                                           causal=True),
                                     "torch": lambda q, k, v, lengths: F.scaled_dot_product_attention(
                                         q, k, v, enable_gqa=True)}),
            bench.HostCase(op="attention_varlen", shape=f"3x{n} H{h} d{d} causal", dtype=dtype,
                           make_inputs=packed_inputs,
                           variants={"fk": lambda q, k, v, cu: attention_varlen(q, k, v, cu, cu, n, n, causal=True),
                                     "torch": packed_sdpa})]
    if testing.on_gpu():  # the flash_attn drop-in against fk's own call: the layer's host cost
        cases.append(bench.HostCase(op="flash_attn_func", shape=f"B{b} N{n} H{h} d{d} causal", dtype=dtype,
                                    make_inputs=flash_layout_inputs,
                                    variants={"fk": functools.partial(flash_attn_func, causal=True),
                                              "fk attention": native}))
    return cases

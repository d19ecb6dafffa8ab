"""fk-attention's plan, top to bottom: block shapes, warps, pipeline stages, autotuning, the Hopper
tensor-descriptor (TMA) gate, and the launch code that binds them once per (shapes, strides, dtype,
device, flags).

Three kernels share it (`Kind`): the forward (a BLOCK_M block of queries walks the keys in steps
of BLOCK_N), dQ (same walk, backward) and dK/dV (a BLOCK_N block of keys walks the queries of its
GQA group in steps of BLOCK_M).

- The interpreter runs one fixed small config (programs run one by one on the CPU; small blocks
  keep the tests quick and still take several loop steps on tiny shapes).
- On a GPU, problems of at least AUTOTUNE_MIN_SCORES scores in fp16/bf16 are autotuned over a few
  candidates per head dim (`triton.autotune`, key: length buckets, heads bucket, window, softcap,
  packed, head dim, dtype), the result kept for the process so a shape tunes once (on disk too
  where no config carries a pre-hook: Triton cannot store those, and the descriptor configs need
  one to size their tiles). Smaller problems, fp32 and fp8 launch the default config of their head dim
  (a handful of compiles instead of a sweep).
- Tensor descriptors (TMA loads and stores) are built on the host, one 4-D descriptor per
  (B, H, N, D) operand passed as a kernel parameter (`tensor_descriptor`), and allowed on CUDA
  with compute capability >= 9 for 16-bit and fp32 inputs whose base and strides are 16-byte
  aligned; pointer loads everywhere else (the interpreter, HIP, Ampere, fp8, odd strides such as
  an expanded gradient). Where allowed, every launch, fixed or tuned, uses them: on an H100 they
  beat pointers, and descriptors built in the kernel, on every shape measured (TUNING.md).
- HIP: `waves_per_eu` by head dim (the Triton tutorial's AMD choice), one pipeline stage.

The candidates follow the Triton fused-attention tutorial's search space (BLOCK_M 64 or 128,
BLOCK_N 32 to 128, 4 or 8 warps, 2 to 4 stages) and FlashAttention-2's Triton backward (128 keys
x 32-64 queries for dK/dV, 128 queries x 32-64 keys for dQ). For head dims 64 and 128 in 16 bits
each list starts with the winner of an H100 sweep (the default), followed by the runners-up;
head dim 256 keeps the priors (TUNING.md).

Not used: Triton's warp specialization (`tl.range(..., warp_specialize=True)` on the forward's
unmasked key walk): on an H100 it did not compile on 4 warps and gained nothing on 8 (TUNING.md).
The dense forward and the backward's dK/dV on Hopper at padded head dim 128 run the Gluon kernels
of `hopper.py` instead (warp-specialized by hand), where they serve.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import os
import threading

import torch

from fk_runtime import alloc, backend, bench, checks, sizing
from fk_runtime.launch import Descriptor, Launch, PlanCache, bind_context

from . import hopper, kernels

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8
# fp8 forward: e4m3/e5m2 tensor-core dots need Ada (8.9) or newer.
FP8_MIN_CAPABILITY = (8, 9)
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, name)
)
# What q, k, v may hold (fp8: forward only).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
# fp8 attention writes its output in this dtype (P @ V accumulates in fp32).
FP8_OUTPUT_DTYPE = torch.bfloat16
# 8-bit dots need K >= 32: fp8 pads head dims (and the forward's BLOCK_N is >= 32) to this.
FP8_MIN_DOT_K = 32
# TMA: Hopper (sm_90) and newer; base address and every stride but the last 16-byte aligned.
DESCRIPTOR_MIN_CAPABILITY = (9, 0)
DESCRIPTOR_ALIGN_BYTES = 16
DESCRIPTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Flip to False to time the pointer path alone on Hopper or newer (e.g. to see what TMA buys).
DESCRIPTORS_ON_HOPPER = True
# TMA strides are below 2**40 bytes.
DESCRIPTOR_MAX_STRIDE_BYTES = 1 << 40

# The interpreter: 16 x 16 blocks, the smallest tl.dot shape.
INTERPRETER_BLOCK = 16
# The interpreter's tl.dot is wrong on bf16 (NumPy has no bf16; fp16 and fp32 are right): bf16
# inputs run there in fp32, results cast back.
INTERPRETER_WIDENED = (torch.bfloat16,)
# Autotune when B * H * Nq * Nk reaches this (N = 1024 with 64 heads; every case of the
# benchmark sweep is above it). Below it a launch takes tens of microseconds on an H100, too
# little for a sweep of compiles to pay back: the head dim's default runs (a prior, not measured).
AUTOTUNE_MIN_SCORES = 1 << 26
AUTOTUNE_DTYPES = (torch.float16, torch.bfloat16)
# FK_AUTOTUNE=0 in the environment: never autotune, the head dim's defaults run (read when a plan
# is bound; e2e/triton_versions.py compares Triton versions on the same tiles this way).
AUTOTUNE_ENV = "FK_AUTOTUNE"
# Each candidate's warm-up before its timing (fk_runtime.bench.do_bench: at least 25 timed calls).
# 100 ms: with Triton's 25 ms the fastest candidate, timed first on a cold clock, lost (TUNING.md).
AUTOTUNE_WARMUP_MS = 100
# Autotune keys: sequence lengths and B * H rounded up to a power of two, lengths clamped to this
# range (past 16384 the best tiles no longer change; below 128 every candidate is one block), and
# the input dtype as a number (`dtype_key`: Triton's tuner adds the dtypes of tensor arguments to
# its key, and TMA descriptors carry none).
KEY_MIN_LENGTH = 128
KEY_MAX_LENGTH = 16384
KEY_MAX_HEADS = 1024
KEY_ARGS = ["n_q_key", "n_k_key", "bh_key", "dtype_key", "WINDOW", "SOFTCAP", "VARLEN", "HEAD_DIM"]
# HIP (AMD): waves per execution unit by padded head dim, (max head dim, waves); one stage.
HIP_WAVES_PER_EU = ((64, 3), (None, 2))
HIP_NUM_STAGES = 1
CACHE_SIZE = 256
STATS_ALIGN = int(kernels.STATS_ALIGN)


class Kind(str, enum.Enum):
    FORWARD = "fwd"
    DQ = "dq"
    DKDV = "dkdv"


# An unbounded window side as the kernels take it: past any sequence length, and small enough that
# their int32 bounds (position +- side) cannot overflow for lengths below 2**29.
UNBOUNDED = 1 << 30


@dataclasses.dataclass(frozen=True)
class Mask:
    """Which keys a query sees and how scores are capped. Query i sees key j when
    -left <= j - (i + shift) <= right (None: unbounded), shift = Nk - Nq with `lower_right`
    (FlashAttention's and torch's CausalVariant.LOWER_RIGHT alignment), else 0 (SDPA's top-left);
    causal is right = 0. `softcap` c: scores s become c * tanh(s / c) before the softmax."""

    left: int | None = None
    right: int | None = None
    lower_right: bool = False
    softcap: float | None = None

    @property
    def windowed(self) -> bool:
        return self.left is not None or self.right is not None

    @property
    def span(self) -> int | None:
        """Keys a query sees at most under a two-sided window; None where a side is unbounded."""
        return None if self.left is None or self.right is None else self.left + self.right + 1

    def kernel_args(self) -> tuple:
        """(softcap, lower_right, left, right) as the kernels take them."""
        return (self.softcap or 1.0, int(self.lower_right), UNBOUNDED if self.left is None else self.left,
                UNBOUNDED if self.right is None else self.right)


CAUSAL = Mask(right=0)
FULL = Mask()


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch: BLOCK_M queries x BLOCK_N keys per step, warps, pipeline stages, and whether
    tiles move through tensor descriptors (TMA) or pointers."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    descriptors: bool = False

    def meta(self, varlen: bool = False) -> dict:
        """The kernels' meta-parameters; packed sequences read inputs through descriptors and write
        through pointers (USE_DESC = 2, kernels.py)."""
        use_desc = (2 if varlen else 1) if self.descriptors else 0
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "USE_DESC": use_desc}


def _configs(*rows: tuple[int, int, int, int]) -> tuple[Config, ...]:
    return tuple(Config(*row) for row in rows)


# Defaults (fixed launches on a GPU), by padded head dim then element size: (max head dim,
# {kind: config}); first match wins.
# 16-bit head dims 64 and 128: the winners of the H100 sweeps (TUNING.md); the rest are priors.
DEFAULTS_16BIT = (
    (64, {Kind.FORWARD: Config(64, 128, 4, 2), Kind.DQ: Config(128, 64, 4, 3),
          Kind.DKDV: Config(64, 64, 4, 3)}),
    (128, {Kind.FORWARD: Config(128, 64, 4, 2), Kind.DQ: Config(128, 64, 8, 3),
           Kind.DKDV: Config(64, 128, 8, 2)}),
    (256, {Kind.FORWARD: Config(64, 64, 4, 2), Kind.DQ: Config(64, 32, 4, 2),
           Kind.DKDV: Config(32, 64, 4, 2)}),
)
# 4-byte head dims 64 and 128: the fastest of the tiles an sm_90 compile left with the fewest
# spills (exact fp32 products are FMA loops held in registers; TUNING.md: DEFAULTS_32BIT); 256
# keeps its priors.
DEFAULTS_32BIT = (
    (64, {Kind.FORWARD: Config(32, 32, 4, 2), Kind.DQ: Config(32, 16, 4, 2),
          Kind.DKDV: Config(16, 64, 8, 2)}),
    (128, {Kind.FORWARD: Config(32, 64, 8, 2), Kind.DQ: Config(32, 64, 8, 2),
           Kind.DKDV: Config(16, 64, 8, 2)}),
    (256, {Kind.FORWARD: Config(32, 32, 4, 1), Kind.DQ: Config(32, 32, 4, 1),
           Kind.DKDV: Config(32, 32, 4, 1)}),
)
# Autotune candidates (CUDA), by padded head dim: (max head dim, {kind: configs}). Each list
# starts with the default and stays short: every candidate is a compile per (dtype, head dim,
# causal) before the first tuned call.
CANDIDATES = (
    (64, {
        Kind.FORWARD: _configs((64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3)),
        Kind.DQ: _configs((128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3)),
        Kind.DKDV: _configs((64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2)),
    }),
    (128, {
        Kind.FORWARD: _configs((128, 64, 4, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)),
        Kind.DQ: _configs((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)),
        Kind.DKDV: _configs((64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)),
    }),
    (256, {
        Kind.FORWARD: _configs((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)),
        Kind.DQ: _configs((64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)),
        Kind.DKDV: _configs((32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 1)),
    }),
)


def check_head_dim(head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head dim must be a multiple of {HEAD_DIM_STEP} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
            f"got {head_dim}"
        )


def check_heads(q, k, v, head_axis: int, same: bool = True) -> None:
    """q, k, v share a head dim the kernels take, k and v one shape, and q's heads are a multiple
    of k's; with `same`, one dtype and device (callers that check more tensors together pass False)."""
    if same:
        checks.check_same_dtype(q=q, k=k, v=v)
        checks.check_same_device(q=q, k=k, v=v)
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v must share the head dim, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hk = q.shape[head_axis], k.shape[head_axis]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hk})")
    check_head_dim(d)


def check_inputs(q, k, v, packed: bool = False, dtypes=None) -> None:
    """What the kernels take: q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) (packed: (total, H, D)) as
    `check_heads` wants them. The public calls check these before launching; the binds check
    again, once per plan, for callers of the registered ops (`torch.ops.fk.attention*`)."""
    dims = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=dtypes or DTYPES, min_dim=dims, max_dim=dims)
    if not packed and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise ValueError(f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    check_heads(q, k, v, 1)


def _check_bounds(cu_q, cu_k, packing) -> None:
    """Packed sequences' bounds: int32 (S + 1,) each, S the packing's sequences."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.check_tensor(name, cu, dtypes=(torch.int32,), min_dim=1, max_dim=1)
        if cu.shape[0] != packing.sequences + 1:
            raise ValueError(f"{name} must hold {packing.sequences + 1} bounds (sequences + 1), got shape "
                             f"{tuple(cu.shape)}")


def _check_backward(grad_out, grad_lse, q, k, v, out, lse, packed: bool) -> None:
    """The backward's inputs as the forward made them (registered-op callers: once per plan)."""
    check_inputs(q, k, v, packed)
    for name, t in (("out", out), ("grad_out", grad_out)):
        checks.check_tensor(name, t, dtypes=DTYPES)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    rows = (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and tuple(t.shape) != rows:
            raise ValueError(f"{name} must have shape {rows} (a row per query and head), got {tuple(t.shape)}")


def padded_head_dim(head_dim: int, dtype: torch.dtype | None = None) -> int:
    """Head dims are padded to a power of two inside the kernels (masked loads, zero fill); at
    least FP8_MIN_DOT_K for 1-byte inputs (an 8-bit tensor-core dot takes K >= 32)."""
    padded = sizing.next_power_of_2(head_dim)
    if dtype is not None and dtype.itemsize == 1:
        padded = max(padded, FP8_MIN_DOT_K)
    return padded


def _row(table, head_dim: int):
    padded = padded_head_dim(head_dim)
    for limit, entry in table:
        if padded <= limit:
            return entry
    raise ValueError(f"head dim {head_dim} is above {MAX_HEAD_DIM}")


@functools.lru_cache(maxsize=CACHE_SIZE)
def default_config(kind: Kind, head_dim: int, dtype: torch.dtype, descriptors: bool) -> Config:
    """The fixed launch for `kind`: tiny blocks on the interpreter, the head dim's default on a
    GPU (fp32: its own tiles, sized to registers); through descriptors when `use_descriptors` allowed them."""
    if backend.is_interpreter():
        return Config(INTERPRETER_BLOCK, INTERPRETER_BLOCK, sizing.MIN_WARPS, 1, descriptors)
    table = DEFAULTS_32BIT if dtype.itemsize > 2 else DEFAULTS_16BIT
    config = dataclasses.replace(_row(table, head_dim)[kind], descriptors=descriptors)
    if backend.is_hip():
        config = dataclasses.replace(config, num_stages=HIP_NUM_STAGES)
    return config


def launch_options(config: Config, head_dim: int) -> dict:
    """Launch keywords for a fixed config, with HIP's waves per EU for this head dim."""
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if backend.is_hip():
        options["waves_per_eu"] = hip_waves_per_eu(head_dim)
    return options


def hip_waves_per_eu(head_dim: int) -> int:
    padded = padded_head_dim(head_dim)
    return next(w for limit, w in HIP_WAVES_PER_EU if limit is None or padded <= limit)


def should_autotune(dtype: torch.dtype, batch_heads: int, n_q: int, n_k: int) -> bool:
    return (
        os.environ.get(AUTOTUNE_ENV, "1") != "0"
        and not backend.is_interpreter()
        and dtype in AUTOTUNE_DTYPES
        and batch_heads * n_q * n_k >= AUTOTUNE_MIN_SCORES
    )


def length_key(n: int) -> int:
    return min(max(sizing.next_power_of_2(n), KEY_MIN_LENGTH), KEY_MAX_LENGTH)


def dtype_key(dtype: torch.dtype) -> int:
    return AUTOTUNE_DTYPES.index(dtype) if dtype in AUTOTUNE_DTYPES else len(AUTOTUNE_DTYPES)


def heads_key(batch_heads: int) -> int:
    return min(sizing.next_power_of_2(batch_heads), KEY_MAX_HEADS)


def _is_hopper_or_newer(device: torch.device | None = None) -> bool:
    return (backend.backend() is backend.Backend.CUDA
            and torch.cuda.get_device_capability(device) >= DESCRIPTOR_MIN_CAPABILITY)


def candidates(kind: Kind, head_dim: int, descriptors: bool) -> tuple[Config, ...]:
    """What the autotuner tries: every candidate through TMA where descriptors are allowed (host
    descriptors beat pointers on every tiling measured), else through pointers."""
    configs = _row(CANDIDATES, head_dim)[kind]
    if backend.is_hip():
        configs = tuple(dict.fromkeys(dataclasses.replace(c, num_stages=HIP_NUM_STAGES) for c in configs))
    return tuple(dataclasses.replace(c, descriptors=descriptors) for c in configs)


def _prune(configs, named_args, **kwargs):
    """Drop candidates whose walking block is longer than the sequence it walks (they only add
    masked work); keep at least one."""
    args = {**named_args, **kwargs}
    n_q, n_k = args["n_q_key"], args["n_k_key"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= n_q and c.kwargs["BLOCK_N"] <= n_k]
    return kept or list(configs[:1])


@functools.lru_cache(maxsize=CACHE_SIZE)
def autotuned(kernel, kind: Kind, head_dim: int, descriptors: bool, varlen: bool):
    """`kernel` (a @triton.jit function) autotuned over this head dim's candidates. One tuner per
    (kernel, head dim, descriptors allowed, packed): the candidates differ. The kernel takes the
    KEY_ARGS; BLOCK_M, BLOCK_N and USE_DESC come from the configs, and with descriptors each
    config sizes the descriptors' tiles before it runs (`fit_descriptors`)."""
    import triton

    configs = []
    for c in candidates(kind, head_dim, descriptors):
        meta = c.meta(varlen)
        if backend.is_hip():
            meta["waves_per_eu"] = hip_waves_per_eu(head_dim)
        configs.append(triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages,
                                     pre_hook=fit_descriptors if descriptors else None))
    options = {"configs": configs, "key": KEY_ARGS, "prune_configs_by": {"early_config_prune": _prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        options["do_bench"] = functools.partial(bench.do_bench, warmup_ms=AUTOTUNE_WARMUP_MS)
    # Triton >= 3.3 can keep tuning results on disk, a shape then tuning once across processes:
    # pointer launches only (descriptor configs carry a pre-hook, see the module docstring).
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    return triton.autotune(**options)(kernel)


# Triton's autotuner keeps a call's arguments on itself while it runs (the descriptor pre-hook
# reads them there), and one tuner serves every thread: tuned launches go one at a time (autograd
# runs each device's backward in a thread of its own).
_TUNED_LAUNCH_LOCK = threading.Lock()


def launch_tuned(kernel, kind: Kind, head_dim: int, descriptors: bool, grid, args: tuple, meta: dict,
                 varlen: bool):
    """Launch `kernel` through its autotuner (`autotuned`) over `grid` (a function of the chosen
    config's meta-parameters), one tuned launch at a time across threads; returns the Triton config
    it ran (the tuner's pick for this key), or None where this Triton does not say."""
    tuned = autotuned(kernel, kind, head_dim, descriptors, varlen)
    bind_context()
    with _TUNED_LAUNCH_LOCK:
        tuned[grid](*args, **meta)
        return getattr(tuned, "best_config", None)


def fp8_supported(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether fp8 inputs can run on `device` (default: the current GPU), and why not."""
    if backend.backend() is not backend.Backend.CUDA:
        return False, ("fp8 attention needs a CUDA GPU (compute capability >= 8.9), backend is "
                       f"{backend.backend().value}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return False, f"fp8 attention needs compute capability >= 8.9, this GPU has {capability}"
    return True, ""


def _aligned(t: torch.Tensor) -> bool:
    """What a 4-D TMA descriptor over t needs: base 16-byte aligned, last dim contiguous, every
    other stride (of a dim with more than one entry: the others are replaced, see
    `_descriptor_strides`) positive, 16-byte aligned and under the TMA limit."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % DESCRIPTOR_ALIGN_BYTES == 0
        and all(0 < t.stride(i) * size < DESCRIPTOR_MAX_STRIDE_BYTES
                and (t.stride(i) * size) % DESCRIPTOR_ALIGN_BYTES == 0
                for i in range(t.dim() - 1) if t.shape[i] > 1)
    )


def _descriptor_strides(t: torch.Tensor) -> list[int]:
    """t's strides, where a dim of one entry (any stride, never stepped) takes the extent of the
    dims inside it rounded up to the alignment: valid for TMA, never overlapping."""
    align = DESCRIPTOR_ALIGN_BYTES // t.element_size()
    strides = list(t.stride())
    extent = t.shape[-1]
    for i in reversed(range(t.dim() - 1)):
        if t.shape[i] == 1:
            strides[i] = sizing.cdiv(extent, align) * align
        extent = max(extent, strides[i] * t.shape[i])
    return strides


def descriptors_allowed(*tensors: torch.Tensor) -> bool:
    """Whether descriptors are valid for these (B, H, N, D) tensors on any backend (tests force
    the descriptor path on the interpreter with this)."""
    return all(t.dtype in DESCRIPTOR_DTYPES and _aligned(t) for t in tensors)


def use_descriptors(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors (TMA) for a launch touching these tensors: Hopper or newer CUDA, and
    `descriptors_allowed`."""
    return DESCRIPTORS_ON_HOPPER and _is_hopper_or_newer() and descriptors_allowed(*tensors)


# Pointer loads and stores form a tile's offsets (row i x token stride + column j x head-dim
# stride, i < BLOCK_M or BLOCK_N, j < the padded head dim) in 32 bits, the block's start in 64:
# a tensor whose strides could overflow that (a view hopping millions of elements between tokens,
# or a head-dim-major layout) is copied contiguous first. MAX_TILE_EXTENT bounds both tile sides.
TILE_OFFSET_LIMIT = sizing.INT32_OFFSET_LIMIT
MAX_TILE_EXTENT = 256


def tile_offsets_fit(t: torch.Tensor) -> bool:
    """Whether every in-tile offset of the (..., N, D) tensor t fits 32 bits."""
    return (MAX_TILE_EXTENT - 1) * (t.stride(-2) + t.stride(-1)) < TILE_OFFSET_LIMIT


def row_offsets_fit(t: torch.Tensor) -> bool:
    """Whether the (..., N) tensor t's row offsets (row x stride, rows < N) fit 32 bits."""
    return t.shape[-1] * t.stride(-1) < TILE_OFFSET_LIMIT


def tensor_descriptor(t: torch.Tensor, rows: str, padded_head_dim: int, config: Config | None):
    """A TMA descriptor over the (B, H, N, D) tensor t, in tiles of [1, 1, R, padded_head_dim]:
    R is `config`'s `rows` block ("BLOCK_M" or "BLOCK_N"), or, with no config (autotuned launches),
    set by each config before it runs (`fit_descriptors`). Rows past N and the head-dim padding
    read as zeros; stores drop them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_rows = config.meta()[rows] if config is not None else 1
    desc = TensorDescriptor(t, list(t.shape), _descriptor_strides(t), [1, 1, block_rows, padded_head_dim])
    desc.fk_rows = rows
    return desc


def fit_descriptors(nargs: dict) -> None:
    """Autotuner pre-hook: give every descriptor made by `tensor_descriptor` the tile rows of the
    config about to run (nargs holds the kernel's arguments and the config's meta-parameters)."""
    for arg in nargs.values():
        rows = getattr(arg, "fk_rows", None)
        if rows is not None:
            arg.block_shape = [1, 1, nargs[rows], arg.block_shape[-1]]


# ---- launch: plans bound once per (shapes, strides, dtype, device, flags) ---------------------------

# Which block's rows each kernel's leading (B, H, N, D) operands are tiled by, in argument order
# (None: not a tile operand): query-side tensors by BLOCK_M, key-side ones by BLOCK_N.
FORWARD_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M")  # q, k, v, out
# The forward's head then takes lse, cu_seqlens_q, cu_seqlens_k (packed sequences' bounds; any
# tensor for dense ones). dQ: q, k, v, out, grad_out, lse, grad_lse, delta, lse2, dq; dK/dV: q, k,
# v, grad_out, lse2, delta, dk, dv (delta, lse2: the backward's scratch rows); each then
# cu_seqlens_q, cu_seqlens_k.
DQ_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", "BLOCK_M", None, None, None, None, "BLOCK_M")
DKDV_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", None, None, "BLOCK_N", "BLOCK_N")


def _inputs_only(tiles: tuple, outputs: tuple[int, ...]) -> tuple:
    """Packed sequences' tiles: outputs go through pointers (a TMA box would cross a sequence end)."""
    return tuple(None if i in outputs else rows for i, rows in enumerate(tiles))


BOUND = PlanCache(CACHE_SIZE)
# Autotuned configs by (kernel kind, head dim, descriptors, tuning key): once a key is tuned, its
# calls launch the winner directly (no tuner, no lock on the hot path).
WINNERS: dict = {}


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs get exact fp32 products (tf32 would cost them ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else None


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    return FP8_OUTPUT_DTYPE if dtype in FP8_DTYPES else dtype


def _heads_inside_tokens(t: torch.Tensor) -> bool:
    """Whether a fresh tensor laid out like t takes (B, N, H, D) storage: t is such a view (so
    that `.transpose(1, 2)` of the result is contiguous again), unless that token stride (H * D)
    would overflow the kernels' in-tile offsets."""
    b, h, n, d = t.shape
    return t.stride(1) < t.stride(2) and (MAX_TILE_EXTENT - 1) * (h * d + 1) < TILE_OFFSET_LIMIT


def _bnhd_strides(shape) -> tuple[int, int, int, int]:
    b, h, n, d = shape
    return n * h * d, d, h * d, 1


def _new(shape, bnhd: bool, like: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, D) tensor in like's dtype and device, on (B, N, H, D) storage where bnhd: a
    tensor of its own, not a view (autograd and torch's in-place rules treat it as torch's)."""
    return alloc.new_empty_strided(like, shape, _bnhd_strides(shape)) if bnhd else alloc.new_empty(like, shape)


def fake_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The registered fakes' output laid out like t, as the bound plans allocate it."""
    dtype = dtype or t.dtype
    if _heads_inside_tokens(t):
        return t.new_empty_strided(t.shape, _bnhd_strides(t.shape), dtype=dtype)
    return t.new_empty(t.shape, dtype=dtype)


def _strides_allow_descriptors(t: torch.Tensor) -> bool:
    """`_aligned` without the base address (checked per call)."""
    size = t.element_size()
    return t.dtype in DESCRIPTOR_DTYPES and t.stride(-1) == 1 and all(
        0 < t.stride(i) * size < DESCRIPTOR_MAX_STRIDE_BYTES and (t.stride(i) * size) % DESCRIPTOR_ALIGN_BYTES == 0
        for i in range(t.dim() - 1) if t.shape[i] > 1)


def _on_hopper_descriptors(device: torch.device) -> bool:
    return DESCRIPTORS_ON_HOPPER and _is_hopper_or_newer(device)


def descriptors_may_serve(device: torch.device, tensors) -> bool:
    """Whether TMA descriptors can serve launches over tensors laid out like these on `device`
    (decided once per plan; `bases_aligned` decides per call)."""
    return _on_hopper_descriptors(device) and all(_strides_allow_descriptors(t) for t in tensors)


def bases_aligned(tensors) -> bool:
    return all(t.data_ptr() % DESCRIPTOR_ALIGN_BYTES == 0 for t in tensors)


class _Kernel:
    """One kernel launch of a bound plan over `programs` (batch, head) pairs x row blocks of
    `n_rows`: the autotuner's winner for big half-precision problems (the tuner runs once per
    key), else the head dim's fixed config, or the caller's (tests). `descriptors`: True / False
    forces TMA on or off; None: TMA where the strides allow it (decided here) and every tile
    operand's base is aligned (decided per call). The first len(`tiles`) head arguments are the
    (B, H, N, D) operands, tiled by the named block's rows ("BLOCK_M" or "BLOCK_N"). A kernel
    with a REST constexpr (the packed backward) is launched twice, REST false then true (over
    `programs` only), same config."""

    def __init__(self, kernel, kind: Kind, n_rows: int, programs: int, tiles: tuple, examples: tuple,
                 tail: tuple, meta: dict, dtype: torch.dtype, tune: bool, descriptors: bool | None,
                 config: Config | None, device: torch.device):
        self.kernel, self.kind, self.n_rows, self.programs = kernel, kind, n_rows, programs
        self.tiles, self.tail, self.meta, self.dtype, self.device = tiles, tail, meta, dtype, device
        self.head_dim, self.padded = meta["HEAD_DIM"], meta["HEAD_DIM_PADDED"]
        self.walked = "BLOCK_N" if kind is Kind.DKDV else "BLOCK_M"
        self.tune, self.config = tune and config is None, config
        self.tile_index = tuple(i for i, rows in enumerate(tiles) if rows is not None)
        operands = [examples[i] for i in self.tile_index]
        if config is not None:
            descriptors = config.descriptors
        self.forced = descriptors
        self.may_use = descriptors if descriptors is not None else (
            descriptors_may_serve(device, operands))
        self.layouts = tuple((list(t.shape), _descriptor_strides(t)) for t in operands)
        self.tuning_key = (kind, self.head_dim, meta["WINDOW"], meta["SOFTCAP"], meta["VARLEN"],
                           meta.get("HAS_DLSE"), tail[-4:], device.index)
        self.launches: dict = {}
        self.rest = "REST" in meta and meta["VARLEN"]

    def _use_descriptors(self, head) -> bool:
        if self.forced is not None or not self.may_use:
            return self.may_use
        return bases_aligned(head[i] for i in self.tile_index)

    def __call__(self, *head) -> None:
        use = self._use_descriptors(head)
        entry = self.launches.get(use)
        tuned_now = False
        if entry is None:
            config = self.config
            if config is None and self.tune:
                config = WINNERS.get((self.tuning_key, use))
                if config is None:
                    self._tune(head, use)  # the tuner's launch ran the kernel (REST false)
                    if not self.rest:
                        return
                    config = WINNERS.get((self.tuning_key, use))
                    tuned_now = config is not None  # else the default config runs both launches
            config = config or default_config(self.kind, self.head_dim, self.dtype, use)
            block = config.meta()[self.walked]
            meta = {**self.meta, **config.meta(self.meta["VARLEN"]), **launch_options(config, self.head_dim)}
            grid = (sizing.cdiv(self.n_rows, block) * self.programs,)
            launches = [Launch(self.kernel, grid, self.tail, meta, self.device)]
            if self.rest:  # one program per (sequence, head) for the blocks past max_seqlen
                launches.append(Launch(self.kernel, (self.programs,), self.tail, {**meta, "REST": True},
                                       self.device))
            entry = self.launches[use] = (launches, config)
        launches, config = entry
        if config.descriptors:
            head = self._descriptors(head, config)
        for launch in launches[1:] if tuned_now else launches:
            launch(*head)

    def _descriptors(self, head, config: Config) -> tuple:
        blocks = config.meta()
        converted = list(head)
        for i, (shape, strides) in zip(self.tile_index, self.layouts, strict=True):
            converted[i] = Descriptor(head[i], shape, strides, [1, 1, blocks[self.tiles[i]], self.padded])
        return tuple(converted)

    def _tune(self, head, use: bool) -> None:
        """Through Triton's autotuner (its launch runs the kernel); its pick is kept as the winner."""
        args = list(head)
        if use:
            for i in self.tile_index:
                args[i] = tensor_descriptor(head[i], self.tiles[i], self.padded, None)
        walked = self.walked
        best = launch_tuned(self.kernel, self.kind, self.head_dim, use,
                            lambda m: (sizing.cdiv(self.n_rows, m[walked]) * self.programs,),
                            (*args, *self.tail), self.meta, self.meta["VARLEN"])
        if best is not None:
            kw = best.kwargs
            WINNERS[(self.tuning_key, use)] = Config(kw["BLOCK_M"], kw["BLOCK_N"], best.num_warps,
                                                    best.num_stages, bool(kw["USE_DESC"]))


def _keys(n_q: int, n_k: int, batch_heads: int, dtype: torch.dtype, mask: Mask) -> tuple[int, int, int, int]:
    # A sliding window's walks are as long as the window, not the sequence: tuned apart from causal.
    walk = n_k if mask.span is None else min(n_k, mask.span)
    return length_key(n_q), length_key(walk), heads_key(batch_heads), dtype_key(dtype)


def _meta(mask: Mask, varlen: bool, head_dim: int, dtype: torch.dtype) -> dict:
    return {"WINDOW": mask.windowed, "SOFTCAP": mask.softcap is not None, "VARLEN": varlen,
            "HEAD_DIM": head_dim, "PRECISION": _precision(dtype),
            "HEAD_DIM_PADDED": padded_head_dim(head_dim, dtype)}


def _fit(t: torch.Tensor, fits=None) -> tuple[torch.Tensor, bool]:
    """t, or a contiguous copy where its strides would overflow the kernels' 32-bit in-tile
    offsets (rare layouts: see `tile_offsets_fit`); and whether t is used as it is."""
    ok = (fits or tile_offsets_fit)(t)
    return (t if ok else t.contiguous()), ok


def packed(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the kernels read it: a (1, H, total, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def _strides(t: torch.Tensor, varlen: bool) -> tuple:
    """(B, H, N, D) strides of a kernel operand; packed operands step no batch (b is the sequence)."""
    return (0, *t.stride()[1:]) if varlen else t.stride()


@dataclasses.dataclass(frozen=True)
class Packing:
    """Packed sequences: how many, and the longest query / key lengths the grids are sized for."""

    sequences: int
    max_q: int
    max_k: int


def _tail_fill(device: torch.device, sequences: int, total: int, *tensors: tuple[tuple, float]):
    """run(*tensors, cu) setting the token rows [cu[sequences], total) of one or two fresh packed
    tensors (the rows of a padded buffer past its last sequence, which no kernel writes) to a value
    each (`kernels.fill_tail_kernel`); each given as (shape, value): a contiguous (total, H, D)
    output or gradient, or an (H, total) log-sum-exp."""
    geometry = []
    for shape, value in tensors:
        rows_last = len(shape) == 2  # (H, total)
        cols = shape[0] if rows_last else shape[1] * shape[2]
        geometry += [cols, 1 if rows_last else cols, total if rows_last else 1, value]
    two = len(tensors) == 2
    launch = Launch(kernels.fill_tail_kernel, (sizing.cdiv(total, kernels.TAIL_ROWS),),
                    (sequences, total, *geometry, *(() if two else (0, 0, 0, 0.0))),
                    {"TWO": two, "BLOCK_R": kernels.TAIL_ROWS, "BLOCK_C": kernels.TAIL_COLS}, device)

    def run(*args):
        *tensors, cu = args
        launch(tensors[0], tensors[-1], cu)

    return run


def _bind_forward(q, k, v, mask: Mask, sm_scale: float, config=None, descriptors=None,
                  packing: Packing | None = None):
    """The forward of one key: run(q, k, v, cu_q, cu_k) -> (out, lse). Dense: (B, H, N, D) inputs,
    out like q, lse (B, H, N). Packed: (total, H, D) inputs, out (total, H, D), lse (H, total)."""
    check_inputs(q, k, v, packing is not None)  # one dtype and device among them
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_kernel_device(name, t)
    if q.dtype in FP8_DTYPES:
        ok, why = fp8_supported(q.device)
        if not ok:
            raise TypeError(why)
    varlen = packing is not None
    dtype, device, out_dtype = q.dtype, q.device, output_dtype(q.dtype)
    out_proto = torch.empty(0, dtype=out_dtype, device=device)
    fp32 = torch.empty(0, dtype=torch.float32, device=device)
    if varlen:
        total_q, hq, d = q.shape
        hk = k.shape[1]
        b, n_q, n_k = packing.sequences, packing.max_q, packing.max_k
        lse_strides = (0, total_q)
        totals = (total_q, k.shape[0])

        def new_outputs():
            return alloc.new_empty(out_proto, (total_q, hq, d)), alloc.new_empty(fp32, (hq, total_q))

        def as_kernel(t):
            return packed(t)
    else:
        b, hq, n_q, d = q.shape
        hk, n_k = k.shape[1], k.shape[2]
        bnhd = _heads_inside_tokens(q)  # out in q's layout, as the registered fake gives it
        out_shape = q.shape
        lse_strides = (hq * n_q, n_q)
        totals = (n_q, n_k)

        def new_outputs():
            out = _new(out_shape, bnhd, out_proto)
            return out, alloc.new_empty(fp32, (b, hq, n_q))

        def as_kernel(t):
            return t

    if q.numel() == 0 or b == 0:
        return lambda *args: new_outputs()
    if k.numel() == 0:  # no keys: SDPA gives zeros; the log-sum-exp of nothing is -inf
        def no_keys(*args):
            out, lse = new_outputs()
            return out.zero_(), lse.fill_(-math.inf)
        return no_keys
    (q_, q_ok), (k_, k_ok), (v_, v_ok) = (_fit(as_kernel(t)) for t in (q, k, v))
    out = as_kernel(new_outputs()[0])
    tail = (sm_scale, *mask.kernel_args()[:1], n_q, n_k, hq, hq // hk, *mask.kernel_args()[1:], *totals,
            *_strides(q_, varlen), *_strides(k_, varlen), *_strides(v_, varlen), *_strides(out, varlen),
            *lse_strides, *_keys(n_q, n_k, b * hq, dtype, mask))
    tiles = _inputs_only(FORWARD_TILES, (3,) if varlen else ())
    kernel = _Kernel(kernels.attn_fwd_kernel, Kind.FORWARD, n_q, b * hq, tiles, (q_, k_, v_, out), tail,
                     _meta(mask, varlen, d, dtype), dtype, should_autotune(dtype, b * hq, n_q, n_k), descriptors,
                     config, device)
    # Packed rows past the last sequence: output 0, log-sum-exp -inf (as a row that sees no key).
    tail = _tail_fill(device, b, total_q, ((total_q, hq, d), 0.0), ((hq, total_q), -math.inf)) \
        if varlen else None
    # The Gluon kernel on Hopper where it serves (hopper.py); a forced config or TMA choice is the tl one's.
    gluon = None
    if not varlen and config is None and descriptors is None and q_ok and k_ok and v_ok \
            and hopper.takes(q_, k_, v_, mask, sm_scale):
        gluon = hopper.bind(q_, k_, v_, out, lse_strides, mask, sm_scale)

    def run(q, k, v, cu_q=None, cu_k=None):
        out, lse = new_outputs()
        if gluon is not None and bases_aligned((q, k, v, out)):
            gluon(q, k, v, out, lse)
            return out, lse
        q, k, v = as_kernel(q), as_kernel(k), as_kernel(v)
        kernel(q if q_ok else q.contiguous(), k if k_ok else k.contiguous(), v if v_ok else v.contiguous(),
               as_kernel(out), lse, lse if cu_q is None else cu_q, lse if cu_k is None else cu_k)
        if tail is not None:
            tail(out, lse, cu_q)
        return out, lse

    return run


def _widened(dtype: torch.dtype) -> bool:
    return dtype in INTERPRETER_WIDENED and backend.is_interpreter()


def forward(q, k, v, mask: Mask, sm_scale: float, config: Config | None = None,
            descriptors: bool | None = None):
    """(out, lse): out like q ((B, Hq, Nq, D), bf16 for fp8 inputs), lse (B, Hq, Nq) fp32 in
    natural log. `config` (with its `descriptors` flag) or `descriptors` alone override the
    table's choice (tests; not cached)."""
    if _widened(q.dtype):
        out, lse = forward(q.float(), k.float(), v.float(), mask, sm_scale, config, descriptors)
        return out.to(q.dtype), lse
    if config is not None or descriptors is not None:
        return _bind_forward(q, k, v, mask, sm_scale, config, descriptors)(q, k, v)
    return bound_forward(q, k, v, mask, sm_scale)(q, k, v)


def bound_forward(q, k, v, mask: Mask, sm_scale: float):
    """run(q, k, v) -> (out, lse): the forward bound for these inputs' layouts (not widened)."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), mask, sm_scale)
    return BOUND.get(key) or BOUND.get_or_build(key, lambda: _bind_forward(q, k, v, mask, sm_scale))


def forward_packed(q, k, v, cu_q, cu_k, packing: Packing, mask: Mask, sm_scale: float,
                   config: Config | None = None):
    """(out (total_q, Hq, D), lse (Hq, total_q)) of packed sequences: sequence i is rows
    cu_q[i]:cu_q[i + 1] of q against rows cu_k[i]:cu_k[i + 1] of k and v."""
    if _widened(q.dtype):
        out, lse = forward_packed(q.float(), k.float(), v.float(), cu_q, cu_k, packing, mask, sm_scale, config)
        return out.to(q.dtype), lse
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.check_kernel_device(name, t)
    if config is not None:
        return _bind_forward(q, k, v, mask, sm_scale, config, None, packing)(q, k, v, cu_q, cu_k)
    key = ("packed", packing, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.get_device(), k.get_device(), v.get_device(), cu_q.shape, cu_k.shape, cu_q.get_device(),
           cu_k.get_device(), mask, sm_scale)

    def build():
        _check_bounds(cu_q, cu_k, packing)
        return _bind_forward(q, k, v, mask, sm_scale, packing=packing)

    run = BOUND.get(key) or BOUND.get_or_build(key, build)
    return run(q, k, v, cu_q, cu_k)


def _bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask: Mask, sm_scale: float,
                   configs=None, descriptors=None, packing: Packing | None = None):
    """The backward of one key: run(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k) -> (dq, dk, dv),
    the gradients laid out like the inputs (packed: (total, H, D))."""
    _check_backward(grad_out, grad_lse, q, k, v, out, lse, packing is not None)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("grad_out", grad_out), ("lse", lse)):
        checks.check_kernel_device(name, t)
    checks.check_same_device(q=q, k=k, v=v, out=out, grad_out=grad_out, lse=lse, grad_lse=grad_lse)
    checks.check_same_dtype(q=q, k=k, v=v, out=out, grad_out=grad_out)
    if lse.dtype != torch.float32 or (grad_lse is not None and grad_lse.dtype != torch.float32):
        raise TypeError("lse and grad_lse must be float32")
    varlen = packing is not None
    dtype, device = q.dtype, q.device
    grad_proto = torch.empty(0, dtype=dtype, device=device)
    fp32 = torch.empty(0, dtype=torch.float32, device=device)
    if varlen:
        total_q, hq, d = q.shape
        hk = k.shape[1]
        b, n_q, n_k = packing.sequences, packing.max_q, packing.max_k
        shapes = [t.shape for t in (q, k, v)]
        lse_strides = (0, total_q)
        totals = (total_q, k.shape[0])

        def new_grads():
            return tuple(alloc.new_empty(grad_proto, shape) for shape in shapes)

        # Scratch rows (delta, base-2 lse), each sequence's aligned and padded (`_stats_first`).
        scratch_rows = sizing.cdiv(total_q + STATS_ALIGN * (b + 1), STATS_ALIGN) * STATS_ALIGN
        scratch_strides = (0, scratch_rows)

        def new_stats():
            return alloc.new_empty(fp32, (2, hq, scratch_rows))

        def as_kernel(t):
            return packed(t)

        def lse_view(t):  # (H, total) as the kernels' (1, H, total) rows
            return t.unsqueeze(0)
    else:
        b, hq, n_q, d = q.shape
        hk, n_k = k.shape[1], k.shape[2]
        layouts = [(t.shape, _heads_inside_tokens(t)) for t in (q, k, v)]  # gradients like the inputs
        lse_strides = (hq * n_q, n_q)
        totals = (n_q, n_k)

        def new_grads():
            return tuple(_new(shape, bnhd, grad_proto) for shape, bnhd in layouts)

        scratch_strides = (hq * n_q, n_q)

        def new_stats():
            return alloc.new_empty(fp32, (2, b, hq, n_q))

        def as_kernel(t):
            return t

        def lse_view(t):
            return t

    if q.numel() == 0 or k.numel() == 0 or b == 0:
        return lambda *args: tuple(g.zero_() for g in new_grads())
    # An expanded gradient (`out.sum().backward()`: zero strides) is materialized: TMA cannot read
    # it, and the pointer path costs more than the copy.
    expanded = 0 in grad_out.stride()
    fitted = [_fit(as_kernel(t)) for t in (q, k, v, out, grad_out.contiguous() if expanded else grad_out)]
    (q_, k_, v_, out_, go_), oks = zip(*fitted, strict=True)
    has_dlse = grad_lse is not None
    dlse_, dlse_ok = _fit(lse_view(grad_lse), row_offsets_fit) if has_dlse else (lse_view(lse), True)
    dq, dk, dv = (as_kernel(g) for g in new_grads())
    delta, lse2 = new_stats()
    dq_config, dkdv_config = configs or (None, None)
    meta = _meta(mask, varlen, d, dtype)
    keys = _keys(n_q, n_k, b * hq, dtype, mask)
    tune = should_autotune(dtype, b * hq, n_q, n_k)
    forced = configs is not None or descriptors is not None
    if configs is None and descriptors is None:
        # One choice for both kernels: TMA where every operand of either allows it.
        descriptors = None if all(_strides_allow_descriptors(t) for t in (q_, k_, v_, out_, go_, dq, dk, dv)) \
            else False
    softcap, lower_right, left, right = mask.kernel_args()
    dlse_strides = (0, *dlse_.stride()[1:]) if varlen else dlse_.stride()
    dq_kernel = _Kernel(
        kernels.attn_bwd_dq_kernel, Kind.DQ, n_q, b * hq, _inputs_only(DQ_TILES, (9,) if varlen else ()),
        (q_, k_, v_, out_, go_, lse, dlse_, delta, lse2, dq),
        (sm_scale, softcap, n_q, n_k, hq, hq // hk, lower_right, left, right, *totals,
         *(s for t in (q_, k_, v_, out_, go_) for s in _strides(t, varlen)), *dlse_strides,
         *_strides(dq, varlen), *lse_strides, *scratch_strides, *keys),
        {**meta, "HAS_DLSE": has_dlse, "REST": False}, dtype, tune, descriptors, dq_config, device)
    dkdv_kernel = _Kernel(
        kernels.attn_bwd_dkdv_kernel, Kind.DKDV, n_k, b * hk, _inputs_only(DKDV_TILES, (6, 7) if varlen else ()),
        (q_, k_, v_, go_, lse2, delta, dk, dv),
        (sm_scale, softcap, n_q, n_k, hk, hq // hk, lower_right, left, right, *totals,
         *(s for t in (q_, k_, v_, go_, dk, dv) for s in _strides(t, varlen)), *scratch_strides, *keys),
        {**meta, "REST": False}, dtype, tune, descriptors, dkdv_config, device)

    as_given = all(oks) and not expanded
    # Packed rows past the last sequence: gradient 0 (their outputs are 0 whatever their inputs).
    tails = (_tail_fill(device, b, totals[0], (shapes[0], 0.0)),
             _tail_fill(device, b, totals[1], (shapes[1], 0.0), (shapes[2], 0.0))) if varlen else None
    # dK/dV in Gluon on Hopper where it serves (hopper.py); forced configs or TMA choices run tl.
    gluon = None
    if not varlen and not forced and hopper.serves(q_, k_, v_, mask) \
            and descriptors_may_serve(device, (go_, dk, dv)):
        gluon = hopper.bind_dkdv(q_, k_, v_, go_, dk, dv, scratch_strides, mask, sm_scale)

    def run(grad_out, grad_lse, q, k, v, out, lse, cu_q=None, cu_k=None):
        if expanded:  # materialized as bound: before the packed view (whose own copy has other strides)
            grad_out = grad_out.contiguous()
        q, k, v, out, grad_out = (as_kernel(t) for t in (q, k, v, out, grad_out))
        if not as_given:
            q, k, v, out, grad_out = (t if ok else t.contiguous()
                                      for t, ok in zip((q, k, v, out, grad_out), oks, strict=True))
        dlse = lse_view(grad_lse if dlse_ok else grad_lse.contiguous()) if has_dlse else lse
        grads = new_grads()
        dq, dk, dv = (as_kernel(g) for g in grads)
        delta, lse2 = new_stats()
        cu_q = lse if cu_q is None else cu_q
        cu_k = lse if cu_k is None else cu_k
        dq_kernel(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, cu_q, cu_k)
        # dK/dV reads the delta and base-2 lse the dQ kernel wrote (same stream, in order).
        if gluon is not None and bases_aligned((q, k, v, grad_out, dk, dv)):
            gluon(q, k, v, grad_out, lse2, delta, dk, dv)
        else:
            dkdv_kernel(q, k, v, grad_out, lse2, delta, dk, dv, cu_q, cu_k)
        if tails is not None:
            tails[0](grads[0], cu_q)
            tails[1](grads[1], grads[2], cu_k)
        return grads

    return run


def backward(grad_out, grad_lse, q, k, v, out, lse, mask: Mask, sm_scale: float,
             configs: tuple[Config, Config] | None = None, descriptors: bool | None = None):
    """(dq, dk, dv). `grad_lse` (may be None) is the gradient reaching the log-sum-exp output.
    `configs` = (dQ config, dK/dV config) or `descriptors` alone override the table's choice
    (tests; not cached; each config's `descriptors` flag holds for its kernel)."""
    if _widened(q.dtype):
        wide = [t.float() for t in (grad_out, q, k, v, out)]
        grads = backward(wide[0], grad_lse, *wide[1:], lse, mask, sm_scale, configs, descriptors)
        return tuple(g.to(q.dtype) for g in grads)
    lse = lse.contiguous()  # the kernels read it as (B, H, N) rows (a saved-tensor hook may hand back other strides)
    if configs is not None or descriptors is not None:
        return _bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, configs,
                              descriptors)(grad_out, grad_lse, q, k, v, out, lse)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape, out.stride(), grad_out.shape,
           grad_out.stride(), lse.shape, lse.stride(),
           None if grad_lse is None else (grad_lse.shape, grad_lse.stride(), grad_lse.dtype, grad_lse.get_device()),
           q.dtype, k.dtype, v.dtype, out.dtype, grad_out.dtype, lse.dtype,
           tuple(t.get_device() for t in (q, k, v, out, grad_out, lse)), mask, sm_scale)
    run = BOUND.get(key) or BOUND.get_or_build(
        key, lambda: _bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale))
    return run(grad_out, grad_lse, q, k, v, out, lse)


def backward_packed(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, packing: Packing, mask: Mask,
                    sm_scale: float, configs: tuple[Config, Config] | None = None):
    """(dq, dk, dv) of `forward_packed`, each (total, H, D). Deterministic (no atomics)."""
    if _widened(q.dtype):
        wide = [t.float() for t in (grad_out, q, k, v, out)]
        grads = backward_packed(wide[0], grad_lse, *wide[1:], lse, cu_q, cu_k, packing, mask, sm_scale, configs)
        return tuple(g.to(q.dtype) for g in grads)
    lse = lse.contiguous()  # the kernels read it as (H, total) rows
    if configs is not None:
        return _bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, configs, None,
                              packing)(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k)
    key = ("packed", packing, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,
           out.stride(), grad_out.shape, grad_out.stride(), lse.shape, lse.stride(),
           None if grad_lse is None else (grad_lse.shape, grad_lse.stride(), grad_lse.dtype, grad_lse.get_device()),
           q.dtype, k.dtype, v.dtype, out.dtype, grad_out.dtype, lse.dtype, cu_q.shape, cu_k.shape,
           tuple(t.get_device() for t in (q, k, v, out, grad_out, lse, cu_q, cu_k)), mask, sm_scale)

    def build():
        _check_bounds(cu_q, cu_k, packing)
        return _bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, packing=packing)

    run = BOUND.get(key) or BOUND.get_or_build(key, build)
    return run(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k)

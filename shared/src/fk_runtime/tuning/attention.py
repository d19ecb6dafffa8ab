"""Launch table for fk-attention: block shapes, warps, pipeline stages, autotuning and the Hopper
tensor-descriptor (TMA) gate.

Three kernels share it (`Kind`): the forward (a BLOCK_M block of queries walks the keys in steps
of BLOCK_N), dQ (same walk, backward) and dK/dV (a BLOCK_N block of keys walks the queries of its
GQA group in steps of BLOCK_M).

- The interpreter runs one fixed small config (programs run one by one on the CPU; small blocks
  keep the tests quick and still take several loop steps on tiny shapes).
- On a GPU, problems of at least AUTOTUNE_MIN_SCORES scores in fp16/bf16 are autotuned over a few
  candidates per head dim (`triton.autotune`, key: length buckets, heads bucket, causal, head
  dim; the dtype is part of every Triton autotune key), the result kept in Triton's cache
  (`cache_results`) so a shape tunes once. Smaller problems, fp32 and fp8 launch the default
  config of their head dim (a handful of compiles instead of a sweep).
- Tensor descriptors (TMA loads and stores, built inside each program with
  `tl.make_tensor_descriptor`) are allowed on CUDA with compute capability >= 9 for 16-bit and
  fp32 inputs whose base and strides are 16-byte aligned; pointer loads everywhere else (the
  interpreter, HIP, Ampere, fp8, odd strides such as an expanded gradient). Where allowed, fixed
  launches use them and the autotuner weighs them against the pointer path.
- HIP: `waves_per_eu` by head dim (the Triton tutorial's AMD choice), one pipeline stage.

The candidates follow the Triton fused-attention tutorial's search space on the H100 (BLOCK_M 64
or 128, BLOCK_N 32 to 128, 4 or 8 warps, 2 to 4 stages) and FlashAttention-2's Triton
backward (128 keys x 32-64 queries for dK/dV, 128 queries x 32-64 keys for dQ). Head dims 64
and 128 in 16 bits are narrowed by an H100 sweep (2026-11-22, bf16, 16384 tokens at N = 4096,
TMA, every BLOCK_M/BLOCK_N in {64, 128} x {4, 8} warps x {2, 3} stages forward, 9 dK/dV and 8 dQ
tiles backward): each list starts with that sweep's winner (forward d128 128x64 on 4 warps, 2
stages: 515 TFLOP/s full, 438 causal, against 454 for the former default; d64 64x128 on 4 warps:
427 / 376), followed by the runners-up. Head dim 256 keeps the priors.

Not used: Triton 3.6's warp specialization (`tl.range(..., warp_specialize=True)` on the forward's
unmasked key walk, TMA loads). H100, 2026-11-23, bf16, 16384 tokens at N = 4096, d64 and d128,
causal and not: every 4-warp config failed to compile (the NVGPUWarpSpecialization pass), every
8-warp config ran within 1% of the same config without it, and the default above stayed fastest.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect

import torch

from .. import backend, sizing

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8
# fp8 forward: e4m3/e5m2 tensor-core dots need Ada (8.9) or newer.
FP8_MIN_CAPABILITY = (8, 9)
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, name)
)
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

# The interpreter: 16 x 16 blocks, the smallest tl.dot shape.
INTERPRETER_BLOCK = 16
# Autotune when B * H * Nq * Nk reaches this (N = 1024 with 64 heads; every case of the
# benchmark sweep is above it). Below it a launch takes tens of microseconds on an H100, too
# little for a sweep of compiles to pay back: the head dim's default runs (a prior, not measured).
AUTOTUNE_MIN_SCORES = 1 << 26
AUTOTUNE_DTYPES = (torch.float16, torch.bfloat16)
# Autotune keys: sequence lengths and B * H rounded up to a power of two, lengths clamped to this
# range (past 16384 the best tiles no longer change; below 128 every candidate is one block).
KEY_MIN_LENGTH = 128
KEY_MAX_LENGTH = 16384
KEY_MAX_HEADS = 1024
KEY_ARGS = ["n_q_key", "n_k_key", "bh_key", "CAUSAL", "HEAD_DIM"]
# With descriptors allowed, the first this many candidates are also tried through pointers.
POINTER_CANDIDATES = 1
# HIP (AMD): waves per execution unit by padded head dim, (max head dim, waves); one stage.
HIP_WAVES_PER_EU = ((64, 3), (None, 2))
HIP_NUM_STAGES = 1
CACHE_SIZE = 256


class Kind(str, enum.Enum):
    FORWARD = "fwd"
    DQ = "dq"
    DKDV = "dkdv"


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch: BLOCK_M queries x BLOCK_N keys per step, warps, pipeline stages, and whether
    tiles move through tensor descriptors (TMA) or pointers."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    descriptors: bool = False

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "USE_DESC": self.descriptors}


def _configs(*rows: tuple[int, int, int, int]) -> tuple[Config, ...]:
    return tuple(Config(*row) for row in rows)


# Defaults (fixed launches on a GPU), by padded head dim then element size: (max head dim,
# {kind: config}); first match wins. 4-byte inputs get half the tile bytes of 2-byte ones.
DEFAULTS_16BIT = (
    (64, {Kind.FORWARD: Config(64, 128, 4, 2), Kind.DQ: Config(128, 32, 4, 3),
          Kind.DKDV: Config(32, 128, 4, 3)}),
    (128, {Kind.FORWARD: Config(128, 64, 4, 2), Kind.DQ: Config(128, 64, 8, 3),
           Kind.DKDV: Config(64, 128, 8, 2)}),
    (256, {Kind.FORWARD: Config(64, 64, 4, 2), Kind.DQ: Config(64, 32, 4, 2),
           Kind.DKDV: Config(32, 64, 4, 2)}),
)
DEFAULTS_32BIT = (
    (64, {Kind.FORWARD: Config(64, 64, 4, 2), Kind.DQ: Config(64, 32, 4, 2),
          Kind.DKDV: Config(32, 64, 4, 2)}),
    (128, {Kind.FORWARD: Config(64, 32, 4, 2), Kind.DQ: Config(64, 32, 4, 2),
           Kind.DKDV: Config(32, 64, 4, 2)}),
    (256, {Kind.FORWARD: Config(32, 32, 4, 1), Kind.DQ: Config(32, 32, 4, 1),
           Kind.DKDV: Config(32, 32, 4, 1)}),
)
# Autotune candidates (CUDA), by padded head dim: (max head dim, {kind: configs}). Each list
# starts with the default and stays short: every candidate is a compile per (dtype, head dim,
# causal) before the first tuned call.
CANDIDATES = (
    (64, {
        Kind.FORWARD: _configs((64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3)),
        Kind.DQ: _configs((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)),
        Kind.DKDV: _configs((32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3)),
    }),
    (128, {
        Kind.FORWARD: _configs((128, 64, 4, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)),
        Kind.DQ: _configs((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)),
        Kind.DKDV: _configs((64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3)),
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
    GPU (half the tile bytes for fp32); through descriptors when `use_descriptors` allowed them."""
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
        not backend.is_interpreter()
        and dtype in AUTOTUNE_DTYPES
        and batch_heads * n_q * n_k >= AUTOTUNE_MIN_SCORES
    )


def length_key(n: int) -> int:
    return min(max(sizing.next_power_of_2(n), KEY_MIN_LENGTH), KEY_MAX_LENGTH)


def heads_key(batch_heads: int) -> int:
    return min(sizing.next_power_of_2(batch_heads), KEY_MAX_HEADS)


def _is_hopper_or_newer() -> bool:
    return (backend.backend() is backend.Backend.CUDA
            and torch.cuda.get_device_capability() >= DESCRIPTOR_MIN_CAPABILITY)


def candidates(kind: Kind, head_dim: int, descriptors: bool) -> tuple[Config, ...]:
    """What the autotuner tries. With descriptors allowed: every candidate through TMA, and the
    first POINTER_CANDIDATES through pointers too, so the tuner can still pick pointers where
    building the descriptors in each program costs more than TMA saves (short sequences)."""
    configs = _row(CANDIDATES, head_dim)[kind]
    if backend.is_hip():
        configs = tuple(dict.fromkeys(dataclasses.replace(c, num_stages=HIP_NUM_STAGES) for c in configs))
    if descriptors:
        configs = tuple(dataclasses.replace(c, descriptors=True) for c in configs) \
            + configs[:POINTER_CANDIDATES]
    return configs


def _prune(configs, named_args, **kwargs):
    """Drop candidates whose walking block is longer than the sequence it walks (they only add
    masked work); keep at least one."""
    args = {**named_args, **kwargs}
    n_q, n_k = args["n_q_key"], args["n_k_key"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= n_q and c.kwargs["BLOCK_N"] <= n_k]
    return kept or list(configs[:1])


@functools.lru_cache(maxsize=CACHE_SIZE)
def autotuned(kernel, kind: Kind, head_dim: int, descriptors: bool):
    """`kernel` (a @triton.jit function) autotuned over this head dim's candidates. One tuner per
    (kernel, head dim, descriptors allowed): the candidates differ. The kernel takes the
    KEY_ARGS; BLOCK_M, BLOCK_N and USE_DESC come from the configs."""
    import triton

    configs = []
    for c in candidates(kind, head_dim, descriptors):
        meta = c.meta()
        if backend.is_hip():
            meta["waves_per_eu"] = hip_waves_per_eu(head_dim)
        configs.append(triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages))
    options = {"configs": configs, "key": KEY_ARGS, "prune_configs_by": {"early_config_prune": _prune}}
    # Triton >= 3.3 can keep tuning results on disk: a shape tunes once across processes.
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    return triton.autotune(**options)(kernel)


def fp8_supported() -> tuple[bool, str]:
    """Whether fp8 inputs can run here, and why not."""
    if backend.backend() is not backend.Backend.CUDA:
        return False, ("fp8 attention needs a CUDA GPU (compute capability >= 8.9), backend is "
                       f"{backend.backend().value}")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return False, f"fp8 attention needs compute capability >= 8.9, this GPU has {capability}"
    return True, ""


def _aligned(t: torch.Tensor) -> bool:
    """Base and strides 16-byte aligned, last dim contiguous. Batch and head strides only move the
    base, so they do not matter where that dim has one entry; the row stride is the descriptor's."""
    size = t.element_size()
    row_dim = t.dim() - 2
    return (
        t.stride(-1) == 1
        and t.data_ptr() % DESCRIPTOR_ALIGN_BYTES == 0
        and all((t.stride(i) * size) % DESCRIPTOR_ALIGN_BYTES == 0
                for i in range(t.dim() - 1) if i == row_dim or t.shape[i] > 1)
    )


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


# Global scratch of in-kernel descriptors (a few hundred bytes per program): one buffer per
# (device, stream), grown on demand and kept, as PyTorch keeps cuBLAS's workspace. Launches on one
# stream run in order, so they may share it; a call's peak memory does not grow by it (4 MiB at
# 32 heads x 16384 tokens).
_descriptor_scratch: dict[tuple[int, int], torch.Tensor] = {}


def descriptor_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for descriptors built inside kernels (`tl.make_tensor_descriptor`)."""
    if torch.cuda.is_current_stream_capturing():
        # Memory a CUDA graph records must come from the graph's own pool.
        return torch.empty(size, device="cuda", dtype=torch.int8)
    key = (torch.cuda.current_device(), int(stream or 0))
    scratch = _descriptor_scratch.get(key)
    if scratch is None or scratch.numel() < size:
        scratch = _descriptor_scratch[key] = torch.empty(size, device="cuda", dtype=torch.int8)
    return scratch


def prepare_descriptors() -> None:
    """Give Triton the scratch allocator in-kernel descriptors need. Triton keeps it in a context
    variable, which autograd's backward threads do not inherit: call before every launch."""
    import triton

    triton.set_allocator(descriptor_allocator)

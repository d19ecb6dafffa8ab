"""fk-attention's numbers: every tile, warp count, pipeline depth and threshold of the prefill
kernels (defaults and autotune candidates), the split-KV decode path and the Hopper Gluon kernels,
with the rules that pick among them by head dim and dtype. TUNING.md says how each was measured.
A tile size for any attention path is changed here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import torch
from fk_runtime import backend, sizing

from . import layout


# The interpreter: 16 x 16 blocks, the smallest tl.dot shape.
INTERPRETER_BLOCK = 16

# Autotune when B * H * Nq * Nk reaches this (N = 1024 with 64 heads; every case of the
# benchmark sweep is above it). Below it a launch takes tens of microseconds on an H100, too
# little for a sweep of compiles to pay back: the head dim's default runs (a prior, not measured).
AUTOTUNE_MIN_SCORES = 1 << 26
AUTOTUNE_DTYPES = (torch.float16, torch.bfloat16)

# Autotuning runs only when asked: FK_AUTOTUNE=1 in the environment (read when a plan is bound).
# Otherwise the fixed defaults below run: no call times candidates, and a new shape compiles
# nothing that its dtype, head dim and mask have not compiled already.
AUTOTUNE_ENV = "FK_AUTOTUNE"

# Each candidate's warm-up before its timing (fk_runtime.timing.do_bench: at least 25 timed calls).
# 100 ms: with Triton's 25 ms the fastest candidate, timed first on a cold clock, lost (TUNING.md).
AUTOTUNE_WARMUP_MS = 100

# Autotune keys: sequence lengths and B * H rounded up to a power of two, lengths clamped to this
# range (past 16384 the best tiles no longer change; below 128 every candidate is one block), and
# the input dtype as a number (`dtype_key`: Triton's tuner adds the dtypes of tensor arguments to
# its key, and TMA descriptors carry none).
KEY_MIN_LENGTH = 128
KEY_MAX_LENGTH = 16384
KEY_MAX_HEADS = 1024
KEY_ARGS = ["n_q_key", "n_k_key", "bh_key", "dtype_key", "WINDOW", "SOFTCAP", "VARLEN", "HEAD_DIM", "PART"]

# Windows unbounded on the left (causal's) compile without that side's compares (the kernels'
# WINDOW 1) from this Triton on: the d64 forward tile then holds 157 registers on 3.8 and 3.9 (181
# with them: two programs per SM where 157 leaves room for three), but 178 on 3.6 (163 with them),
# which keeps the two-sided build (TUNING.md: Triton versions; sm_90 compiles, not yet timed).
LEFT_UNBOUNDED_BUILD_FROM = (3, 7)

# Softcapped scores of these input dtypes take tanh from the GPU's tanh.approx.f32 (one MUFU op a score, as
# FlashAttention does; at most 7.8e-6 off tanh) where tanh from exp2 took two MUFU ops and about eight ALU
# ones (TUNING.md: Softcaps); fp32 keeps exp2's (2.3e-7), as does the interpreter (no inline asm).
SOFTCAP_APPROX_DTYPES = (torch.float16, torch.bfloat16)


# The dense forward walks a window's last key block (causal's diagonal) in a half-width step where
# its query block sees at most half of it: with BLOCK_N = 2 BLOCK_M (d64's 64 x 128) every other
# query block otherwise computes a whole block of which half is masked (TUNING.md: prefill tiles).
FORWARD_HALF_TAIL = True


def forward_meta() -> dict:
    """The forward kernel's constexprs that no other kernel takes."""
    return {"HALF_TAIL": FORWARD_HALF_TAIL}


def window_build(mask) -> int:
    """The WINDOW constexpr for `mask` (`mask.Mask.window_build`) on this Triton."""
    build = mask.window_build
    return 2 if build == 1 and not backend.triton_at_least(LEFT_UNBOUNDED_BUILD_FROM) else build


# HIP (AMD): waves per execution unit by padded head dim, (max head dim, waves); one stage.
HIP_WAVES_PER_EU = ((64, 3), (None, 2))
HIP_NUM_STAGES = 1
CACHE_SIZE = 256

# Attention dropout's seeds: drawn per call in [0, DROPOUT_SEED_BOUND) from the caller's generator (62 bits:
# torch.randint's int64 bound with room; Philox keys on all 64 bits of the int64).
DROPOUT_SEED_BOUND = 1 << 62


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

    def meta(self, varlen: bool = False) -> dict:
        """The kernels' meta-parameters; packed sequences read inputs through descriptors and write
        through pointers (USE_DESC = 2, kernels.py)."""
        use_desc = (2 if varlen else 1) if self.descriptors else 0
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "USE_DESC": use_desc}


def _configs(*rows: tuple[int, int, int, int]) -> tuple[Config, ...]:
    return tuple(Config(*row) for row in rows)


# Defaults (fixed launches on a GPU), by padded head dim then element size: (max head dim,
# {kind: config}); first match wins.
# 16-bit head dims 64 and 128: the winners of the H100 sweeps; 256 the H200's on Triton 3.8 (TUNING.md).
DEFAULTS_16BIT = (
    (64, {Kind.FORWARD: Config(64, 128, 4, 2), Kind.DQ: Config(128, 64, 4, 3),
          Kind.DKDV: Config(64, 64, 4, 3)}),
    (128, {Kind.FORWARD: Config(128, 64, 4, 2), Kind.DQ: Config(128, 64, 8, 3),
           Kind.DKDV: Config(64, 128, 8, 2)}),
    (256, {Kind.FORWARD: Config(128, 32, 8, 3), Kind.DQ: Config(128, 32, 8, 3),
           Kind.DKDV: Config(32, 128, 8, 3)}),
)

# Padded head dims whose tl dK/dV kernel runs as two launches, dV then dK (`dkdv_parts`): one fp32
# accumulator a program where both spilled (d256: 5 matmuls for 4, the backward 0.44x the time in
# 16 bits, 0.78x in fp32, on 3.8; TUNING.md: Head dim 256). Where Gluon serves d256 (GLUON_ROLE_HEAD_DIMS)
# the role-split kernel takes dK/dV instead.
DKDV_SPLIT_HEAD_DIMS = (256,)


def dkdv_parts(head_dim: int) -> tuple[int, ...]:
    """The dK/dV kernel's PART constexprs, launched in order: (0,) both at once; (1, 2) dV, then dK."""
    return (1, 2) if layout.padded_head_dim(head_dim) in DKDV_SPLIT_HEAD_DIMS else (0,)


# Masked walks, 16-bit, by padded head dim (exact): two-sided windows of at most WINDOW_MAX_SPAN keys
# (their walks are as long as the window, not the sequence), packed sequences and softcapped scores
# take smaller forward and dK/dV tiles at 128; other kinds and head dims take the dense defaults
# (WINDOW_MAX_SPAN: a prior). Window 1024 at N 16384 (TUNING.md: masked walks tuned apart): forward
# 64 x 64 325 µs against 375-393 for 128 x 128, dK/dV 64 x 64 644-661 against 734-746 for 64 x 128;
# packed d128 forward 0.93x, dK/dV 0.93x and softcap 50 dK/dV 0.92x the dense tiles' time (3.8).
WINDOW_MAX_SPAN = 2048
MASKED_DEFAULTS_16BIT = (
    (128, {Kind.FORWARD: Config(64, 64, 4, 3), Kind.DKDV: Config(64, 64, 4, 2)}),
)

# Triton before OLDER_TRITON_BEFORE (3.6, 3.7), 16-bit, by padded head dim (exact): the tiles its
# compiler runs faster, where 3.6's tuner beat the defaults above by 2% or more (H200, TUNING.md:
# older Tritons): causal and windowed d64 dK/dV 32 x 64, four stages (0.95-0.96x the time at N1024,
# packed 0.97x; full masks keep 64 x 64, 3% faster there at N >= 4096); softcapped d128 dK/dV
# 64 x 128, three stages (0.97x). 3.8 and later keep the defaults.
OLDER_TRITON_BEFORE = (3, 8)
OLDER_TRITON_CAUSAL_16BIT = ((64, {Kind.DKDV: Config(32, 64, 4, 4)}),)
OLDER_TRITON_SOFTCAP_16BIT = ((128, {Kind.DKDV: Config(64, 128, 8, 3)}),)

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
        Kind.FORWARD: _configs((128, 32, 8, 3), (128, 32, 8, 4), (64, 32, 4, 3)),
        Kind.DQ: _configs((128, 32, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2)),
        Kind.DKDV: _configs((32, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2)),
    }),
)


def _row(table, head_dim: int):
    padded = layout.padded_head_dim(head_dim)
    for limit, entry in table:
        if padded <= limit:
            return entry
    raise ValueError(f"head dim {head_dim} is above {layout.MAX_HEAD_DIM}")


@functools.lru_cache(maxsize=CACHE_SIZE)
def default_config(kind: Kind, head_dim: int, dtype: torch.dtype, descriptors: bool,
                   span: int | None = None, varlen: bool = False, softcap: bool = False,
                   causal: bool = False) -> Config:
    """The fixed launch for `kind`: tiny blocks on the interpreter, the head dim's default on a
    GPU (fp32: its own tiles, sized to registers; a two-sided window of `span` keys, packed
    sequences or softcapped scores: the masked walks' own where measured; Triton 3.6 and 3.7: their
    own where measured, for `causal` (or windowed) walks and softcaps); through descriptors when
    `descriptors` says so."""
    if backend.is_interpreter():
        return Config(INTERPRETER_BLOCK, INTERPRETER_BLOCK, sizing.MIN_WARPS, 1, descriptors)
    table = DEFAULTS_32BIT if dtype.itemsize > 2 else DEFAULTS_16BIT
    config = _row(table, head_dim)[kind]
    masked = varlen or softcap or (span is not None and span <= WINDOW_MAX_SPAN)
    padded = layout.padded_head_dim(head_dim)
    tables = []
    if dtype.itemsize <= 2:
        tables = [MASKED_DEFAULTS_16BIT] if masked else []
        if not backend.triton_at_least(OLDER_TRITON_BEFORE):
            tables += [older for older, used in ((OLDER_TRITON_CAUSAL_16BIT, causal),
                                                 (OLDER_TRITON_SOFTCAP_16BIT, softcap)) if used]
    for overrides in tables:  # later tables win
        config = next((row[kind] for dim, row in overrides if dim == padded and kind in row), config)
    config = dataclasses.replace(config, descriptors=descriptors)
    if backend.is_hip():
        config = dataclasses.replace(config, num_stages=HIP_NUM_STAGES)
    return config


def candidates(kind: Kind, head_dim: int, descriptors: bool) -> tuple[Config, ...]:
    """What the autotuner tries: every candidate through TMA where descriptors are allowed (host
    descriptors beat pointers on every tiling measured), else through pointers."""
    configs = _row(CANDIDATES, head_dim)[kind]
    if backend.is_hip():
        configs = tuple(dict.fromkeys(dataclasses.replace(c, num_stages=HIP_NUM_STAGES) for c in configs))
    return tuple(dataclasses.replace(c, descriptors=descriptors) for c in configs)


def launch_options(config: Config, head_dim: int) -> dict:
    """Launch keywords for a fixed config, with HIP's waves per EU for this head dim."""
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if backend.is_hip():
        options["waves_per_eu"] = hip_waves_per_eu(head_dim)
    return options


def hip_waves_per_eu(head_dim: int) -> int:
    padded = layout.padded_head_dim(head_dim)
    return next(w for limit, w in HIP_WAVES_PER_EU if limit is None or padded <= limit)


# Packed rows past the last sequence that the Gluon forward leaves: rows and columns one program fills per
# step (`kernels.fill_tail_kernel`; the tl kernels fill their own).
TAIL_ROWS = 64
TAIL_COLS = 128


# ---- split-KV decode (decode.py) --------------------------------------------------------------


# `attention` takes the decode path up to this many query rows (a decode step, speculative or
# chunked decoding); longer queries fill the GPU with query blocks alone.
DECODE_MAX_QUERIES = 64

# Query rows per program: a GQA group's rows x queries, padded to a tl.dot's smallest M (16).
DECODE_MIN_BLOCK_M = 16
DECODE_MAX_BLOCK_M = 64

# Key tiles by padded head dim, (max head dim, (BLOCK_N, warps, stages)), 2- and 4-byte inputs;
# a grid of at least `DecodeGrids.shallow_pipeline` programs per multiprocessor takes one stage
# less (more of them fit an SM, and together they keep enough loads in flight) (TUNING.md: decode).
DECODE_TILES_16BIT = ((64, (64, 4, 3)), (128, (64, 4, 3)), (256, (32, 4, 3)))
DECODE_TILES_32BIT = ((64, (32, 4, 2)), (128, (32, 4, 2)), (256, (16, 4, 2)))

# Keys are sliced only where that gives at least this many times the programs there are.
MIN_SLICE_GAIN = 1.5


@dataclasses.dataclass(frozen=True)
class DecodeGrids:
    """The decode numbers that follow a card's memory, in programs per multiprocessor."""

    sliced_programs_d128: float  # key slices aim at this many programs at head dim 128 (twice at 64)
    shallow_pipeline: float  # grids of at least this many take one stage less
    descriptors_below: float  # K/V through TMA on grids below this many
    slice_min_gain: float = MIN_SLICE_GAIN  # MIN_SLICE_GAIN for caches of fewer than SHORT_CACHE_KEYS keys


# Measured on the H100 (TUNING.md: decode); cards not listed below, and paged caches on every card
# (on the H200 its own grids cost paged caches up to 1.29x the time).
DECODE_GRIDS = DecodeGrids(sliced_programs_d128=1, shallow_pipeline=2, descriptors_below=2)
# Dense caches, by a name the device's name holds. The H200 (4.8 TB/s against the H100's 3.35):
# twice the slices, every stage and TMA on every grid, short caches not sliced where that would only
# double the programs (TUNING.md: decode, the H200).
DECODE_GRIDS_BY_CARD = (("H200", DecodeGrids(sliced_programs_d128=2, shallow_pipeline=math.inf,
                                             descriptors_below=math.inf, slice_min_gain=2.5)),)


def decode_grids(device_index: int, paged: bool = False) -> DecodeGrids:
    """The decode grid numbers of this device's card, for a dense cache or a paged one."""
    if paged:
        return DECODE_GRIDS
    name = backend.device_name(device_index)
    return next((grids for card, grids in DECODE_GRIDS_BY_CARD if card in name), DECODE_GRIDS)


# K/V at padded head dim 64 or 128, 16-bit, at most DECODE_MIN_BLOCK_M query rows per KV head, dense or
# in pages that hold whole blocks,
# fewer (batch, KV head) programs than multiprocessors: key blocks of WIDE_BLOCK_N rows, slices
# for WIDE_PROGRAMS times the usual programs (each at least one block), WIDE_STAGES stages where
# the grid is no larger and a slice holds more than one block, else one less; where a program's
# shared memory holds WIDE_STAGES stages of K and V blocks and SHARED_RESERVE bytes more
# (TUNING.md: decode, wide key blocks).
WIDE_BLOCK_N, WIDE_WARPS = 128, 4
WIDE_PROGRAMS = 0.5
WIDE_STAGES = 3
SHARED_RESERVE = 16 << 10

# Key slices: about `DecodeGrids.sliced_programs_d128` programs per multiprocessor at head dim 128
# (twice as many at 64: each reads half the bytes per step), as a power of two, of at least
# MIN_SLICE_KEYS keys each and at most MAX_SLICES (the merge reads them in one tile).
MIN_SLICE_KEYS = 64
MAX_SLICES = 64
# Caches of fewer keys take `DecodeGrids.slice_min_gain` for MIN_SLICE_GAIN: there a second launch, the
# merge, costs more than a grid only about twice as full saves.
SHORT_CACHE_KEYS = 4096

# The merge: as few warps as hold a query row's slices at MERGE_VALUES_PER_THREAD values a thread
# (one warp's reductions need no shared memory: 0.1-0.9 µs a call less than 4 warps in graph
# replays, TUNING.md: decode, the merge).
MERGE_VALUES_PER_THREAD = 64

# The interpreter: small tiles and slices, and a few programs' worth of slices (it runs programs
# one by one: slicing costs it time), so that tiny tests of one or two heads still slice and merge.
INTERPRETER_SLICE_KEYS = 16
INTERPRETER_SLICED_PROGRAMS = 8

# Paged caches whose pages hold whole key blocks, on grids of few programs: each slice's page
# indices are read into registers first (at most SLICE_PAGES). Grids of at least
# ROW_PAGES_GRID programs per multiprocessor, and slices of more pages, read each block's
# page per row in the walk instead (TUNING.md: decode, paged reads); on a grid of few programs
# that takes ROW_PAGES_FILL times the slices: the page load ahead of each key block stalls a lone
# program's pipeline, a second program per multiprocessor hides it.
SLICE_PAGES = 128
ROW_PAGES_GRID = 2
ROW_PAGES_FILL = 2
# How many page indices a slice preloads: the smallest of these that holds the pages it spans. Each
# is a compiled variant that a server's batch and lengths reach (powers of two, 8 of them, stalled
# a paged decode loop on compiles: BENCHMARKS.md, first calls); picking among more costs short rows.
SLICE_PAGE_BUCKETS = (8, SLICE_PAGES)

# K/V through TMA from this padded head dim, on grids below `DecodeGrids.descriptors_below`
# programs per SM: there it beat or matched pointers at d128; at d64 it lost up to 16% on paged
# caches, on the H100's fuller grids up to 7% (TUNING.md: decode).
DECODE_DESCRIPTOR_MIN_HEAD_DIM = 128

# New cache rows written per append program.
APPEND_ROWS = 16

# The Gluon decode kernel on Hopper (`decode_hopper`: one warp a program, K and V through a TMA ring), dense
# caches of 16-bit K/V, at most DECODE_MIN_BLOCK_M query rows per KV head: (padded head dim, BLOCK_N) where
# it serves. GLUON_DECODE_STAGES (shallow, deep): its ring takes the deep one where the programs resident on
# a multiprocessor fit it in its shared memory (each GLUON_DECODE_RESERVE bytes besides: layout scratch,
# barriers, the CTA's reserved KiB), else the shallow one: a lone warp needs more bytes in flight
# (TUNING.md: decode, the Gluon kernel).
GLUON_DECODE_TILES = ((64, 64),)
GLUON_DECODE_STAGES = (2, 4)
GLUON_DECODE_RESERVE = 3 << 10
# (fewest, most] programs per multiprocessor of the grids it takes; the others keep the tl kernel: one a
# multiprocessor or fewer (a lone warp there) took 1.03-1.06x the time of its wide blocks (B1 and B16 KV1024
# H32:8), 16 (several waves) 1.01-1.10x (B64 H32:32).
GLUON_DECODE_PROGRAMS_PER_SM = (1, 4)
# Grids past that `most` whose programs read at most GLUON_DECODE_SHORT_KEYS keys each take it too, from Triton
# GLUON_DECODE_SHORT_FROM on: at B64 KV1024 H32:32 (2048 programs) 0.976x the tl kernel's time on 3.7, 0.984x on
# 3.8, 0.976x on 3.9, but 1.034x on 3.6; at KV8192 1.008x (3.8).
GLUON_DECODE_SHORT_KEYS = 1024
GLUON_DECODE_SHORT_FROM = (3, 7)
# A cache shorter than SHORT_CACHE_KEYS that the tl kernel reads without slices keeps it where the Gluon kernel
# would slice it (and merge the slices in a second launch): B16 KV1024 H32:8 d64, 4 slices, took 1.03x the tl
# kernel's time on 3.8, 1.01x on 3.6.
GLUON_DECODE_KEEP_UNSLICED = True


# ---- Hopper kernels in Gluon (hopper.py) -------------------------------------------------------


# Padded head dims whose dK/dV runs in Gluon: 128 (the forward's: `GLUON_FORWARD_TILES`), and 256 on the
# role-split kernel.
GLUON_HEAD_DIMS = (128, 256)
# Padded head dims whose Gluon dK/dV splits its two warpgroups by role over one 64-key block (one takes the
# scores, the other dP; each keeps half the head dim of dK and dV; a warpgroup cannot hold both of 64 keys
# at d256): the d256 backward 1.15-1.26x the speed it had with the tl dV and dK launches on Triton 3.8
# (1.19-1.49x on 3.6), 1.03-1.15x cuDNN's (TUNING.md: Backward dK/dV at d256).
GLUON_ROLE_HEAD_DIMS = (256,)
# Triton releases whose Gluon forward takes windows and softcaps too, each timed against the tl kernel
# (H200; window 1024 0.90 / 0.82 / 0.91 / 0.84x, softcap 50 0.76 / 0.86 / 0.80 / 0.84x its time on
# 3.6 / 3.7 / 3.8 / 3.9; TUNING.md: Hopper forward).
GLUON_FORWARD_MASKS = ((3, 6), (3, 7), (3, 8), (3, 9))

# The forward's padded head dims, each with its keys per step, K/V ring stages and consumer warpgroups
# of GLUON_ROWS query rows, (head dim, BLOCK_N, STAGES, CONSUMERS; V's ring a stage shorter): d128 beat
# the tl kernel by 7-33%; d256 0.82x the time of 32 keys with 64 (128 overflows the shared memory); d64 with
# three consumers (192-row tiles) 0.88-0.93x its time at N >= 4096, level at N1024 (two: 3-10%
# slower at N >= 4096, 2-6% faster at N1024; since a tile's consumers without rows skip it, 4-6% less
# time at N1024 on 3.8, level on 3.6). TUNING.md: Hopper forward. Two stages at least: a consumer
# still reads step j - 1's V while it waits for step j's K.
GLUON_FORWARD_TILES = ((64, 128, 3, 3), (128, 128, 3, 2), (256, 64, 3, 2))
# Padded head dims whose Gluon forward takes full and causal masks only: d64's windows and softcaps run tl
# (H200, B1 N16384, Gluon ÷ tl time on three consumers 1.29-1.43 window 1024, 1.03-1.06 softcap (tanh.approx);
# on two 0.96-0.98 and 1.00-1.03; TUNING.md: Measured and not kept).
GLUON_FORWARD_FULL_OR_CAUSAL = (64,)
# Padded head dims whose Gluon forward takes packed sequences too (else the tl kernel), one tile a program
# on at most GLUON_FORWARD_PACKED_CONSUMERS consumers (d64 on three spilled 168 bytes, offline, 3.8). H200,
# causal bf16 forward, Gluon ÷ tl time, 3.8 / 3.6: d128 0.87 / 0.90 (8 x 2048), 0.91 / 0.92 (9 random
# lengths); d64 1.10 / 1.13 and 1.10 / 1.13, so tl; d256 not timed. TUNING.md: Packed sequences.
GLUON_FORWARD_PACKED_HEAD_DIMS = (128,)
GLUON_FORWARD_PACKED_CONSUMERS = 2
# (padded head dim, SEEN, rows): the mask build SEEN (0 full, 1 causal) up to `rows` query rows takes two
# consumers (128-row tiles) where GLUON_FORWARD_TILES has three: d64 causal on three took 1.47-1.50x the tl
# kernel's time at N1024, on two 0.95-0.97x (N4096 0.95-0.96x); past 4096 rows three, 0.94x. d64 full at
# N1024 (three: five 192-row tiles and one of 64) on two: 0.98 / 0.94-0.96x three's time (3.8 / 3.6); past
# 1024 rows three (two took 3-10% more time at N >= 4096). TUNING.md: Hopper forward.
GLUON_FORWARD_TWO = ((64, 1, 4096), (64, 0, 1024))
# (padded head dim, SEEN) whose forward on two consumers takes a consumer's last key block at half width
# where its rows see none of the block's second half (causal: a 128-row tile's first 64 rows on its
# diagonal): d64 up to 4096 rows 1.00-1.04x the speed in 10 of 11 row runs (0.98x in one); d96-d256 and
# d64 on three consumers level or slower (TUNING.md: Hopper forward, the diagonal at half width).
GLUON_FORWARD_HALF_LAST = ((64, 1),)
# (padded head dim, SEEN, consumers) whose forward waits for a step's P V below a branch after the
# softmax, so that the softmax runs under it: ptxas moves a wgmma wait up to the top of its basic block,
# before the softmax (SASS, Triton 3.6 and 3.8). H200, on ÷ off time, 3 runs on 3.8 and 2 on 3.6: d64 full
# on three consumers (N > 1024) 0.96-0.98 at N16384, 0.97-1.01 at N4096; every other build level or slower
# (N1024 two consumers 0.99-1.05, d96 1.03-1.04). TUNING.md: Hopper forward, the P V wait below the softmax.
GLUON_FORWARD_LATE_PV_WAIT = ((64, 0, 3),)
# (padded head dim, SEEN) whose forward on two consumers on the persistent grid starts the second consumer
# once the first has ended its first softmax (a program's first tile): H200, not staggered ÷ staggered time,
# 3.8 (three runs) | 3.6: d128 N4096 full 1.014-1.019 | 1.011, causal 1.000-1.033 | 1.019, N16384 1.009-1.037
# | 1.020, d96 1.016-1.031 | 1.023, N1024 0.994-1.015; d64 0.993-1.015 (not taken). TUNING.md: Hopper forward,
# consumers staggered.
GLUON_FORWARD_STAGGER = ((128, 0), (128, 1), (128, 2))
# (Triton release, padded head dim, SEEN, consumers, max chains) whose forward's softmax takes each row's sum over
# a thread's scores in one chain, as Triton 3.6 and 3.7 reduce (3.8 on: in a tree, after which ptxas issues the
# exponentials in bursts), and its max in `max chains` chains a thread. H200, tree ÷ one chain's time, d64 N1024 (two
# consumers), bf16 / fp16: 3.8 full 1.016 / 1.024, causal 1.000-1.010 / 1.001-1.005 (three runs; causal N2048-4096
# 0.990-1.006); 3.9 full 1.023 / 1.046, causal 0.992 / 0.998 (not taken); d64 three consumers 0.956, d128
# 0.962-0.997, d96 0.999 (3.8, not taken). The max in two chains, one chain's time ÷ two's, 3.8, two runs: causal
# 1.001-1.019 (N1024-4096); full N1024 0.985 / 0.960 (not taken); four chains slower on every row. TUNING.md: Hopper
# forward, the row reductions in chains.
GLUON_FORWARD_ROW_CHAINS = (((3, 8), 64, 0, 2, 1), ((3, 8), 64, 1, 2, 2), ((3, 9), 64, 0, 2, 1))
# Masks (the forward kernel's SEEN: 0 full, 1 causal, 2 a window) and padded head dims whose Gluon
# forward runs on a persistent grid, a program a multiprocessor: the next tile's loads under this
# one's epilogue, about 9% less time at d128 N1024, 7-12% at d64 N1024 (TUNING.md: Forward on a
# persistent grid); d256 keeps one tile a program (not timed on the persistent grid).
# Causal up to GLUON_PERSISTENT_CAUSAL_N query rows: past it the static grid's last wave cost more
# than the starts saved.
GLUON_PERSISTENT_SEEN = (0, 1, 2)
GLUON_PERSISTENT_HEAD_DIMS = (64, 128)
GLUON_PERSISTENT_CAUSAL_N = 4096
# The causal persistent forward's order (`hopper.causal_schedule`): (padded head dim, tiles a program) whose
# last heads, about that many tiles a program, go longest first to the least loaded program (a tile's start and
# epilogue counted as GLUON_CAUSAL_TILE_BLOCKS key blocks); other head dims keep units of a head's r-th longest
# and r-th shortest tile round robin to the end, whose last turn left about half the programs idle. H200, units'
# time ÷ this order's, 3.8 | 3.6: d64 causal N1024 1.015-1.023 | 1.004-1.039, N4096 1.009-1.023 | 0.991-1.015,
# B8 N2048 1.016-1.024 | 1.021-1.025; d128 0.989-1.002 | 0.963-1.000, so not there (TUNING.md: Forward on a
# persistent grid).
GLUON_CAUSAL_TAIL_TILES = ((64, 6),)
GLUON_CAUSAL_TILE_BLOCKS = 1
# Query rows per consumer warpgroup, the consumers' registers after the producer warp gives its own
# back: two consumers 240 (no spills at d128), three 160 (16 warps share the 64K registers: Triton
# gives the first consumer, its default partition, what is left, 168; the producer's warpgroup 24).
GLUON_ROWS = 64
GLUON_CONSUMER_REGISTERS = 240
GLUON_PRODUCER_REGISTERS = 24
GLUON_THREE_CONSUMER_REGISTERS = 160

# ---- backward: dK and dV (the dQ kernel, which also writes the row terms, stays tl) ----------
#
# Each program takes 2 x GLUON_KEYS keys of one (batch, KV head): one consumer warpgroup per GLUON_KEYS keys,
# which keeps its K, V and its dK, dV accumulators (fp32, registers) while the producer warp
# streams Q and dO blocks of GLUON_Q_ROWS rows of every query head of the group through a ring.
GLUON_KEYS = 64
GLUON_Q_ROWS = 64
GLUON_BWD_STAGES = 2

# The 5-matmul backward on the same tiles (Triton >= 3.8): dQ = dS K formed beside dK/dV and added
# into an fp32 buffer by TMA reduce-adds (not deterministic): 0.86-0.99x the 7-matmul pair's time
# (TUNING.md: Hopper backward). Never taken for a call asking for determinism (`deterministic=True`,
# torch.use_deterministic_algorithms(True)).
GLUON_FUSED_DQ = True
# Padded head dims the 5-matmul backward takes (its own gate beside GLUON_HEAD_DIMS): at d64 it ran
# in 0.92-0.99x the time of the tl pair that d64 had before (TUNING.md: Its head dims).
GLUON_FUSED_HEAD_DIMS = (64, 128)
# Softcapped scores (tanh.approx builds, `Mask.softcap_build`) in the 5-matmul backward, where the tl dQ and dK/dV
# kernels took them: 0.71x / 0.79x their time at d128 / d64 (H200, 3.8; TUNING.md: The softcapped backward).
GLUON_BWD_SOFTCAP = True
# Windows other than causal (sliding, either side bounded) in the 5-matmul backward, where the tl dQ and dK/dV kernels
# took them: 0.90x / 0.89x their time at d128 / d64, causal window 1024 (H200, 3.8; TUNING.md: Windows in the 5-matmul
# backward).
GLUON_BWD_WINDOWS = True
# Padded head dims whose 5-matmul backward issues the next Q block's S^T and dP^T before this block's dV, dK and
# dQ (`hopper_backward._steps_ahead`: the softmax under those matmuls), on a ring of GLUON_BWD_AHEAD_STAGES (two
# blocks held while the next loads): d64 took 0.91-0.96x the in-order time, 4 stages 2-6% less than 3, 5 or 6;
# d128 1.65-1.99x (the second block's scores spill). TUNING.md: Steps ahead.
GLUON_BWD_AHEAD_HEAD_DIMS = (64,)
GLUON_BWD_AHEAD_STAGES = 4
# Padded head dims (in order, not ahead) whose full-mask 5-matmul backward has its consumers take turns at dQ, one
# the whole 64 x 128 block a step (`hopper_backward._dq_by_turns`): each forming half of it every step took
# 1.006-1.021x the time on Triton 3.9, 0.989-1.008x on 3.8; causal masks by turns took 1.06-1.10x (TUNING.md: dQ
# by turns).
GLUON_BWD_DQ_TURNS_HEAD_DIMS = (128,)
# Padded head dims whose 5-matmul backward keeps its fp32 dQ sum in fragment rows, as the consumers' accumulators
# hold it (`hopper_backward.dq_sum_fields`: 16-byte stores, no bank conflict, where rows in order took 2-way
# conflicts): d128 1.012-1.061x faster, d64 0.964-0.987x (TUNING.md: The dQ sum in fragment rows).
GLUON_BWD_DQ_FRAGMENT_HEAD_DIMS = (128,)
# Causal backward programs (any of the kernels) go key block by key block, the longest first, over sections of KV
# heads whose query heads' Q, dO and dQ sum fit this many bytes of L2 (`hopper_backward.causal_section`), so that
# the last wave holds the shortest programs: 0.2-4.8% less time than head by head (0); 64 MiB took more
# (TUNING.md: Causal backward in sections of heads).
GLUON_BWD_CAUSAL_L2_BYTES = 32 << 20
# Rows per program of the tl kernel that writes its row terms and clears the dQ buffer.
PREP_ROWS = 64


# ---- serving: packed prefill and decode sequences against a paged cache in one launch ---------
# (serving.py, serving_kernels.py). The d128 16-bit tiles are measured (H100, the serving table's
# batch, TUNING.md); the split rule was varied with the earlier tiles only; other head dims and
# fp32 are priors.

# Long sequences' row tiles (BLOCK_M (token, group head) rows x BLOCK_N keys), short sequences'
# (SHORT_N keys; SHORT_M rows: at least the dot's 16, at least a GQA group), warps and stages of
# the one launch, by padded head dim: (max head dim, (BLOCK_M, BLOCK_N, SHORT_N, warps, stages)).
# One kernel holds both walks: its shared memory is the larger one's, so both take 64-key blocks
# at d128 (three stages of K and V, 96 KB). d128: 64 rows on four warps ran the mixed batch in
# 0.70-0.72x the time of 128 rows on eight (one program per multiprocessor at 237 registers); two
# stages or another split rule moved the latter by 4% at most (e2e/row_variants.py, 3.6 and 3.8).
SERVING_TILES_16BIT = ((64, (128, 64, 64, 4, 3)), (128, (64, 64, 64, 4, 3)), (256, (64, 32, 32, 8, 2)))
SERVING_TILES_32BIT = ((64, (64, 32, 32, 4, 2)), (128, (64, 32, 32, 4, 2)), (256, (32, 16, 16, 4, 2)))
SERVING_MIN_SHORT_M = 16
SERVING_MAX_SHORT_M = 64

# Short sequences' key splits: about SERVING_SPLIT_PROGRAMS_PER_SM programs per multiprocessor
# over the sequences' (KV head) items, as a power of two, each of at least SERVING_MIN_SPLIT_KEYS
# keys, at most SERVING_MAX_SPLITS, and at most SERVING_MAX_SPLIT_ITEMS items per call (their fp32
# scratch: 16 rows x (D + 1) each, 68 MB at d128). Splits of about one size balance the decode
# reads, and many small items fill the gaps that prefill tiles leave.
SERVING_SPLIT_PROGRAMS_PER_SM = 16
SERVING_MIN_SPLIT_KEYS = 1024
SERVING_MAX_SPLITS = 64
SERVING_MAX_SPLIT_ITEMS = 1 << 13

# Sequences each program's prefix sums read at a time (more: a loop).
SERVING_BLOCK_S = 1024

# New rows written per program of the page-write launch, and the sequences it compares at a time.
SERVING_WRITE_ROWS = 16
SERVING_WRITE_BLOCK_S = 128

# The interpreter: the smallest tiles, long tiles of two blocks, and splits of a few blocks.
SERVING_INTERPRETER_TILES = (32, 16, 16, 1, 1)
SERVING_INTERPRETER_PROGRAMS = 16
SERVING_INTERPRETER_SPLIT_KEYS = 16

"""fk-attention's plan: for one key (shapes, strides, dtype, device, mask, scale), what to launch,
bound once (`BOUND`), and the autotuning that picks among config's candidates.

Three tl kernels share it (`Kind`): the forward (a BLOCK_M block of queries walks the keys in steps
of BLOCK_N), dQ (same walk, backward) and dK/dV (a BLOCK_N block of keys walks the queries of its
GQA group in steps of BLOCK_M). On Hopper at padded head dim 128 the dense forward and the
backward's dK/dV (switched on: the whole backward, 5 matmuls) run the Gluon kernels of `hopper`
instead, where they serve; the split-KV decode path is `decode`'s. Numbers live in `config`, input
checks, TMA gates and layouts in `layout`, the mask in `mask`.

- The interpreter runs one fixed small config (programs run one by one on the CPU; small blocks
  keep the tests quick and still take several loop steps on tiny shapes).
- On a GPU every launch takes config's fixed default for its kind, head dim, dtype and mask
  (measured on the H100; no call times anything). With FK_AUTOTUNE=1, problems of at least
  AUTOTUNE_MIN_SCORES scores in fp16/bf16 are autotuned over a few candidates per head dim
  (`triton.autotune`, key: length buckets, heads bucket, window, softcap, packed, head dim,
  dtype), the result kept for the process so a shape tunes once (on disk too where no config
  carries a pre-hook: Triton cannot store those, and the descriptor configs need one to size
  their tiles).
- Tensor descriptors (TMA loads and stores) are built on the host, one 4-D descriptor per
  (B, H, N, D) operand passed as a kernel parameter, where `layout` allows them (CUDA, compute
  capability >= 9, 16-bit and fp32 inputs whose base and strides are 16-byte aligned); pointer
  loads everywhere else. Where allowed, every launch, fixed or tuned, uses them: on an H100 they
  beat pointers, and descriptors built in the kernel, on every shape measured (TUNING.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import re
import threading
from pathlib import Path

import torch

from fk_runtime import ahead, alloc, backend, checks, package_version, sizing, timing
from fk_runtime.launch import FP_FUSION, Descriptor, Launch, PlanCache, bind_context, layout_key

from . import hopper, hopper_backward, kernels
from .config import (AUTOTUNE_DTYPES, AUTOTUNE_ENV, AUTOTUNE_MIN_SCORES, AUTOTUNE_WARMUP_MS, CACHE_SIZE,
                     KEY_ARGS, KEY_MAX_HEADS, KEY_MAX_LENGTH, KEY_MIN_LENGTH, TAIL_COLS, TAIL_ROWS, Config, Kind,
                     candidates, default_config, dkdv_parts, forward_meta, hip_waves_per_eu, launch_options, window_build)
from .layout import (FP8_DTYPES, Packing, alibi_strides, bases_aligned, check_alibi, check_backward, check_bounds,
                     check_inputs,
                     descriptor_strides, descriptors_may_serve, fit, fp8_supported, heads_inside_tokens,
                     kernel_strides, new_output, output_dtype, packed, padded_head_dim, precision,
                     row_offsets_fit, strides_allow_descriptors, widened)
from .mask import Mask


STATS_ALIGN = int(kernels.STATS_ALIGN)


def should_autotune(dtype: torch.dtype, batch_heads: int, n_q: int, n_k: int) -> bool:
    return (
        os.environ.get(AUTOTUNE_ENV, "0") == "1"
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
    (kernel, head dim, descriptors allowed, packed): the candidates differ. Its key: the KEY_ARGS
    the kernel takes (dK/dV's PART, so that its two launches tune apart); BLOCK_M, BLOCK_N and
    USE_DESC come from the configs, and with descriptors each config sizes the descriptors' tiles
    before it runs (`fit_descriptors`)."""
    import triton

    configs = []
    for c in candidates(kind, head_dim, descriptors):
        meta = c.meta(varlen)
        if backend.is_hip():
            meta["waves_per_eu"] = hip_waves_per_eu(head_dim)
        configs.append(triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages,
                                     pre_hook=fit_descriptors if descriptors else None))
    key = [name for name in KEY_ARGS if name in kernel.arg_names]
    options = {"configs": configs, "key": key, "prune_configs_by": {"early_config_prune": _prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        options["do_bench"] = functools.partial(timing.do_bench, warmup_ms=AUTOTUNE_WARMUP_MS)
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
        tuned[grid](*args, **meta, enable_fp_fusion=FP_FUSION)
        return getattr(tuned, "best_config", None)


def tensor_descriptor(t: torch.Tensor, rows: str, padded_head_dim: int, config: Config | None,
                      layout: tuple[list, list] | None = None):
    """A TMA descriptor over the (B, H, N, D) tensor t (or over t's base laid out as `layout`, (shape,
    strides): a packed tensor as its bound view), in tiles of [1, 1, R, padded_head_dim]: R is
    `config`'s `rows` block ("BLOCK_M" or "BLOCK_N"), or, with no config (autotuned launches), set by
    each config before it runs (`fit_descriptors`). Rows past N and the head-dim padding read as
    zeros; stores drop them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_rows = config.meta()[rows] if config is not None else 1
    shape, strides = layout or (list(t.shape), descriptor_strides(t))
    desc = TensorDescriptor(t, list(shape), list(strides), [1, 1, block_rows, padded_head_dim])
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
# ... and on disk, one file per device name, Triton version and fk version (FK_CACHE_DIR, else
# ~/.cache/fk): a key tunes once across processes, descriptor configs included.
CACHE_DIR_ENV = "FK_CACHE_DIR"
_WINNER_FILES: dict = {}


def winners_file(device: torch.device) -> Path:
    """Where the tuning picks for `device` live (the name says which device, Triton and fk)."""
    import triton

    root = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "fk")
    name = backend.device_name(device.index or 0)
    fk = _fk_version()
    stem = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", part) for part in (name, f"triton{triton.__version__}", f"fk{fk}"))
    return root / f"attention-tuning-{stem}.json"


@functools.cache
def _fk_version() -> str:
    return package_version(__package__, str(Path(__file__).with_name("__init__.py")))


def _stored_key(key) -> str:
    (kind, *rest, device_index), use = key
    return json.dumps([kind.value, *rest[:-1], list(rest[-1]), use])


def stored_winner(key, device: torch.device) -> Config | None:
    """The pick on disk for `key` (WINNERS' key), read once per device and process."""
    picks = _WINNER_FILES.get(device.index)
    if picks is None:
        path = winners_file(device)
        try:
            picks = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            picks = {}  # unreadable or torn: tune again, the next store rewrites it
        _WINNER_FILES[device.index] = picks
    row = picks.get(_stored_key(key))
    return Config(*row) if row is not None else None


def store_winner(key, config: Config, device: torch.device) -> None:
    picks = _WINNER_FILES.setdefault(device.index, {})
    picks[_stored_key(key)] = dataclasses.astuple(config)
    path = winners_file(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(picks, indent=0, sort_keys=True))
        os.replace(scratch, path)  # whole files only, also with several processes tuning at once
    except OSError:
        pass  # a read-only home: the pick stays in this process


class Kernel:
    """One kernel launch of a bound plan over `programs` (batch, head) pairs x row blocks of
    `n_rows`: the autotuner's winner for big half-precision problems (the tuner runs once per
    key), else the head dim's fixed config, or the caller's (tests). `descriptors`: True / False
    forces TMA on or off; None: TMA where the strides allow it (decided here) and every tile
    operand's base is aligned (decided per call). The first len(`tiles`) head arguments are the
    (B, H, N, D) operands (a call may pass any tensor with the example's base: only its address is
    read, the shape and strides are the example's), tiled by the named block's rows ("BLOCK_M" or
    "BLOCK_N"). A kernel with a REST constexpr (the packed backward) is launched twice, REST false then
    true (over `programs` only, and `spare` programs more: they fill the rows past the last sequence),
    same config."""

    def __init__(self, kernel, kind: Kind, n_rows: int, programs: int, tiles: tuple, examples: tuple,
                 tail: tuple, meta: dict, dtype: torch.dtype, tune: bool, descriptors: bool | None,
                 config: Config | None, device: torch.device, span: int | None = None, spare: int = 0):
        self.kernel, self.kind, self.n_rows, self.programs, self.spare = kernel, kind, n_rows, programs, spare
        self.tiles, self.tail, self.meta, self.dtype, self.device = tiles, tail, meta, dtype, device
        self.head_dim, self.padded = meta["HEAD_DIM"], meta["HEAD_DIM_PADDED"]
        self.walked = "BLOCK_N" if kind is Kind.DKDV else "BLOCK_M"
        self.tune, self.config, self.span = tune and config is None, config, span
        self.tile_index = tuple(i for i, rows in enumerate(tiles) if rows is not None)
        operands = [examples[i] for i in self.tile_index]
        if config is not None:
            descriptors = config.descriptors
        self.forced = descriptors
        self.may_use = descriptors if descriptors is not None else (
            descriptors_may_serve(device, operands))
        self.layouts = tuple((list(t.shape), descriptor_strides(t)) for t in operands)
        self.tuning_key = (kind, self.head_dim, meta["WINDOW"], meta["SOFTCAP"], meta["VARLEN"],
                           meta.get("HAS_DLSE"), meta.get("PART", 0), tail[-4:], device.index)
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
                config = WINNERS.get((self.tuning_key, use)) or stored_winner((self.tuning_key, use), self.device)
                if config is None:
                    if ahead.active():  # no tuning ahead: the backward's own first call tunes
                        return
                    self._tune(head, use)  # the tuner's launch ran the kernel (REST false)
                    if not self.rest:
                        return
                    config = WINNERS.get((self.tuning_key, use))
                    tuned_now = config is not None  # else the default config runs both launches
            config = config or default_config(self.kind, self.head_dim, self.dtype, use, self.span,
                                              self.meta["VARLEN"], bool(self.meta["SOFTCAP"]),
                                              self.meta["WINDOW"] != 0)
            block = config.meta()[self.walked]
            meta = {**self.meta, **config.meta(self.meta["VARLEN"]), **launch_options(config, self.head_dim)}
            grid = (sizing.cdiv(self.n_rows, block) * self.programs,)
            launches = [Launch(self.kernel, grid, self.tail, meta, self.device)]
            if self.rest:  # one program per (sequence, head) for the blocks past max_seqlen
                launches.append(Launch(self.kernel, (self.programs + self.spare,), self.tail, {**meta, "REST": True},
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
            for i, layout in zip(self.tile_index, self.layouts, strict=True):
                args[i] = tensor_descriptor(head[i], self.tiles[i], self.padded, None, layout)
        walked = self.walked
        best = launch_tuned(self.kernel, self.kind, self.head_dim, use,
                            lambda m: (sizing.cdiv(self.n_rows, m[walked]) * self.programs,),
                            (*args, *self.tail), self.meta, self.meta["VARLEN"])
        if best is not None:
            kw = best.kwargs
            WINNERS[(self.tuning_key, use)] = Config(kw["BLOCK_M"], kw["BLOCK_N"], best.num_warps,
                                                    best.num_stages, bool(kw["USE_DESC"]))
            store_winner((self.tuning_key, use), WINNERS[(self.tuning_key, use)], self.device)


def tuning_keys(n_q: int, n_k: int, batch_heads: int, dtype: torch.dtype, mask: Mask) -> tuple[int, int, int, int]:
    # A sliding window's walks are as long as the window, not the sequence: tuned apart from causal.
    walk = n_k if mask.span is None else min(n_k, mask.span)
    return length_key(n_q), length_key(walk), heads_key(batch_heads), dtype_key(dtype)


def _meta(mask: Mask, varlen: bool, head_dim: int, dtype: torch.dtype, alibi: bool = False,
          dropout: bool = False) -> dict:
    return {"WINDOW": window_build(mask), "SOFTCAP": mask.softcap_build(dtype), "ALIBI": alibi, "DROPOUT": dropout,
            "VARLEN": varlen,
            "HEAD_DIM": head_dim, "PRECISION": precision(dtype),
            "HEAD_DIM_PADDED": padded_head_dim(head_dim, dtype)}


def _tail_fill(device: torch.device, sequences: int, total: int, heads: int, head_dim: int):
    """launch(out, lse, cu) setting the token rows [cu[sequences], total) of a fresh packed output (total, heads,
    head_dim) to 0 and of its log-sum-exp (heads, total) to -inf: the rows of a padded buffer past its last
    sequence, which the Gluon forward leaves (`kernels.fill_tail_kernel`)."""
    cols = heads * head_dim
    return Launch(kernels.fill_tail_kernel, (sizing.cdiv(total, TAIL_ROWS),),
                  (sequences, total, cols, cols, 1, 0.0, heads, 1, total, -math.inf),
                  {"BLOCK_R": TAIL_ROWS, "BLOCK_C": TAIL_COLS}, device)


def bind_forward(q, k, v, mask: Mask, sm_scale: float, config=None, descriptors=None,
                  packing: Packing | None = None, alibi: torch.Tensor | None = None, dropout: bool = False):
    """The forward of one key: run(q, k, v, cu_q, cu_k, alibi, dropout_p, seed) -> (out, lse). Dense:
    (B, H, N, D) inputs, out like q, lse (B, H, N). Packed: (total, H, D) inputs, out (total, H, D), lse
    (H, total). `alibi`: ALiBi slopes laid out as the calls will pass them (`layout.check_alibi`);
    `dropout`: the calls pass a dropout_p > 0 and their int64 seed on the device."""
    check_inputs(q, k, v, packing is not None)  # one dtype and device among them
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_kernel_device(name, t)
    if q.dtype in FP8_DTYPES:
        ok, why = fp8_supported(q.device)
        if not ok:
            raise TypeError(why)
    varlen = packing is not None
    check_alibi(alibi, q, packing.sequences if varlen else q.shape[0], q.shape[1])  # once per plan
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
        bnhd = heads_inside_tokens(q)  # out in q's layout, as the registered fake gives it
        out_shape = q.shape
        lse_strides = (hq * n_q, n_q)
        totals = (n_q, n_k)

        def new_outputs():
            out = new_output(out_shape, bnhd, out_proto)
            return out, alloc.new_empty(fp32, (b, hq, n_q))

        def as_kernel(t):
            return t

    if q.numel() == 0:
        return lambda *args, **kwargs: new_outputs()
    if k.numel() == 0 or b == 0:  # no keys (packed: or no sequence, every row spare): zeros; the lse of nothing is -inf
        def no_keys(*args, **kwargs):
            out, lse = new_outputs()
            return out.zero_(), lse.fill_(-math.inf)
        return no_keys
    (q_, q_ok), (k_, k_ok), (v_, v_ok) = (fit(as_kernel(t)) for t in (q, k, v))
    out = as_kernel(new_outputs()[0])
    tail = (sm_scale, *mask.kernel_args()[:1], n_q, n_k, hq, hq // hk, *mask.kernel_args()[1:], *totals,
            *kernel_strides(q_, varlen), *kernel_strides(k_, varlen), *kernel_strides(v_, varlen), *kernel_strides(out, varlen),
            *lse_strides, *alibi_strides(alibi), *tuning_keys(n_q, n_k, b * hq, dtype, mask))
    tiles = _inputs_only(FORWARD_TILES, (3,) if varlen else ())
    # Packed: a sequence of programs more, which fills the rows past the last sequence (`kernels._spare_rows`).
    kernel = Kernel(kernels.attn_fwd_kernel, Kind.FORWARD, n_q, (b + varlen) * hq, tiles, (q_, k_, v_, out), tail,
                     {**_meta(mask, varlen, d, dtype, alibi is not None, dropout), **forward_meta()}, dtype,
                     should_autotune(dtype, b * hq, n_q, n_k), descriptors,
                     config, device, mask.span)
    # The Gluon kernel on Hopper where it serves (hopper.py); a forced config or TMA choice is the tl one's.
    gluon = spare = None
    if config is None and descriptors is None and q_ok and k_ok and v_ok and alibi is None and not dropout \
            and hopper.takes(q_, k_, v_, mask, sm_scale, packing):
        gluon = hopper.bind(q_, k_, v_, out, lse_strides, mask, sm_scale, packing)
        # Packed rows past the last sequence, which the Gluon kernel leaves: output 0, log-sum-exp -inf.
        spare = _tail_fill(device, b, total_q, hq, d) if varlen else None

    # The kernels read a tensor's base only (its bound views' shapes and strides are the plan's), so a call
    # passes the tensors themselves; an input whose offsets overflow passes its copy, laid out as bound.
    as_given = q_ok and k_ok and v_ok

    def run(q, k, v, cu_q=None, cu_k=None, alibi=None, dropout_p=0.0, seed=None):
        out, lse = new_outputs()
        if gluon is not None and bases_aligned((q, k, v, out)):
            gluon(q, k, v, out, lse, cu_q, cu_k)
            if spare is not None:
                spare(out, lse, cu_q)
        else:
            if not as_given:
                q, k, v = (t if ok else as_kernel(t).contiguous() for t, ok in ((q, q_ok), (k, k_ok), (v, v_ok)))
            kernel(q, k, v, out, lse, lse if cu_q is None else cu_q, lse if cu_k is None else cu_k,
                   lse if alibi is None else alibi, lse if seed is None else seed, float(dropout_p))
        return out, lse

    return run


def forward(q, k, v, mask: Mask, sm_scale: float, config: Config | None = None,
            descriptors: bool | None = None, alibi: torch.Tensor | None = None, dropout_p: float = 0.0,
            seed: torch.Tensor | None = None):
    """(out, lse): out like q ((B, Hq, Nq, D), bf16 for fp8 inputs), lse (B, Hq, Nq) fp32 in
    natural log. `config` (with its `descriptors` flag) or `descriptors` alone override the
    config's choice (tests; not cached). `alibi`: fp32 ALiBi slopes, (Hq,) or (B, Hq). `dropout_p`
    > 0: attention dropout keyed by `seed` (int64 (1,) on q's device; `kernels.dropout_scale`)."""
    if widened(q.dtype):
        out, lse = forward(q.float(), k.float(), v.float(), mask, sm_scale, config, descriptors, alibi, dropout_p,
                           seed)
        return out.to(q.dtype), lse
    drop = (dropout_p, seed)
    if config is not None or descriptors is not None:
        return bind_forward(q, k, v, mask, sm_scale, config, descriptors, alibi=alibi,
                            dropout=dropout_p > 0)(q, k, v, None, None, alibi, *drop)
    return bound_forward(q, k, v, mask, sm_scale, alibi, dropout_p > 0)(q, k, v, None, None, alibi, *drop)


def bound_forward(q, k, v, mask: Mask, sm_scale: float, alibi: torch.Tensor | None = None, dropout: bool = False):
    """run(q, k, v, cu_q, cu_k, alibi, dropout_p, seed) -> (out, lse): the forward bound for these
    inputs' layouts (not widened)."""
    key = (*layout_key(q, k, v, alibi), mask, sm_scale, dropout)
    return BOUND.get(key) or BOUND.get_or_build(
        key, lambda: bind_forward(q, k, v, mask, sm_scale, alibi=alibi, dropout=dropout))


def forward_packed(q, k, v, cu_q, cu_k, packing: Packing, mask: Mask, sm_scale: float,
                   config: Config | None = None, alibi: torch.Tensor | None = None, dropout_p: float = 0.0,
                   seed: torch.Tensor | None = None):
    """(out (total_q, Hq, D), lse (Hq, total_q)) of packed sequences: sequence i is rows
    cu_q[i]:cu_q[i + 1] of q against rows cu_k[i]:cu_k[i + 1] of k and v; `alibi` (Hq,) or
    (sequences, Hq); `dropout_p`, `seed` as in `forward`."""
    if widened(q.dtype):
        out, lse = forward_packed(q.float(), k.float(), v.float(), cu_q, cu_k, packing, mask, sm_scale, config,
                                  alibi, dropout_p, seed)
        return out.to(q.dtype), lse
    dropout = dropout_p > 0
    if config is not None:
        _check_bounds_device(cu_q, cu_k)
        return bind_forward(q, k, v, mask, sm_scale, config, None, packing, alibi, dropout)(
            q, k, v, cu_q, cu_k, alibi, dropout_p, seed)
    run = bound_forward_packed(q, k, v, cu_q, cu_k, packing, mask, sm_scale, alibi, dropout)
    return run(q, k, v, cu_q, cu_k, alibi, dropout_p, seed)


def bound_forward_packed(q, k, v, cu_q, cu_k, packing: Packing, mask: Mask, sm_scale: float,
                         alibi: torch.Tensor | None = None, dropout: bool = False):
    """run(q, k, v, cu_q, cu_k, alibi, dropout_p, seed) -> (out, lse): the packed forward bound for
    these inputs' layouts, the bounds' and `packing` (not widened)."""
    key = ("packed", packing, *layout_key(q, k, v, cu_q, cu_k, alibi), mask, sm_scale, dropout)

    def build():
        _check_bounds_device(cu_q, cu_k)
        check_bounds(cu_q, cu_k, packing)
        return bind_forward(q, k, v, mask, sm_scale, packing=packing, alibi=alibi, dropout=dropout)

    return BOUND.get(key) or BOUND.get_or_build(key, build)


def _check_bounds_device(cu_q, cu_k) -> None:
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.check_kernel_device(name, t)


def bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask: Mask, sm_scale: float,
                   configs=None, descriptors=None, packing: Packing | None = None,
                   alibi: torch.Tensor | None = None, dropout: bool = False):
    """The backward of one key: run(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, alibi, dropout_p,
    seed) -> (dq, dk, dv), the gradients laid out like the inputs (packed: (total, H, D))."""
    check_backward(grad_out, grad_lse, q, k, v, out, lse, packing is not None)
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
        layouts = [(t.shape, heads_inside_tokens(t)) for t in (q, k, v)]  # gradients like the inputs
        lse_strides = (hq * n_q, n_q)
        totals = (n_q, n_k)

        def new_grads():
            return tuple(new_output(shape, bnhd, grad_proto) for shape, bnhd in layouts)

        padded_n = sizing.cdiv(n_q, STATS_ALIGN) * STATS_ALIGN  # strides and offsets that never move with N
        scratch_strides = (hq * padded_n, padded_n)

        def new_stats():
            return alloc.new_empty(fp32, (2, b, hq, padded_n))

        def as_kernel(t):
            return t

        def lse_view(t):
            return t

    if q.numel() == 0 or k.numel() == 0 or b == 0:
        return lambda *args, **kwargs: tuple(g.zero_() for g in new_grads())
    # An expanded gradient (`out.sum().backward()`: zero strides) is materialized: TMA cannot read
    # it, and the pointer path costs more than the copy.
    expanded = 0 in grad_out.stride()
    fitted = [fit(as_kernel(t)) for t in (q, k, v, out, grad_out.contiguous() if expanded else grad_out)]
    (q_, k_, v_, out_, go_), oks = zip(*fitted, strict=True)
    has_dlse = grad_lse is not None
    dlse_, dlse_ok = fit(lse_view(grad_lse), row_offsets_fit) if has_dlse else (lse_view(lse), True)
    dq, dk, dv = (as_kernel(g) for g in new_grads())
    delta, lse2 = new_stats()
    dq_config, dkdv_config = configs or (None, None)
    meta = _meta(mask, varlen, d, dtype, alibi is not None, dropout)
    keys = tuning_keys(n_q, n_k, b * hq, dtype, mask)
    tune = should_autotune(dtype, b * hq, n_q, n_k)
    forced = configs is not None or descriptors is not None
    if configs is None and descriptors is None:
        # One choice for both kernels: TMA where every operand of either allows it.
        descriptors = None if all(strides_allow_descriptors(t) for t in (q_, k_, v_, out_, go_, dq, dk, dv)) \
            else False
    softcap, lower_right, left, right = mask.kernel_args()
    dlse_strides = (0, *dlse_.stride()[1:]) if varlen else dlse_.stride()
    # Packed: the REST launches' programs of one sequence more set the gradients' rows past the last sequence to 0
    # (their outputs are 0 whatever their inputs).
    dq_kernel = Kernel(
        kernels.attn_bwd_dq_kernel, Kind.DQ, n_q, b * hq, _inputs_only(DQ_TILES, (9,) if varlen else ()),
        (q_, k_, v_, out_, go_, lse, dlse_, delta, lse2, dq),
        (sm_scale, softcap, n_q, n_k, hq, hq // hk, lower_right, left, right, *totals,
         *(s for t in (q_, k_, v_, out_, go_) for s in kernel_strides(t, varlen)), *dlse_strides,
         *kernel_strides(dq, varlen), *lse_strides, *scratch_strides, *alibi_strides(alibi), *keys),
        {**meta, "HAS_DLSE": has_dlse, "REST": False}, dtype, tune, descriptors, dq_config, device, mask.span,
        hq if varlen else 0)
    dkdv_kernels = [Kernel(
        kernels.attn_bwd_dkdv_kernel, Kind.DKDV, n_k, b * hk, _inputs_only(DKDV_TILES, (6, 7) if varlen else ()),
        (q_, k_, v_, go_, lse2, delta, dk, dv),
        (sm_scale, softcap, n_q, n_k, hk, hq // hk, lower_right, left, right, *totals,
         *(s for t in (q_, k_, v_, go_, dk, dv) for s in kernel_strides(t, varlen)), *scratch_strides,
         *alibi_strides(alibi), *keys),
        {**meta, "REST": False, "PART": part}, dtype, tune, descriptors, dkdv_config, device, mask.span,
        hk if varlen else 0)
        for part in dkdv_parts(d)]

    as_given = all(oks) and not expanded
    # dK/dV in Gluon on Hopper where it serves (hopper_backward.py), the 5-matmul backward where that serves;
    # forced configs or TMA choices run tl.
    gluon = fused = None
    if not varlen and not forced and alibi is None and not dropout and descriptors_may_serve(device, (go_, dk, dv)):
        if hopper_backward.serves(q_, k_, v_, mask):
            gluon = hopper_backward.bind_dkdv(q_, k_, v_, go_, dk, dv, scratch_strides, mask, sm_scale)
        if hopper_backward.fused_serves(q_, k_, v_, mask):
            fused = hopper_backward.bind_backward(q_, k_, v_, out_, go_, dlse_ if has_dlse else None, dq, dk, dv,
                                                  lse_strides, scratch_strides, mask, sm_scale)

    def run(grad_out, grad_lse, q, k, v, out, lse, cu_q=None, cu_k=None, alibi=None, dropout_p=0.0, seed=None):
        # The tensors themselves, as the forward's run passes them; copies laid out as bound where they overflow.
        if expanded:  # materialized as bound: before the packed view (whose own copy has other strides)
            grad_out = grad_out.contiguous()
        if not as_given:
            q, k, v, out, grad_out = (t if ok else as_kernel(t).contiguous()
                                      for t, ok in zip((q, k, v, out, grad_out), oks, strict=True))
        dlse = (grad_lse if dlse_ok else grad_lse.contiguous()) if has_dlse else lse
        grads = dq, dk, dv = new_grads()
        delta, lse2 = new_stats()
        cu_q = lse if cu_q is None else cu_q
        cu_k = lse if cu_k is None else cu_k
        alibi = lse if alibi is None else alibi
        drop = (lse if seed is None else seed, float(dropout_p))
        aligned = (gluon is not None or fused is not None) and bases_aligned((q, k, v, grad_out, dk, dv))
        if fused is not None and aligned and not torch.are_deterministic_algorithms_enabled():
            fused(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, dk, dv)
            return grads
        dq_kernel(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, cu_q, cu_k, alibi, *drop)
        # dK/dV reads the delta and base-2 lse the dQ kernel wrote (same stream, in order).
        if aligned and gluon is not None:
            gluon(q, k, v, grad_out, lse2, delta, dk, dv)
        else:
            for dkdv_kernel in dkdv_kernels:
                dkdv_kernel(q, k, v, grad_out, lse2, delta, dk, dv, cu_q, cu_k, alibi, *drop)
        return grads

    return run


def backward(grad_out, grad_lse, q, k, v, out, lse, mask: Mask, sm_scale: float,
             configs: tuple[Config, Config] | None = None, descriptors: bool | None = None,
             alibi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """(dq, dk, dv). `grad_lse` (may be None) is the gradient reaching the log-sum-exp output.
    `configs` = (dQ config, dK/dV config) or `descriptors` alone override the config's choice
    (tests; not cached; each config's `descriptors` flag holds for its kernel). `dropout_p`, `seed`:
    the forward's (its mask regenerated, never stored)."""
    if widened(q.dtype):
        wide = [t.float() for t in (grad_out, q, k, v, out)]
        grads = backward(wide[0], grad_lse, *wide[1:], lse, mask, sm_scale, configs, descriptors, alibi, dropout_p,
                         seed)
        return tuple(g.to(q.dtype) for g in grads)
    lse = lse.contiguous()  # the kernels read it as (B, H, N) rows (a saved-tensor hook may hand back other strides)
    drop = (dropout_p, seed)
    if configs is not None or descriptors is not None:
        return bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, configs, descriptors,
                              alibi=alibi, dropout=dropout_p > 0)(grad_out, grad_lse, q, k, v, out, lse, None, None,
                                                                   alibi, *drop)
    key = (*layout_key(q, k, v, out, grad_out, lse, grad_lse, alibi), mask, sm_scale, dropout_p > 0)
    run = BOUND.get(key) or BOUND.get_or_build(
        key, lambda: bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, alibi=alibi,
                                   dropout=dropout_p > 0))
    return run(grad_out, grad_lse, q, k, v, out, lse, None, None, alibi, *drop)


def backward_packed(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, packing: Packing, mask: Mask,
                    sm_scale: float, configs: tuple[Config, Config] | None = None,
                    alibi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """(dq, dk, dv) of `forward_packed`, each (total, H, D). Deterministic (no atomics)."""
    if widened(q.dtype):
        wide = [t.float() for t in (grad_out, q, k, v, out)]
        grads = backward_packed(wide[0], grad_lse, *wide[1:], lse, cu_q, cu_k, packing, mask, sm_scale, configs,
                                alibi, dropout_p, seed)
        return tuple(g.to(q.dtype) for g in grads)
    lse = lse.contiguous()  # the kernels read it as (H, total) rows
    dropout = dropout_p > 0
    if configs is not None:
        return bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, configs, None, packing, alibi,
                              dropout)(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, alibi, dropout_p, seed)
    key = ("packed", packing, *layout_key(q, k, v, out, grad_out, lse, grad_lse, cu_q, cu_k, alibi), mask,
           sm_scale, dropout)

    def build():
        check_bounds(cu_q, cu_k, packing)
        return bind_backward(grad_out, grad_lse, q, k, v, out, lse, mask, sm_scale, packing=packing, alibi=alibi,
                              dropout=dropout)

    run = BOUND.get(key) or BOUND.get_or_build(key, build)
    return run(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, alibi, dropout_p, seed)

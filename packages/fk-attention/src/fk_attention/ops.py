"""Launchers, `torch.library` ops and autograd for attention.

Path of a call: checks (fk_runtime, tensor metadata only) -> autograd.Function -> launch plan
(fk_runtime.tuning.attention: fixed config or autotuner, TMA descriptors or pointers) -> forward
kernel (saves O and the fp32 row log-sum-exp) -> backward: dQ kernel (also writes the row term
delta = rowsum(dO * O)), then dK/dV kernel (per KV head, summed over its query heads). Nothing
N x N is ever stored. Eager calls reach the launchers directly; under `torch.compile` they go
through the registered ops (opaque, with fake implementations and autograd), so compiled graphs
call the same kernels without a graph break (fk_runtime.dispatch).
"""

from __future__ import annotations

import contextlib
import math

import torch
from fk_runtime import alloc, backend, checks, dispatch
from fk_runtime import sizing as fk_sizing
from fk_runtime.tuning import attention as table

from . import kernels

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *table.FP8_DTYPES)
# Which block's rows each kernel's leading (B, H, N, D) operands are tiled by, in argument order
# (None: not a tile operand): query-side tensors by BLOCK_M, key-side ones by BLOCK_N.
FORWARD_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M")  # q, k, v, out
# dQ: q, k, v, out, grad_out, lse, grad_lse, delta, dq; dK/dV: q, k, v, grad_out, lse, delta, dk, dv.
DQ_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", "BLOCK_M", None, None, None, "BLOCK_M")
DKDV_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", None, None, "BLOCK_N", "BLOCK_N")


def _strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


def _addressable(t: torch.Tensor, fits=table.tile_offsets_fit) -> torch.Tensor:
    """t, or a contiguous copy where its strides would overflow the kernels' 32-bit in-tile
    offsets (rare layouts: see `table.tile_offsets_fit`)."""
    return t if fits(t) else t.contiguous()


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs get exact fp32 products (tf32 would cost them ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else None


def _same_layout(t: torch.Tensor, dtype: torch.dtype, empty) -> torch.Tensor:
    """A fresh (B, H, N, D) tensor laid out like `t`: (B, N, H, D) storage when `t` is such a view
    (heads inside tokens), so that `.transpose(1, 2)` of the result is contiguous again, unless
    that token stride (H * D) would overflow the kernels' in-tile offsets."""
    b, h, n, d = t.shape
    if t.stride(1) < t.stride(2):
        out = empty((b, n, h, d), dtype).transpose(1, 2)
        if table.tile_offsets_fit(out):
            return out
    return empty((b, h, n, d), dtype)


def _alloc_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _same_layout(t, dtype or t.dtype, lambda shape, dt: alloc.empty(shape, dtype=dt, device=t.device))


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _same_layout(t, dtype or t.dtype, lambda shape, dt: t.new_empty(shape, dtype=dt))


def _output_dtype(dtype: torch.dtype) -> torch.dtype:
    return table.FP8_OUTPUT_DTYPE if dtype in table.FP8_DTYPES else dtype


def _launch(kernel, kind: table.Kind, n_rows: int, programs: int, args: tuple, tiles: tuple,
            meta: dict, dtype: torch.dtype, tune: bool, descriptors: bool,
            config: table.Config | None) -> None:
    """One launch over `programs` (batch, head) pairs x row blocks of `n_rows`: the autotuner's
    pick for big half-precision problems, else the fixed config (or the caller's, for tests).
    `descriptors`: the tensors allow TMA here (tests may force it on any backend); then the first
    len(`tiles`) args, (B, H, N, D) tensors, go as TMA descriptors of tiles of the named block's
    rows ("BLOCK_M" or "BLOCK_N"; None: the arg stays as it is)."""
    head_dim = meta["HEAD_DIM"]
    walked = "BLOCK_N" if kind is table.Kind.DKDV else "BLOCK_M"
    if config is None and tune:
        if descriptors:
            args = _descriptors(args, tiles, meta["HEAD_DIM_PADDED"], None)
        table.launch_tuned(kernel, kind, head_dim, descriptors,
                           lambda m: (fk_sizing.cdiv(n_rows, m[walked]) * programs,), args, meta)
        return
    config = config or table.default_config(kind, head_dim, dtype, descriptors)
    if config.descriptors:
        args = _descriptors(args, tiles, meta["HEAD_DIM_PADDED"], config)
    block = config.meta()[walked]
    kernel[(fk_sizing.cdiv(n_rows, block) * programs,)](
        *args, **meta, **config.meta(), **table.launch_options(config, head_dim)
    )


def _descriptors(args: tuple, tiles: tuple, padded_head_dim: int, config: table.Config | None) -> tuple:
    """`args` with its first len(`tiles`) tensors as TMA descriptors (see `_launch`)."""
    tiled = args[:len(tiles)]
    converted = tuple(t if rows is None else table.tensor_descriptor(t, rows, padded_head_dim, config)
                      for t, rows in zip(tiled, tiles, strict=True))
    return converted + args[len(tiles):]


def _on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device)."""
    if backend.is_interpreter() or t.device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _keys(n_q: int, n_k: int, batch_heads: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    return (table.length_key(n_q), table.length_key(n_k), table.heads_key(batch_heads),
            table.dtype_key(dtype))


def _meta(causal: bool, head_dim: int, dtype: torch.dtype) -> dict:
    return {"CAUSAL": causal, "HEAD_DIM": head_dim, "PRECISION": _precision(dtype),
            "HEAD_DIM_PADDED": table.padded_head_dim(head_dim, dtype)}


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float,
    config: table.Config | None = None, descriptors: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out like q ((B, Hq, Nq, D), bf16 for fp8 inputs), lse (B, Hq, Nq) fp32 in
    natural log. `config` (with its `descriptors` flag) or `descriptors` alone override the tuned
    choice (tests)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_kernel_device(name, t)
    if q.dtype in table.FP8_DTYPES:
        ok, why = table.fp8_supported()
        if not ok:
            raise TypeError(why)
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    out = _alloc_like(q, _output_dtype(q.dtype))  # in q's layout, as the registered fake gives it
    lse = alloc.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    q, k, v = _addressable(q), _addressable(k), _addressable(v)
    if out.numel() == 0:
        return out, lse
    if n_k == 0:  # no keys: SDPA gives zeros; the log-sum-exp of nothing is -inf
        return out.zero_(), lse.fill_(-math.inf)
    if config is not None:
        descriptors = config.descriptors
    elif descriptors is None:
        descriptors = table.use_descriptors(q, k, v, out)
    args = (q, k, v, out, lse, sm_scale, n_q, n_k, hq, hq // hk,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            *_keys(n_q, n_k, b * hq, q.dtype))
    tune = table.should_autotune(q.dtype, b * hq, n_q, n_k)
    with _on_device(q):
        _launch(kernels.attn_fwd_kernel, table.Kind.FORWARD, n_q, b * hq, args, FORWARD_TILES,
                _meta(causal, d, q.dtype), q.dtype, tune, descriptors, config)
    return out, lse


def backward(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, sm_scale: float,
    configs: tuple[table.Config, table.Config] | None = None, descriptors: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv). `grad_lse` (may be None) is the gradient reaching the log-sum-exp output.
    `configs` = (dQ config, dK/dV config) or `descriptors` alone override the tuned choice (tests;
    each config's `descriptors` flag holds for its kernel)."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    dq, dk, dv = _alloc_like(q), _alloc_like(k), _alloc_like(v)  # in the inputs' layouts, as the fake
    q, k, v, out, grad_out = (_addressable(t) for t in (q, k, v, out, grad_out))
    if grad_lse is not None:
        grad_lse = _addressable(grad_lse, table.row_offsets_fit)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = alloc.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    dq_config, dkdv_config = configs or (None, None)
    if configs is not None:
        descriptors = dq_config.descriptors
    elif descriptors is None:
        descriptors = table.use_descriptors(q, k, v, out, grad_out, dq, dk, dv)
    meta = _meta(causal, d, q.dtype)
    keys = _keys(n_q, n_k, b * hq, q.dtype)
    tune = table.should_autotune(q.dtype, b * hq, n_q, n_k)
    has_dlse = grad_lse is not None
    dlse = grad_lse if has_dlse else lse  # a stand-in pointer when there is no lse gradient
    with _on_device(q):
        _launch(
            kernels.attn_bwd_dq_kernel, table.Kind.DQ, n_q, b * hq,
            (q, k, v, out, grad_out, lse, dlse, delta, dq, sm_scale, n_q, n_k, hq, hq // hk,
             *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(grad_out),
             *_strides(dlse), *_strides(dq), *keys),
            DQ_TILES, {**meta, "HAS_DLSE": has_dlse}, q.dtype, tune, descriptors, dq_config,
        )
        # dK/dV reads the delta the dQ kernel wrote (same stream, in order).
        _launch(
            kernels.attn_bwd_dkdv_kernel, table.Kind.DKDV, n_k, b * hk,
            (q, k, v, grad_out, lse, delta, dk, dv, sm_scale, n_q, n_k, hk, hq // hk,
             *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dk),
             *_strides(dv), *keys),
            DKDV_TILES, meta, q.dtype, tune, descriptors, dkdv_config,
        )
    return dq, dk, dv


def _forward_impl(q, k, v, causal, sm_scale):
    return forward(q, k, v, causal, sm_scale)


def _backward_impl(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale):
    return backward(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale)


@torch.library.custom_op("fk::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, causal, sm_scale)


@attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    return _fake_like(q, _output_dtype(q.dtype)), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fk::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale)


@attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, causal, sm_scale):
    return _fake_like(q), _fake_like(k), _fake_like(v)


_run_forward = dispatch.eager_or_op(attention_op, _forward_impl)
_run_backward = dispatch.gradients_eager_or_op(attention_backward_op, _backward_impl,
                                               "fk::attention_backward")


def _save(ctx, q, k, v, out, lse, causal, sm_scale):
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _gradients(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:  # only the log-sum-exp was used
        grad_out = torch.zeros_like(out)
    return _run_backward(grad_out, grad_lse, q, k, v, out, lse, ctx.causal, ctx.sm_scale)


# The registered op is differentiable on its own too (torch.ops.fk.attention in other code).
def _op_setup_context(ctx, inputs, output):
    _save(ctx, *inputs[:3], *output, *inputs[3:])


def _op_backward(ctx, grad_out, grad_lse):
    return (*_gradients(ctx, grad_out, grad_lse), None, None)


attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v (the caller's tensors, no copies), the output and the fp32 log-sum-exp; both
    outputs are differentiable (the log-sum-exp's gradient folds into the backward's delta)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = _run_forward(q, k, v, causal, sm_scale)
        ctx.set_materialize_grads(False)
        _save(ctx, q, k, v, out, lse, causal, sm_scale)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return (*_gradients(ctx, grad_out, grad_lse), None, None)


def _check(q, k, v, sm_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=ATTENTION_DTYPES, min_dim=4, max_dim=4)
    checks.check_same_dtype(q=q, k=k, v=v)
    checks.check_same_device(q=q, k=k, v=v)
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(f"q, k, v must share the head dim, got {d}, {k.shape[3]}, {v.shape[3]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hk = k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hk})")
    table.check_head_dim(d)
    if sm_scale is not None:
        checks.check_positive("sm_scale", sm_scale)
    if q.dtype in table.FP8_DTYPES and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("fp8 attention is forward-only (inference): q, k, v must not require grad")


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, return_lse: bool = False):
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True)`.

    q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) with Hq a multiple of Hk (GQA/MQA), D a multiple of 8
    from 16 to 256; any strides (e.g. (B, N, H, D) tensors transposed), any lengths. fp16, bf16,
    fp32 (fp32 math inside, fp32 products); fp8 (e5m2, e4m3fn) forward only, on CUDA GPUs of
    compute capability >= 8.9, with a bf16 output. `causal` masks key j for query i when j > i
    (SDPA's top-left alignment when Nq != Nk). `sm_scale` > 0 defaults to 1 / sqrt(D).

    `return_lse=True` returns (out, lse) with lse the fp32 row log-sum-exp (B, Hq, Nq) of the
    scaled scores, natural log: what merging partial attentions needs. It is differentiable too.
    The output is laid out like q ((B, N, H, D) storage for such a view)."""
    _check(q, k, v, sm_scale)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.dtype in table.FP8_DTYPES:
        out, lse = _run_forward(q, k, v, bool(causal), scale)
    else:
        out, lse = AttentionFunction.apply(q, k, v, bool(causal), scale)
    return (out, lse) if return_lse else out

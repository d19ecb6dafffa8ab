"""attention and attention_varlen: checks, then the differentiable ops (fk_runtime.ops.define).

Path of a call: metadata checks -> `fk::attention` / `fk::attention_varlen` (eager: the
autograd.Function straight into `plan.forward` / `plan.forward_packed`, bound once per shapes,
strides, dtype, device and mask: a fixed config or the autotuner's winner, TMA descriptors or
pointers) -> forward kernel (saves O and the fp32 row log-sum-exp) -> backward: dQ kernel (also
writes the row term delta = rowsum(dO * O)), then dK/dV kernel (per KV head, summed over its
query heads). Nothing N x N is ever stored. Calls that autograd does not record go straight to
their key's bound plan once a call of that key passed the checks (`fk_runtime.ops.quiet_key`):
no checks, no argument parsing, no autograd.Function; calls it records (no slopes, no dropout) go
straight to the autograd.Function around the forward their key bound (the backward bound ahead by the
key's first call).

The registered ops carry the mask as one list of floats (`mask.op_args`: window sides, -1 for
unbounded; lower-right alignment; softcap, 0.0 for none). Attention dropout (`dropout_p` > 0) comes last,
with its seed: an int64 (1,) tensor on q's device drawn from the caller's generator per call and saved for
the backward, whose kernels regenerate the forward's mask from it (`kernels.dropout_scale`).
"""

from __future__ import annotations

import torch
from fk_runtime import ahead, checks
from fk_runtime import ops as fk_ops
from fk_runtime.launch import PlanCache

from . import decode, plan, serving
from .config import DROPOUT_SEED_BOUND
from .layout import (Packing, check_alibi, check_attention_inputs, check_dropout, fake_like, output_dtype, softmax_scale,
                     widened)
from .mask import from_op_args, lower_right, op_args

# What the kernels compile for, whose backward was bound and compiled ahead (`_backward_ahead`).
AHEAD = PlanCache()


def _backward_ahead(q, k, v, scale: float, mask: list[float], alibi, dropout: tuple, cu: tuple = (), packing=None):
    """On a call that autograd records, bind its backward now (the upstream gradient laid out like
    the output) so that the backward's kernels compile in threads while the forward's kernel
    compiles (`fk_runtime.ahead`: a cold fwd+bwd then waits for the slowest compile, not their
    sum). Once per what the kernels compile for (dtype, heads, head dim, mask, device; not lengths
    or strides: a packed batch's new lengths must not bind a plan twice); nothing runs on the GPU."""
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return
    key = (q.dtype, q.shape[-1], q.shape[-3 if packing is None else -2], k.shape[-3 if packing is None else -2],
           tuple(mask), dropout[0] > 0, alibi is None, packing is None, q.device)
    if not ahead.first(AHEAD, key, q, k, v):
        return
    seed = torch.zeros(1, dtype=torch.int64, device=q.device) if dropout[0] > 0 else None
    with ahead.compile_ahead():
        if packing is None:
            out = fake_like(q, output_dtype(q.dtype))
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            plan.backward(out, None, q, k, v, out, lse, from_op_args(mask), scale, alibi=alibi,
                          dropout_p=dropout[0], seed=seed)
        else:
            out = q.new_empty(q.shape, dtype=output_dtype(q.dtype))
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
            plan.backward_packed(out, None, q, k, v, out, lse, *cu, packing, from_op_args(mask), scale, alibi=alibi,
                                 dropout_p=dropout[0], seed=seed)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, mask: list[float],
    alibi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = from_op_args(mask)
    if dropout_p == 0 and decode.takes(q):  # few query rows: keys sliced across programs (split-KV)
        return decode.forward(q, k, v, mask, sm_scale, alibi=alibi)
    # (with dropout, few rows too take the prefill kernels: the split-KV path has no dropout)
    return plan.forward(q, k, v, mask, sm_scale, alibi=alibi, dropout_p=dropout_p, seed=seed)


def _forward_fake(q, k, v, sm_scale, mask, alibi=None, dropout_p=0.0, seed=None):
    return fake_like(q, output_dtype(q.dtype)), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sm_scale: float, mask: list[float],
    alibi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan.backward(grad_out, grad_lse, q, k, v, out, lse, from_op_args(mask), sm_scale, alibi=alibi,
                         dropout_p=dropout_p, seed=seed)


def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, *rest):
    return fake_like(q), fake_like(k), fake_like(v)


def _saved(tensors: int, others: int):
    """save(inputs, outputs) of an op: its first `tensors` inputs, the outputs, the ALiBi slopes and
    the dropout seed (the inputs after the `others` arguments that follow those tensors, with
    dropout_p between them; None where not passed) as tensors, those arguments and dropout_p as the
    rest."""
    def save(inputs, outputs):
        extra = inputs[tensors + others:]
        alibi, dropout_p, seed = (*extra, *(None, 0.0, None)[len(extra):])
        return (*inputs[:tensors], *outputs, alibi, seed), (*inputs[tensors:tensors + others], dropout_p)
    return save


def _backward_args(saved, other, grads, needs):
    *inputs, out, lse, alibi, seed = saved
    *other, dropout_p = other
    grad_out, grad_lse = grads
    if grad_out is None:  # only the log-sum-exp was used
        grad_out = torch.zeros_like(out)
    return (grad_out, grad_lse, *inputs[:3], out, lse, *inputs[3:], *other, alibi, dropout_p, seed)


# Both outputs are differentiable (the log-sum-exp's gradient folds into the backward's delta);
# q, k, v are saved as the caller's tensors (no copies), with the output and the log-sum-exp. No
# gradient reaches the ALiBi slopes (constants, as in FlashAttention).
ATTENTION = fk_ops.define(
    "attention",
    forward=_forward, forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake,
    save=_saved(3, 2),
    backward_args=_backward_args,
    input_grads=lambda other, grads, needs: (*grads, *(None,) * (len(needs) - 3)),
    materialize_grads=False,
    bound_inputs=3,
)


def _packing(cu_q: torch.Tensor, max_q: int, max_k: int) -> Packing:
    # At least one block per sequence: a max_seqlen of 0 would size an empty grid (sequences that
    # hold rows anyway are then walked in turn, as past any smaller max_seqlen).
    return Packing(cu_q.shape[0] - 1, max(max_q, 1), max(max_k, 1))


def _index(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """An int32 index tensor (sequence bounds, lengths, page ids) as the kernels read it: unit
    strides along its last dim (a page table's rows may stride). The registered ops, which every
    call reaches, make them so: the public functions' callers and direct callers alike."""
    if t is None:
        return None
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32, got {t.dtype}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, sm_scale: float, mask: list[float], alibi: torch.Tensor | None = None, dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q, cu_k = _index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k)
    return plan.forward_packed(q, k, v, cu_q, cu_k, _packing(cu_q, max_q, max_k),
                                from_op_args(mask), sm_scale, alibi=alibi, dropout_p=dropout_p, seed=seed)


def _forward_varlen_fake(q, k, v, cu_q, cu_k, *args):
    out = q.new_empty(q.shape, dtype=output_dtype(q.dtype))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _backward_varlen(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, sm_scale: float, mask: list[float], alibi: torch.Tensor | None = None,
    dropout_p: float = 0.0, seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cu_q, cu_k = _index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k)
    return plan.backward_packed(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k,
                                 _packing(cu_q, max_q, max_k), from_op_args(mask),
                                 sm_scale, alibi=alibi, dropout_p=dropout_p, seed=seed)


def _backward_varlen_fake(grad_out, grad_lse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


ATTENTION_VARLEN = fk_ops.define(
    "attention_varlen",
    forward=_forward_varlen, forward_fake=_forward_varlen_fake, backward=_backward_varlen,
    backward_fake=_backward_varlen_fake,
    save=_saved(5, 4),
    backward_args=_backward_args,
    input_grads=lambda other, grads, needs: (*grads, *(None,) * (len(needs) - 3)),
    materialize_grads=False,
    bound_inputs=5,
)


def _dropout(dropout_p, generator, q: torch.Tensor) -> tuple:
    """The registered ops' trailing dropout arguments (dropout_p, seed): (0.0, None) for dropout_p = 0
    (no seed drawn), else the seed an int64 (1,) on q's device drawn from `generator` (torch's default
    CPU generator when None), so that torch.manual_seed or a seeded generator repeats a call's mask.
    Always both: Dynamo hands the Function's context to a forward called with fewer inputs than it has
    parameters."""
    p = check_dropout(dropout_p, generator)
    if p == 0:
        return 0.0, None
    device = generator.device if generator is not None else torch.device("cpu")
    seed = torch.randint(0, DROPOUT_SEED_BOUND, (1,), generator=generator, device=device, dtype=torch.int64)
    return p, seed.to(q.device, non_blocking=True)


def attention(q, k, v, causal=False, sm_scale: float | None = None, return_lse: bool = False,
              window=None, softcap: float | None = None, align: str | None = None, alibi_slopes=None,
              dropout_p: float = 0.0, generator: torch.Generator | None = None, deterministic: bool = False):
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True)`,
    with sliding windows, softcapping and lower-right causal alignment.

    q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) with Hq a multiple of Hk (GQA/MQA), any D from 1 to
    256 (padded inside; 16-byte rows read fastest, through TMA on Hopper); any strides (e.g.
    (B, N, H, D) tensors transposed), any lengths. fp16, bf16, fp32 (fp32 math inside, fp32
    products); fp8 (e5m2, e4m3fn) forward only, on CUDA GPUs of compute capability >= 8.9, with a
    bf16 output. `sm_scale` > 0 defaults to 1 / sqrt(D).

    `causal`: False; True or "upper_left" (query i sees keys j <= i: SDPA's `is_causal`); or
    "lower_right" (query i sees keys j <= i + Nk - Nq: FlashAttention's convention, torch's
    CausalVariant.LOWER_RIGHT, what a KV cache or chunked prefill needs). `window=(left, right)`
    (None for unbounded on a side): query i sees keys j with -left <= j - (i + shift) <= right,
    shift = Nk - Nq under "lower_right", else 0; with causal, right is at most 0. Key blocks outside
    the window are skipped. `align="lower_right"` (or "upper_left") sets that alignment for a
    window without causal too (FlashAttention aligns every mask lower-right); None takes causal's.
    `softcap=c`: scores become c * tanh(scores / c) before the softmax
    (Gemma 2); fp16 and bf16 inputs take tanh from the GPU's tanh.approx.f32, as FlashAttention does
    (at most 7.8e-6 off tanh, so c * 7.8e-6 on a score), fp32 inputs to fp32 rounding.
    `alibi_slopes`: fp32 (Hq,) or (B, Hq), FlashAttention's ALiBi: -slope * |j - (i +
    shift)| is added to the (scaled, capped) score of query i and key j, shift as for windows;
    no gradient reaches the slopes. A query that sees no key gets a zero output and a log-sum-exp
    of -inf. `dropout_p` in [0, 1): FlashAttention's attention dropout, applied whenever > 0 (pass it
    in training only): each softmax weight is kept with probability 1 - p and scaled by 1 / (1 - p);
    the mask is a function of (seed, batch, head, i, j) with the seed drawn per call from `generator`
    (default: torch's CPU generator, so torch.manual_seed repeats it), regenerated by the backward.
    `deterministic=True`: a backward that gives the same bits on every run (on Hopper with Triton
    >= 3.8 the default backward adds dQ's partial sums in a varying order at head dims 33-128;
    `torch.use_deterministic_algorithms(True)` asks the same of every call).

    `return_lse=True` returns (out, lse) with lse the fp32 row log-sum-exp (B, Hq, Nq) of the
    scaled scores, natural log: what merging partial attentions needs. It is differentiable too.
    The output is laid out like q ((B, N, H, D) storage for such a view). Under `torch.autocast`
    q, k, v are taken in its dtype, as SDPA takes them."""
    key = None
    # (calls with slopes or dropout take the full path)
    if alibi_slopes is None and type(dropout_p) in (float, int) and dropout_p == 0 and generator is None:
        key, run = fk_ops.quiet_run(plan.BOUND, "attention", (q, k, v),
                                    (causal, sm_scale, return_lse, window, softcap, align, deterministic))
        if run:
            return run(q, k, v)
    q, k, v = fk_ops.autocast(q, k, v)
    check_attention_inputs(q, k, v)
    check_alibi(alibi_slopes, q, q.shape[0], q.shape[1])
    mask = op_args(causal, window, softcap, align, deterministic)
    return_lse = checks.check_flag("return_lse", return_lse)
    scale = softmax_scale(sm_scale, q.shape[-1])
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: _quiet(q, k, v, scale, mask, return_lse),
                            lambda: _recorded(q, k, v, scale, mask, return_lse))
    if run:  # checked: this key's calls go straight to the plan, or to the autograd.Function
        return run(q, k, v)
    dropout = _dropout(dropout_p, generator, q)
    _backward_ahead(q, k, v, scale, mask, alibi_slopes, dropout)
    out, lse = ATTENTION.apply(q, k, v, scale, mask, alibi_slopes, *dropout)
    return (out, lse) if return_lse else out


def _recorded(q, k, v, sm_scale: float, mask: list[float], return_lse: bool):
    """run(q, k, v) of an `attention` call that autograd records (`fk_runtime.ops.quiet_key`: no
    slopes, no dropout) whose checks passed: the autograd.Function around the forward bound for
    its key; the first call binds the backward ahead."""
    _backward_ahead(q, k, v, sm_scale, mask, None, (0.0, None))
    bound = _bound(q, k, v, sm_scale, mask, True)
    if bound:
        def run(q, k, v):
            return ATTENTION.bound(bound, q, k, v, sm_scale, mask, None, 0.0, None)
    else:
        def run(q, k, v):
            return ATTENTION.recorded(q, k, v, sm_scale, mask, None, 0.0, None)
    return run if return_lse else (lambda q, k, v: run(q, k, v)[0])


def _quiet(q, k, v, sm_scale: float, mask: list[float], return_lse: bool):
    """run(q, k, v) of a quiet `attention` call (`fk_runtime.ops.quiet_key`): the bound plan's
    outputs, which are tensors of their own; False where the interpreter widens bf16."""
    run = _bound(q, k, v, sm_scale, mask, return_lse)
    return run if return_lse or not run else (lambda q, k, v: run(q, k, v)[0])


def _bound(q, k, v, sm_scale: float, mask: list[float], with_lse: bool):
    """run(q, k, v) -> (out, lse) bound for these inputs' layouts, as `_forward` takes them without
    slopes or dropout (lse None on the decode path without `with_lse`: none allocated or stored);
    False where the interpreter widens bf16."""
    if widened(q.dtype):
        return False
    m = from_op_args(mask)
    if decode.takes(q):
        return decode.bound(q, k, v, m, sm_scale, with_lse=with_lse)
    return plan.bound_forward(q, k, v, m, sm_scale)


def _check_cu_seqlens(name: str, cu: torch.Tensor, q: torch.Tensor) -> None:
    checks.check_tensor(name, cu, dtypes=(torch.int32,), min_dim=1, max_dim=1)
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one entry (0), got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal=False,
                     sm_scale: float | None = None, window=None, softcap: float | None = None,
                     return_lse: bool = False, align: str | None = None, alibi_slopes=None,
                     dropout_p: float = 0.0, generator: torch.Generator | None = None, block_table=None,
                     k_new=None, v_new=None):
    """Attention over packed sequences, as FlashAttention's `flash_attn_varlen_func`.

    q (total_q, Hq, D), k and v (total_k, Hk, D): the sequences' tokens one after another;
    `cu_seqlens_q` / `cu_seqlens_k` int32 (S + 1,) prefix sums of their lengths (sequence i is rows
    cu[i]:cu[i + 1]), on q's device; `max_seqlen_q` / `max_seqlen_k` the longest lengths (they
    size the grid: a smaller value costs parallelism, never correctness). No attention crosses
    sequences and no work is spent on padding. `causal`, `window`, `softcap`, `sm_scale`, `align`,
    `dropout_p`, `generator` (the mask's i, j count within each sequence, b the sequence),
    `alibi_slopes` ((Hq,) or (sequences, Hq)) as in `attention`, per sequence (lower-right alignment uses each sequence's own lengths). Bounds
    are read on the GPU without a sync: out-of-range or decreasing ones are clamped to [0, total]
    (wrong rows, never an out-of-range access). Gradients for q, k, v; the backward is
    deterministic. On Hopper the inputs are read in TMA tiles that may cross a sequence's end;
    what they read there (the next sequence, or rows past cu_seqlens[-1] in a padded buffer) gets
    zero weight, so finite values never cross; an inf or NaN there can turn the neighbouring
    sequence's edge rows NaN (0 * inf): keep spare rows finite (e.g. a buffer from torch.zeros).
    Spare rows past cu_seqlens[-1] get a zero output, a log-sum-exp of -inf and zero gradients.

    Paged KV (`block_table` int32 (S, pages per sequence), on q's device; a serving batch of
    prefilling and decoding sequences in one call, as FlashAttention's paged varlen call): k and v
    are paged caches (pages, Hk, page_size, D) with any strides, as `attention_with_kvcache` takes
    them (FlashAttention's (pages, page_size, Hk, D) as `.transpose(1, 2)`): key j of sequence b in
    page block_table[b, j // page_size], row j % page_size. Sequence b has L_b = cu_seqlens_k[b + 1]
    - cu_seqlens_k[b] keys (its cache length after this call's rows) and Q_b query rows, query i at
    key position L_b - Q_b + i: every mask is aligned lower-right (`causal=True`; "upper_left" is
    refused). `k_new`, `v_new` (total_q, Hk, D), packed like q, optional (both or neither): written
    into the pages in place first, at positions [L_b - Q_b, L_b), then read as part of the cache.
    Lengths and page indices are read on the GPU (no host sync: CUDA graphs capture the call) and
    clamped (L_b to the table's pages, pages to the cache): wrong rows, never an out-of-range access.
    Forward only (inputs must not require grad with grad mode on); no `alibi_slopes`, no dropout;
    the output is a fresh (total_q, Hq, D) tensor, rows past cu_seqlens_q[-1] left unwritten.

    Returns out (total_q, Hq, D), and with `return_lse=True` also lse (Hq, total_q) fp32. Under
    `torch.autocast` q, k, v are taken in its dtype, as in `attention`."""
    if block_table is not None or k_new is not None or v_new is not None:
        return _attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       sm_scale, window, softcap, return_lse, align, alibi_slopes, dropout_p,
                                       generator, block_table, k_new, v_new)
    key = None
    # (calls with slopes or dropout take the full path)
    if alibi_slopes is None and type(dropout_p) in (float, int) and dropout_p == 0 and generator is None:
        key, run = fk_ops.quiet_run(plan.BOUND, "attention_varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k),
                                    (max_seqlen_q, max_seqlen_k, causal, sm_scale, return_lse, window, softcap, align))
        if run:
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k)
    q, k, v = fk_ops.autocast(q, k, v)
    check_attention_inputs(q, k, v, packed=True)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one shape (sequences + 1), got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    max_q = checks.check_size("max_seqlen_q", max_seqlen_q, minimum=0)
    max_k = checks.check_size("max_seqlen_k", max_seqlen_k, minimum=0)
    mask = op_args(causal, window, softcap, align)
    return_lse = checks.check_flag("return_lse", return_lse)
    check_alibi(alibi_slopes, q, cu_seqlens_q.shape[0] - 1, q.shape[1])
    scale = softmax_scale(sm_scale, q.shape[-1])
    run = fk_ops.keep_quiet(plan.BOUND, key, lambda: _quiet_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                                                   scale, mask, return_lse),
                            lambda: _recorded_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, mask,
                                                     return_lse))
    if run:  # checked: this key's calls go straight to the plan, or to the autograd.Function
        return run(q, k, v, cu_seqlens_q, cu_seqlens_k)
    dropout = _dropout(dropout_p, generator, q)
    cu = (_index("cu_seqlens_q", cu_seqlens_q), _index("cu_seqlens_k", cu_seqlens_k))
    _backward_ahead(q, k, v, scale, mask, alibi_slopes, dropout, cu, _packing(cu_seqlens_q, max_q, max_k))
    out, lse = ATTENTION_VARLEN.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, mask, alibi_slopes,
                                      *dropout)
    return (out, lse) if return_lse else out


def _recorded_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, sm_scale: float, mask: list[float],
                     return_lse: bool):
    """run(q, k, v, cu_q, cu_k) of an `attention_varlen` call that autograd records, as `_recorded`."""
    cu = (_index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k))
    _backward_ahead(q, k, v, sm_scale, mask, None, (0.0, None), cu, _packing(cu_q, max_q, max_k))
    bound = _bound_varlen(q, k, v, cu_q, cu_k, max_q, max_k, sm_scale, mask)
    if bound:
        def run(q, k, v, cu_q, cu_k):
            return ATTENTION_VARLEN.bound(bound, q, k, v, cu_q, cu_k, max_q, max_k, sm_scale, mask, None, 0.0, None)
    else:
        def run(q, k, v, cu_q, cu_k):
            return ATTENTION_VARLEN.recorded(q, k, v, cu_q, cu_k, max_q, max_k, sm_scale, mask, None, 0.0, None)
    return run if return_lse else (lambda *args: run(*args)[0])


def _quiet_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, sm_scale: float, mask: list[float],
                  return_lse: bool):
    """run(q, k, v, cu_q, cu_k) of a quiet `attention_varlen` call, as `_quiet`."""
    run = _bound_varlen(q, k, v, cu_q, cu_k, max_q, max_k, sm_scale, mask)
    return run if return_lse or not run else (lambda *args: run(*args)[0])


def _bound_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, sm_scale: float, mask: list[float]):
    """run(q, k, v, cu_q, cu_k) -> (out, lse), the packed forward bound for these layouts, as `_bound`;
    False also where a bound's stride is not 1 (the registered op copies those)."""
    if widened(q.dtype) or cu_q.stride(-1) != 1 or cu_k.stride(-1) != 1:
        return False
    return plan.bound_forward_packed(q, k, v, cu_q, cu_k, _packing(cu_q, max_q, max_k), from_op_args(mask), sm_scale)


def _forward_paged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    block_table: torch.Tensor, max_k: int, sm_scale: float, mask: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    return serving.forward(q, k, v, _index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k),
                           _index("block_table", block_table), None, None, max_k, from_op_args(mask), sm_scale)


def _forward_paged_append(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    block_table: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, max_k: int, sm_scale: float,
    mask: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_writable(k, v)
    return serving.forward(q, k, v, _index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k),
                           _index("block_table", block_table), k_new, v_new, max_k, from_op_args(mask), sm_scale)


def _check_writable(k_cache, v_cache, names=("k", "v")) -> None:
    """torch's rule on in-place writes into inference tensors, which the kernels' writes bypass."""
    if torch.is_inference_mode_enabled():
        return
    for name, t in zip(names, (k_cache, v_cache), strict=True):
        if t.is_inference():
            raise RuntimeError(f"{name} is an inference tensor and the new rows are written into it in place: "
                               f"inplace updates to inference tensors outside InferenceMode are not allowed; "
                               f"call under torch.inference_mode(), or allocate the cache outside it")


# Forward only (inference), paged KV: one op that reads the caches, one that first writes new rows
# into them in place (only it declares the caches mutated: torch.compile copies nothing for reads).
ATTENTION_VARLEN_PAGED = torch.library.custom_op("fk::attention_varlen_paged", _forward_paged, mutates_args=())
ATTENTION_VARLEN_PAGED_APPEND = torch.library.custom_op("fk::attention_varlen_paged_append", _forward_paged_append,
                                                        mutates_args=("k", "v"))


def _forward_paged_fake(q, *args):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


ATTENTION_VARLEN_PAGED.register_fake(_forward_paged_fake)
ATTENTION_VARLEN_PAGED_APPEND.register_fake(_forward_paged_fake)


def _attention_varlen_paged(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap, return_lse,
                            align, alibi_slopes, dropout_p, generator, block_table, k_new, v_new):
    """`attention_varlen` over a paged KV cache (its docstring): checks, then the serving plan
    (eager) or the registered ops (traced)."""
    if block_table is None:
        raise ValueError("k_new and v_new are written into a paged cache: they need block_table")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: not supported with block_table (paged KV) yet; pass None")
    if check_dropout(dropout_p, generator) > 0:
        raise ValueError("dropout_p: attention with block_table (paged KV) is inference-only; pass dropout_p=0")
    q, k_new, v_new = fk_ops.autocast(q, k_new, v_new)
    serving.check_paged(q, k, v, cu_q, cu_k, block_table, k_new, v_new)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, k_new, v_new)):
        raise ValueError("attention_varlen with block_table is forward-only (inference): q, k, v, k_new, v_new must "
                         "not require grad (or call under torch.no_grad() / torch.inference_mode())")
    checks.check_size("max_seqlen_q", max_q, minimum=0)
    max_k = checks.check_size("max_seqlen_k", max_k, minimum=0)
    variant = causal.name if type(causal).__name__ == "CausalVariant" else causal
    if (isinstance(variant, str) and variant.lower() == "upper_left") or align == "upper_left":
        raise ValueError("attention_varlen with block_table aligns masks lower-right (each sequence's cache end): "
                         "pass causal=True or 'lower_right', align None or 'lower_right'")
    mask = lower_right(op_args(causal, window, softcap, align))
    return_lse = checks.check_flag("return_lse", return_lse)
    scale = softmax_scale(sm_scale, q.shape[-1])
    tensors = (q, k, v, cu_q, cu_k, block_table, k_new, v_new)
    if fk_ops.transforms_active() or fk_ops.traced(tensors):
        if k_new is None:
            out, lse = ATTENTION_VARLEN_PAGED(q, k, v, cu_q, cu_k, block_table, max_k, scale, mask)
        else:
            out, lse = ATTENTION_VARLEN_PAGED_APPEND(q, k, v, cu_q, cu_k, block_table, k_new, v_new, max_k, scale,
                                                     mask)
    else:
        if k_new is not None:
            for name, t in (("k", k), ("v", v)):
                if t.is_neg():  # written in place: a lazily negated view cannot be resolved into a copy
                    raise ValueError(f"{name} must not be a lazily negated view (is_neg()): written in place, "
                                     f"it would hold -values; pass a real tensor")
            _check_writable(k, v)
        q, k, v, k_new, v_new = fk_ops.resolve_negated((q, k, v, k_new, v_new))
        out, lse = serving.forward(q, k, v, _index("cu_seqlens_q", cu_q), _index("cu_seqlens_k", cu_k),
                                   _index("block_table", block_table), k_new, v_new, max_k, from_op_args(mask), scale)
        if k_new is not None:  # as the registered op would: autograd sees the caches written
            torch.autograd.graph.increment_version(k)
            torch.autograd.graph.increment_version(v)
    return (out, lse) if return_lse else out


def _forward_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    k: torch.Tensor | None, v: torch.Tensor | None, block_table: torch.Tensor | None, sm_scale: float,
    mask: list[float], alibi: torch.Tensor | None = None, leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, sm_scale, mask, alibi, leftpad)


def _kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, sm_scale: float, mask: list[float],
             alibi=None, leftpad=None, facts: tuple | None = None, with_lse: bool = True):
    """The registered op's implementation; `facts`: the inputs' `decode.layouts`, where the
    caller has them (eager calls); lse None without `with_lse` (an eager call that returns none
    binds the plan its next, quiet, calls take: one compile, not two)."""
    cache_seqlens, block_table = _index("cache_seqlens", cache_seqlens), _index("block_table", block_table)
    leftpad = _index("cache_leftpad", leftpad)
    if k is not None and not torch.is_inference_mode_enabled():  # torch's rule, which the kernel's write bypasses
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.is_inference():
                raise RuntimeError(f"{name} is an inference tensor and the new rows are written into it in place: "
                                   f"inplace updates to inference tensors outside InferenceMode are not allowed; "
                                   f"call under torch.inference_mode(), or allocate the cache outside it")
    return decode.forward_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                  from_op_args(mask), sm_scale, facts, alibi=alibi, leftpad=leftpad, with_lse=with_lse)


# Forward only (an inference call); writes the new rows into the caches in place.
ATTENTION_KVCACHE = torch.library.custom_op("fk::attention_with_kvcache", _forward_kvcache,
                                            mutates_args=("k_cache", "v_cache"))


@ATTENTION_KVCACHE.register_fake
def _forward_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *args):
    return fake_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, causal=False,
                           sm_scale: float | None = None, window=None, softcap: float | None = None,
                           return_lse: bool = False, alibi_slopes=None, cache_leftpad=None):
    """Attention of new queries against a KV cache, as FlashAttention's `flash_attn_with_kvcache`:
    first `k` / `v` (new rows, may be None) are written into the caches in place at each sequence's
    length, then q attends to the cache's first cache_seqlens[b] + Nnew rows, lower-right aligned
    (query i of Nq sits at key position i + len - Nq: `causal=True` lets it see the keys up to
    itself, `window=(left, right)` counts from there). Forward only (inference); no host sync, so
    a decode loop can be captured in a CUDA graph, and `torch.compile` traces it without breaks.
    Few query rows (decode) take the split-KV path: each sequence's keys cut across programs,
    the query heads of a GQA group reading their K/V once.

    Layouts, fk's (B, H, N, D) order with any strides (FlashAttention's (B, N, H, D) tensors
    passed as `.transpose(1, 2)` views):
    - q (B, Hq, Nq, D); k, v (B, Hk, Nnew, D) or None; Hq a multiple of Hk.
    - Dense cache: k_cache, v_cache (B, Hk, capacity, D).
    - Paged cache (`block_table` given): k_cache, v_cache (pages, Hk, page_size, D) and
      block_table int32 (B, pages per sequence): key j of sequence b lives in page
      block_table[b, j // page_size], row j % page_size (FlashAttention's and vLLM's
      (pages, page_size, Hk, D) as `.transpose(1, 2)`). Any page size.
    - cache_seqlens int32 (B,): rows each sequence holds before this call (not updated here).
    Lengths and page indices are read on the GPU and clamped: rows that would land at or past
    the capacity are dropped and keys past it not read, page indices clamped to the cache (wrong
    rows, never an out-of-range access). fp16, bf16, fp32. `alibi_slopes` fp32 (Hq,) or (B, Hq) as
    in `attention` (the distance counted from the query's position at the cache's end).
    `cache_leftpad` int32 (B,): sequence b's keys start at row cache_leftpad[b] of its cache (rows
    before it are seen by no query; positions, rotary's and ALiBi's, stay the cache's rows), as
    FlashAttention's; dense and paged caches.

    Returns out like q, and with `return_lse=True` also lse (B, Hq, Nq) fp32 (natural log). Under
    `torch.autocast` q and the new rows are taken in its dtype (the caches' must match it)."""
    tensors = (q, k_cache, v_cache, cache_seqlens, k, v, block_table)
    key = None
    if k_cache is not None and v_cache is not None and alibi_slopes is None and cache_leftpad is None:
        # torch's rule on writes into inference tensors (`_kvcache`) reads the mode and the caches
        key, run = fk_ops.quiet_run(decode.BOUND, "attention_with_kvcache", tensors,
                                    (causal, sm_scale, window, softcap, return_lse),
                                    lambda: (torch.is_inference_mode_enabled(), k_cache.is_inference(),
                                             v_cache.is_inference()))
        if run:
            return run(*tensors)
    q, k, v = fk_ops.autocast(q, k, v)
    # Plain eager calls skip the registered op's dispatch (tens of microseconds) and check the
    # inputs once per plan (their layouts key it); tracers and torch.func transforms take the op.
    eager = not (fk_ops.transforms_active() or fk_ops.traced((q, k_cache, v_cache, cache_seqlens)))
    if eager:
        facts = decode.layouts(q, k_cache, v_cache, cache_seqlens, k, v, block_table)
    else:
        decode.check_cache(q, k_cache, v_cache, cache_seqlens, k, v, block_table)
    mask = lower_right(op_args(causal, window, softcap))
    variant = causal.name if type(causal).__name__ == "CausalVariant" else causal
    if isinstance(variant, str) and variant.lower() == "upper_left":
        raise ValueError("attention_with_kvcache aligns causal masks lower-right (the cache's end): "
                         "pass causal=True or 'lower_right'")
    return_lse = checks.check_flag("return_lse", return_lse)
    check_alibi(alibi_slopes, q, q.shape[0], q.shape[1])
    args = (q, k_cache, v_cache, cache_seqlens, k, v, block_table, softmax_scale(sm_scale, q.shape[-1]), mask,
            alibi_slopes, cache_leftpad)
    if not eager:
        out, lse = ATTENTION_KVCACHE(*args)
    else:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.is_neg():  # written in place: a lazily negated view cannot be resolved into a copy
                raise ValueError(f"{name} must not be a lazily negated view (is_neg()): written in place, "
                                 f"it would hold -values; pass a real tensor")
        resolved = fk_ops.resolve_negated(args)
        if any(a is not b for a, b in zip(resolved, args, strict=True)):  # copies: their own layouts
            facts = None
        out, lse = _kvcache(*resolved, facts=facts, with_lse=return_lse)
        if k is not None:  # as the registered op would: autograd sees the caches written
            torch.autograd.graph.increment_version(k_cache)
            torch.autograd.graph.increment_version(v_cache)
        # this call passed every check: the key's next calls go straight to its plan
        fk_ops.keep_quiet(decode.BOUND, key, lambda: _quiet_kvcache(*args[:-2], return_lse))
    return (out, lse) if return_lse else out


def _quiet_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, sm_scale: float, mask: list[float],
                   return_lse: bool):
    """run(q, k_cache, v_cache, cache_seqlens, k, v, block_table) of a quiet
    `attention_with_kvcache` call (`fk_runtime.ops.quiet_key`) whose checks passed: its plan,
    the caches' versions bumped where rows are written; False where `_index` would copy."""
    if any(t is not None and t.stride(-1) != 1 for t in (cache_seqlens, block_table)):
        return False
    run = decode.bound_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                               from_op_args(mask), sm_scale, with_lse=return_lse)
    written = k is not None

    def quiet(q, k_cache, v_cache, cache_seqlens, k, v, block_table):
        out, lse = run(q, k_cache, v_cache, cache_seqlens, k, v, block_table)
        if written:
            torch.autograd.graph.increment_version(k_cache)
            torch.autograd.graph.increment_version(v_cache)
        return (out, lse) if return_lse else out

    return quiet

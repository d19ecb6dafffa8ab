"""Context-parallel (ring) attention on torch.distributed: each rank holds a shard of the sequence.

The K/V shards travel the ring (rank r sends to r + 1 and receives from r - 1, P2P
`batch_isend_irecv`: NCCL on GPUs, gloo on CPUs), the next transfer posted before the current
block's attention so that the two overlap; each block is `fk_attention.attention` with its
log-sum-exp, and the partial outputs merge by log-sum-exp in fp32. The backward runs the same
ring: each block's gradients come from the registered backward op (`fk::attention_backward`) fed
the merged output and log-sum-exp (so each block's softmax weights are the exact global ones),
dQ stays local and dK/dV (fp32) travel around the ring behind the K/V they belong to, landing
on the rank that owns them.

Layouts (how the full sequence of N tokens is cut over the W ranks of the group):
- "zigzag" (the default; balanced under a causal mask): the sequence is cut into 2W chunks of
  N / 2W tokens and rank r holds chunks r and 2W - 1 - r, one after the other: with W = 2, rank 0
  holds chunks 0 and 3, rank 1 chunks 1 and 2. Every rank then does the same causal work.
- "contiguous": rank r holds tokens [r N / W, (r + 1) N / W); under a causal mask the last rank
  does W times the work of the first (which idles), so use it for non-causal attention, where
  every layout costs the same.
`shard_sequence` and `gather_sequence` cut a full tensor into this rank's shard and put the
shards back together; position ids for rotary embeddings shard the same way
(`shard_sequence(torch.arange(N), dim=0)`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from fk_runtime import checks

from .layout import check_attention_inputs, softmax_scale
from .mask import op_args
from .ops import attention

LAYOUTS = ("zigzag", "contiguous")
RING_DTYPES = checks.FLOAT_DTYPES
# P2P tags of the two transfers a backward step may have in flight to one peer (gloo matches on them).
KV_TAG, GRAD_TAG = 0, 1


def _group(group) -> dist.ProcessGroup:
    """The process group, the default one for None; refuses what is not one."""
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group's answer outside it
        raise ValueError("group does not hold this rank: only the ranks of the group take part")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None or a torch.distributed.ProcessGroup, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("ring attention needs an initialized process group: call torch.distributed."
                           "init_process_group first (backend 'nccl' on GPUs, 'gloo' on CPUs)")
    return dist.group.WORLD if group is None else group


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


class _Ring:
    """This rank's place in the ring of the group: the peers it sends to and receives from."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # P2POp takes global ranks.
        self.send_to = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.receive_from = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def pass_on(self, tensor: torch.Tensor, tag: int):
        """Starts sending `tensor` to the next rank and receiving the previous rank's into a new
        buffer; returns a function that waits for both and returns that buffer."""
        incoming = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.send_to, self.group, tag),
            dist.P2POp(dist.irecv, incoming, self.receive_from, self.group, tag),
        ])

        def wait() -> torch.Tensor:
            for request in requests:
                request.wait()
            return incoming

        return wait


ALL = slice(None)


def _block(ring: _Ring, step: int, n_local: int, causal: bool, layout: str):
    """(query rows, key rows, causal mask) of the local block at `step`, when this rank holds
    the K/V shard of rank (rank - step) mod W; None when no local query sees any of its keys."""
    if not causal:
        return ALL, ALL, False
    if step == 0:  # own shard: in both layouts the local tokens are in sequence order
        return ALL, ALL, True
    source = (ring.rank - step) % ring.world
    if layout == "contiguous":
        return (ALL, ALL, False) if source < ring.rank else None
    # Zigzag: local chunks r < 2W-1-r, the source's s < 2W-1-s. Source s < r: both local chunks
    # come after chunk s and before chunk 2W-1-s (> 2W-1-r). Source s > r: chunk r precedes both
    # of the source's; chunk 2W-1-r follows both (s < W <= 2W-1-r, 2W-1-s < 2W-1-r).
    half = n_local // 2
    if source < ring.rank:
        return ALL, slice(0, half), False
    return slice(half, None), ALL, False


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds a block's (out, lse) into the fp32 accumulators `out`, `lse` (views, in place): two
    passes over out (the big tensor), block_out read as it is."""
    merged = torch.logaddexp(lse, block_lse)
    # Rows that no key has reached yet (both -inf) keep weight 0 instead of exp(-inf + inf) = NaN.
    base = torch.where(merged == -math.inf, 0.0, merged)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).addcmul_(block_out, torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(merged)


def _ring_forward(q, k, v, ring: _Ring, causal: bool, layout: str, sm_scale: float):
    if ring.world == 1:  # the whole sequence is local
        out, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
        return out.to(q.dtype), lse  # (under autocast, attention's dtype)
    out = lse = None
    n_k = k.shape[2]
    kv = torch.stack((k, v))  # one buffer: one send and one receive per step
    for step in range(ring.world):
        arriving = ring.pass_on(kv, KV_TAG) if step + 1 < ring.world else None
        block = _block(ring, step, n_k, causal, layout)
        if block is not None:
            rows, cols, masked = block
            block_out, block_lse = attention(q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols],
                                             causal=masked, sm_scale=sm_scale, return_lse=True)
            if step == 0:  # the own shard, every row and key: the accumulators start from it
                out, lse = block_out.float(), block_lse
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if arriving is not None:
            kv = arriving()
    return out.to(q.dtype), lse


def _ring_backward(grad_out, grad_lse, q, k, v, out, lse, ring: _Ring, causal: bool, layout: str,
                   sm_scale: float):
    if ring.world == 1:  # the whole sequence is local
        return torch.ops.fk.attention_backward(grad_out, grad_lse, q, k, v, out, lse, sm_scale,
                                               op_args(causal, None, None))
    kv = torch.stack((k, v))  # stacked again, not saved: the forward keeps the caller's k and v only
    dq = grad_kv = arriving_grad = None
    for step in range(ring.world):
        arriving = ring.pass_on(kv, KV_TAG) if step + 1 < ring.world else None
        block = _block(ring, step, kv.shape[3], causal, layout)
        if block is not None:
            rows, cols, masked = block
            # The merged out and lse: each block's backward recomputes exact global probabilities.
            dq_block, dk_block, dv_block = torch.ops.fk.attention_backward(
                grad_out[:, :, rows], None if grad_lse is None else grad_lse[:, :, rows],
                q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], out[:, :, rows],
                lse[:, :, rows], sm_scale, op_args(masked, None, None))
            if step == 0:  # the own shard, every row and key
                dq = dq_block.float()
                # dK/dV of the shard held now: this block's (no rank before has added to it).
                grad_kv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
                grad_kv[0].copy_(dk_block)
                grad_kv[1].copy_(dv_block)
            else:
                dq[:, :, rows] += dq_block
        if step > 0:  # dK/dV of the shard held now: what the ranks before added, plus this block's
            grad_kv = arriving_grad()
            if block is not None:
                grad_kv[0, :, :, cols] += dk_block
                grad_kv[1, :, :, cols] += dv_block
        # The last pass brings each rank its own shard's finished dK/dV: sent in the inputs' dtype
        # (rounded once, as the owner would; half the bytes on a transfer nothing overlaps).
        arriving_grad = ring.pass_on(grad_kv if arriving is not None else grad_kv.to(kv.dtype), GRAD_TAG)
        if arriving is not None:
            kv = arriving()
    grad_kv = arriving_grad()
    return dq.to(q.dtype), grad_kv[0], grad_kv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, layout, sm_scale):
        out, lse = _ring_forward(q, k, v, ring, causal, layout, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = ring, causal, layout, sm_scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:  # only the log-sum-exp was used
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.args)
        need_k, need_v = ctx.needs_input_grad[1:3]
        if dk._base is not None and need_k != need_v:
            # dK and dV share one received buffer: the one kept gets storage of its own.
            dk, dv = (dk.clone() if need_k else None), (dv.clone() if need_v else None)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = False, sm_scale: float | None = None,
                   layout: str = "zigzag", return_lse: bool = False):
    """Attention of the whole sequence, sharded over the ranks of `group`: this rank's shards in,
    this rank's rows of `attention(Q, K, V, causal=causal)` out (Q, K, V the full sequence).

    q (B, Hq, n, D), k and v (B, Hk, n_k, D): this rank's shards of the sequence, laid out as
    `layout` says (see the module docstring: "zigzag", the default, balances a causal mask;
    `shard_sequence` cuts a full tensor); Hq a multiple of Hk (GQA/MQA); fp16, bf16, fp32; D as
    `attention` takes it. Every rank must pass the same shapes. With `causal=True`, the query
    and key shards have one length n (even under "zigzag": two chunks of n / 2); without it they
    may differ (e.g. cross-attention of local queries to a sharded context) and the layout does
    not matter. `sm_scale` > 0 defaults to 1 / sqrt(D).

    `group`: the torch.distributed process group whose ranks hold the shards (None: the default
    group); it must be initialized (`torch.distributed.init_process_group`): NCCL with CUDA
    tensors (each rank on its own GPU), gloo with CPU tensors (the Triton interpreter,
    TRITON_INTERPRET=1). Any group size W >= 1; the full sequence is W * n tokens. Every rank of
    the group must call this together (the K/V shards pass around the ring).

    Returns out (B, Hq, n, D) like q and, with `return_lse=True`, also the fp32 log-sum-exp
    (B, Hq, n) of each query row over the whole sequence; both are differentiable: the gradients
    of q, k, v land on the rank that holds them (dK/dV travel back around the ring). Tested in
    eager mode; not under `torch.compile`."""
    check_attention_inputs(q, k, v, RING_DTYPES)  # here, before any rank starts sending
    causal = checks.check_flag("causal", causal)
    return_lse = checks.check_flag("return_lse", return_lse)
    layout = _check_layout(layout)
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal ring attention needs query and key shards of one length, got q's "
                         f"{q.shape[2]} and k's {k.shape[2]}")
    if causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zigzag layout holds two chunks per rank: the shards' length must be even, "
                         f"got {q.shape[2]}")
    ring = _Ring(_group(group))
    out, lse = _RingAttention.apply(q, k, v, ring, causal, layout, sm_scale)
    return (out, lse) if return_lse else out


def _sequence_args(x, dim, group, layout):
    checks.check_tensor("x", x, dtypes=(*RING_DTYPES, torch.float64, torch.int32, torch.int64), min_dim=1)
    dim = checks.normalize_dim("dim", dim, x.dim())
    layout = _check_layout(layout)
    group = _group(group)
    return dim, layout, dist.get_rank(group), dist.get_world_size(group), group


def shard_sequence(x: torch.Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim` (2 for (B, H, N, D)) under `layout`
    (see the module docstring); N must divide into 2W chunks ("zigzag") or W ("contiguous"),
    W the size of `group` (None: the default group). Differentiable (a slice and a concatenation)."""
    dim, layout, rank, world, _ = _sequence_args(x, dim, group, layout)
    n, chunks = x.shape[dim], 2 * world if layout == "zigzag" else world
    if n % chunks:
        raise ValueError(f"x's length along dim {dim} ({n}) must divide into {chunks} chunks "
                         f"({layout} layout over {world} ranks)")
    parts = x.split(n // chunks, dim)
    if layout == "contiguous":
        return parts[rank]
    return torch.cat((parts[rank], parts[chunks - 1 - rank]), dim)


def gather_sequence(x: torch.Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard `x` (as `shard_sequence` cut it), on every rank:
    the inverse of `shard_sequence`. Every rank of `group` must call it together. Not
    differentiable (an all-gather, e.g. to inspect or evaluate the full output)."""
    dim, layout, _, world, group = _sequence_args(x, dim, group, layout)
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"zigzag shards hold two chunks: x's length along dim {dim} must be even, got "
                         f"{x.shape[dim]}")
    local = x.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=group)
    if layout == "contiguous":
        return torch.cat(shards, dim)
    halves = [shard.chunk(2, dim) for shard in shards]
    # Chunks 0..W-1 are the ranks' first halves in rank order, chunks W..2W-1 their second halves reversed.
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)

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

Masks (causal, sliding windows, packed documents) are planned on the host once per call: each
step's (query chunk, key chunk) pairs, by the global positions the layout gives them (a shard's
chunks that are neighbours in the sequence count as one), are skipped where no query sees any
key, and otherwise run as few calls as keep each pair's mask exact (a causal zigzag step is one).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import math

import torch
import torch.distributed as dist
from fk_runtime import checks

from .layout import check_attention_inputs, softmax_scale
from .mask import from_op_args, op_args
from .ops import attention, attention_varlen

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


# Debug counters, per process: (query chunk, key chunk) pairs computed and skipped by the forward
# and backward rings ("forward_pairs", "forward_skipped", "backward_pairs", "backward_skipped");
# `STATS.clear()` resets them.
STATS = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A run of a shard's rows that is contiguous in the full sequence."""

    local: int  # first row in the shard
    start: int  # its global position
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def shard_chunks(rank: int, world: int, n: int, layout: str) -> list[Chunk]:
    """The runs of global positions that rank `rank` of `world` holds in its shard of n rows."""
    if layout == "contiguous":
        return [Chunk(0, rank * n, n)]
    half = n // 2
    first, second = Chunk(0, rank * half, half), Chunk(half, (2 * world - 1 - rank) * half, half)
    if first.end == second.start:  # rank W - 1 (and a group of one) holds two neighbouring chunks: one run
        return [Chunk(0, first.start, n)]
    return [first, second]


@dataclasses.dataclass(frozen=True)
class Pair:
    """One attention call of a ring step: local query rows x key rows of the block held then, the
    window in the call's own (top-left) coordinates, and for packed documents the bounds of the
    documents it holds (the same for queries and keys) on the device, with the longest."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    window: tuple | None
    cu: torch.Tensor | None = None
    max_len: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    pairs: list[Pair]
    computed: int  # chunk pairs some query of which sees some key
    skipped: int


def _call_window(left, right, n_q: int, n_k: int):
    """A window (inf: unbounded) as `attention` takes it over n_q x n_k, sides that never bind
    dropped; None where neither binds."""
    left = None if left >= n_q - 1 else int(left)
    right = None if right >= n_k - 1 else int(right)
    return None if left is None and right is None else (left, right)


def _band(qa: int, qb: int, ka: int, kb: int, left, right):
    """The part of queries [qa, qb) x keys [ka, kb) (global positions) inside the window (query i sees
    key j when -left <= j - i <= right; inf unbounded): (qa, qb, ka, kb, window of the call), or None."""
    ka, kb = max(ka, qa - left), min(kb, qb + right)
    if ka >= kb:
        return None
    qa, qb = max(qa, ka - right), min(qb, kb + left)
    if qa >= qb:
        return None
    shift = qa - ka  # global offset of the call's first query from its first key
    return qa, qb, ka, kb, _call_window(left - shift, right + shift, qb - qa, kb - ka)


@dataclasses.dataclass(frozen=True)
class _Sub:
    q: Chunk
    k: Chunk
    lo: float  # j - i (chunk-local) that query i and key j may differ by to see each other
    hi: float

    @property
    def visible(self) -> bool:
        return self.lo <= self.hi


def _sub(q: Chunk, k: Chunk, left, right) -> _Sub:
    shift = q.start - k.start
    return _Sub(q, k, max(shift - left, 1 - q.size), min(shift + right, k.size - 1))


def _cover(subs: list[_Sub], left, right) -> Pair | None:
    """One call over the rectangle that `subs` (every chunk pair inside it) span, with one window that
    masks each of them exactly as the global window does; None where no such window exists."""
    r0, r1 = min(s.q.local for s in subs), max(s.q.local + s.q.size for s in subs)
    c0, c1 = min(s.k.local for s in subs), max(s.k.local + s.k.size for s in subs)
    offsets = [(s.q.local - r0) - (s.k.local - c0) for s in subs]
    # Candidates: unmasked, or the window that makes some visible pair exact.
    candidates = [(math.inf, math.inf)]
    candidates += [(left - s.q.start + s.k.start + o, right + s.q.start - s.k.start - o)
                   for s, o in zip(subs, offsets, strict=True) if s.visible]
    for cand_left, cand_right in candidates:
        if cand_left < 0 or cand_right < 0:  # not a window attention takes (top-left, sides >= 0)
            continue
        exact = True
        for s, o in zip(subs, offsets, strict=True):
            got = _sub(Chunk(0, o, s.q.size), Chunk(0, 0, s.k.size), cand_left, cand_right)
            if (got.lo, got.hi) != (s.lo, s.hi) and (got.visible or s.visible):
                exact = False
                break
        if exact:
            return Pair((r0, r1), (c0, c1), _call_window(cand_left, cand_right, r1 - r0, c1 - c0))
    return None


def _grouped(subs: list[_Sub], by_rows: bool, left, right) -> list[Pair] | None:
    """One call per query chunk (by_rows) or key chunk over the span of its visible pairs."""
    own = (lambda s: s.q) if by_rows else (lambda s: s.k)
    other = (lambda s: s.k) if by_rows else (lambda s: s.q)
    pairs = []
    for chunk in dict.fromkeys(own(s) for s in subs):
        seen = [other(s) for s in subs if own(s) == chunk and s.visible]
        if not seen:
            continue
        lo, hi = min(c.local for c in seen), max(c.local + c.size for c in seen)
        group = [s for s in subs if own(s) == chunk and lo <= other(s).local < hi]
        pair = _cover(group, left, right)
        if pair is None:
            return None
        pairs.append(pair)
    return pairs


def _dense_step(q_chunks: list[Chunk], k_chunks: list[Chunk], left, right) -> Step:
    subs = [_sub(qc, kc, left, right) for qc in q_chunks for kc in k_chunks]
    visible = [s for s in subs if s.visible]
    step = functools.partial(Step, computed=len(visible), skipped=len(subs) - len(visible))
    if not visible:
        return step([])
    whole = _cover(subs, left, right)
    if whole is not None:
        return step([whole])
    # Fewer calls where a row or column of chunk pairs takes one window; else each pair cut to its band.
    singles = []
    for s in visible:
        qa, qb, ka, kb, window = _band(s.q.start, s.q.end, s.k.start, s.k.end, left, right)
        singles.append(Pair((qa - s.q.start + s.q.local, qb - s.q.start + s.q.local),
                            (ka - s.k.start + s.k.local, kb - s.k.start + s.k.local), window))
    options = [_grouped(subs, by_rows, left, right) for by_rows in (True, False)]
    options = [p for p in options if p is not None]
    return step(min([singles, *options], key=len))  # a tie keeps the pairs cut to their bands


def _local(chunk: Chunk, a: int, b: int) -> tuple[int, int]:
    return a - chunk.start + chunk.local, b - chunk.start + chunk.local


def _packed_step(q_chunks, k_chunks, left, right, bounds: list[int], device) -> Step:
    """A ring step over packed documents (global `bounds`, cu_seqlens): a chunk with itself holds its
    documents one after another (one varlen call, every document's window from its own start);
    two distinct chunks share at most one document (the one that runs from one over to the other),
    which is one dense call on the rows and keys it holds in each."""
    pairs, skipped = [], 0
    for qc in q_chunks:
        for kc in k_chunks:
            if qc.start == kc.start:
                inner = sorted({b - qc.start for b in bounds if qc.start < b < qc.end})
                cuts = [0, *inner, qc.size]
                if len(cuts) > 2:
                    longest = max(b - a for a, b in itertools.pairwise(cuts))
                    pairs.append(Pair(_local(qc, qc.start, qc.end), _local(kc, kc.start, kc.end),
                                      _call_window(left, right, longest, longest),
                                      torch.tensor(cuts, dtype=torch.int32, device=device), longest))
                    continue
                ranges = (qc.start, qc.end, kc.start, kc.end)
            else:
                first, last = (kc, qc) if kc.start < qc.start else (qc, kc)
                doc = bisect.bisect_right(bounds, first.end - 1) - 1
                if doc != bisect.bisect_right(bounds, last.start) - 1:  # no document spans both chunks
                    skipped += 1
                    continue
                a, b = bounds[doc], bounds[doc + 1]
                ranges = (max(qc.start, a), min(qc.end, b), max(kc.start, a), min(kc.end, b))
            band = _band(*ranges, left, right)
            if band is None:
                skipped += 1
                continue
            qa, qb, ka, kb, window = band
            pairs.append(Pair(_local(qc, qa, qb), _local(kc, ka, kb), window))
    return Step(pairs, len(pairs), skipped)


def _plan(ring: _Ring, n_q: int, n_k: int, layout: str, left, right, bounds=None, device=None) -> list[Step]:
    """The calls of each ring step (step s: the K/V shard of rank (rank - s) mod W) on this rank."""
    if bounds is None and left == right == math.inf:  # no mask: every key of every block
        return [Step([Pair((0, n_q), (0, n_k), None)], 1, 0)] * ring.world
    q_chunks = shard_chunks(ring.rank, ring.world, n_q, layout)
    steps = []
    for step in range(ring.world):
        k_chunks = shard_chunks((ring.rank - step) % ring.world, ring.world, n_k, layout)
        steps.append(_dense_step(q_chunks, k_chunks, left, right) if bounds is None else
                     _packed_step(q_chunks, k_chunks, left, right, bounds, device))
    return steps


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(1, H, n, D) view -> (n, H, D) as the varlen ops take it (and (1, H, n) -> (H, n))."""
    return t[0].transpose(0, 1) if t.dim() == 4 else t[0]


def _attend(pair: Pair, q, k, v, sm_scale: float):
    """(out, lse) of one call, in the ring's (B, H, n, D) / (B, H, n) views."""
    rows, cols = slice(*pair.rows), slice(*pair.cols)
    q, k, v = q[:, :, rows], k[:, :, cols], v[:, :, cols]
    if pair.cu is None:
        return attention(q, k, v, sm_scale=sm_scale, window=pair.window, return_lse=True)
    out, lse = attention_varlen(_packed(q), _packed(k), _packed(v), pair.cu, pair.cu, pair.max_len,
                                pair.max_len, sm_scale=sm_scale, window=pair.window, return_lse=True)
    return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def _attend_backward(pair: Pair, grad_out, grad_lse, q, k, v, out, lse, sm_scale: float):
    """(dq, dk, dv) of one call from the merged out and lse, in the ring's views."""
    rows, cols = slice(*pair.rows), slice(*pair.cols)
    mask = op_args(False, pair.window, None)
    args = (grad_out[:, :, rows], None if grad_lse is None else grad_lse[:, :, rows], q[:, :, rows],
            k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows])
    if pair.cu is None:
        return torch.ops.fk.attention_backward(*args, sm_scale, mask)
    grads = torch.ops.fk.attention_varlen_backward(
        *(None if t is None else _packed(t) for t in args), pair.cu, pair.cu, pair.max_len, pair.max_len,
        sm_scale, mask)
    return tuple(g.transpose(0, 1).unsqueeze(0) for g in grads)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds a block's (out, lse) into the fp32 accumulators `out`, `lse` (views, in place): two
    passes over out (the big tensor), block_out read as it is."""
    merged = torch.logaddexp(lse, block_lse)
    # Rows that no key has reached yet (both -inf) keep weight 0 instead of exp(-inf + inf) = NaN.
    base = torch.where(merged == -math.inf, 0.0, merged)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).addcmul_(block_out, torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(merged)


def _ring_forward(q, k, v, ring: _Ring, steps: list[Step], sm_scale: float):
    n = q.shape[2]
    out = lse = None
    kv = torch.stack((k, v))  # one buffer: one send and one receive per step
    for index, step in enumerate(steps):
        arriving = ring.pass_on(kv, KV_TAG) if index + 1 < ring.world else None
        STATS["forward_pairs"] += step.computed
        STATS["forward_skipped"] += step.skipped
        for pair in step.pairs:
            block_out, block_lse = _attend(pair, q, kv[0], kv[1], sm_scale)
            if out is None and pair.rows == (0, n):  # every row: the accumulators start from it
                out, lse = block_out.float(), block_lse
                continue
            if out is None:
                out = torch.zeros_like(q, dtype=torch.float32)  # (strides kept: packed rows stay packed)
                lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
            rows = slice(*pair.rows)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if arriving is not None:
            kv = arriving()
    return out.to(q.dtype), lse  # (under autocast, attention's dtype); every row sees itself: never None


def _ring_backward(grad_out, grad_lse, q, k, v, out, lse, ring: _Ring, steps: list[Step], sm_scale: float):
    n = q.shape[2]
    kv = torch.stack((k, v))  # stacked again, not saved: the forward keeps the caller's k and v only
    dq = grad_kv = arriving_grad = None
    for index, step in enumerate(steps):
        arriving = ring.pass_on(kv, KV_TAG) if index + 1 < ring.world else None
        STATS["backward_pairs"] += step.computed
        STATS["backward_skipped"] += step.skipped
        block_grads = []
        for pair in step.pairs:
            # The merged out and lse: each block's backward recomputes exact global probabilities.
            dq_block, dk_block, dv_block = _attend_backward(pair, grad_out, grad_lse, q, kv[0], kv[1], out,
                                                            lse, sm_scale)
            if dq is None and pair.rows == (0, n):
                dq = dq_block.float()
            else:
                if dq is None:
                    dq = torch.zeros_like(q, dtype=torch.float32)
                dq[:, :, slice(*pair.rows)] += dq_block
            block_grads.append((slice(*pair.cols), dk_block, dv_block))
        # dK/dV of the shard held now: what the ranks before added (waited for after this step's
        # kernels, which overlap the transfer), plus this step's; a skipped block adds nothing.
        if index == 0:
            whole = bool(block_grads) and block_grads[0][0] == slice(0, kv.shape[3])
            grad_kv = (torch.empty if whole else torch.zeros)(kv.shape, dtype=torch.float32, device=kv.device)
            if whole:  # the own shard's first block covers every key: copied in, no zero fill to add to
                _, dk_block, dv_block = block_grads.pop(0)
                grad_kv[0].copy_(dk_block)
                grad_kv[1].copy_(dv_block)
        else:
            grad_kv = arriving_grad()
        for cols, dk_block, dv_block in block_grads:
            grad_kv[0, :, :, cols] += dk_block
            grad_kv[1, :, :, cols] += dv_block
        if ring.world > 1:
            # The last pass brings each rank its own shard's finished dK/dV: sent in the inputs' dtype
            # (rounded once, as the owner would; half the bytes on a transfer nothing overlaps).
            arriving_grad = ring.pass_on(grad_kv if arriving is not None else grad_kv.to(kv.dtype), GRAD_TAG)
        if arriving is not None:
            kv = arriving()
    grad_kv = arriving_grad() if ring.world > 1 else grad_kv.to(kv.dtype)
    return dq.to(q.dtype), grad_kv[0], grad_kv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, steps, sm_scale):
        out, lse = _ring_forward(q, k, v, ring, steps, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = ring, steps, sm_scale
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
        return dq, dk, dv, None, None, None


def _window_sides(causal, window) -> tuple:
    """(left, right) of the global mask, math.inf for an unbounded side, from `causal` (a bool,
    "upper_left", "lower_right": one mask where queries and keys are one sequence) and `window`."""
    mask = from_op_args(op_args(causal, window, None))
    return (math.inf if mask.left is None else mask.left), (math.inf if mask.right is None else mask.right)


def _check_even(layout: str, n: int, name: str) -> None:
    if layout == "zigzag" and n % 2:
        raise ValueError(f"the zigzag layout holds two chunks per rank: {name}'s shard length must be even, "
                         f"got {n}")


def ring_attention(q, k, v, group=None, causal=False, sm_scale: float | None = None,
                   layout: str = "zigzag", return_lse: bool = False, window=None):
    """Attention of the whole sequence, sharded over the ranks of `group`: this rank's shards in,
    this rank's rows of `attention(Q, K, V, causal=causal, window=window)` out (Q, K, V the full
    sequence).

    q (B, Hq, n, D), k and v (B, Hk, n_k, D): this rank's shards of the sequence, laid out as
    `layout` says (see the module docstring: "zigzag", the default, balances a causal mask;
    `shard_sequence` cuts a full tensor); Hq a multiple of Hk (GQA/MQA); fp16, bf16, fp32; D as
    `attention` takes it. Every rank must pass the same shapes. With a mask (`causal` or `window`)
    the query and key shards have one length n (even under "zigzag": two chunks of n / 2); without
    one they may differ (e.g. cross-attention of local queries to a sharded context) and the
    layout does not matter. `sm_scale` > 0 defaults to 1 / sqrt(D).

    `causal`: False, True, "upper_left" or "lower_right" (one mask here: queries and keys are one
    sequence). `window=(left, right)` (None for an unbounded side), FlashAttention's sliding
    window in global positions: query i sees keys j with i - left <= j <= i + right, causal
    capping right at 0. A (query chunk, key chunk) pair of a step in which no query sees any key
    is skipped (no attention, no merge, no backward; its K/V still travel on, its dK/dV stay
    zero), counted in `STATS`; the others run with the window moved into their own coordinates.

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
    left, right = _window_sides(causal, window)
    return_lse = checks.check_flag("return_lse", return_lse)
    layout = _check_layout(layout)
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    masked = left != math.inf or right != math.inf
    if masked and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal or windowed ring attention needs query and key shards of one length, got "
                         f"q's {q.shape[2]} and k's {k.shape[2]}")
    if masked:
        _check_even(layout, q.shape[2], "q")
    ring = _Ring(_group(group))
    steps = _plan(ring, q.shape[2], k.shape[2], layout, left, right)
    out, lse = _RingAttention.apply(q, k, v, ring, steps, sm_scale)
    return (out, lse) if return_lse else out


def _document_bounds(cu_seqlens) -> list[int]:
    """The documents' bounds (global cu_seqlens) as host ints, checked but for their total."""
    checks.check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), min_dim=1, max_dim=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must hold at least two entries (0 and the token count), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()  # read once per call on the host: every step's plan comes from it
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError("cu_seqlens must be non-decreasing (prefix sums of the documents' lengths)")
    return bounds


def ring_attention_varlen(q, k, v, cu_seqlens, max_seqlen: int, group=None, causal=False, window=None,
                          sm_scale: float | None = None, layout: str = "zigzag", return_lse: bool = False):
    """`attention_varlen` of a packed batch of documents sharded over the ranks of `group`, as
    `ring_attention` shards one sequence: no token attends to another document's.

    q (n, Hq, D), k and v (n, Hk, D): this rank's shard of the packed (total, H, D) tokens, cut as
    `layout` says (`shard_sequence(x, dim=0, layout=...)`; total = W * n, n even under "zigzag").
    `cu_seqlens`: the GLOBAL int32 (S + 1,) prefix sums of the documents' lengths, the same on
    every rank, its last entry the total (documents may cross shard and chunk bounds; read on the
    host once per call). `max_seqlen`: the longest document (FlashAttention's signature; each call
    takes its own longest from cu_seqlens). `causal`, `window`, `sm_scale`, `group`, `return_lse`
    as in `ring_attention`, per document; lse (Hq, n).

    Each step, a chunk of queries with the same chunk of keys is one `attention_varlen` call over
    the documents it holds; two distinct chunks share at most one document (the one spanning the
    chunks between them), one dense call on its rows there, or none (skipped, counted in `STATS`).
    Load balance (tokens are not moved): zigzag evens out the causal work of a document as it
    evens out a sequence's, exactly for one document and roughly for documents long against a
    chunk (N / 2W tokens). Documents much shorter than a chunk keep their work inside the chunks
    that hold them (the far blocks skipped, their K/V passed on unread), so each rank's share is
    that of its own chunks' documents: even only as far as their lengths are, under either layout."""
    check_attention_inputs(q, k, v, RING_DTYPES, packed=True)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v must hold one shard length (tokens), got q's {q.shape[0]} and k's "
                         f"{k.shape[0]}")
    checks.check_size("max_seqlen", max_seqlen, minimum=0)
    left, right = _window_sides(causal, window)
    return_lse = checks.check_flag("return_lse", return_lse)
    layout = _check_layout(layout)
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    _check_even(layout, q.shape[0], "q")
    bounds = _document_bounds(cu_seqlens)
    ring = _Ring(_group(group))
    if bounds[-1] != q.shape[0] * ring.world:
        raise ValueError(f"cu_seqlens' last entry must be the global token count {q.shape[0] * ring.world} "
                         f"(the {ring.world} ranks' shards), got {bounds[-1]}")
    steps = _plan(ring, q.shape[0], q.shape[0], layout, left, right, bounds, q.device)
    # The ring runs on (1, H, n, D) views of the packed tokens.
    views = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, lse = _RingAttention.apply(*views, ring, steps, sm_scale)
    out, lse = out[0].transpose(0, 1), lse[0]
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

"""Ring attention over gloo, 2 and 4 CPU processes (the Triton interpreter), and, where two GPUs
are, over NCCL on them (also at GPU sizes): its output, log-sum-exp and gradients gathered from
every rank against single-process fk attention on the full sequence and against a float64
reference with an explicit mask; sliding windows and packed documents across 2 ranks against the
float64 reference, the chunk pairs they skip, each step's plan against the mask; bad inputs."""

import bisect
import functools
import itertools
import json
import math
import random
import types

import pytest
import torch
import torch.distributed as dist
from fk_runtime.harness import testing

from fk_attention import attention
from fk_attention import ring, ring_bench
from fk_attention.ring import gather_sequence, ring_attention, ring_attention_varlen, shard_sequence

# id: (ranks, batch, q heads, kv heads, full length, head dim, dtype, causal, layout, lse in the loss)
CASES = {
    "w2-causal-gqa-fp32": (2, 1, 2, 1, 64, 16, torch.float32, True, "zigzag", False),
    "w2-causal-fp16-lse": (2, 1, 2, 2, 64, 16, torch.float16, True, "zigzag", True),
    "w2-full-fp32-lse": (2, 2, 2, 2, 32, 32, torch.float32, False, "contiguous", True),
    "w4-causal-gqa-fp32-lse": (4, 1, 4, 2, 64, 16, torch.float32, True, "zigzag", True),
    "w4-causal-contiguous": (4, 1, 2, 2, 64, 16, torch.float32, True, "contiguous", False),
    "w4-full-gqa-fp32": (4, 1, 2, 1, 64, 16, torch.float32, False, "zigzag", False),
}
# Where GPUs are, also at sizes the GPU kernels tile as in training; four GPUs run every case as
# the CPU ranks do (the 2-rank ones on PAIR), two GPUs the 2-rank cases.
BIG_CASES = {
    "w2-causal-gqa-bf16-d128-lse": (2, 2, 8, 2, 4096, 128, torch.bfloat16, True, "zigzag", True),
    "w2-full-fp16-d64": (2, 1, 4, 4, 2048, 64, torch.float16, False, "contiguous", False),
    "w4-causal-gqa-bf16-d128-lse": (4, 1, 8, 2, 8192, 128, torch.bfloat16, True, "zigzag", True),
}
ALL_CASES = {**CASES, **BIG_CASES}
# Sliding windows and packed documents, on 2 ranks (PAIR among 4), B 1, N 64, D 16, fp32, the lse
# in the loss. id: (q heads, kv heads, causal, layout, window, document lengths; None: one sequence)
MASKED_CASES = {
    "window-8-0-causal-zigzag": (2, 1, True, "zigzag", (8, 0), None),
    "window-8-0-causal-contiguous": (2, 2, True, "contiguous", (8, 0), None),
    "window-4-4-zigzag": (2, 1, False, "zigzag", (4, 4), None),
    "window-4-4-contiguous": (2, 2, False, "contiguous", (4, 4), None),
    "docs-causal-zigzag": (2, 1, True, "zigzag", None, (5, 40, 19)),
    "docs-full-contiguous": (2, 2, False, "contiguous", None, (5, 40, 19)),
    "docs-window-7-2-zigzag": (2, 1, False, "zigzag", (7, 2), (5, 40, 19)),
}
MASKED_N, MASKED_D = 64, 16
WORLD = 4
GPU_WORLD = 4 if testing.gpu_ranks_available(4) else 2
GPU_CASES = {case: spec for case, spec in ALL_CASES.items() if spec[0] <= GPU_WORLD}
# The 2-rank cases run on a subgroup of global ranks 1 and 3: not adjacent, and without rank 0.
PAIR = (1, 3)
GRADS = ("dq", "dk", "dv")


def forward_backward(fn, q, k, v, grad_out, grad_lse, with_lse: bool) -> dict:
    """out, lse and the gradients of q, k, v for the upstream gradients (grad_lse only with_lse)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    torch.autograd.backward((out, lse) if with_lse else out, (grad_out, grad_lse) if with_lse else grad_out)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def reference(q, k, v, causal: bool, window=None, documents=None):
    """Float64 attention with the mask written out (causal, window (left, right), documents'
    lengths): (out, lse)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = scores.shape[-1]
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    seen = torch.ones(n, n, dtype=torch.bool, device=q.device) if not causal else j <= i
    left, right = window or (None, None)
    if left is not None:
        seen = seen & (j >= i - left)
    if right is not None:
        seen = seen & (j <= i + right)
    if documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents)).to(q.device)
        seen = seen & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~seen, -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def new_inputs(case: str) -> list[torch.Tensor]:
    """Fresh full-sequence q, k, v and upstream gradients of out and lse, on the CPU (for the ranks)."""
    _, b, hq, hk, n, d, dtype, *_ = ALL_CASES[case]
    shapes = [(b, hq, n, d), (b, hk, n, d), (b, hk, n, d), (b, hq, n, d)]
    return [torch.randn(s).to(dtype) for s in shapes] + [torch.randn(b, hq, n)]


def gathered_run(case: str, full: list[torch.Tensor], group, device: torch.device) -> dict:
    """This rank's part of one case on its shards, gathered back to full sequences (on the CPU)."""
    *_, causal, layout, with_lse = ALL_CASES[case]
    shards = [shard_sequence(t.to(device), 2, group, layout) for t in full]
    attend = functools.partial(ring_attention, group=group, causal=causal, layout=layout, return_lse=True)
    local = forward_backward(attend, *shards, with_lse)
    return {name: gather_sequence(t, 2, group, layout).cpu() for name, t in local.items()}


def new_masked_inputs(case: str) -> list[torch.Tensor]:
    """Fresh (1, H, N, D) q, k, v, upstream gradient of out, and of lse (1, H, N), fp32."""
    hq, hk, *_ = MASKED_CASES[case]
    shapes = [(1, hq, MASKED_N, MASKED_D), (1, hk, MASKED_N, MASKED_D), (1, hk, MASKED_N, MASKED_D),
              (1, hq, MASKED_N, MASKED_D)]
    return [torch.randn(s) for s in shapes] + [torch.randn(1, hq, MASKED_N)]


def masked_run(case: str, full: list[torch.Tensor], group, device: torch.device) -> tuple[dict, dict]:
    """One windowed or packed case on this rank's shards, gathered back to (1, H, N, D) / (1, H, N)
    on the CPU; and this rank's skip counters of the case."""
    _, _, causal, layout, window, documents = MASKED_CASES[case]
    full = [t.to(device) for t in full]
    ring.STATS.clear()
    if documents is None:
        shards = [shard_sequence(t, 2, group, layout) for t in full]
        attend = functools.partial(ring_attention, group=group, causal=causal, layout=layout, window=window,
                                   return_lse=True)
        local = forward_backward(attend, *shards, True)
        gathered = {name: gather_sequence(t, 2, group, layout).cpu() for name, t in local.items()}
    else:
        # Packed (N, H, D) tokens and a (H, N) lse, cut along the tokens.
        packed = [t[0].transpose(0, 1).contiguous() for t in full[:4]] + [full[4][0]]
        shards = [shard_sequence(t, 0, group, layout) for t in packed[:4]]
        shards.append(shard_sequence(packed[4], 1, group, layout))
        cu = torch.tensor([0, *itertools.accumulate(documents)], dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match="last entry must be the global token count 64"):
            ring_attention_varlen(*shards[:3], cu[:-1], 40, group=group, layout=layout)
        attend = functools.partial(ring_attention_varlen, cu_seqlens=cu, max_seqlen=max(documents),
                                   group=group, causal=causal, window=window, layout=layout, return_lse=True)
        local = forward_backward(attend, *shards, True)
        gathered = {name: gather_sequence(t, 1 if name == "lse" else 0, group, layout).cpu()
                    for name, t in local.items()}
        gathered = {name: t.unsqueeze(0) if name == "lse" else t.transpose(0, 1).unsqueeze(0)
                    for name, t in gathered.items()}
    return gathered, dict(ring.STATS)


def rank_main(rank: int, store: str, inputs: dict, result: str, world: int = WORLD, backend: str = "gloo",
              masked: dict | None = None) -> None:
    """One of `world` ranks (gloo: CPU processes; nccl: one GPU each): each case on its shards, over
    every rank or, for 2-rank cases among 4, over PAIR; rank 1, which is in every case, saves what
    it gathered (the `masked` cases' under "masked", with both ranks' skip counters under "stats")."""
    device = testing.init_rank(rank, world, store, backend)
    pair = dist.new_group(PAIR) if world == WORLD else None  # every rank takes part in making it
    gathered = {"masked": {}, "stats": {}}
    if pair is None or rank in PAIR:
        for case, full in (masked or {}).items():
            gathered["masked"][case], stats = masked_run(case, full, pair, device)
            gathered["stats"][case] = [None] * 2
            dist.all_gather_object(gathered["stats"][case], stats, group=pair)
    for case, full in inputs.items():
        group = None if ALL_CASES[case][0] == world else pair
        if group is not None and rank not in PAIR:
            with pytest.raises(ValueError, match="group does not hold this rank"):
                ring_attention(*full[:3], group=pair)
            continue
        gathered[case] = gathered_run(case, full, group, device)
    with pytest.raises(ValueError, match="must divide into 8 chunks"):
        shard_sequence(torch.zeros(1, 1, 6, 16, device=device))
    # A group of one rank: the whole sequence is local, the ring one fk attention (checked on rank 1:
    # every rank makes the groups, one runs them; the CI's 2 cores run all 4 ranks).
    alone = [dist.new_group([r]) for r in range(world)][rank]
    if rank == 1:
        full = [t.to(device) for t in next(iter(inputs.values()))]
        for causal in (False, True):
            got, want = (forward_backward(functools.partial(fn, causal=causal, return_lse=True), *full, True)
                         for fn in (functools.partial(ring_attention, group=alone), attention))
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        # Under autocast a group of one gives the inputs' dtype, as larger groups do, and differentiates.
        q, k, v = (t.float().requires_grad_() for t in full[:3])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = ring_attention(q, k, v, group=alone, causal=True)
        assert out.dtype == torch.float32
        out.sum().backward()
        assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (q, k, v))
    # With only k requiring grad, dK comes back equal to the full run's, in storage of its own.
    case = next(c for c in inputs if ALL_CASES[c][0] == world)
    *_, causal, layout, _ = ALL_CASES[case]
    shards = [shard_sequence(t.to(device), 2, None, layout) for t in inputs[case][:4]]
    both = forward_backward(functools.partial(ring_attention, causal=causal, layout=layout, return_lse=True),
                            *shards[:3], shards[3], None, False)
    q, k, v = (t.detach().requires_grad_(i == 1) for i, t in enumerate(shards[:3]))
    torch.autograd.backward(ring_attention(q, k, v, causal=causal, layout=layout), shards[3])
    assert k.grad._base is None and q.grad is None and v.grad is None
    torch.testing.assert_close(k.grad, both["dk"], rtol=0, atol=0)
    if rank == 1:
        torch.save(gathered, result)
    dist.barrier()  # no rank leaves while another still finishes a collective with it
    dist.destroy_process_group()


def expected(case: str, full: list[torch.Tensor]) -> tuple[dict, dict]:
    """Single-process fk attention and the float64 reference on the full sequence."""
    *_, causal, _, with_lse = ALL_CASES[case]
    full = [t.to(testing.device()) for t in full]
    fk = forward_backward(functools.partial(attention, causal=causal, return_lse=True), *full, with_lse)
    exact = forward_backward(functools.partial(reference, causal=causal), *(t.double() for t in full),
                             with_lse)
    return fk, exact


def masked_expected(case: str, full: list[torch.Tensor]) -> dict:
    """The float64 reference of a windowed or packed case on the full sequence."""
    _, _, causal, _, window, documents = MASKED_CASES[case]
    attend = functools.partial(reference, causal=causal, window=window, documents=documents)
    return forward_backward(attend, *(t.to(testing.device()).double() for t in full), True)


def _runs(folder, cases: dict, world: int, backend: str) -> dict:
    """{case: (what the ranks gathered, fk attention's results, float64 results)} from one spawn of
    `world` ranks, the references computed here meanwhile; "masked": {case: (gathered, float64)}
    and "stats": {case: each rank's skip counters} of the MASKED_CASES."""
    inputs = {case: new_inputs(case) for case in cases}
    masked = {case: new_masked_inputs(case) for case in MASKED_CASES}
    ranks = testing.spawn_ranks(rank_main, world, (str(folder / "store"), inputs, str(folder / "result.pt"),
                                                   world, backend, masked), join=False, backend=backend)
    try:
        references = {case: expected(case, full) for case, full in inputs.items()}
        masked_references = {case: masked_expected(case, full) for case, full in masked.items()}
    finally:
        while not ranks.join():
            pass
    gathered = torch.load(folder / "result.pt")
    return {**{case: (gathered[case], *references[case]) for case in cases},
            "masked": {case: (gathered["masked"][case], masked_references[case]) for case in MASKED_CASES},
            "stats": gathered["stats"]}


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    return testing.shared_gloo_runs(tmp_path_factory, "ring-gloo", lambda folder: _runs(folder, CASES, WORLD, "gloo"))


@pytest.fixture(scope="module")
def gpu_ring_runs(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("ring-nccl"), GPU_CASES, GPU_WORLD, "nccl")


def _check(gathered, fk, exact, dtype):
    for name in ("out", "lse", *GRADS):
        got = gathered[name].to(testing.device())
        testing.assert_close(f"{name} vs float64", got, exact[name], dtype)
        testing.assert_close(f"{name} vs fk attention", got, fk[name], dtype)


@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_ring_matches_full_sequence(case, ring_runs):
    _check(*ring_runs[case], CASES[case][6])


@pytest.mark.skipif(not testing.gpu_ranks_available(2), reason="NCCL ranks need two GPUs")
@pytest.mark.parametrize("case", GPU_CASES)
def test_ring_matches_full_sequence_on_gpus(case, gpu_ring_runs):
    _check(*gpu_ring_runs[case], GPU_CASES[case][6])


@pytest.mark.heavy
@pytest.mark.parametrize("case", MASKED_CASES)
def test_ring_masks_match_full_sequence(case, ring_runs):
    """Windows (both layouts) and packed documents (uneven lengths 5, 40, 19 over 4 chunks of 16):
    out, lse, dq, dk, dv against float64 attention with the mask written out."""
    gathered, exact = ring_runs["masked"][case]
    for name in ("out", "lse", *GRADS):
        got = gathered[name].to(testing.device())
        testing.assert_close(f"{name} vs float64", got, exact[name], torch.float32)


@pytest.mark.heavy
def test_ring_skips_chunk_pairs_outside_the_window(ring_runs):
    """Zigzag over 2 ranks, N 64: rank 0 holds chunks 0 and 3 of 16 tokens, rank 1 chunks 1-2 as one
    run. Under a causal window of 8, rank 0 skips (0, 3) and (0, 1-2) as causal would, and (3, 0)
    for the window; rank 1 skips (1-2, 3). The backward skips the same."""
    stats = ring_runs["stats"]["window-8-0-causal-zigzag"]
    assert [s["forward_skipped"] for s in stats] == [3, 1]
    assert [s["forward_pairs"] for s in stats] == [3, 2]
    assert [s["backward_skipped"] for s in stats] == [3, 1]
    assert [s["backward_pairs"] for s in stats] == [3, 2]
    # Packed documents 5, 40, 19: rank 0's chunk 3 shares no document with chunk 0.
    assert ring_runs["stats"]["docs-causal-zigzag"][0]["forward_skipped"] >= 1


def _positions(rank: int, world: int, n: int, layout: str) -> torch.Tensor:
    pos = torch.empty(n, dtype=torch.long)
    for c in ring.shard_chunks(rank, world, n, layout):
        pos[c.local:c.local + c.size] = torch.arange(c.start, c.end)
    return pos


def _plan_mask(pair) -> torch.Tensor:
    """Which (row, key) of its rectangle one planned call lets see each other."""
    (ra, rb), (ca, cb) = pair.rows, pair.cols
    diff = torch.arange(cb - ca)[None, :] - torch.arange(rb - ra)[:, None]
    left, right = pair.window or (None, None)
    seen = (diff >= -(math.inf if left is None else left)) & (diff <= (math.inf if right is None else right))
    if pair.cu is not None:
        cu = pair.cu.tolist()
        doc = torch.tensor([bisect.bisect_right(cu, x) - 1 for x in range(rb - ra)])
        seen &= doc[:, None] == doc[None, :]
    return seen


PLAN_WINDOWS = (None, (0, 0), (3, 0), (5, 2), (None, 3), (2, None))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_covers_the_mask_exactly(world):
    """On the host (no kernels): every step's calls on every rank, with their windows and document
    bounds, let each (query, key) see each other at most once, and exactly where the global mask
    (window, causal, documents) does; a causal zigzag step is one call."""
    rng, n = random.Random(world), 12
    total = n * world
    for layout, causal, window in itertools.product(("zigzag", "contiguous"), (False, True), PLAN_WINDOWS):
        left, right = ring._window_sides(causal, window)
        for bounds in (None, [0, total], [0, *sorted(rng.sample(range(1, total), 4)), total]):
            doc = None if bounds is None else torch.tensor([bisect.bisect_right(bounds, p) - 1
                                                            for p in range(total)])
            for rank in range(world):
                where = types.SimpleNamespace(rank=rank, world=world)
                steps = ring._plan(where, n, n, layout, left, right, bounds, "cpu")
                q = _positions(rank, world, n, layout)
                for index, step in enumerate(steps):
                    k = _positions((rank - index) % world, world, n, layout)
                    diff = k[None, :] - q[:, None]
                    want = (diff >= -left) & (diff <= right)
                    if doc is not None:
                        want &= doc[q][:, None] == doc[k][None, :]
                    got = torch.zeros(n, n, dtype=torch.int)
                    for pair in step.pairs:
                        got[slice(*pair.rows), slice(*pair.cols)] += _plan_mask(pair).int()
                    assert got.max() <= 1 and torch.equal(got.bool(), want), (layout, causal, window, bounds,
                                                                               rank, index)
                    if causal and window is None and bounds is None:
                        assert len(step.pairs) <= 1


def test_merge_of_rows_without_keys():
    """A row that no block has reached stays zero with a -inf log-sum-exp (no NaN from -inf - -inf);
    the first block to reach a row sets it."""
    out, lse = torch.zeros(1, 1, 2, 16), torch.full((1, 1, 2), -math.inf)
    block_out, block_lse = torch.randn(1, 1, 2, 16), torch.tensor([[[-math.inf, 0.5]]])
    block_out[:, :, 0] = 0  # what attention returns for a row that sees no key
    ring._merge(out, lse, block_out, block_lse)
    assert torch.equal(out[:, :, 0], torch.zeros(1, 1, 16)) and lse[0, 0, 0] == -math.inf
    torch.testing.assert_close(out[:, :, 1], block_out[:, :, 1])
    assert lse[0, 0, 1] == 0.5


def test_bad_inputs():
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ring_attention(q.tolist(), k, k)
    with pytest.raises(TypeError, match="q must have dtype"):
        ring_attention(q.int(), k, k)
    with pytest.raises(ValueError, match="k must have at least 4 dims"):
        ring_attention(q, k[0], k[0])
    with pytest.raises(TypeError, match="one dtype"):
        ring_attention(q, k, k.half())
    with pytest.raises(ValueError, match="k and v must have one shape"):
        ring_attention(q, k, k[:, :1])
    with pytest.raises(ValueError, match="multiple of k's and v's heads"):
        ring_attention(q[:, :3], k, k)
    with pytest.raises(ValueError, match="must share the head dim"):
        ring_attention(q, k[..., :8], k[..., :8])
    with pytest.raises(ValueError, match="head dim must be from 1 to 256"):
        ring_attention(torch.zeros(*q.shape[:-1], 264), torch.zeros(*k.shape[:-1], 264), torch.zeros(*k.shape[:-1], 264))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_attention(q, k, k, causal=1)
    with pytest.raises(ValueError, match="causal must be a bool, 'upper_left' or 'lower_right'"):
        ring_attention(q, k, k, causal="yes")
    with pytest.raises(ValueError, match=r"window\[0\] must be >= 0"):
        ring_attention(q, k, k, window=(-2, 0))
    with pytest.raises(TypeError, match="window must be None or a"):
        ring_attention(q, k, k, window=4)
    with pytest.raises(ValueError, match="one length"):
        ring_attention(q, k[:, :, :4], k[:, :, :4], window=(2, 2))
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ring_attention(q, k, k, return_lse=1)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, k, k, layout="ring")
    with pytest.raises(ValueError, match="sm_scale must be a positive"):
        ring_attention(q, k, k, sm_scale=-1.0)
    with pytest.raises(ValueError, match="one length"):
        ring_attention(q, k[:, :, :4], k[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="must be even"):
        ring_attention(q[:, :, :7], k[:, :, :7], k[:, :, :7], causal=True)
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup"):
        ring_attention(q, k, k, group="world")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ring_attention(q, k, k)
        with pytest.raises(RuntimeError, match="init_process_group"):
            shard_sequence(q)
    with pytest.raises(ValueError, match="dim=4 is out of range"):
        shard_sequence(q, dim=4)
    p, cu = torch.zeros(8, 4, 16), torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must have at most 3 dims"):
        ring_attention_varlen(q, k, k, cu, 8)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        ring_attention_varlen(p, p, p, cu.long(), 8)
    with pytest.raises(ValueError, match="cu_seqlens must have at most 1 dims"):
        ring_attention_varlen(p, p, p, cu[None], 8)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ring_attention_varlen(p, p, p, cu + 1, 8)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        ring_attention_varlen(p, p, p, torch.tensor([0, 5, 3, 8], dtype=torch.int32), 8)
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        ring_attention_varlen(p, p, p, cu, 8.0)
    with pytest.raises(ValueError, match=r"window\[1\] must be >= 0"):
        ring_attention_varlen(p, p, p, cu, 8, window=(None, -3))
    with pytest.raises(ValueError, match="shard length must be even"):
        ring_attention_varlen(p[:7], p[:7], p[:7], cu, 8)
    with pytest.raises(ValueError, match="one shard length"):
        ring_attention_varlen(p, p[:4], p[:4], cu, 8)


def test_bench_arguments():
    args = ring_bench.parse_args([])
    assert (args.seqlen, args.heads, args.kv_heads, args.head_dim, args.dtype, args.causal) == (
        131072, 16, 16, 128, "bfloat16", True)
    assert ring_bench.parse_args(["--kv-heads", "4", "--no-causal"]).kv_heads == 4
    with pytest.raises(SystemExit):
        ring_bench.parse_args(["--heads", "16", "--kv-heads", "3"])
    with pytest.raises(SystemExit):
        ring_bench.parse_args(["--profile", "-1"])


def test_bench_section(tmp_path):
    """--benchmarks keeps each world size's result and writes the ring section from all of them."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    assert ring_bench.parse_args(["--benchmarks", str(folder)]).benchmarks == folder
    result = dict(seqlen=131072, world=2, batch=1, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16",
                  causal=True, layout="zigzag", t1_ms=508.49, tn_ms=275.36, efficiency=0.9233,
                  rel_errors={"out": 1.1e-3, "dq": 1.1e-3, "dk": 2.9e-3, "dv": 2.9e-3}, device="GPU",
                  torch="t", triton="3.6.0", date="today")
    (folder / "ring-4.json").write_text(json.dumps({**result, "world": 4, "tn_ms": 140.0, "efficiency": 0.908}))
    (folder / "ring-2.json").write_text(json.dumps(result))
    assert ring_bench.write_section(folder) == tmp_path / "BENCHMARKS.md"
    rows = [line for line in (folder / "ring.md").read_text().splitlines() if line.startswith("| 2 ") or
            line.startswith("| 4 ")]
    assert [row.split(" | ")[10] for row in rows] == ["0.923", "0.908"]
    assert "## ring" in (tmp_path / "BENCHMARKS.md").read_text()

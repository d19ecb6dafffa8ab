"""Ring attention over gloo, 2 and 4 CPU processes (the Triton interpreter), and, where two GPUs
are, over NCCL on them (also at GPU sizes): its output, log-sum-exp and gradients gathered from
every rank against single-process fk attention on the full sequence and against a float64
reference with an explicit mask; bad inputs."""

import functools
import json
import math

import pytest
import torch
import torch.distributed as dist
from fk_runtime import backend
from fk_runtime.harness import testing

from fk_attention import attention
from fk_attention import ring, ring_bench
from fk_attention.ring import gather_sequence, ring_attention, shard_sequence

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


def reference(q, k, v, causal: bool):
    """Float64 attention with the mask written out: (out, lse)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
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


def rank_main(rank: int, store: str, inputs: dict, result: str, world: int = WORLD, backend: str = "gloo") -> None:
    """One of `world` ranks (gloo: CPU processes; nccl: one GPU each): each case on its shards, over
    every rank or, for 2-rank cases among 4, over PAIR; rank 1, which is in every case, saves what
    it gathered."""
    device = testing.init_rank(rank, world, store, backend)
    pair = dist.new_group(PAIR) if world == WORLD else None  # every rank takes part in making it
    gathered = {}
    for case, full in inputs.items():
        group = None if ALL_CASES[case][0] == world else pair
        if group is not None and rank not in PAIR:
            with pytest.raises(ValueError, match="group does not hold this rank"):
                ring_attention(*full[:3], group=pair)
            continue
        gathered[case] = gathered_run(case, full, group, device)
    with pytest.raises(ValueError, match="must divide into 8 chunks"):
        shard_sequence(torch.zeros(1, 1, 6, 16, device=device))
    # A group of one rank: the whole sequence is local, the ring one fk attention.
    alone = [dist.new_group([r]) for r in range(world)][rank]
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


def _runs(folder, cases: dict, world: int, backend: str) -> dict:
    """{case: (what the ranks gathered, fk attention's results, float64 results)} from one spawn of
    `world` ranks, the references computed here meanwhile."""
    inputs = {case: new_inputs(case) for case in cases}
    ranks = testing.spawn_ranks(rank_main, world, (str(folder / "store"), inputs, str(folder / "result.pt"),
                                                   world, backend), join=False, backend=backend)
    try:
        references = {case: expected(case, full) for case, full in inputs.items()}
    finally:
        while not ranks.join():
            pass
    gathered = torch.load(folder / "result.pt")
    return {case: (gathered[case], *references[case]) for case in cases}


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    problem = backend.interpreter_numpy_problem()  # the gloo ranks run kernels on the interpreter
    if problem is not None:
        pytest.skip(problem)
    return _runs(tmp_path_factory.mktemp("ring"), CASES, WORLD, "gloo")


@pytest.fixture(scope="module")
def gpu_ring_runs(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("ring-nccl"), GPU_CASES, GPU_WORLD, "nccl")


def _check(gathered, fk, exact, dtype):
    for name in ("out", "lse", *GRADS):
        got = gathered[name].to(testing.device())
        testing.assert_close(f"{name} vs float64", got, exact[name], dtype)
        testing.assert_close(f"{name} vs fk attention", got, fk[name], dtype)


@pytest.mark.parametrize("case", CASES)
def test_ring_matches_full_sequence(case, ring_runs):
    _check(*ring_runs[case], CASES[case][6])


@pytest.mark.skipif(not testing.gpu_ranks_available(2), reason="NCCL ranks need two GPUs")
@pytest.mark.parametrize("case", GPU_CASES)
def test_ring_matches_full_sequence_on_gpus(case, gpu_ring_runs):
    _check(*gpu_ring_runs[case], GPU_CASES[case][6])


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
        ring_attention(q, k, k, causal="yes")
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

"""fk ops in torch's data-parallel training: a small block of fk modules (LayerNorm, GQA causal
self-attention, softmax, RMSNorm, a weighted-sum head) trained by 2 CPU processes (gloo, the Triton
interpreter) and, where two GPUs are, by 2 GPU processes (NCCL), under DDP and under FSDP2
(`fully_shard`), each rank on its half of the global batch, against the same training in one
process on the whole batch: every step's loss and every gradient (DDP's all-reduced ones, FSDP2's
unsharded)."""

import pytest
import torch
import torch.distributed as dist
from fk_runtime.harness import testing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fk_attention import SelfAttention
from fk_layernorm import LayerNorm, RMSNorm
from fk_softmax import softmax
from fk_weightedsum import WeightedSum

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 under its old name
    from torch.distributed._composable.fsdp import fully_shard

WORLD, STEPS, LR = 2, 2, 0.5
BATCH, TOKENS, DIM = 4, 16, 32
WRAPPERS = ("ddp", "fsdp2")


class Block(torch.nn.Module):
    """x (B, N, DIM) -> (B, N): pre-norm causal GQA attention with a residual, a softmax gate,
    RMSNorm, a weighted-sum head."""

    def __init__(self):
        super().__init__()
        self.norm = LayerNorm(DIM)
        self.attn = SelfAttention(DIM, num_heads=2, num_kv_heads=1, causal=True, bias=True)
        self.gate = torch.nn.Linear(DIM, DIM)
        self.final = RMSNorm(DIM)
        self.head = WeightedSum(DIM)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return self.head(self.final(x * softmax(self.gate(x), dim=-1)))


def train(model, block: Block, x, target) -> list[dict]:
    """STEPS of SGD on the mean squared error; per step the loss (averaged over the ranks) and the
    gradient of each of `block`'s parameters (whole, as one process would have it)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        loss = loss.detach().clone()
        if dist.is_initialized():  # each rank's loss covers its share of the batch
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for name, p in block.named_parameters()}
        steps.append({"loss": loss, **{name: g.detach().clone() for name, g in grads.items()}})
        optimizer.step()
    return steps


def wrap(block: Block, how: str, device: torch.device):
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(block)
    mesh = init_device_mesh(device.type, (WORLD,))
    for layer in (block.attn, block.gate):
        fully_shard(layer, mesh=mesh)
    return fully_shard(block, mesh=mesh)


def rank_main(rank: int, store: str, state: dict, x, target, result: str, backend: str) -> None:
    """One rank: the block trained under each wrapper on this rank's share of the batch; rank 0
    saves the steps."""
    device = testing.init_rank(rank, WORLD, store, backend)
    runs = {}
    for how in WRAPPERS:
        block = Block().to(device)
        block.load_state_dict(state)
        runs[how] = train(wrap(block, how, device), block, x.chunk(WORLD)[rank].to(device),
                          target.chunk(WORLD)[rank].to(device))
    if rank == 0:
        torch.save({how: [{name: t.cpu() for name, t in step.items()} for step in steps]
                    for how, steps in runs.items()}, result)
    dist.barrier()  # no rank leaves while another still finishes a collective with it
    dist.destroy_process_group()


def _runs(folder, backend: str):
    """(the one-process steps, {wrapper: the distributed steps}) from fresh weights and data."""
    state = {name: t.detach() for name, t in Block().state_dict().items()}
    x, target = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS)
    testing.spawn_ranks(rank_main, WORLD, (str(folder / "store"), state, x, target, str(folder / "result.pt"),
                                           backend), backend=backend)
    block = Block().to(testing.device())
    block.load_state_dict(state)
    one = train(block, block, x.to(testing.device()), target.to(testing.device()))
    return one, torch.load(folder / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """CPU ranks over gloo."""
    return testing.shared_gloo_runs(tmp_path_factory, "distributed-gloo", lambda folder: _runs(folder, "gloo"))


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory):
    """Ranks on two GPUs over NCCL."""
    return _runs(tmp_path_factory.mktemp("nccl"), "nccl")


def _check(one, distributed, how):
    for step, (expected, got) in enumerate(zip(one, distributed[how], strict=True)):
        assert got.keys() == expected.keys()
        for name, value in got.items():
            testing.assert_close(f"step {step} {name}", value.to(testing.device()), expected[name],
                                 torch.float32)


@pytest.mark.heavy
@pytest.mark.parametrize("how", WRAPPERS)
def test_matches_one_process(how, runs):
    _check(*runs, how)


@pytest.mark.skipif(not testing.gpu_ranks_available(WORLD), reason="NCCL ranks need two GPUs")
@pytest.mark.parametrize("how", WRAPPERS)
def test_matches_one_process_on_gpus(how, nccl_runs):
    _check(*nccl_runs, how)

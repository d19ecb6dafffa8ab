"""The context-parallel training recipe (e2e/train_context_parallel.py): a tiny transformers Llama
trained by 4 CPU processes (gloo, the Triton interpreter) as dp 2 x cp 2, FSDP2 over dp and fk's
ring over cp, and, where four GPUs are, by 4 GPU processes (NCCL), against the same model trained
in one process on the whole batch and the whole sequence with transformers' own attention (SDPA)
and shifted-label loss: every step's loss and every parameter's gradient (unsharded). SDPA, not
"fk", in the one process: an independent reference, and 10x cheaper than fk's kernels on the
interpreter (the 4 ranks and it share the CI's 2 cores)."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fk_runtime.harness import testing

transformers = pytest.importorskip("transformers")  # nox installs it (the "transformers" extra)

import fk_attention.hf  # noqa: E402  (ring_mask, fk_ring_attention_forward, context_parallel)

_spec = importlib.util.spec_from_file_location(
    "train_context_parallel", Path(__file__).resolve().parent.parent / "e2e" / "train_context_parallel.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)

DP, CP = 2, 2
WORLD = DP * CP
# One sequence per dp rank (the ranks' interpreted backward kernels are most of the test's time).
STEPS, BATCH, SEQ, LR = 2, 2, 32, 0.5
# Elementwise fp32 bounds: the ring merges the two halves of each row's softmax (and sums dK/dV
# over ranks) in another order than one call does; FSDP and the cp hook sum gradients in another order.
ATOL, RTOL = 1e-5, 1e-4
REFERENCE = "sdpa"


def config():  # one decoder layer: FSDP2 still shards it apart from the root (CI's time)
    return recipe.llama_config("tiny", num_hidden_layers=1)


def rank_main(rank: int, store: str, state: dict, result: str, backend: str) -> None:
    """One rank of the recipe's training; rank 0 saves the steps."""
    testing.init_rank(rank, WORLD, store, backend)
    steps = recipe.train(config(), DP, CP, STEPS, BATCH, SEQ, lr=LR, optimizer="sgd", state=state,
                         keep_grads=True)
    if rank == 0:
        torch.save([{name: t.cpu() for name, t in step.items()} for step in steps], result)
    dist.barrier()  # no rank leaves while another still finishes a collective with it
    dist.destroy_process_group()


def one_process(state: dict, device: torch.device) -> list[dict]:
    """The same training in one process: whole batch, whole sequence, transformers' loss."""
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=REFERENCE)
    model.load_state_dict(state)
    model = model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        ids = recipe.global_batch(step, BATCH, SEQ, config().vocab_size).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        steps.append({"loss": loss.detach().clone(),
                      **{name: p.grad.detach().clone() for name, p in model.named_parameters()}})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def _runs(folder, backend: str):
    """(the one-process steps, the recipe's steps) from one random init."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config())
    for p in model.parameters():  # random norm weights too (they start at 1)
        p.data.normal_(0.0, 0.3 if p.dim() == 1 else 0.1)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    ranks = testing.spawn_ranks(rank_main, WORLD, (str(folder / "store"), state, str(folder / "result.pt"),
                                                   backend), join=False, backend=backend)
    try:
        one = one_process(state, testing.device())
    finally:
        while not ranks.join():
            pass
    return one, torch.load(folder / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """CPU ranks over gloo."""
    return testing.shared_gloo_runs(tmp_path_factory, "context-parallel-recipe-gloo",
                                    lambda folder: _runs(folder, "gloo"))


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory):
    """Ranks on four GPUs over NCCL."""
    return _runs(tmp_path_factory.mktemp("cp-nccl"), "nccl")


def _check(one, distributed):
    assert len(distributed) == len(one) == STEPS
    for step, (expected, got) in enumerate(zip(one, distributed, strict=True)):
        assert got.keys() == expected.keys()
        for name, value in got.items():
            torch.testing.assert_close(value.to(expected[name].device), expected[name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, step=step, name=name: f"step {step} {name}: {m}")


@pytest.mark.heavy
def test_matches_one_process(runs):
    _check(*runs)


@pytest.mark.skipif(not testing.gpu_ranks_available(WORLD), reason="NCCL ranks need four GPUs")
def test_matches_one_process_on_gpus(nccl_runs):
    _check(*nccl_runs)


def test_refuses_what_the_ring_cannot_do():
    """Padding masks and a model's own mask functions, before any rank would send."""
    with pytest.raises(ValueError, match="no padding mask"):
        fk_attention.hf.ring_mask(attention_mask=torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="model-specific mask functions"):
        fk_attention.hf.ring_mask(use_vmap=True)
    assert fk_attention.hf.ring_mask(attention_mask=torch.ones(1, 4, dtype=torch.bool)) is None
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="does not support dropout, a padding mask"):
        fk_attention.hf.fk_ring_attention_forward(None, q, q, q, torch.ones(1, 4), dropout=0.1)
    with pytest.raises(ValueError, match="a KV cache"):
        fk_attention.hf.fk_ring_attention_forward(None, q, torch.zeros(1, 2, 8, 16), q, None)
    with pytest.raises(ValueError, match="layout must be one of"):
        fk_attention.hf.context_parallel(layout="striped")

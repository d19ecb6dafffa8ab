"""Training recipe: a transformers Llama with FSDP2 over the data-parallel ranks and fk's ring
attention over the context-parallel ranks.

The world is a 2-D device mesh (dp, cp). Every step's global batch (B, N) of token ids is the same
on every rank here (made from the seed; a real loader gives each dp rank its own rows): a rank
keeps its dp rank's B / dp rows and, of those, its cp rank's shard of the sequence (N / cp tokens
in fk's zigzag layout, `fk_attention.ring.shard_sequence`), with the tokens' global position ids
and next-token labels cut the same way: rotary embeddings and the shift to the next token are
those of the whole sequence. Attention is `attn_implementation=fk_attention.hf.context_parallel(
cp_group)`, ring attention over the cp ranks. Parameters are sharded over dp (`fully_shard` on
each decoder layer, then the root) and replicated over cp.

Loss: the mean token cross-entropy over the whole global batch. Each rank backpropagates its own
tokens' summed loss over the global token count (one all-reduce of the counts), so the ranks'
losses add up to the global mean and their gradients add up to its gradient; FSDP's
reduce-scatter sums over dp (its division by the dp size turned off) and a hook then sums each
reduced shard over cp (each cp rank's copy of a parameter saw other tokens). The gradients are
the one-process gradients of the same batch (tests/test_context_parallel_recipe.py checks them).

    # GPUs (NCCL; NVLink multicast off, as fk's distributed tests run it):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 4 e2e/train_context_parallel.py --dp 2 --cp 2
    # CPU (gloo, the Triton interpreter; a tiny model):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 4 e2e/train_context_parallel.py --dp 2 --cp 2

`--size tiny` (the CPU default: 2 layers of width 64, N = 32, fp32) or `--size 1b` (the GPU
default: a Llama-3.2-1B-like model, 16 layers of width 2048, N = 16384, bf16 compute with fp32
parameters and gradient reductions); `--seq`, `--batch`, `--steps` override. Prints each step's
loss (rank 0).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 under its old name
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

IGNORE = -100  # cross_entropy's ignore_index: the label of each sequence's last token
# Model sizes: LlamaConfig arguments, and the run's sequence length, global batch (per dp rank) and dtype.
SIZES = {
    "tiny": dict(config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                 seq=32, batch_per_dp=2, dtype=torch.float32),
    "1b": dict(config=dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=64),
               seq=16384, batch_per_dp=1, dtype=torch.bfloat16),
}


def llama_config(size: str = "tiny", **overrides):
    import transformers

    # No dropout (fk has none) and no cache (training); the rest as the size gives it.
    return transformers.LlamaConfig(**{**SIZES[size]["config"], "attention_dropout": 0.0, "use_cache": False,
                                       **overrides})


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Step `step`'s (batch, seq) token ids, the same on every rank (a CPU generator of its own)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(vocab, (batch, seq), generator=generator)


def local_batch(ids: torch.Tensor, dp_rank: int, dp: int, cp_group, layout: str = "zigzag"):
    """This rank's (input ids, position ids, labels): its dp rows, their cp shard of the sequence."""
    from fk_attention.ring import shard_sequence

    ids = ids.chunk(dp)[dp_rank]
    # Labels are shifted on the whole sequence, before sharding: a shard's next token may be on another rank.
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)), 1)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return tuple(shard_sequence(t, 1, cp_group, layout) for t in (ids, positions, labels))


def shard_model(model, mesh, mp_policy=None):
    """FSDP2 over mesh["dp"] (each decoder layer, then the root), gradients summed over the dp and
    the cp ranks (the loss is already divided by the global token count)."""
    cp_group = mesh.get_group("cp")
    kwargs = {"mesh": mesh["dp"]} if mp_policy is None else {"mesh": mesh["dp"], "mp_policy": mp_policy}
    modules = [*model.model.layers, model]
    for module in modules:
        fully_shard(module, **kwargs)
    for module in modules:
        module.set_gradient_divide_factor(1.0)  # a sum over dp, not FSDP's mean
        module.set_force_sum_reduction_for_comms(True)  # (a plain SUM: gloo has no PREMUL_SUM)
        if mesh["cp"].size() > 1:  # the reduced shard of a layer's gradients, summed over the cp ranks
            module.set_all_reduce_hook(lambda grad: dist.all_reduce(grad, group=cp_group))
    return model


def train(config, dp: int, cp: int, steps: int, batch: int, seq: int, lr: float = 1e-3, optimizer: str = "adamw",
          seed: int = 0, state: dict | None = None, dtype: torch.dtype = torch.float32, layout: str = "zigzag",
          keep_grads: bool = False, log=None) -> list[dict]:
    """`steps` optimizer steps over the initialized world (dp * cp ranks; NCCL on GPUs, gloo on
    CPUs). The model starts from `state` (a full state dict, the same on every rank) or from
    `seed`. Returns per step {"loss": the global batch's mean token loss} and, with keep_grads,
    every parameter's whole gradient by name (gathered from the dp shards: every rank must ask)."""
    import transformers

    import fk_attention.hf

    if dp * cp != dist.get_world_size():
        raise ValueError(f"dp * cp must be the world size {dist.get_world_size()}, got {dp} * {cp}")
    if batch % dp:
        raise ValueError(f"the global batch {batch} must divide over the {dp} dp ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group, dp_rank = mesh.get_group("cp"), mesh.get_local_rank("dp")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(
        config, attn_implementation=fk_attention.hf.context_parallel(cp_group, layout))
    if state is not None:
        model.load_state_dict(state)
    model = model.to(device).train()
    # Compute in `dtype`, parameters and gradient reductions in fp32.
    mp_policy = None if dtype == torch.float32 else MixedPrecisionPolicy(param_dtype=dtype,
                                                                         reduce_dtype=torch.float32)
    shard_model(model, mesh, mp_policy)
    make = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt = make(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        ids, positions, labels = (t.to(device) for t in local_batch(
            global_batch(step, batch, seq, config.vocab_size, seed), dp_rank, dp, cp_group, layout))
        count = (labels != IGNORE).sum()
        dist.all_reduce(count)  # the global batch's token count (each rank sees only its tokens)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        token_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
        loss = token_sum / count
        loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # the ranks' parts add up to the global mean
        record = {"loss": loss}
        if keep_grads:
            record.update({name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                           for name, p in model.named_parameters()})
        history.append(record)
        if log is not None:
            log(step, loss.item())
        opt.step()
        opt.zero_grad()
    return history


def main(argv=None) -> None:
    from fk_runtime import backend

    backend.use_interpreter_without_gpu()  # before fk's ops define their kernels
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, required=True, help="data-parallel ranks (FSDP2)")
    parser.add_argument("--cp", type=int, required=True, help="context-parallel ranks (fk's ring)")
    parser.add_argument("--size", choices=SIZES, default=None, help="tiny on CPUs, 1b on GPUs by default")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (divisible by 2 * cp)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step, over all dp ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gpu = not backend.is_interpreter()
    size = args.size or ("1b" if gpu else "tiny")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    if not gpu:
        torch.set_num_threads(1)  # the CPU ranks share the machine's cores
    try:
        spec = SIZES[size]
        log = (lambda step, loss: print(f"step {step}: loss {loss:.6f}", flush=True)) if dist.get_rank() == 0 else None
        train(llama_config(size), args.dp, args.cp, args.steps, args.batch or spec["batch_per_dp"] * args.dp,
              args.seq or spec["seq"], args.lr, args.optimizer, args.seed, dtype=spec["dtype"], log=log)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

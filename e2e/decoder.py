"""End to end: a Llama-style decoder on fk's ops against the same model on torch's.

What a model built on fk costs in use, host work and all. One decoder class and one parameter set
run either with fk's RMSNorm and attention (`fk_layernorm.rms_norm`, `fk_attention.attention`) or
with torch's (`F.rms_norm`, `F.scaled_dot_product_attention(is_causal=..., enable_gqa=True)` on
its default backend); embedding, projections, MLP, LM head and loss are the same torch code in
both. Timed eagerly, each step between two synchronizations, fk's and torch's steps interleaved:

- a training step (zero_grad, forward, cross-entropy, backward, AdamW step; fused on a GPU) at
  (B, N) = (8, 2048) and (4, 4096), width 1024 and 2048, bf16 parameters;
- a one-token decode forward against a KV cache of 4096 tokens (the new token's keys written
  into a preallocated cache, attention over all 4097, no mask), batch 1 and 16, both widths.

Model: 4 layers of RMSNorm -> fused qkv projection -> causal GQA attention (head dim 128, width /
128 heads, a quarter as many kv heads; the (B, N, H, D) projection views transposed, not copied)
-> output projection -> residual, then RMSNorm -> SwiGLU MLP (hidden 8/3 of the width rounded up
to a multiple of 256) -> residual; a final RMSNorm, an LM head over 8192 tokens and cross-entropy
on random tokens. No positional encoding: rotary would be the same torch code on both sides.
Before timing, both sides' loss and every parameter's gradient (training) and logits (decode)
on the same weights and tokens are compared; a gap past bf16 rounding stops the run.

    python e2e/decoder.py [--small] [--out benchmarks]
    bash shared/from-source.sh python e2e/decoder.py      # a GPU box without network

Writes `<out>/decoder.{json,md}` and rebuilds BENCHMARKS.md as the main job does (beside an `<out>`
named benchmarks, else inside it). `--small`: 2 layers of width 256, B = 1, N = 64, fp32 on the interpreter (a CPU check that
it runs; its numbers mean nothing). Reported: ms per step and torch's ms over fk's (above 1: the
model on fk's ops is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import shlex
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from fk_runtime import backend

SEED = 0
HEAD_DIM = 128
# Query heads per kv head.
KV_GROUP = 4
MLP_MULTIPLE = 256
RMS_EPS = 1e-6
INIT_STD = 0.02
LR = 1e-4
# Worst relative gap ||fk - torch|| / ||torch|| allowed between the two sides, by parameter dtype:
# well past rounding (bf16 rounds each output to 2^-9 relative; the gaps compound over layers)
# and well below what a wrong kernel gives (order 1).
TOLERANCE = {torch.bfloat16: 0.1, torch.float32: 1e-3}
OUT_NAME = "decoder"


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    vocab: int
    widths: tuple[int, ...]
    train_shapes: tuple[tuple[int, int], ...]
    decode_batches: tuple[int, ...]
    kv_length: int
    dtype: torch.dtype
    warmup: int
    steps: int
    decode_steps: int


FULL = Sizes(layers=4, vocab=8192, widths=(1024, 2048), train_shapes=((8, 2048), (4, 4096)),
             decode_batches=(1, 16), kv_length=4096, dtype=torch.bfloat16, warmup=3, steps=10,
             decode_steps=30)


def small_sizes() -> Sizes:
    # The interpreter: one timed step a side, no warm-up (its times mean nothing; CI's 2 cores run it).
    interpreted = backend.is_interpreter()
    return Sizes(layers=2, vocab=512, widths=(256,), train_shapes=((1, 64),), decode_batches=(1,),
                 kv_length=64, dtype=torch.float32 if interpreted else torch.bfloat16, warmup=0 if interpreted else 1,
                 steps=1 if interpreted else 2, decode_steps=1 if interpreted else 2)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The two functions the sides differ in: RMSNorm (x, weight) and attention (q, k, v, causal)
    with q (B, H, N, D) and k, v (B, H / KV_GROUP, N', D)."""

    name: str
    rms_norm: Callable
    attention: Callable


def fk_ops() -> Ops:
    from fk_attention import attention
    from fk_layernorm import rms_norm

    return Ops("fk", lambda x, w: rms_norm(x, w, RMS_EPS),
               lambda q, k, v, causal: attention(q, k, v, causal=causal))


def torch_ops() -> Ops:
    return Ops("torch", lambda x, w: F.rms_norm(x, x.shape[-1:], w, RMS_EPS),
               lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                      enable_gqa=True))


class KVCache:
    """One layer's keys and values, (B, Hk, length + 1, D): `length` cached tokens and the slot
    every decode step writes its token into (the same slot each step, so that steps are alike)."""

    def __init__(self, batch, kv_heads, length, dtype, device):
        shape = (batch, kv_heads, length + 1, HEAD_DIM)
        self.k = torch.randn(shape, dtype=dtype, device=device)
        self.v = torch.randn(shape, dtype=dtype, device=device)
        self.length = length

    def append(self, k, v):
        n = k.shape[2]
        self.k[:, :, self.length:self.length + n].copy_(k)
        self.v[:, :, self.length:self.length + n].copy_(v)
        return self.k[:, :, :self.length + n], self.v[:, :, :self.length + n]


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.heads = width // HEAD_DIM
        self.kv_heads = max(1, self.heads // KV_GROUP)
        hidden = MLP_MULTIPLE * math.ceil(8 * width / 3 / MLP_MULTIPLE)
        self.attn_norm = torch.nn.Parameter(torch.ones(width))
        self.qkv = torch.nn.Linear(width, (self.heads + 2 * self.kv_heads) * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(self.heads * HEAD_DIM, width, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(width))
        self.gate_up = torch.nn.Linear(width, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x, ops: Ops, cache: KVCache | None = None):
        b, n, _ = x.shape
        q, k, v = self.qkv(ops.rms_norm(x, self.attn_norm)).split(
            [self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], -1)
        # (B, N, H, D) views seen as (B, H, N, D): no copies.
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        # A decoded token sees every cached key: no mask (causal would align it with the first).
        attended = ops.attention(q, k, v, cache is None)
        x = x + self.out(attended.transpose(1, 2).reshape(b, n, -1))
        gate, up = self.gate_up(ops.rms_norm(x, self.mlp_norm)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, width: int, sizes: Sizes):
        super().__init__()
        self.embed = torch.nn.Embedding(sizes.vocab, width)
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(sizes.layers))
        self.norm = torch.nn.Parameter(torch.ones(width))
        self.head = torch.nn.Linear(width, sizes.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                torch.nn.init.normal_(module.weight, std=INIT_STD)

    def forward(self, tokens, ops: Ops, caches: list[KVCache] | None = None):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, ops, None if caches is None else caches[i])
        return self.head(ops.rms_norm(x, self.norm))


def build(width: int, sizes: Sizes) -> Decoder:
    torch.manual_seed(SEED)
    with torch.device(backend.default_device()):
        return Decoder(width, sizes).to(sizes.dtype)


def loss_of(model, tokens, targets, ops: Ops):
    return F.cross_entropy(model(tokens, ops).flatten(0, 1).float(), targets.flatten())


def train_step(model, opt, tokens, targets, ops: Ops) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of(model, tokens, targets, ops).backward()
    opt.step()


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def time_steps(steps: dict[str, Callable[[], object]], warmup: int, count: int) -> dict[str, float]:
    """Median ms of each step, every step between two synchronizations, the sides interleaved so
    that a slow stretch of the machine weighs on both alike (`fk_runtime.harness.bench`'s timer)."""
    from fk_runtime.harness import bench

    return {name: s * 1e3 for name, s in bench.interleaved_seconds(steps, warmup, 1, count).items()}


def _check(what: str, gap: float, dtype: torch.dtype) -> None:
    bound = TOLERANCE[dtype]
    print(f"  check {what}: relative gap fk vs torch {gap:.2e} (bound {bound:.0e})")
    if not gap <= bound:
        raise SystemExit(f"decoder: fk's and torch's {what} differ by {gap:.3g} (bound {bound:g}): "
                         "the timings would compare different computations")


def _free() -> None:
    gc.collect()
    if not backend.is_interpreter():
        torch.cuda.empty_cache()


def bench_training(width: int, batch: int, length: int, sizes: Sizes, sides: list[Ops]) -> dict:
    model = build(width, sizes)
    dev = backend.default_device()
    tokens = torch.randint(sizes.vocab, (batch, length), device=dev)
    targets = torch.randint(sizes.vocab, (batch, length), device=dev)
    # Same weights, same tokens: loss and every gradient, each side, before any step.
    losses, grads = {}, {}
    for ops in sides:
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens, targets, ops)
        loss.backward()
        losses[ops.name] = loss.item()
        grads[ops.name] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fk, ref = (o.name for o in sides)
    loss_gap = abs(losses[fk] - losses[ref]) / abs(losses[ref])
    grad_gap = max(rel_gap(a, b) for a, b in zip(grads[fk], grads[ref], strict=True))
    del grads
    _check(f"loss ({losses[fk]:.4f} vs {losses[ref]:.4f})", loss_gap, sizes.dtype)
    _check("gradients (worst parameter)", grad_gap, sizes.dtype)

    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=not backend.is_interpreter())
    ms = time_steps({o.name: functools.partial(train_step, model, opt, tokens, targets, o) for o in sides},
                    sizes.warmup, sizes.steps)
    params = sum(p.numel() for p in model.parameters())
    del model, opt
    _free()
    return dict(width=width, batch=batch, tokens=length, layers=sizes.layers, params=params,
                fk_ms=ms[fk], torch_ms=ms[ref], speedup=ms[ref] / ms[fk], loss_fk=losses[fk],
                loss_torch=losses[ref], loss_gap=loss_gap, grad_gap=grad_gap)


@torch.no_grad()
def bench_decode(width: int, batch: int, sizes: Sizes, sides: list[Ops]) -> dict:
    model = build(width, sizes)
    layer = model.layers[0]
    dev = backend.default_device()
    caches = [KVCache(batch, layer.kv_heads, sizes.kv_length, sizes.dtype, dev) for _ in model.layers]
    token = torch.randint(sizes.vocab, (batch, 1), device=dev)
    logits = {o.name: model(token, o, caches) for o in sides}
    fk, ref = (o.name for o in sides)
    gap = rel_gap(logits[fk], logits[ref])
    _check("decode logits", gap, sizes.dtype)
    ms = time_steps({o.name: functools.partial(model, token, o, caches) for o in sides},
                    sizes.warmup, sizes.decode_steps)
    del model, caches
    _free()
    return dict(width=width, batch=batch, kv_length=sizes.kv_length, layers=sizes.layers,
                fk_ms=ms[fk], torch_ms=ms[ref], speedup=ms[ref] / ms[fk], logits_gap=gap)


def markdown(train: list[dict], decode: list[dict], sizes: Sizes, meta: dict) -> str:
    dtype = str(sizes.dtype).removeprefix("torch.")
    lines = [
        "## decoder (end to end)",
        "",
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. A "
        f"Llama-style decoder of {sizes.layers} layers ({dtype} parameters, head dim {HEAD_DIM}, "
        f"1/{KV_GROUP} as many kv heads as query heads, SwiGLU MLP, vocabulary {sizes.vocab}, "
        "cross-entropy on random tokens, no positional encoding), one parameter set run on fk's "
        "RMSNorm and "
        "attention or on torch's (`F.rms_norm`, SDPA with its default backend); everything else is "
        "the same torch code. Eager, each step between two synchronizations, median of "
        f"{sizes.steps} training steps (zero_grad, forward, backward, AdamW) and {sizes.decode_steps} "
        f"decode steps (one new token per sequence against {sizes.kv_length} cached ones) after "
        f"{sizes.warmup} warm-up step(s) each, the two sides interleaved. `torch ÷ fk`: torch's time over "
        "fk's (above 1: the model on fk's ops is faster). Gaps: ||fk - torch|| / ||torch|| on the "
        "same weights and tokens (gradients: the worst parameter).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "### Training step",
        "",
        "| width | B × N | params (M) | fk ms | torch ms | torch ÷ fk | loss gap | gradient gap |",
        "|" + " --- |" * 8,
    ]
    for r in train:
        lines.append(f"| {r['width']} | {r['batch']} × {r['tokens']} | {r['params'] / 1e6:.0f} | "
                     f"{r['fk_ms']:.2f} | {r['torch_ms']:.2f} | {r['speedup']:.3f}× | "
                     f"{r['loss_gap']:.1e} | {r['grad_gap']:.1e} |")
    lines += [
        "",
        f"### Decode (one token, {sizes.kv_length} cached)",
        "",
        "| width | batch | fk ms | torch ms | torch ÷ fk | logits gap |",
        "|" + " --- |" * 6,
    ]
    for r in decode:
        lines.append(f"| {r['width']} | {r['batch']} | {r['fk_ms']:.3f} | {r['torch_ms']:.3f} | "
                     f"{r['speedup']:.3f}× | {r['logits_gap']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python e2e/decoder.py", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model and inputs (a CPU check)")
    parser.add_argument("--out", default=None,
                        help="folder for results (default: benchmarks; on the interpreter a temporary folder)")
    args = parser.parse_args(argv)

    backend.use_interpreter_without_gpu()  # before fk's ops define their kernels
    from fk_runtime.harness import bench, cli

    sizes = small_sizes() if args.small or backend.is_interpreter() else FULL
    sides = [fk_ops(), torch_ops()]
    out = cli.resolve_out(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = bench.environment()
    meta["command"] = "python e2e/decoder.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"decoder: {backend.device_name()}, {sizes.layers} layers, {sizes.dtype}")

    train, decode = [], []
    for width in sizes.widths:
        for batch, length in sizes.train_shapes:
            print(f"train width {width}, B {batch}, N {length}")
            train.append(bench_training(width, batch, length, sizes, sides))
            r = train[-1]
            print(f"  fk {r['fk_ms']:.2f} ms, torch {r['torch_ms']:.2f} ms: torch / fk {r['speedup']:.3f}")
    for width in sizes.widths:
        for batch in sizes.decode_batches:
            print(f"decode width {width}, batch {batch}, {sizes.kv_length} cached")
            decode.append(bench_decode(width, batch, sizes, sides))
            r = decode[-1]
            print(f"  fk {r['fk_ms']:.3f} ms, torch {r['torch_ms']:.3f} ms: torch / fk {r['speedup']:.3f}")

    sizes_meta = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(sizes).items()}
    payload = dict(meta=meta, sizes=sizes_meta, head_dim=HEAD_DIM, kv_group=KV_GROUP, train=train,
                   decode=decode)
    (out / f"{OUT_NAME}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{OUT_NAME}.md").write_text(markdown(train, decode, sizes, meta))
    print(f"\nwrote {out / OUT_NAME}.{{json,md}} and {cli.rebuild_benchmarks_md(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Ring attention's scaling: fwd+bwd over n GPUs against fk attention on one GPU at the same total N.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m torch.distributed.run --nproc-per-node 2 -m fk_attention.ring_bench --out ring.json

Each rank takes one GPU (LOCAL_RANK) and NCCL; rank 0 first times `attention` on the whole
sequence alone (T(1)), then every rank times `ring_attention` on its zigzag shard (T(n), the
slowest rank's median). Printed and written to --out (JSON, rank 0): T(1), T(n) and the scaling
efficiency T(1) / (n T(n)); with the check on (default), also the relative errors of the gathered
ring output and gradients against the one-GPU run on the same inputs. `--benchmarks benchmarks`
also keeps the result as `benchmarks/ring-<n>.json`, writes the `ring` section (`ring.md`, a row per
`ring-*.json` there) and rebuilds BENCHMARKS.md as the main job does (beside a folder named
`benchmarks`, else inside it). NVLink multicast stays off
(the two variables above; set here too when unset). Without a GPU it runs on gloo and the Triton
interpreter: a smoke test at tiny sizes (TRITON_INTERPRET=1 in the environment, e.g.
--seqlen 64 --heads 2 --head-dim 16 --dtype float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fk_runtime.harness import testing
from fk_runtime.harness.bench import environment

from .ops import attention
from .ring import gather_sequence, ring_attention, shard_sequence

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m fk_attention.ring_bench",
        description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072,
                        help="total tokens over all ranks (default 131072)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--no-causal", dest="causal", action="store_false",
                        help="full attention (default causal)")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="timed iterations; the median counts (default 5)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip comparing the ring's output and gradients with the one-GPU run")
    parser.add_argument("--out", type=Path, default=Path("ring_bench.json"), help="JSON written by rank 0")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also profile one ring fwd+bwd and print each rank's K costliest GPU kernels "
                             "(CPU ops without a GPU)")
    parser.add_argument("--benchmarks", type=Path, default=None,
                        help="also keep the result in this folder's ring section and rebuild BENCHMARKS.md "
                             "(beside a folder named benchmarks, else inside it)")
    args = parser.parse_args(argv)
    for name in ("seqlen", "batch", "heads", "head_dim", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.profile < 0:
        parser.error("--profile must be at least 0 (0: no profile)")
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    return args


COMMAND = ("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 bash shared/from-source.sh python -m "
           "torch.distributed.run --nproc-per-node N -m fk_attention.ring_bench --benchmarks benchmarks")


def section(results: list[dict]) -> str:
    """The `ring` section of BENCHMARKS.md: a row per kept result, fewest GPUs first."""
    lines = [
        "## ring", "",
        "Ring attention (`fk_attention.ring_attention`) over n GPUs, NCCL with NVLink multicast off: forward and "
        "backward of one sequence split into zigzag shards, against fk `attention` on one GPU running the whole "
        "sequence. T(1), T(n): medians of CUDA-event times per fwd+bwd (T(n): the slowest rank's); scaling "
        "efficiency T(1) / (n T(n)). Errors: relative norms of the gathered ring output and gradients against "
        "the one-GPU run on the same inputs.", "",
        f"Command: `{COMMAND}`", "",
        "| GPUs | device | N | B | H q/kv | d | dtype | mask | T(1) ms | T(n) ms | efficiency | out / dq / dk / dv error "
        "| torch | triton | date |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(results, key=lambda r: (r["world"], r["seqlen"])):
        errors = " / ".join(f"{e:.1e}" for e in r["rel_errors"].values()) if r.get("rel_errors") else "not checked"
        lines.append(
            f"| {r['world']} | {r['device']} | {r['seqlen']} | {r['batch']} | {r['heads']}/{r['kv_heads']} | "
            f"{r['head_dim']} | {r['dtype']} | {'causal' if r['causal'] else 'full'} {r['layout']} | "
            f"{r['t1_ms']:.1f} | {r['tn_ms']:.1f} | {r['efficiency']:.3f} | {errors} | {r['torch']} | "
            f"{r['triton']} | {r['date']} |")
    return "\n".join(lines) + "\n"


def write_section(folder: Path) -> Path:
    """folder/ring.md from every folder/ring-*.json; BENCHMARKS.md rebuilt as the main job does."""
    from fk_runtime.harness import cli

    results = [json.loads(p.read_text()) for p in sorted(folder.glob("ring-*.json"))]
    (folder / "ring.md").write_text(section(results))
    return cli.rebuild_benchmarks_md(folder)


def _elapsed_ms(step) -> float:
    """One call of `step` in milliseconds: CUDA events on a GPU, the wall clock on the CPU."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _median_ms(step, warmup: int, reps: int, group=None) -> float:
    """Median milliseconds of `step` after `warmup` calls; with a `group`, each call starts on
    all its ranks together and the slowest rank's median counts."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        samples.append(_elapsed_ms(step))
    median = torch.tensor(statistics.median(samples), dtype=torch.float64,
                          device="cuda" if torch.cuda.is_available() else "cpu")
    if group is not None:
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return median.item()


def _fwd_bwd(fn, q, k, v, grad_out):
    """One forward and backward of `fn`: (out, dq, dk, dv)."""
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def _profile(step, top: int, rank: int, world: int) -> None:
    """Each rank in turn prints the `top` kernels of one call of `step` by their summed device time,
    with the call's wall time beside the time its kernels ran (compute and communication overlap)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        wall = _elapsed_ms(step)
    table = prof.key_averages().table(sort_by="self_device_time_total" if torch.cuda.is_available()
                                      else "self_cpu_time_total", row_limit=top)
    for turn in range(world):
        if turn == rank:
            print(f"rank {rank}: one ring fwd+bwd, {wall:.2f} ms\n{table}", flush=True)
        dist.barrier()


def main(argv=None) -> dict:
    args = parse_args(argv)
    for name, value in testing.NCCL_ENV.items():  # read when NCCL starts
        os.environ.setdefault(name, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)  # every rank draws the same full sequence, then keeps its shard
    b, n, d = args.batch, args.seqlen, args.head_dim
    q_shape, kv_shape = (b, args.heads, n, d), (b, args.kv_heads, n, d)
    full = [torch.randn(s, device=device, dtype=dtype) for s in (q_shape, kv_shape, kv_shape, q_shape)]
    single = None
    if rank == 0:
        q, k, v, grad_out = (t.clone().requires_grad_(i < 3) for i, t in enumerate(full))
        one_gpu = lambda q, k, v: attention(q, k, v, causal=args.causal)  # noqa: E731
        t1 = _median_ms(lambda: _fwd_bwd(one_gpu, q, k, v, grad_out), args.warmup, args.reps)
        single = _fwd_bwd(one_gpu, q, k, v, grad_out) if args.check else None
        del q, k, v, grad_out
    dist.barrier()
    q, k, v, grad_out = (shard_sequence(t, 2, layout=args.layout).clone().requires_grad_(i < 3)
                         for i, t in enumerate(full))
    del full

    def ring(q, k, v):
        return ring_attention(q, k, v, causal=args.causal, layout=args.layout)

    tn = _median_ms(lambda: _fwd_bwd(ring, q, k, v, grad_out), args.warmup, args.reps, dist.group.WORLD)
    if args.profile:
        _profile(lambda: _fwd_bwd(ring, q, k, v, grad_out), args.profile, rank, world)
    errors = None
    if args.check:
        gathered = [gather_sequence(t, 2, layout=args.layout) for t in _fwd_bwd(ring, q, k, v, grad_out)]
        if rank == 0:
            errors = {name: testing.rel_error(got, ref) for name, got, ref in
                      zip(("out", "dq", "dk", "dv"), gathered, single, strict=True)}
    result = None
    if rank == 0:
        result = dict(
            seqlen=n, world=world, batch=b, heads=args.heads, kv_heads=args.kv_heads, head_dim=d,
            dtype=args.dtype, causal=args.causal, layout=args.layout, reps=args.reps, t1_ms=t1, tn_ms=tn,
            efficiency=t1 / (world * tn), rel_errors=errors,
            env={name: os.environ.get(name) for name in testing.NCCL_ENV}, **environment(),
        )
        mask = "causal" if args.causal else "full"
        print(f"ring attention fwd+bwd, N={n} B={b} H={args.heads}/{args.kv_heads} D={d} {args.dtype} {mask} "
              f"{args.layout}: T(1) {t1:.2f} ms, T({world}) {tn:.2f} ms, "
              f"efficiency T(1)/({world} T({world})) {result['efficiency']:.3f}")
        if errors:
            print("relative errors against one GPU: " + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        if args.benchmarks is not None:
            args.benchmarks.mkdir(parents=True, exist_ok=True)
            (args.benchmarks / f"ring-{world}.json").write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {write_section(args.benchmarks)}")
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

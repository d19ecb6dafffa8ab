"""What an eager fwd+bwd costs the host on a GPU box, fk beside torch's op and beside the floor of any Python
`autograd.Function` (a no-op one: its forward and backward only allocate), with autograd's device threads (how a
user runs it) and with the backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`:
what is left without the hand-over to the engine's thread). BENCHMARKS.md: The floor of a recorded call;
shared/TUNING.md: Recorded calls straight to the autograd.Function.

Calls (bf16, tiny device times): attention B1 H8 N128 d64 causal (SDPA's default beside fk), rms_norm 4 x 4096
(torch's beside fk), made as the host section makes them (`bench.host_call`); 30 warm-up calls, then 7
interleaved samples of 200 calls back to back and one synchronization (`bench.interleaved_samples`); µs a call,
the median and the fastest sample. `--profile` adds cProfile of fk's fwd+bwd on the calling thread (all of fk's
Python, with the profiler's own overhead).

    bash shared/from-source.sh python e2e/host_floor.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys

import torch
import torch.nn.functional as F

from fk_runtime.harness import bench

CALLS, SAMPLES = bench.HOST_CALLS_GPU, bench.HOST_REPEATS_GPU  # the host section's samples
WARMUP = 30


class Noop(torch.autograd.Function):
    """The floor: a recorded forward and a backward that only allocate their results."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


def one_thread(fn):
    """fn() with the backward on this thread (autograd's device threads off)."""
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return call


def calls() -> dict:
    """{(row, mode): call}: each op's host calls as the host section makes them (`bench.host_call`), and fwd+bwd
    on one thread."""
    from fk_attention import attention
    from fk_layernorm import rms_norm

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    qkv = [randn(1, 8, 128, 64) for _ in range(3)]
    xw = [randn(4, 4096), randn(4096)]
    ops = {
        "attention torch": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv),
        "attention fk": (lambda q, k, v: attention(q, k, v, causal=True), qkv),
        "rms_norm torch": (lambda x, w: F.rms_norm(x, (4096,), w), xw),
        "rms_norm fk": (rms_norm, xw),
        "no-op Function": (Noop.apply, qkv),
    }
    found = {}
    for name, (fn, inputs) in ops.items():
        found[(name, "fwd")] = bench.host_call(fn, inputs, "fwd")
        found[(name, "fwd+bwd")] = bench.host_call(fn, inputs, "fwd+bwd")
        found[(name, "fwd+bwd, one thread")] = one_thread(found[(name, "fwd+bwd")])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_floor.py times CUDA calls: run it on a GPU machine")
    found = calls()
    samples = {key: [t * 1e6 for t in times]
               for key, times in bench.interleaved_samples(found, WARMUP, CALLS, SAMPLES).items()}
    env = bench.environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}: µs a call, median (fastest) "
          f"of {SAMPLES} samples of {CALLS}\n")
    modes = ("fwd", "fwd+bwd", "fwd+bwd, one thread")
    print("| call | " + " | ".join(modes) + " |\n| --- |" + " --- |" * len(modes))
    for name in dict.fromkeys(key[0] for key in found):
        cells = [f"{statistics.median(samples[(name, m)]):.1f} ({min(samples[(name, m)]):.1f})" for m in modes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.profile:
        for name in ("attention fk", "rms_norm fk"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(CALLS):
                found[(name, "fwd+bwd, one thread")]()
            torch.cuda.synchronize()
            profile.disable()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(30)
            print(f"\n{name} fwd+bwd on one thread, cProfile, {CALLS} calls\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What an eager fwd+bwd costs the host on a GPU box, fk beside torch's op and beside the floor of any Python
`autograd.Function` (a no-op one: its forward and backward only allocate), with autograd's device threads (how a
user runs it) and with the backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`:
what is left without the hand-over to the engine's thread). shared/TUNING.md: The floor of a recorded call.

Calls (bf16, tiny device times): attention B1 H8 N128 d64 causal (SDPA's default beside fk), rms_norm 4 x 4096
(torch's beside fk); 30 warm-up calls, then 7 interleaved samples of 200 calls back to back and one
synchronization; µs a call, the median and the fastest sample. `--profile` adds cProfile of fk's fwd+bwd on the
calling thread (all of fk's Python, with the profiler's own overhead).

    bash shared/from-source.sh python e2e/host_floor.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

CALLS = 200
SAMPLES = 7
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


def with_backward(fn, leaves, grad):
    """fn() and autograd.grad of its result (as the host section's `fwd+bwd`)."""
    return lambda: torch.autograd.grad(fn(), leaves, grad)


def calls() -> dict:
    from fk_attention import attention
    from fk_layernorm import rms_norm

    def randn(*shape, grad=True):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=grad)

    q, k, v = (randn(1, 8, 128, 64) for _ in range(3))
    g = randn(1, 8, 128, 64, grad=False)
    x, w, gx = randn(4, 4096), randn(4096), randn(4, 4096, grad=False)
    pairs = {
        "attention": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda: attention(q, k, v, causal=True), (q, k, v), g),
        "rms_norm": (lambda: F.rms_norm(x, (4096,), w), lambda: rms_norm(x, w), (x, w), gx),
        "no-op Function": (None, lambda: Noop.apply(q, k, v), (q, k, v), g),
    }
    found = {}
    for op, (torch_fn, fk_fn, leaves, grad) in pairs.items():
        for who, fn in (("torch", torch_fn), ("fk", fk_fn)):
            if fn is None:
                continue
            name = f"{op} {who}" if op != "no-op Function" else op
            both = with_backward(fn, leaves, grad)
            found[(name, "fwd")] = fn
            found[(name, "fwd+bwd")] = both
            found[(name, "fwd+bwd, one thread")] = one_thread(both)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_floor.py times CUDA calls: run it on a GPU machine")
    found = calls()
    for fn in found.values():
        for _ in range(WARMUP):
            fn()
    from fk_runtime import ahead
    ahead.finish()
    samples = {key: [] for key in found}
    for _ in range(SAMPLES):
        for key, fn in found.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(CALLS):
                fn()
            torch.cuda.synchronize()
            samples[key].append((time.perf_counter() - began) / CALLS * 1e6)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}: µs a call, median (fastest) of {SAMPLES} samples of {CALLS}\n")
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

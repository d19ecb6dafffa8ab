"""Host time per eager call of fk's TMA launch paths under variants of plan numbers, beside torch's own op, in one
process: what `launch.DESCRIPTOR_CACHE` and the Gluon decode kernel cost the host (shared/TUNING.md).

Calls (bf16, under `torch.no_grad()`, tiny device times): decode B1 KV8192 H32:8 d64 (the Gluon decode kernel and
its merge on Hopper), decode B1 KV1024 H32:8 d128 (the tl kernel through TMA), attention B1 H8 N128 d64 causal
(the Gluon forward), attention_varlen 3 x 128 H8 d128 causal (the Gluon forward on packed sequences; torch's op:
SDPA on the 384 tokens as one sequence). Each variant (`base`: the code as it is; a variant sets module constants as
`e2e/row_variants.py`'s do, plans cleared) and torch's op: 20 warm-up calls, then `--samples` samples of 200
calls back to back and one synchronization, variants interleaved; medians in µs a call and over torch's. The
CUDA kernels each variant launched (torch.profiler, one call) are printed first. Samples are
`fk_runtime.harness.bench.interleaved_seconds`'s, one a variant at a time (a variant switch binds plans again).

    bash shared/from-source.sh python e2e/host_variants.py --variant nocache "fk_runtime.launch:DESCRIPTOR_CACHE=0" \\
        --variant tl "fk_attention.config:GLUON_DECODE_TILES=()"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from row_variants import applied, patches  # noqa: E402

CALLS = 200
WARMUP = 20


def _kernels(fn) -> list[str]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:32] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def _calls():
    """(name, fk's call, torch's call) of each case."""
    import torch
    import torch.nn.functional as F

    from fk_attention import attention, attention_varlen, attention_with_kvcache

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    for b, hq, hk, n, d in ((1, 32, 8, 8192, 64), (1, 32, 8, 1024, 128)):
        q, k, v = randn(b, hq, 1, d), randn(b, hk, n, d), randn(b, hk, n, d)
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        yield (f"decode B{b} KV{n} H{hq}:{hk} d{d}",
               lambda q=q, k=k, v=v, s=seqlens: attention_with_kvcache(q, k, v, s, causal=True),
               lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    q, k, v = randn(1, 8, 128, 64), randn(1, 8, 128, 64), randn(1, 8, 128, 64)
    yield ("attention B1 H8 N128 d64 causal", lambda: attention(q, k, v, causal=True),
           lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # torch has no packed call: its peer is SDPA on the three sequences as one (1, 8, 384, 128) sequence
    pq, pk, pv = randn(384, 8, 128), randn(384, 8, 128), randn(384, 8, 128)
    cu = torch.tensor([0, 128, 256, 384], dtype=torch.int32, device="cuda")
    dq, dk, dv = (t.transpose(0, 1).unsqueeze(0) for t in (pq, pk, pv))
    yield ("attention_varlen 3x128 H8 d128 causal",
           lambda: attention_varlen(pq, pk, pv, cu, cu, 128, 128, causal=True),
           lambda: F.scaled_dot_product_attention(dq, dk, dv, is_causal=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "PATCHES"))
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args(argv)

    import torch
    import triton

    from fk_runtime.harness import bench

    if not torch.cuda.is_available():
        raise SystemExit("host_variants.py times CUDA launches: run it on a GPU machine")
    variants = [("base", [])] + [(name, patches(spec)) for name, spec in args.variant]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    print("| call | variant | µs a call | ÷ torch | samples |\n| --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for name, fk, theirs in _calls():
            runs = [(v, fk, p) for v, p in variants] + [("torch", theirs, [])]
            for variant, fn, patched in runs:
                with applied(patched):
                    bench.interleaved_seconds({variant: fn}, WARMUP, 1, 1)
                    print(f"| {name} | {variant} kernels | {', '.join(_kernels(fn))} | | |", flush=True)
            samples: dict[str, list[float]] = {v: [] for v, _, _ in runs}
            for i in range(args.samples):
                for variant, fn, patched in runs if i % 2 == 0 else runs[::-1]:
                    with applied(patched):  # (a variant's plans bind again: warm-up calls, then one sample)
                        seconds = bench.interleaved_seconds({variant: fn}, WARMUP, CALLS, 1)[variant]
                        samples[variant].append(seconds * 1e6)
            theirs_us = statistics.median(samples["torch"])
            for variant, got in samples.items():
                us = statistics.median(got)
                print(f"| {name} | {variant} | {us:.1f} | {us / theirs_us:.2f} | {min(got):.1f}-{max(got):.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

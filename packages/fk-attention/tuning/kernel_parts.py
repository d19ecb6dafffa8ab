"""Each kernel's device time in one call of attention rows, fk against SDPA's cuDNN backend (TUNING.md: where a
call's time goes): eager calls rotating over the rows' input sets, torch.profiler kernel durations
(`bench.device_us_by_kernel`).

    bash shared/from-source.sh python packages/fk-attention/tuning/kernel_parts.py OUT.json [ROW ...]

ROW: `attention bwd B4 H16 N4096 d128` as the main tables name it, less the dtype (bf16).
"""

import importlib
import json
import sys

import torch

from fk_runtime.harness import bench

ROWS = ("attention bwd B16 H16 N1024 d128", "attention bwd B4 H16 N4096 d128", "attention bwd B4 H16 N4096 d128 causal",
        "attention bwd B1 H16 N16384 d128", "attention bwd B16 H32 N1024 d64", "attention bwd B4 H32 N4096 d64",
        "attention fwd B16 H32 N1024 d64", "attention fwd B16 H32 N1024 d64 causal")
VARIANTS = ("fk", "sdpa cudnn")
CALLS = 20


def main() -> None:
    out, rows = sys.argv[1], sys.argv[2:] or ROWS
    cases = {c.row(dtype=False): c
             for c in importlib.import_module("fk_attention.bench").cases(True) if c.dtype == torch.bfloat16}
    results = []
    for row in rows:
        case = cases[row]
        for variant in VARIANTS:
            sets = [case.make_inputs() for _ in range(bench.input_sets(case))]
            kernels = bench.device_us_by_kernel(bench.rotating([case.variants[variant](s) for s in sets]), CALLS)
            results.append(dict(row=row, variant=variant, total_us=sum(kernels.values()), kernels_us=kernels))
            print(f"{row} | {variant}: {results[-1]['total_us']:.1f} us", flush=True)
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"    {us:9.1f}  {name[:100]}", flush=True)
    meta = bench.environment()
    meta["command"] = "python packages/fk-attention/tuning/kernel_parts.py " + " ".join(sys.argv[1:])
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()

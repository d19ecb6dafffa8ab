"""Device time beside the SM clock and board power that each variant of an attention row runs at (TUNING.md: fp16
against bf16, diagnosis): fk and cuDNN, fp16 and bf16, random inputs and zeros (less switching, less power), each
timed as the main tables time it (CUDA-graph replays, `do_bench` median), then replayed for a second while
`nvidia-smi` samples clocks and power every 25 ms.

    bash shared/from-source.sh python packages/fk-attention/tuning/clocks.py OUT.json [ROW ...]

ROW: `attention fwd B16 H32 N1024 d64` as the main tables name it, less the dtype (both are run).
"""

import importlib
import json
import statistics
import subprocess
import sys
import time

import torch

from fk_runtime.harness import bench

ROWS = ("attention fwd B16 H32 N1024 d64", "attention fwd B1 H16 N16384 d128", "attention bwd B4 H16 N4096 d128",
        "attention bwd B1 H16 N16384 d128")
VARIANTS = ("fk", "sdpa cudnn")
SAMPLE_MS = 25


def input_sets(case, zero: bool) -> list:
    """The case's input sets; `zero`: multiplied by 0 (less switching, less power)."""
    inputs = [case.make_inputs() for _ in range(bench.input_sets(case))]
    if zero:
        with torch.no_grad():
            for i in inputs:
                for t in (i.values() if isinstance(i, dict) else i if isinstance(i, (tuple, list)) else [i]):
                    if torch.is_tensor(t) and t.is_floating_point():
                        t.mul_(0.0)
    return inputs


def clocks(calls, seconds: float = 1.0) -> tuple[float, float]:
    """Median SM clock (MHz) and board power (W) while `calls` replay for `seconds`, the first quarter (the
    ramp) left out."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    start, n = time.time(), 0
    while time.time() - start < seconds:
        for _ in range(10):
            calls[n % len(calls)]()
            n += 1
        torch.cuda.synchronize()
    smi.terminate()
    samples = [tuple(map(float, line.split(","))) for line in smi.communicate()[0].splitlines() if "," in line]
    samples = samples[len(samples) // 4:]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def main() -> None:
    out, rows = sys.argv[1], sys.argv[2:] or ROWS
    cases = {(c.row(dtype=False), c.dtype): c
             for c in importlib.import_module("fk_attention.bench").cases(True)
             if c.dtype in (torch.float16, torch.bfloat16)}
    results = []
    for rnd in range(2):
        for row in rows:
            for dtype in (torch.bfloat16, torch.float16):
                for variant in VARIANTS:
                    for zero in (False, True):
                        case = cases[(row, dtype)]
                        with bench.captured(case.variants[variant], input_sets(case, zero)) as calls:
                            ms = bench.time_ms(calls)
                            mhz, watts = clocks(calls)
                        results.append(dict(row=row, dtype=str(dtype).removeprefix("torch."), variant=variant,
                                            zero=zero, round=rnd, ms=ms, sm_mhz=mhz, watts=watts))
                        print(json.dumps(results[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

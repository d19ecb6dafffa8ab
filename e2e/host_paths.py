"""fk's host work per eager call with the launch taken out, for comparing two trees on any CPU.

Every op's host cases (the main job's host section: `fwd`, `fwd+bwd`, `infer`) run on Triton's
interpreter with `Launch.__call__` replaced by a no-op, so a call is the Python and torch work fk
does around its launches; the launch itself is one C call that two trees share. Attention runs at
the GPU's host shape, so that it takes the path it takes there (the CPU's smaller shape takes
split-KV decode). Per row: the median of `--samples` samples of `--calls` calls, µs; with `--count`,
the Python bytecodes a call executes instead (`sys.settrace` opcode events over `--calls` calls):
the same number on every run and CPU, where times on a shared machine move up to 2x between runs;
`--ops` takes some ops only. `--gpu` (a GPU box): the launches run and torch's op is timed beside
fk's, interleaved, in the same process (rows `op mode` and `op mode torch`); `--compare` then also
gives fk ÷ torch of the other tree over the baseline's, per row.

    bash shared/from-source.sh python e2e/host_paths.py --out new.json          # this tree
    (cd OLD && bash shared/from-source.sh python NEW/e2e/host_paths.py --out old.json)
    python e2e/host_paths.py --compare old.json new.json [more pairs, alternated runs]

`--compare A B [A B ...]` takes files in pairs (A: the baseline tree, B: the other) and prints each
row's figures and the ratio of the medians, B over A.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

OPS = ("attention", "layernorm", "softmax", "weightedsum")
WARMUP = 30


def _bench():
    try:
        from fk_runtime.harness import bench
    except ImportError:  # trees before the harness moved into its own package
        from fk_runtime import bench
    return bench


def host_calls(ops=OPS, gpu: bool = False):
    """("op mode", {variant: call}) of every host case of `ops`, each call made WARMUP times: fk's
    variant with its launches stubbed (on the CPU, also on a GPU machine: torch is imported after
    the GPUs are hidden), or with `gpu` fk's and torch's, launches run."""
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from fk_runtime import launch

        launch.Launch.__call__ = lambda self, *head: None
    bench = _bench()
    host_call = getattr(bench, "host_call", None) or bench._host_call  # (older trees' name)
    for op in ops:
        module = importlib.import_module(f"fk_{op}.bench")
        if op == "attention" and not gpu:
            module.SMALL_HOST_SHAPE = module.HOST_SHAPE
        for case in module.host_cases():
            inputs = case.make_inputs()
            for mode in case.modes:
                calls = {name: host_call(case.variants[name], inputs, mode)
                         for name in (("fk", "torch") if gpu else ("fk",)) if name in case.variants}
                for call in calls.values():
                    for _ in range(WARMUP):
                        call()
                yield f"{case.op} {mode}", calls


def measure(calls: int, samples: int, ops=OPS, gpu: bool = False) -> dict[str, float]:
    """{"op mode": fk's µs per call} (and with `gpu`, {"op mode torch": torch's})."""
    found = {}
    for row, variants in host_calls(ops, gpu):
        for name, seconds in _bench().interleaved_seconds(variants, 0, calls, samples).items():
            found[row if name == "fk" else f"{row} {name}"] = seconds * 1e6
    return found


def count(calls: int, ops=OPS) -> dict[str, float]:
    """{"op mode": Python bytecodes executed per call} (the C work they start is not counted)."""
    executed = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            executed[0] += 1
        return trace

    found = {}
    for row, variants in host_calls(ops):
        executed[0] = 0
        sys.settrace(trace)
        try:
            for _ in range(calls):
                variants["fk"]()
        finally:
            sys.settrace(None)
        found[row] = executed[0] / calls
    return found


def compare(paths: list[Path]) -> str:
    if len(paths) % 2:
        raise SystemExit("--compare takes files in pairs: baseline, other")
    runs = [json.loads(p.read_text()) for p in paths]
    base, other = runs[0::2], runs[1::2]
    lines = ["| row | baseline | other | other ÷ baseline | fk ÷ torch, other ÷ baseline |",
             "| --- | --- | --- | --- | --- |"]
    for row in other[0]:
        if row.endswith(" torch") or not all(row in r for r in base + other):
            continue
        a, b = [r[row] for r in base], [r[row] for r in other]
        vs_torch = "–"
        if all(f"{row} torch" in r for r in base + other):  # each run's fk over its own torch, medians
            ratio = [statistics.median(r[row] / r[f"{row} torch"] for r in runs) for runs in (base, other)]
            vs_torch = f"{ratio[1] / ratio[0]:.3f}"
        lines.append(f"| {row} | {' '.join(f'{x:.1f}' for x in a)} | {' '.join(f'{x:.1f}' for x in b)} | "
                     f"{statistics.median(b) / statistics.median(a):.3f} | {vs_torch} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--compare", type=Path, nargs="+")
    parser.add_argument("--count", action="store_true", help="Python bytecodes per call, not µs")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    parser.add_argument("--gpu", action="store_true", help="launches run, torch's op timed beside fk's")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    found = count(args.calls, args.ops) if args.count else measure(args.calls, args.samples, args.ops, args.gpu)
    text = json.dumps(found, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

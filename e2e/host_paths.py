"""fk's host work per eager call with the launch taken out, for comparing two trees on any CPU.

Every op's host cases (the main job's host section: `fwd`, `fwd+bwd`, `infer`) run on Triton's
interpreter with `Launch.__call__` replaced by a no-op, so a call is the Python and torch work fk
does around its launches; the launch itself is one C call that two trees share. Attention runs at
the GPU's host shape, so that it takes the path it takes there (the CPU's smaller shape takes
split-KV decode). Per row: the median of `--samples` samples of `--calls` calls, µs; with `--count`,
the Python bytecodes a call executes instead (`sys.settrace` opcode events over `--calls` calls):
the same number on every run and CPU, where times on a shared machine move up to 2x between runs;
`--ops` takes some ops only.

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


def host_calls(ops=OPS):
    """("op mode", call) of fk's variant of every host case of `ops`, launches stubbed (on the CPU,
    also on a GPU machine: torch is imported after the GPUs are hidden), each called WARMUP times."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from fk_runtime import launch

    launch.Launch.__call__ = lambda self, *head: None
    bench = _bench()
    host_call = getattr(bench, "host_call", None) or bench._host_call  # (older trees' name)
    for op in ops:
        module = importlib.import_module(f"fk_{op}.bench")
        if op == "attention":
            module.SMALL_HOST_SHAPE = module.HOST_SHAPE
        for case in module.host_cases():
            inputs = case.make_inputs()
            for mode in case.modes:
                call = host_call(case.variants["fk"], inputs, mode)
                for _ in range(WARMUP):
                    call()
                yield f"{case.op} {mode}", call


def measure(calls: int, samples: int, ops=OPS) -> dict[str, float]:
    """{"op mode": µs per call}."""
    return {row: _bench().interleaved_seconds({"fk": call}, 0, calls, samples)["fk"] * 1e6
            for row, call in host_calls(ops)}


def count(calls: int, ops=OPS) -> dict[str, float]:
    """{"op mode": Python bytecodes executed per call} (the C work they start is not counted)."""
    executed = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            executed[0] += 1
        return trace

    found = {}
    for row, call in host_calls(ops):
        executed[0] = 0
        sys.settrace(trace)
        try:
            for _ in range(calls):
                call()
        finally:
            sys.settrace(None)
        found[row] = executed[0] / calls
    return found


def compare(paths: list[Path]) -> str:
    if len(paths) % 2:
        raise SystemExit("--compare takes files in pairs: baseline, other")
    runs = [json.loads(p.read_text()) for p in paths]
    base, other = runs[0::2], runs[1::2]
    lines = ["| row | baseline | other | other ÷ baseline |", "| --- | --- | --- | --- |"]
    for row in other[0]:
        if not all(row in r for r in base + other):
            continue
        a, b = [r[row] for r in base], [r[row] for r in other]
        lines.append(f"| {row} | {' '.join(f'{x:.1f}' for x in a)} | {' '.join(f'{x:.1f}' for x in b)} | "
                     f"{statistics.median(b) / statistics.median(a):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--compare", type=Path, nargs="+")
    parser.add_argument("--count", action="store_true", help="Python bytecodes per call, not µs")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    found = count(args.calls, args.ops) if args.count else measure(args.calls, args.samples, args.ops)
    text = json.dumps(found, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

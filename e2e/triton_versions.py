"""fk on each Triton a current torch pins, measured the same way on one machine.

One process per Triton version (the GPU box stages the others: ../shared/gpu-stack), one after
the other on the same warm machine:

- host time per eager call of every op on its tiny input (fk and torch's op, `fwd`, `fwd+bwd`,
  `infer`), as the main job's host section measures it, in `--host-passes` passes over the cases
  (each row the median of its passes), and how many of fk's launches per call
  still go through Triton's own dispatch (0 where every launch is direct);
- fk's device time (CUDA-graph replays, `do_bench` medians) on every row of the chosen tables of
  the main job (default: attention, layernorm, rmsnorm, softmax), fk's variant alone, with
  attention's fixed tiles (FK_AUTOTUNE=0, the default: every version runs the same tiles, and a
  version's run does not spend minutes compiling candidates; `--autotune` turns tuning on).

    bash shared/from-source.sh python e2e/triton_versions.py --out DIR      # once per version
    python e2e/triton_versions.py --summarize DIR [DIR ...] --out benchmarks  # after the last

A run writes `<out>/versions-<triton>.json`. `--summarize` reads every such file in the folders
given, writes `<out>/versions.md` (each version's host and device times beside the baseline
version's, 3.6 by default, and their ratios) and rebuilds BENCHMARKS.md as the main job does.
`--budget-s` stops timing new device rows after that many seconds (the rows left are named).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

DEFAULT_TABLES = ("attention", "layernorm", "rmsnorm", "softmax")
OPS = ("attention", "layernorm", "softmax", "weightedsum")
BASELINE = "3.6"
PREFIX = "versions-"
SECTION = "versions"
# Device time a version may lose to the baseline before its row is flagged (issue: 0.97x).
KEEP = 0.97
# Passes over the host cases in one run, each row the median of its passes: samples spread over
# the run, not one slow stretch of the box.
HOST_PASSES = 2


def _call(fn, inputs, mode: str):
    """One call of `fn` as the host section makes it in `mode` (fwd, fwd+bwd, infer)."""
    import torch

    if mode == "infer":
        with torch.no_grad():
            return fn(*inputs)
    out = fn(*inputs)
    if mode == "fwd+bwd":
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return out


def dispatched_per_call(cases, calls: int = 4) -> dict:
    """{(op, shape, dtype, mode): launches per call that took Triton's dispatch (`Launch._slow`)
    once warm}: 0 where the direct path serves every launch."""
    from fk_runtime import launch
    from fk_runtime.harness import bench

    counts, real = [0], launch.Launch._slow

    def counted(self, head):
        counts[0] += 1
        return real(self, head)

    found = {}
    launch.Launch._slow = counted
    try:
        for case in cases:
            inputs = case.make_inputs()
            for mode in case.modes:
                for _ in range(2):
                    _call(case.variants[bench.FK], inputs, mode)
                counts[0] = 0
                for _ in range(calls):
                    _call(case.variants[bench.FK], inputs, mode)
                found[(case.op, case.shape, str(case.dtype).removeprefix("torch."), mode)] = counts[0] / calls
    finally:
        launch.Launch._slow = real
    return found


def _passes_merged(passes: list[list]) -> list:
    """One host row per case and mode from several passes over them: the median of the passes'
    times per call; the first pass's device time."""
    merged = []
    for rows in zip(*passes, strict=True):
        us = [r.us for r in rows if r.us is not None]
        merged.append(dataclasses.replace(rows[0], us=statistics.median(us) if us else None))
    return merged


def measure(out: Path, tables: tuple[str, ...], budget_s: float, host_rows: bool = True,
            host_passes: int = HOST_PASSES) -> Path:
    from fk_runtime import backend
    from fk_runtime.harness import bench

    backend.use_interpreter_without_gpu()
    meta = bench.environment()
    meta["command"] = "python e2e/triton_versions.py " + shlex.join(sys.argv[1:])
    _, meta["host_calls"], meta["host_repeats"] = bench.host_settings()
    meta["host_passes"] = host_passes
    modules = [importlib.import_module(f"fk_{op}.bench") for op in OPS]
    host_cases = [c for m in modules if hasattr(m, "host_cases") for c in m.host_cases()] if host_rows else []
    host = _passes_merged([bench.run_host_cases(host_cases, progress=not i) for i in range(host_passes)])
    dispatched = dispatched_per_call(host_cases)
    full = not backend.is_interpreter()
    cases = [dataclasses.replace(c, variants={bench.FK: c.variants[bench.FK]})
             for m in modules for c in m.cases(full) if c.op in tables and bench.FK in c.variants]
    ceilings = bench.measure_ceilings() if cases else None
    device, skipped, start = [], [], time.monotonic()
    for case in cases:
        if time.monotonic() - start > budget_s:
            skipped.append(f"{case.op} {case.direction} {case.shape} {case.dtype}")
            continue
        device += bench.run_cases([case], ceilings, progress=False)
        r = device[-1]
        print(f"{r.op} {r.direction} {r.shape} {r.dtype}: {r.ms if r.ms is None else round(r.ms, 4)} ms"
              f"{'' if r.error is None else ' ' + r.error}", flush=True)
    path = out / f"{PREFIX}{meta['triton']}.json"
    out.mkdir(parents=True, exist_ok=True)
    host_rows = [dict(dataclasses.asdict(r), dispatched=dispatched.get((r.op, r.shape, r.dtype, r.mode)))
                 for r in host]
    path.write_text(json.dumps(dict(meta=meta, host=host_rows,
                                    device=[dataclasses.asdict(r) for r in device], skipped=skipped), indent=1))
    print(f"wrote {path}; {len(device)} device rows, {len(skipped)} left for the budget")
    return path


def _release(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _fmt(x, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _median_run(runs: list[dict]) -> dict:
    """One version's runs as one: each host and device figure the median over the runs; each fk
    host row also gets `ratio`, the median of the runs' fk ÷ torch (torch's op in the same run)."""
    if len(runs) == 1:
        return runs[0]

    def key(r, fields):
        return tuple(r[f] for f in fields)

    host_fields, device_fields = ("op", "shape", "dtype", "mode", "variant"), ("op", "shape", "direction", "dtype")
    host, device = {}, {}
    for run in runs:
        peers = {key(r, host_fields[:4]): r["us"] for r in run["host"] if r["variant"] != "fk"}
        for r in run["host"]:
            row = host.setdefault(key(r, host_fields), dict(r, us=[], ratio=[]))
            row["us"].append(r["us"])
            if r["variant"] == "fk" and r["us"] and peers.get(key(r, host_fields[:4])):
                row["ratio"].append(r["us"] / peers[key(r, host_fields[:4])])
        for r in run["device"]:
            device.setdefault(key(r, device_fields), dict(r, ms=[]))["ms"].append(r["ms"])

    def median(values):
        values = [x for x in values if x]
        return statistics.median(values) if values else None

    return dict(meta=runs[0]["meta"], skipped=runs[0]["skipped"],
                host=[dict(r, us=median(r["us"]), ratio=median(r["ratio"])) for r in host.values()],
                device=[dict(r, ms=median(r["ms"])) for r in device.values()])


def _spread(runs: list[dict]) -> tuple[float, str] | None:
    """How far one version's own runs move: the worst fk host row's largest fk ÷ torch over its
    smallest across the runs (None below two host runs), with that row's name. A ratio between
    versions within this of 1 is within what a rerun of the same code gives."""
    ratios: dict = {}
    for run in runs:
        peers = {(r["op"], r["shape"], r["mode"]): r["us"] for r in run["host"] if r["variant"] != "fk"}
        for r in run["host"]:
            peer = peers.get((r["op"], r["shape"], r["mode"]))
            if r["variant"] == "fk" and r["us"] and peer:
                ratios.setdefault(f"{r['op']} {r['mode']}", []).append(r["us"] / peer)
    spreads = [(max(v) / min(v), k) for k, v in ratios.items() if len(v) > 1]
    return max(spreads) if spreads else None


def summarize(folders: list[Path], out: Path, baseline: str = BASELINE, where: str = "on the same machine") -> str:
    rounds: dict[str, list] = {}
    for folder in folders:
        for path in sorted(folder.glob(f"{PREFIX}*.json")):
            run = json.loads(path.read_text())
            rounds.setdefault(run["meta"]["triton"], []).append(run)
    runs = {v: _median_run(r) for v, r in rounds.items()}
    # runs per version: a file of medians (meta "runs") stands for the runs it was made from
    counts = {v: sum(r["meta"].get("runs", 1) for r in rs) for v, rs in rounds.items()}
    kinds = {v: (sum(bool(r["host"]) for r in rs), sum(bool(r["device"]) for r in rs)) for v, rs in rounds.items()}
    # each kind of run once: the folders and budgets differ from run to run
    commands = dict.fromkeys(re.sub(r" --budget-s \S+", "", re.sub(r"--out \S+", "--out DIR", r["meta"]["command"]))
                             for rs in rounds.values() for r in rs)
    versions = sorted(runs, key=lambda v: tuple(int(p) for p in _release(v).split(".")))
    base = next((v for v in versions if _release(v) == baseline), None)
    if base is None:
        raise SystemExit(f"no run of Triton {baseline} in {[str(f) for f in folders]}")
    others = [v for v in versions if v != base]
    first = runs[base]["meta"]
    sampled = next((r["meta"] for r in rounds[base] if r["host"]), first)  # a host run's sampling settings
    lines = [
        "## Triton versions", "",
        f"{first['device']}, torch {first['torch']}; Triton {', '.join(versions)}, each in its own process on "
        f"{where} ({', '.join(runs[v]['meta']['date'] for v in versions)}); "
        f"{', '.join(f'{counts[v]} run(s) of {v} ({kinds[v][0]} with host rows, {kinds[v][1]} with device rows)' for v in versions)}, alternating versions where several: "
        "each figure the median over a version's runs (host ratios: each run's fk ÷ torch, then the median). "
        f"`÷ {_release(base)}`: the "
        f"version's time over {_release(base)}'s (below 1: faster). Host: µs per eager call on a tiny input "
        f"(the host section's method: the median of {sampled.get('host_repeats', '?')} interleaved samples of "
        f"{sampled.get('host_calls', '?')} calls, in each of {sampled.get('host_passes', 1)} pass(es) over the cases, "
        "their median), fk's and torch's op in the same process; host time moves between "
        "processes on this machine (torch's own op by up to 1.8x here), so a version's host figure is "
        f"compared as fk's time over torch's in its own run, divided by that of {_release(base)}. "
        "`dispatched`: fk's launches per call that went through Triton's own dispatch instead of the "
        "compiled launcher (0: every launch direct; – : not recorded by that run). Device: fk's CUDA-graph replay time of the main tables' rows, "
        f"fk alone, attention's default tiles (no autotuning, the same tiles on every version); rows at `÷ {_release(base)}` above {1 / KEEP:.3f} (below {KEEP}x the speed) are marked `!`.",
        "", f"Commands: {' and '.join(f'`{c}`' for c in commands)} in each version's runs, then "
        "`python e2e/triton_versions.py --summarize`", "",
        "### Host time per call", "",
    ]
    head = ["op", "call"] + [f"fk / torch {v} (µs)" for v in versions] + [f"÷ {_release(base)}, {v}" for v in others]
    head += [f"dispatched {v}" for v in versions]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def index(rows, key):
        return {key(r): r for r in rows}

    host = {v: index(runs[v]["host"], lambda r: (r["op"], r["shape"], r["dtype"], r["mode"], r["variant"]))
            for v in versions}

    def fk_over_torch(v, key):
        fk = host[v].get(key)
        peer = next((p for k, p in host[v].items() if k[:4] == key[:4] and p["variant"] != "fk"), None)
        if not (fk and peer and fk["us"] and peer["us"]):
            return None, None, None
        return fk["us"], peer["us"], fk.get("ratio") or fk["us"] / peer["us"]

    worst_host = {v: 0.0 for v in others}
    for key, r in host[base].items():
        if r["variant"] != "fk":
            continue
        cells = {v: fk_over_torch(v, key) for v in versions}
        row = [f"{key[0]} {key[1]} {key[2]}", key[3]]
        row += [f"{_fmt(c[0], 1)} / {_fmt(c[1], 1)}" for c in cells.values()]
        for v in others:
            ratio = cells[v][2] / cells[base][2] if cells[v][2] and cells[base][2] else None
            if ratio is not None:
                worst_host[v] = max(worst_host[v], ratio)
            row.append(_fmt(ratio, 2))
        row += [_fmt((host[v].get(key) or {}).get("dispatched"), 1) for v in versions]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Worst host ratio (fk ÷ torch, against the baseline's): " + ", ".join(f"{v} {worst_host[v]:.2f}x" for v in others)]
    spreads = {v: _spread(rounds[v]) for v in versions}
    if any(spreads.values()):
        lines += ["", "Same-version spread (the worst row's largest fk ÷ torch over its smallest, across one version's "
                  "runs: what a rerun of the same code moves): "
                  + ", ".join(f"{v} {w[0]:.2f}x ({w[1]})" for v, w in spreads.items() if w)]
    lines += ["", "### Device time (ms)", ""]
    head = ["table", "row", "dir", "dtype", f"fk {base}"] + [c for v in others for c in (f"fk {v}", f"÷ {_release(base)}")]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    device = {v: index(runs[v]["device"], lambda r: (r["op"], r["shape"], r["direction"], r["dtype"]))
              for v in versions}
    worst = {v: (0.0, None) for v in others}
    for key, r in device[base].items():
        row = [key[0], key[1], key[2], key[3], _fmt(r["ms"], 4)]
        for v in others:
            o = device[v].get(key)
            ratio = o["ms"] / r["ms"] if o and o["ms"] and r["ms"] else None
            if ratio is not None and ratio > worst[v][0]:
                worst[v] = (ratio, " ".join(key))
            mark = " !" if ratio is not None and ratio > 1 / KEEP else ""
            row += [_fmt(o["ms"] if o else None, 4), _fmt(ratio, 3) + mark]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Worst device ratio: " + ", ".join(f"{v} {w[0]:.3f} ({w[1]})" for v, w in worst.items())]
    for v in versions:
        if runs[v]["skipped"]:
            tables = Counter(row.split()[0] for row in runs[v]["skipped"])
            lines.append(f"\n{v}: {len(runs[v]['skipped'])} rows not timed (its budget ran out): "
                         + ", ".join(f"{t} {n}" for t, n in tables.items()))
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{SECTION}.md").write_text(text)
    from fk_runtime.harness import cli

    print(text)
    print(f"wrote {out / f'{SECTION}.md'} and {cli.rebuild_benchmarks_md(out)}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    parser.add_argument("--tables", nargs="*", default=list(DEFAULT_TABLES), help="none: host time only")
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--summarize", type=Path, nargs="+", default=None,
                        help="folders of earlier runs' versions-*.json: write the section")
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--where", default="on the same machine", help="where the runs ran (the section's words)")
    parser.add_argument("--autotune", action="store_true", help="let attention autotune (off by default)")
    parser.add_argument("--host-passes", type=int, default=HOST_PASSES, help="passes over the host cases")
    parser.add_argument("--no-host", action="store_true",
                        help="device rows only (a run beside others on a shared host: its host times would be theirs too)")
    args = parser.parse_args(argv)
    os.environ["FK_AUTOTUNE"] = "1" if args.autotune else "0"
    if args.summarize is not None:
        summarize(args.summarize, args.out, args.baseline, args.where)
    else:
        measure(args.out, tuple(args.tables), args.budget_s, host_rows=not args.no_host, host_passes=args.host_passes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

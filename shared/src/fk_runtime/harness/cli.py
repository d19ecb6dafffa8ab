"""The main job: check and benchmark every installed fk op on the default device.

    python -m fk_runtime [--ops OP ...] [--tables TABLE ...] [--out benchmarks] [--no-bench] [--host-only]

On a GPU it runs each op's full sweep; without one it runs the Triton interpreter at small sizes
(the numbers then only show that everything runs). Each op's results land in
`<out>/<op>.{json,md,png}`, the host time per call of every op in `<out>/host.{json,md}`, and
`BENCHMARKS.md` is rebuilt from every section in `<out>`: beside it when the folder is named
`benchmarks` (the committed layout), else inside it. On the interpreter the
results go to a temporary folder unless `--out` is given, so that a CPU run never overwrites the
committed GPU numbers.

Ops are found as importable top-level modules named `fk_*` with a `bench` submodule providing
`checks(full) -> [(label, callable returning [Comparison])]` and `cases(full) -> [Case]`, and
optionally `host_cases() -> [HostCase]` (tiny inputs for the host-time section).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pkgutil
import re
import shlex
import sys
import tempfile
from pathlib import Path

from .. import backend

RUNTIME_MODULE = "fk_runtime"
OP_PREFIX = "fk_"
DEFAULT_OUT = "benchmarks"
HOST_SECTION = "host"
# Sections that sum up across ops come first in BENCHMARKS.md (by file stem in <out>), the
# per-op sections after them in name order.
LEADING_SECTIONS = ("decoder", HOST_SECTION, "host-floor", "versions")
# What the benchmarks import beyond torch and triton (fk-runtime's `bench` extra).
BENCH_MODULES = ("matplotlib", "tqdm")


def discover_ops() -> list[str]:
    names = {
        m.name.removeprefix(OP_PREFIX)
        for m in pkgutil.iter_modules()
        if m.name.startswith(OP_PREFIX) and m.name != RUNTIME_MODULE
    }
    return sorted(names)


def run_checks(op: str, bench_module, full: bool) -> bool:
    from .. import alloc

    ok = True
    print(f"\n== check {op} on {backend.device_name()}")
    for label, check in bench_module.checks(full):
        with alloc.poisoned_outputs():
            comparisons = check()
        passed = all(c.ok for c in comparisons)
        ok &= passed
        worst = max(comparisons, key=lambda c: c.error / c.bound if c.bound else c.error)
        print(f"  {'ok  ' if passed else 'FAIL'} {label}: worst {worst}")
        if not passed:
            for c in comparisons:
                print(f"         {c}")
    return ok


def section(op: str, results, ceilings, meta: dict, plot_names: list[str]) -> str:
    """An op's (or table's) section: plots linked beside the section's file (BENCHMARKS.md's copy
    links them in the folder: `rebuild_benchmarks_md`)."""
    from . import bench

    lines = [
        f"## {op}",
        "",
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. "
        f"Ceilings measured in the same run: copy {ceilings.copy_gbps:.0f} GB/s (read + write), "
        f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s. Times and rates are `do_bench` medians "
        "of CUDA-graph replays, for every variant alike: device time, without the launch gaps "
        "Python leaves when one short call is timed alone (`(eager)` marks a variant that could "
        "not be captured). `fk eager ms` is fk launched from Python each call, host work "
        "included. `fk / peer` is the peer's time over fk's (above 1: fk is faster). "
        "`same-bytes copy % ceiling` (GB/s ops): a plain device copy moving the row's bytes (half "
        "read, half written), timed the same way: what a problem of that size reaches at best, "
        "where launch ramp and tail weigh on short problems.",
        "",
        f"Command: `{meta['command']}`",
        "",
    ]
    for name in dict.fromkeys(r.op for r in results):  # an op package may bench several ops
        lines += [f"### {name}", "", bench.markdown_table(results, name), ""]
    lines += [f"![{name}]({name})" for name in plot_names] + [""]
    return "\n".join(lines)


def host_section(results, meta: dict, kept_from: str | None = None) -> str:
    from . import bench

    warmup, count, repeats = bench.host_settings()
    kept = (f" Rows of ops this run did not measure are kept from the run of {kept_from} (same device)."
            if kept_from else "")
    return "\n".join([
        "## Host time per call",
        "",
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. What a "
        "user pays per call when the device is not the bottleneck: each op on a tiny input, "
        f"{count} eager calls back to back with one synchronization at the end (after {warmup} "
        f"warm-up calls), median of {repeats} repeats, every variant's repeats interleaved. "
        "`fwd`: the forward with inputs that require grad (autograd records it, as in training); "
        "`fwd+bwd`: that and `torch.autograd.grad` of every input; `infer`: the forward under "
        "`torch.no_grad()` (inference, a decode step). `device µs`: the kernels' "
        f"durations of one call (torch.profiler, mean of {bench.PROFILED_CALLS} calls); the gap to "
        "the eager time is host work. `fk ÷ peer` is fk's time over the peer's (below 1: fk "
        "costs less)." + kept,
        "",
        f"Command: `{meta['command']}`",
        "",
        bench.host_markdown_table(results),
        "",
    ])


def resolve_out(out: str | None) -> Path:
    """The results folder: `out` when given; else `benchmarks` on a GPU and a fresh temporary
    folder on the interpreter, whose timings measure nothing and must not replace the committed
    GPU numbers (BENCHMARKS.md is rebuilt beside the folder, so it lands there too)."""
    if out is not None:
        return Path(out)
    if backend.is_interpreter():
        path = Path(tempfile.mkdtemp(prefix="fk-bench-")) / DEFAULT_OUT
        print(f"interpreter timings measure nothing: results go to {path}, this tree's "
              f"BENCHMARKS.md and {DEFAULT_OUT}/ are left alone (--out {DEFAULT_OUT} to write them)")
        return path
    return Path(DEFAULT_OUT)


def benchmarks_md(out: Path) -> Path:
    """Where the sections of `out` are gathered: BENCHMARKS.md beside a folder named `benchmarks`
    (the committed layout), else inside `out` (so that `--out results` never rewrites the tree's
    BENCHMARKS.md)."""
    return out.parent / "BENCHMARKS.md" if out.name == DEFAULT_OUT else out / "BENCHMARKS.md"


def plot_dir(out: Path) -> str:
    """The plots' folder as BENCHMARKS.md links it."""
    return f"{DEFAULT_OUT}/" if out.name == DEFAULT_OUT else ""


def rebuild_benchmarks_md(out: Path) -> Path:
    target = benchmarks_md(out)
    order = lambda p: (p.stem not in LEADING_SECTIONS,  # noqa: E731
                       LEADING_SECTIONS.index(p.stem) if p.stem in LEADING_SECTIONS else 0, p.stem)
    sections = [p.read_text() for p in sorted(out.glob("*.md"), key=order) if p != target]
    # Sections link their plots beside them; BENCHMARKS.md, beside the folder, links them in it.
    sections = [re.sub(r"!\[([^\]]*)\]\(([^/)]+\.png)\)", rf"![\1]({plot_dir(out)}\2)", s) for s in sections]
    header = (
        "# Benchmarks\n\nThe latest run of each op, written by the main job, `python -m fk_runtime` "
        "(`nox -s bench`; on a GPU box without network `bash shared/from-source.sh python -m "
        "fk_runtime`), and of the end-to-end model, `python e2e/decoder.py`. Each section gives its "
        "command, device and, for the ops, the ceilings measured in the same run. Raw numbers: "
        "`benchmarks/<section>.json`; plots beside them.\n\n"
    )
    target.write_text(header + "\n".join(sections))
    return target


def run_sweeps(modules: dict, out: Path, meta: dict, full: bool, tables: list[str] | None = None) -> None:
    """Each op's sweep: `<out>/<op>.{json,md,png}`. With `tables`, only the cases of those tables
    (a case's `op`), each written as a section of its own, `<out>/<table>.{json,md,png}`; a later
    run of the whole op removes such sections of its tables (its own section holds them)."""
    from . import bench

    ceilings = bench.measure_ceilings()
    print(f"\nceilings: copy {ceilings.copy_gbps:.0f} GB/s, matmul {ceilings.matmul_tflops:.1f} "
          "TFLOP/s")
    for op, module in modules.items():
        cases = module.cases(full)
        if tables is not None:
            cases = [c for c in cases if c.op in tables]
        results = bench.run_cases(cases, ceilings)
        names = list(dict.fromkeys(r.op for r in results))
        plots = {name: bench.plot(results, name, ceilings, out / f"{name}.png") for name in names}
        if tables is None:
            bench.write_json(results, ceilings, meta, out / f"{op}.json")
            (out / f"{op}.md").write_text(
                section(op, results, ceilings, meta, [p.name for p in plots.values() if p]))
            for name in (n for n in names if n != op):  # stale sections of a `--tables` run
                for suffix in (".md", ".json"):
                    (out / f"{name}{suffix}").unlink(missing_ok=True)
        if tables is not None:
            _take_tables_out_of_op_section(out, op, set(names))
        for name in names:
            if tables is not None:
                mine = [r for r in results if r.op == name]
                bench.write_json(mine, ceilings, meta, out / f"{name}.json")
                (out / f"{name}.md").write_text(
                    section(name, mine, ceilings, meta, [plots[name].name] if plots[name] else []))
            print(f"\n{name}\n" + bench.markdown_table(results, name))


def _take_tables_out_of_op_section(out: Path, op: str, names: set[str]) -> None:
    """Before a `--tables` run writes sections of its own: the op's full section (from its last
    whole run) gives up those tables (no table twice in BENCHMARKS.md); if its main table is among
    them, the tables left get sections of their own (none disappears)."""
    from . import bench

    path = out / f"{op}.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
        results = [bench.Result(**r) for r in old["results"]]
        ceilings, meta = bench.Ceilings(**old["ceilings"]), old["meta"]
    except (ValueError, KeyError, TypeError):  # an unreadable or older file: the run's sections stand alone
        return
    left = [r for r in results if r.op not in names]
    if len(left) == len(results):
        return

    def write(name: str, rows: list) -> None:
        tables = list(dict.fromkeys(r.op for r in rows))
        plots = [f"{t}.png" for t in tables if (out / f"{t}.png").exists()]
        bench.write_json(rows, ceilings, meta, out / f"{name}.json")
        (out / f"{name}.md").write_text(section(name, rows, ceilings, meta, plots))

    if op in names:  # the op's own section becomes its main table's: the others stand alone
        path.unlink()
        (out / f"{op}.md").unlink(missing_ok=True)
        for name in dict.fromkeys(r.op for r in left):
            write(name, [r for r in left if r.op == name])
    else:
        write(op, left)


def check_tables(modules: dict, tables: list[str], full: bool) -> str | None:
    """Why `--tables` cannot run (an unknown table), or None. A table named like its op is the op's
    main table: its section then holds that table alone (the others keep sections of their own)."""
    known = {c.op for module in modules.values() for c in module.cases(full)}
    unknown = [t for t in tables if t not in known]
    if unknown:
        return f"unknown tables {unknown}; these ops have {sorted(known)}"
    return None


def run_host(modules: dict, out: Path, meta: dict) -> None:
    """The host-time section of every op whose bench module has `host_cases()`."""
    from . import bench

    cases = [case for module in modules.values() if hasattr(module, "host_cases")
             for case in module.host_cases()]
    if not cases:
        return
    results = bench.run_host_cases(cases)
    path = out / f"{HOST_SECTION}.json"
    kept, kept_from = _other_ops_host_rows(path, meta, {r.op for r in results})
    bench.write_host_json(kept + results, meta, path)
    (out / f"{HOST_SECTION}.md").write_text(host_section(kept + results, meta, kept_from))
    print("\nhost time per call\n" + bench.host_markdown_table(results))


def _other_ops_host_rows(path: Path, meta: dict, ran: set[str]) -> tuple[list, str | None]:
    """The rows of ops this run did not measure, from the section's last run on the same device
    (a one-op run must not drop the other ops' rows), and that run's date."""
    from . import bench

    if not path.exists():
        return [], None
    try:
        old = json.loads(path.read_text())
        if old["meta"]["device"] != meta["device"]:
            return [], None
        rows = [bench.HostResult(**r) for r in old["results"] if r["op"] not in ran]
    except (ValueError, KeyError, TypeError):  # an unreadable or older file: start afresh
        return [], None
    return rows, (old["meta"].get("date") if rows else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fk_runtime", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", nargs="*", help="ops to run (default: every installed one)")
    parser.add_argument("--out", default=None,
                        help=f"folder for results (default: {DEFAULT_OUT}; on the interpreter a "
                        "temporary folder)")
    parser.add_argument("--no-bench", action="store_true", help="run the checks only")
    parser.add_argument("--no-check", action="store_true", help="run the benchmarks only")
    parser.add_argument("--small", action="store_true", help="small sizes even on a GPU")
    parser.add_argument("--no-host", action="store_true", help="skip the host time per call")
    parser.add_argument("--host-only", action="store_true",
                        help="of the benchmarks, only the host time per call (no sweeps)")
    parser.add_argument("--tables", nargs="+", default=None,
                        help="of the sweeps, only these tables (a case's op name), each its own section")
    args = parser.parse_args(argv)

    if backend.use_interpreter_without_gpu():  # before any op module defines its kernels
        backend.check_interpreter_numpy()
    from . import bench

    full = not backend.is_interpreter() and not args.small
    installed = discover_ops()
    ops = args.ops or installed
    if not ops:
        print("no fk ops installed (looked for importable fk_* modules)", file=sys.stderr)
        return 2
    print(f"fk main job: ops {', '.join(ops)}; backend {backend.backend().value}; "
          f"{'full' if full else 'small'} sizes")

    unknown = [op for op in ops if op not in installed]
    if unknown:
        print(f"unknown ops {unknown}; installed: {installed}", file=sys.stderr)
        return 2
    if not args.no_bench:
        missing = [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            print(f"the benchmarks need {', '.join(missing)}: pip install 'fk-runtime[bench]' "
                  "(or --no-bench for the checks alone)", file=sys.stderr)
            return 2
    modules = {op: importlib.import_module(f"{OP_PREFIX}{op}.bench") for op in ops}
    if args.tables is not None:
        why = check_tables(modules, args.tables, full)
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    all_ok = True
    if not args.no_check:
        for op, module in modules.items():
            all_ok &= run_checks(op, module, full)
    if args.no_bench:
        return 0 if all_ok else 1

    out = resolve_out(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = bench.environment()
    meta["command"] = "python -m fk_runtime " + shlex.join(argv if argv is not None else sys.argv[1:])
    if not args.host_only:
        run_sweeps(modules, out, meta, full, args.tables)
    # After the sweeps: the host section's profiler pass must not run before any timed launch.
    if not args.no_host:
        run_host(modules, out, meta)
    print(f"\nwrote {rebuild_benchmarks_md(out)}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

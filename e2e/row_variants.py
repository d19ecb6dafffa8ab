"""Device time of chosen benchmark rows under variants of an op's plan numbers, in one process.

A variant sets module constants (`fk_softmax.plan:SPLIT_FORWARD_PROGRAMS_PER_SM={}`; also in the
package's modules that imported the name, `importers`) and clears the plan caches. Each round times
every row under every variant back to back (the variants' order turned by one place each round, the
round's first one run once untimed before: a row's first timing ran slow), so that a slow stretch of
the GPU, or its drift over a long run, weighs on each variant alike; a count of rounds that is a multiple
of the variants' (base and peers included) puts each in each place alike (the first place still timed up to
3% slow: H200, B1 H16 N16384 d128 backward, 2026-12-01). Each row is timed as the main
tables time fk (CUDA-graph replays, `do_bench` median), and the table gives each variant's median
over the rounds and its ratio to the first variant.

    bash shared/from-source.sh python e2e/row_variants.py --out DIR --rounds 3 \
        --rows "softmax fwd 1024x65536 bfloat16" "layernorm bwd 256x262144 float32" \
        --variant nocap "fk_softmax.plan:SPLIT_FORWARD_PROGRAMS_PER_SM={}"

A value is a literal, or an expression in the patched module's own names, e.g. attention's d64
forward tiles: `"fk_attention.config:DEFAULTS_16BIT=((64, {**DEFAULTS_16BIT[0][1], Kind.FORWARD:
Config(64, 64, 4, 2)}),) + DEFAULTS_16BIT[1:]"`.

A row is `op direction shape dtype` as the main tables name them (`x` for `×`), or `all:TABLE`
for every row of a main table; the first variant is always `base` (the code as it is), and
`env:FK_AUTOTUNE='1'` is a variant too (attention autotuned, as a bind reads it). `--time NAME` times
the row's variant NAME (default `fk`) under the patches, e.g. `'fk paged'`. `--peers` times
each row's other variants (torch, ...) once a round, in turn with the variants. Writes
`<out>/row-variants-<triton>.json` and prints the table (a variant that cannot run a row, a tile
over the shared memory, is named and left out of it), with what attention's autotuner picked
for each row it tuned in this process (`tuned_picks`; picks read back from FK_CACHE_DIR are not
listed: point it at an empty folder to see every one).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import statistics
import sys
import types
from pathlib import Path

OPS = ("layernorm", "softmax", "attention", "weightedsum")
BASE = "base"


class _Environment:
    """`env:NAME='value'` patches set os.environ[NAME] (None: unset) as module patches set names."""

    def __getattr__(self, name):
        return os.environ.get(name)

    def __setattr__(self, name, value):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def patches(spec: str) -> list[tuple[object, str, object]]:
    """`module:NAME=value;env:NAME='value'` -> [(module or the environment, NAME, value)]: a value is
    a literal, or for a module an expression in that module's names (`Config(64, 64, 4, 2)`)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        target, value = item.split("=", 1)
        module, name = target.split(":")
        if module == "env":
            out.append((_Environment(), name, ast.literal_eval(value)))
            continue
        holder = importlib.import_module(module)
        try:
            out.append((holder, name, ast.literal_eval(value)))
        except (ValueError, SyntaxError):  # not a literal: built from the module's own names
            out.append((holder, name, eval(value, vars(holder))))  # noqa: S307 (the caller's own command line)
    return out


def _clear_plans() -> None:
    """Every cached plan and bound call of the op packages, so that new numbers take effect."""
    from fk_runtime.launch import PlanCache

    for name, module in list(sys.modules.items()):
        if not name.startswith("fk_") or name.startswith("fk_runtime"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, PlanCache) or hasattr(value, "cache_info"):  # functools.lru_cache's
                value.cache_clear()


_MISSING = object()


def importers(module, name: str) -> list:
    """The other modules of `module`'s package that hold its `name` object under that name (bound by `from
    .config import NAME`): a variant of the name must reach them too, else it would change nothing there."""
    value, package = getattr(module, name), module.__name__.split(".")[0]
    return [m for key, m in list(sys.modules.items()) if key.split(".")[0] == package and m is not module
            and vars(m).get(name, _MISSING) is value]


@contextlib.contextmanager
def applied(patched):
    """`patched` (module, name, value) set (plans cleared) inside, in the module and its `importers`, the old
    values back (plans cleared) after."""
    patched = [(m2, n, value) for m, n, value in patched
               for m2 in [m, *(importers(m, n) if isinstance(m, types.ModuleType) else [])]]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patched]
    for m, n, value in patched:
        setattr(m, n, value)
    _clear_plans()
    try:
        yield
    finally:
        for m, n, value in saved:
            setattr(m, n, value)
        _clear_plans()


def _time(case, variant: str, bench, torch) -> float:
    """A variant's device time of `case` as the tables take it: CUDA-graph replays over its input sets."""
    inputs = [case.make_inputs() for _ in range(bench.input_sets(case))]
    prepare = case.variants[variant]
    if not torch.cuda.is_available():  # the interpreter: that it runs, not what it costs
        return bench.time_ms([prepare(i) for i in inputs])
    with bench.captured(prepare, inputs) as calls:
        return bench.time_ms(calls)


def _tuned_picks() -> dict:
    """The attention autotuner's picks so far, {key: Config} (empty where fk_attention's plan is not loaded)."""
    return dict(getattr(sys.modules.get("fk_attention.plan"), "WINNERS", {}))


def _described(key, config) -> str:
    kind = getattr(key[0][0], "value", key[0][0])
    return (f"{kind} {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
            + (" tma" if config.descriptors else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="+", required=True)
    parser.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "PATCHES"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", action="store_true", help="also time each row's peers (torch, ...) once a round, "
                        "in turn among the variants")
    parser.add_argument("--time", default="fk", help="the row's variant timed under the patches (default fk; e.g. "
                        "'fk paged' of the decode table)")
    args = parser.parse_args(argv)

    import torch
    import triton

    from fk_runtime import backend
    from fk_runtime.harness import bench

    backend.use_interpreter_without_gpu()
    full = not backend.is_interpreter()
    wanted = [" ".join(r.replace("×", "x").split()) for r in args.rows]
    tables = {w.removeprefix("all:") for w in wanted if w.startswith("all:")}
    wanted = [w for w in wanted if not w.startswith("all:")]
    cases = {}
    for op in OPS:
        for case in importlib.import_module(f"fk_{op}.bench").cases(full):
            name = case.row()
            if case.op in tables and name not in wanted:
                wanted.append(name)
            if name in wanted and args.time in case.variants:
                cases[name] = case
    missing = [w for w in wanted if w not in cases]
    if missing:
        raise SystemExit(f"no such rows: {missing}")
    variants = [(BASE, [])] + [(name, patches(spec)) for name, spec in args.variant]
    peers = sorted({p for r in wanted for p in cases[r].variants if p != args.time}) if args.peers else []
    times: dict = {(v, r): [] for v in [v for v, _ in variants] + peers for r in wanted}
    picks: dict = {}  # "variant row": what the autotuner picked while timing it (the configs to fix next)
    unfit: dict = {}  # "variant row": why it cannot run (a tile over the shared memory): left out, not fatal
    for round_ in range(args.rounds):
        for row in wanted:
            # the row's peers take their turns among the variants (a peer: its name and no patches)
            entries = variants + [(p, None) for p in peers if p in cases[row].variants]
            order = entries[round_ % len(entries):] + entries[:round_ % len(entries)]
            # a row's first timing in a round ran slow, whichever variant it was (H200, decode B64 KV1024
            # H32:32: 0.147 against 0.133 ms): the round's first variant once untimed before
            with contextlib.suppress(triton.runtime.errors.OutOfResources), applied(order[0][1] or []):
                _time(cases[row], args.time if order[0][1] is not None else order[0][0], bench, torch)
            for vname, patched in order:
                if patched is None:
                    times[(vname, row)].append(_time(cases[row], vname, bench, torch))
                    print(f"round {round_} {vname:12s} {row}: {times[(vname, row)][-1]:.4f} ms", flush=True)
                    continue
                if f"{vname} {row}" in unfit:
                    continue
                before = _tuned_picks()
                try:
                    with applied(patched):
                        ms = _time(cases[row], args.time, bench, torch)
                except triton.runtime.errors.OutOfResources as e:
                    unfit[f"{vname} {row}"] = str(e)
                    print(f"round {round_} {vname:12s} {row}: cannot run: {e}", flush=True)
                    continue
                new = [_described(k, c) for k, c in _tuned_picks().items() if k not in before]
                if new:
                    picks[f"{vname} {row}"] = new
                times[(vname, row)].append(ms)
                print(f"round {round_} {vname:12s} {row}: {ms:.4f} ms", flush=True)
    meta = bench.environment()
    meta["command"] = "python e2e/row_variants.py " + " ".join(sys.argv[1:])
    names = [v for v, _ in variants] + peers
    rows = [dict(row=r, variant=v, ms=times[(v, r)], median=statistics.median(times[(v, r)]))
            for r in wanted for v in names if times[(v, r)]]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"row-variants-{triton.__version__}.json"
    path.write_text(json.dumps(dict(meta=meta, variants={v: s for v, s in args.variant}, rows=rows,
                                     tuned_picks=picks, unfit=unfit), indent=1))
    print(f"\n{meta['device']}, torch {meta['torch']}, Triton {triton.__version__}; medians of {args.rounds} rounds (ms)")
    print("| row | " + " | ".join(names) + " |")
    for r in wanted:
        base = statistics.median(times[(BASE, r)])
        cells = [f"{statistics.median(times[(v, r)]):.4f} ({statistics.median(times[(v, r)]) / base:.3f})"
                 if times[(v, r)] else "–" for v in names]
        print(f"| {r} | " + " | ".join(cells) + " |")
    for name, new in picks.items():
        print(f"tuned picks, {name}: {', '.join(new)}")
    for name, why in unfit.items():
        print(f"cannot run, {name}: {why}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

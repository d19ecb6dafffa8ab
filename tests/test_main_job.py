"""The README's main job, end to end: every op found, checked and benchmarked on this device."""

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fk_runtime.harness import cli

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def test_committed_benchmarks_md_is_the_rebuild_of_its_sections(tmp_path):
    """BENCHMARKS.md is what the main job rebuilds from `benchmarks/*.md`: a section written into it
    alone would vanish at the next GPU run, and a plot link must point into `benchmarks/`."""
    committed = PACKAGES.parent / "benchmarks"
    out = tmp_path / "benchmarks"
    out.mkdir()
    for section in committed.glob("*.md"):
        (out / section.name).write_text(section.read_text())
    assert cli.rebuild_benchmarks_md(out).read_text() == (PACKAGES.parent / "BENCHMARKS.md").read_text()


def test_every_package_is_discovered():
    on_disk = {p.name.removeprefix("fk-") for p in PACKAGES.glob("fk-*")}
    assert on_disk and on_disk <= set(cli.discover_ops())


@pytest.mark.heavy
def test_main_job_checks_and_benchmarks_every_op(tmp_path):
    out = tmp_path / "benchmarks"
    out.mkdir()
    stale = out / "attention-decode.md"  # as a `--tables attention-decode` run leaves it
    stale.write_text("## attention-decode\n")
    # The checks' comparisons are the op tests' (and half this run's time): `test_checks_run_and_report`.
    run = subprocess.run([sys.executable, "-m", "fk_runtime", "--small", "--no-check", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for op in cli.discover_ops():
        payload = json.loads((out / f"{op}.json").read_text())
        fk_rows = [r for r in payload["results"] if r["variant"] == "fk"]
        assert fk_rows and all(r["ms"] > 0 for r in fk_rows), op
        assert (out / f"{op}.png").stat().st_size > 0
    # The host-time section: every op package supplies a tiny input, fk timed in every mode.
    host = json.loads((out / "host.json").read_text())
    fk_host = [r for r in host["results"] if r["variant"] == "fk"]
    assert {r["mode"] for r in fk_host} == {"fwd", "fwd+bwd", "infer"}
    assert len(fk_host) >= 2 * len(cli.discover_ops()) and all(r["us"] > 0 for r in fk_host)
    assert all(r["us"] > 0 for r in host["results"] if r["variant"] == "torch")
    assert not stale.exists(), "the whole op's run must replace a --tables section of its table"
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Host time per call" in text and "## " in text.replace("## Host time per call", "")


def test_checks_run_and_report(capsys, monkeypatch):
    """The main job's checks (`--no-bench`): each comparison's line, exit 0 when all pass, and a
    failing comparison reported as FAIL with exit 1."""
    assert cli.main(["--ops", "weightedsum", "--no-bench", "--small"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("weighted" in line for line in lines) and not any("FAIL" in line for line in lines)
    module = importlib.import_module("fk_weightedsum.bench")
    checks = list(module.checks(False))[:1]

    def wrong(check=checks[0][1]):  # the first check, its errors past their bounds
        return [dataclasses.replace(c, error=2 * c.bound + 1) for c in check()]

    monkeypatch.setattr(module, "checks", lambda full: [(checks[0][0], wrong)])
    assert cli.main(["--ops", "weightedsum", "--no-bench", "--small"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_interpreter_run_leaves_the_committed_numbers_alone(tmp_path):
    """Without --out, a run on the interpreter writes to a temporary folder, not ./benchmarks."""
    if cli.backend.is_interpreter():
        run = subprocess.run([sys.executable, "-m", "fk_runtime", "--ops", "softmax", "--no-check",
                              "--host-only"], capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert not (tmp_path / "benchmarks").exists() and not (tmp_path / "BENCHMARKS.md").exists()
        assert "measure nothing" in run.stdout
    else:
        assert cli.resolve_out(None) == Path(cli.DEFAULT_OUT)


def test_tables_run_writes_their_own_sections(tmp_path):
    """`--tables` runs only those tables, each a section of its own (a later run of the whole op
    removes it: see above); unknown tables are refused; the op's main table (named like the op) may
    run alone."""
    out = tmp_path / "benchmarks"
    base = [sys.executable, "-m", "fk_runtime", "--ops", "attention", "--no-check", "--no-host", "--small",
            "--out", str(out)]
    run = subprocess.run([*base, "--tables", "attention-decode"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    payload = json.loads((out / "attention-decode.json").read_text())
    assert {r["op"] for r in payload["results"]} == {"attention-decode"}
    assert not (out / "attention.json").exists()
    assert "## attention-decode" in (tmp_path / "BENCHMARKS.md").read_text()
    refused = subprocess.run([*base, "--tables", "nope"], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 2 and "nope" in refused.stderr
    modules = {"attention": importlib.import_module("fk_attention.bench")}
    assert cli.check_tables(modules, ["attention"], False) is None
    assert "attention-nope" in cli.check_tables(modules, ["attention", "attention-nope"], False)


def test_unknown_ops_and_missing_bench_modules_are_refused(monkeypatch, capsys):
    """An op that is not installed (or the runtime) and benchmarks without their modules: a clear
    message and exit code 2 (a traceback from the import before)."""
    for op in ("nosuchop", "runtime"):
        assert cli.main(["--ops", op, "--no-bench"]) == 2
        assert f"unknown ops ['{op}']" in capsys.readouterr().err
    monkeypatch.setattr(cli, "BENCH_MODULES", ("fk_no_such_module",))
    assert cli.main(["--ops", "softmax", "--no-check"]) == 2
    assert "pip install 'fk-runtime[bench]'" in capsys.readouterr().err


def test_another_out_folder_gathers_its_own_benchmarks_md(tmp_path):
    """--out results: BENCHMARKS.md inside results/, plots linked beside it; the one beside the
    folder (the tree's, run from its root) is not rewritten."""
    beside = tmp_path / "BENCHMARKS.md"
    beside.write_text("the committed numbers\n")
    out = tmp_path / "results"
    run = subprocess.run([sys.executable, "-m", "fk_runtime", "--ops", "weightedsum", "--small", "--no-check",
                          "--no-host", "--out", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert beside.read_text() == "the committed numbers\n"
    text = (out / "BENCHMARKS.md").read_text()
    assert "## weightedsum" in text and "](weightedsum.png)" in text and (out / "weightedsum.png").exists()


def test_tables_run_after_a_whole_op_run_keeps_every_table_once(tmp_path):
    """A `--tables` run after a whole run of the op: a table run alone leaves the op's section
    (no table twice in BENCHMARKS.md); the op's main table run alone leaves the op's other tables
    sections of their own (they disappeared)."""
    from fk_runtime.harness import bench

    out = tmp_path / "benchmarks"
    out.mkdir()
    rows = [bench.Result(name, "fwd", "4", "float32", v, bench.GBPS, 1.0, 1.0, 50.0)
            for name in ("norm", "rms") for v in ("fk", "peer")]
    meta = dict(device="dev", torch="t", triton="t", date="d", command="c")
    ceilings = bench.Ceilings(1000.0, 100.0)

    def whole_run():
        bench.write_json(rows, ceilings, meta, out / "norm.json")
        (out / "norm.md").write_text(cli.section("norm", rows, ceilings, meta, []))

    whole_run()
    cli._take_tables_out_of_op_section(out, "norm", {"rms"})
    assert {r["op"] for r in json.loads((out / "norm.json").read_text())["results"]} == {"norm"}
    assert "### rms" not in (out / "norm.md").read_text()
    whole_run()
    cli._take_tables_out_of_op_section(out, "norm", {"norm"})
    assert not (out / "norm.json").exists() and not (out / "norm.md").exists()
    assert {r["op"] for r in json.loads((out / "rms.json").read_text())["results"]} == {"rms"}
    assert "## rms" in (out / "rms.md").read_text()

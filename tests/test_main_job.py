"""The README's main job, end to end: every op found, checked and benchmarked on this device."""

import json
import subprocess
import sys
from pathlib import Path

from fk_runtime import cli

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def test_every_package_is_discovered():
    on_disk = {p.name.removeprefix("fk-") for p in PACKAGES.glob("fk-*")}
    assert on_disk and on_disk <= set(cli.discover_ops())


def test_main_job_checks_and_benchmarks_every_op(tmp_path):
    out = tmp_path / "benchmarks"
    run = subprocess.run([sys.executable, "-m", "fk_runtime", "--small", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path)
    # A failed check prints FAIL (its line, and each failing comparison) among many lines.
    failed = [line for line in run.stdout.splitlines() if "FAIL" in line]
    assert run.returncode == 0, "\n".join(failed) + "\n" + run.stdout[-2000:] + run.stderr[-2000:]
    for op in cli.discover_ops():
        payload = json.loads((out / f"{op}.json").read_text())
        fk_rows = [r for r in payload["results"] if r["variant"] == "fk"]
        assert fk_rows and all(r["ms"] > 0 for r in fk_rows), op
        assert (out / f"{op}.png").stat().st_size > 0
    assert "## " in (tmp_path / "BENCHMARKS.md").read_text()

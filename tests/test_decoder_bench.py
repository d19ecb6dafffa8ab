"""The end-to-end decoder benchmark runs, checks fk's model against torch's and reports both."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "e2e" / "decoder.py"


@pytest.mark.heavy
def test_decoder_benchmark_runs_small(tmp_path):
    out = tmp_path / "benchmarks"
    run = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    payload = json.loads((out / "decoder.json").read_text())
    assert payload["train"] and payload["decode"]
    for row in payload["train"] + payload["decode"]:
        assert row["fk_ms"] > 0 and row["torch_ms"] > 0 and row["speedup"] > 0
    # The run stops before timing when the two sides disagree (bf16 bound 0.1); the gaps it passed
    # are recorded.
    assert all(r["grad_gap"] <= 0.1 and r["loss_gap"] <= 0.1 for r in payload["train"])
    assert all(r["logits_gap"] <= 0.1 for r in payload["decode"])
    assert "## decoder (end to end)" in (out / "decoder.md").read_text()
    assert "## decoder (end to end)" in (tmp_path / "BENCHMARKS.md").read_text()

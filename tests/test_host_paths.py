"""e2e/host_paths.py: fk's host work per eager call with the launch stubbed, for A/B of two trees."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "e2e" / "host_paths.py"


def test_every_host_row_is_timed_without_launching(tmp_path):
    """Its own process (the stubbed launch must not reach other tests): one time per op and mode."""
    out = tmp_path / "paths.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--calls", "2", "--samples", "1", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    times = json.loads(out.read_text())
    for row in ("attention fwd", "attention fwd+bwd", "attention infer", "attention_with_kvcache infer",
                "rms_norm fwd", "layer_norm fwd+bwd", "softmax infer", "weighted_sum fwd"):
        assert times[row] > 0, row


def test_count_gives_the_same_bytecodes_on_every_run(tmp_path):
    """`--count`: Python bytecodes per call, the same in two runs, and more for a recorded call
    (fwd+bwd) than for the same op's inference."""
    counts = []
    for i in range(2):
        out = tmp_path / f"count{i}.json"
        run = subprocess.run([sys.executable, str(SCRIPT), "--count", "--calls", "2", "--ops", "layernorm",
                              "--out", str(out)],
                             capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        counts.append(json.loads(out.read_text()))
    assert counts[0] == counts[1]
    assert 0 < counts[0]["rms_norm infer"] < counts[0]["rms_norm fwd+bwd"]


def test_compare_sets_each_tree_against_the_baseline_by_medians(tmp_path, e2e_script):
    paths = e2e_script("host_paths")
    files = []
    for i, (old, new) in enumerate(((10.0, 12.0), (11.0, 30.0), (9.0, 11.0))):  # one slow run of the other tree
        for name, us in (("old", old), ("new", new)):
            files.append(tmp_path / f"{name}{i}.json")
            files[-1].write_text(json.dumps({"softmax fwd": us, "only here": 1.0} if name == "new" else
                                            {"softmax fwd": us}))
    table = paths.compare(files)
    assert "| softmax fwd | 10.0 11.0 9.0 | 12.0 30.0 11.0 | 1.200 | – |" in table and "only here" not in table


def test_compare_sets_fk_over_torch_of_each_run_against_the_baseline(tmp_path, e2e_script):
    """`--gpu` runs carry torch's time beside fk's: each run's fk ÷ torch, medians, other over
    baseline (a slow process slows both alike and cancels)."""
    paths = e2e_script("host_paths")
    files = []
    for i, (old, new, slow) in enumerate(((10.0, 12.0, 1.0), (11.0, 24.0, 2.0), (9.0, 11.0, 1.0))):
        for name, us, torch_us in (("old", old, 5.0), ("new", new, 5.0 * slow)):
            files.append(tmp_path / f"{name}{i}.json")
            files[-1].write_text(json.dumps({"softmax fwd": us, "softmax fwd torch": torch_us}))
    table = paths.compare(files)
    # old fk/torch 2.0 2.2 1.8 (median 2.0); new 2.4 2.4 2.2 (median 2.4)
    assert "| softmax fwd | 10.0 11.0 9.0 | 12.0 24.0 11.0 | 1.200 | 1.200 |" in table
    assert "softmax fwd torch |" not in table

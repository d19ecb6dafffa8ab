"""e2e/triton_versions.py: one run per Triton version, then a section that sets each against the
baseline's run (host time as fk over torch in the same process, device time row by row)."""

import json
from pathlib import Path


def _run(folder: Path, triton: str, fk_us: float, torch_us: float, ms: dict, dispatched=0.0) -> None:
    meta = dict(device="GPU", torch="2.11", triton=triton, date="today", command="python e2e/triton_versions.py",
                host_calls=200, host_repeats=7, host_passes=2)
    host = [dict(op="rms_norm", shape="4×4096", dtype="bfloat16", variant=variant, mode="fwd", us=us,
                 device_us=None, error=None, dispatched=dispatched if variant == "fk" else None)
            for variant, us in (("fk", fk_us), ("torch", torch_us))]
    device = [dict(op="attention", shape=shape, direction="fwd", dtype="bfloat16", variant="fk", ms=value)
              for shape, value in ms.items()]
    (folder / f"versions-{triton}.json").write_text(json.dumps(dict(meta=meta, host=host, device=device,
                                                                     skipped=[])))


def test_summary_sets_each_version_against_the_baseline(tmp_path, e2e_script):
    versions = e2e_script("triton_versions")
    _run(tmp_path, "3.6.0", 40.0, 20.0, {"B1 N128": 1.0, "B1 N4096": 2.0})
    # A slower process: torch's op took twice as long, so fk's doubled time is no regression.
    _run(tmp_path, "3.8.0", 80.0, 40.0, {"B1 N128": 1.1, "B1 N4096": 1.9}, dispatched=1.0)
    out = tmp_path / "benchmarks"
    text = versions.summarize([tmp_path], out)
    assert (out / "versions.md").read_text() == text and (tmp_path / "BENCHMARKS.md").exists()
    host_row = next(line for line in text.splitlines() if line.startswith("| rms_norm"))
    assert "| 1.00 |" in host_row and host_row.rstrip(" |").endswith("1.0")  # normalized ratio, dispatched
    slow = next(line for line in text.splitlines() if "B1 N128" in line)
    fast = next(line for line in text.splitlines() if "B1 N4096" in line)
    assert "1.100 !" in slow and "0.950" in fast and "!" not in fast
    assert "Worst device ratio: 3.8.0 1.100 (attention B1 N128 fwd bfloat16)" in text


def test_several_runs_of_a_version_are_taken_as_their_medians(tmp_path, e2e_script):
    """Alternating processes (3.6, 3.8, 3.6, 3.8, ...): each version's host ratio is the median of
    its runs' fk ÷ torch, and each device row the median of its runs' times."""
    versions = e2e_script("triton_versions")
    for i, (fk_us, torch_us, ms) in enumerate(((40.0, 20.0, 1.0), (50.0, 20.0, 1.2), (30.0, 20.0, 1.1))):
        (tmp_path / f"a{i}").mkdir()
        _run(tmp_path / f"a{i}", "3.6.0", fk_us, torch_us, {"B1 N128": ms})
        (tmp_path / f"b{i}").mkdir()
        _run(tmp_path / f"b{i}", "3.8.0", 2 * fk_us, 3 * torch_us, {"B1 N128": 2 * ms})
    text = versions.summarize(sorted(p for p in tmp_path.iterdir() if p.is_dir()), tmp_path / "benchmarks")
    assert "3 run(s) of 3.6.0 (3 with host rows, 3 with device rows), 3 run(s) of 3.8.0" in text
    host_row = next(line for line in text.splitlines() if line.startswith("| rms_norm"))
    assert "| 40.0 / 20.0 | 80.0 / 60.0 | 0.67 |" in host_row  # median µs; each 3.8 run at 2/3 of its 3.6 pair
    assert "| 1.1000 | 2.2000 | 2.000 ! |" in text
    assert "median of 7 interleaved samples of 200 calls, in each of 2 pass(es)" in text
    # 3.6's own runs: fk ÷ torch 1.5 to 2.5; 3.8's 1/1.5 of those
    assert "Same-version spread" in text and "3.6.0 1.67x (rms_norm fwd), 3.8.0 1.67x (rms_norm fwd)" in text


def test_host_passes_merge_into_one_row_per_case(e2e_script):
    """Each row's time is the median of its passes'; its device time the first pass's."""
    from fk_runtime.harness import bench

    versions = e2e_script("triton_versions")
    passes = [[bench.HostResult("op", "4", "bfloat16", "fk", "fwd", us, device_us=dev)]
              for us, dev in ((10.0, 1.0), (14.0, 2.0), (12.0, 3.0))]
    (row,) = versions._passes_merged(passes)
    assert (row.us, row.device_us) == (12.0, 1.0)

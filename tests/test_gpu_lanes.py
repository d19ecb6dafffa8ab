"""e2e/gpu_lanes.sh: a device call's steps in lanes, one GPU each (checked here in its dry mode, which
prints each step's command with its GPU and Triton instead of running it)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _dry(tmp_path, *lanes: str) -> list[str]:
    jobs = tmp_path / "jobs.sh"
    jobs.write_text("""job() { ARGS=(--rounds 3 --rows "attention fwd B1 x" --variant tuned "env:FK_AUTOTUNE='1'"); }\n""")
    # its own folder: this suite runs inside a real call's lanes on the GPU box, whose logs are in /tmp/lanes
    env = {**os.environ, "FK_LANES_DRY": "1", "FK_LANES_JOBS": str(jobs), "FK_LANES_DIR": str(tmp_path / "lanes")}
    out = subprocess.run(["bash", str(ROOT / "e2e" / "gpu_lanes.sh"), "600", *lanes], env=env, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def test_steps_run_in_their_lane_on_their_triton(tmp_path):
    lines = _dry(tmp_path, "suite:3.8:15:300 host:3.6", "rows:3.9:job table:3.8:attention:attention-varlen,attention-window")
    suite, host, rows, table = lines
    assert suite.startswith("gpu0 /tmp/triton-3.8.0 ") and "FK_GPU_WORKERS=15" in suite
    assert suite.endswith(f"e2e/gpu_check.sh {tmp_path}/lanes/suite-3.8 300 0")  # one folder per version: resumable
    assert host.startswith("gpu0 box ") and "taskset -c 8-11" in host and "triton_versions.py" in host
    assert rows.startswith("gpu1 /tmp/triton-3.9.0 ") and f"FK_CACHE_DIR={tmp_path}/lanes/rows_3.9_job/tuned " in rows
    assert f"row_variants.py --out {tmp_path}/lanes/rows_3.9_job --rounds 3 --rows attention fwd B1 x" in rows
    assert table.startswith("gpu1 /tmp/triton-3.8.0 ")
    assert table.endswith("--tables attention-varlen attention-window") and "--ops attention" in table


def test_a_suite_cap_never_passes_the_call_limit(tmp_path):
    (suite,) = _dry(tmp_path, "suite:3.6:8:100000")
    assert suite.startswith("gpu0 box ") and "FK_GPU_WORKERS=8" in suite
    cap = int(suite.split()[-2])
    assert 500 < cap < 600


def test_an_unknown_step_is_named(tmp_path):
    assert _dry(tmp_path, "bogus:3.6") == ["unknown step bogus:3.6"]


def test_a_suite_may_name_its_tests(tmp_path):
    (suite,) = _dry(tmp_path, "suite:3.8:15:200:packages/fk-attention/tests/test_decode.py,tests/test_bench.py")
    assert suite.endswith("suite-3.8 200 0 packages/fk-attention/tests/test_decode.py tests/test_bench.py")


def test_a_shell_step_runs_a_function_of_the_jobs_file(tmp_path):
    (probe,) = _dry(tmp_path, "host:3.6 sh:3.8:probe")[1:]
    assert probe.startswith("gpu0 /tmp/triton-3.8.0 timeout -s INT ")
    assert probe.endswith('bash -c source "$FK_LANES_JOBS" && probe')

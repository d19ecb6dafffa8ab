"""e2e/offline_compile.py: the launches a CPU run records compile for sm_90 without a GPU, and a launch
that Triton's compiler refuses is reported, not passed."""

import json


def test_recorded_launches_compile_for_hopper(e2e_script, capsys):
    script = e2e_script("offline_compile")
    assert script.main(["--ops", "softmax"]) == 0
    assert "2 launches, 0 failed to compile" in capsys.readouterr().out


def test_a_launch_the_compiler_refuses_is_reported(e2e_script, tmp_path):
    script = e2e_script("offline_compile")
    recorded = script._child(["--record", "--ops", "softmax"], interpret=True)
    launches = json.loads(recorded.stdout.strip().splitlines()[-1])
    module, name, args, meta = json.loads(launches[0])
    pointer = next(i for i, a in enumerate(args) if isinstance(a, str))
    args[pointer] = ["fp32", 0.0]  # a float where the kernel loads through a pointer
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([launches[0], json.dumps([module, name, args, meta])]))
    compiled = script._child(["--compile", str(path)], interpret=False)
    assert compiled.returncode == 1, compiled.stderr[-2000:]
    assert "2 launches, 1 failed to compile" in compiled.stdout and f"FAIL {name}" in compiled.stdout

"""e2e/offline_compile.py: the launches a CPU run records compile for sm_90 without a GPU, and a launch
that Triton's compiler refuses is reported, not passed."""

import json

import pytest
from fk_runtime import backend


@pytest.fixture
def offline_compile(e2e_script):
    """e2e/offline_compile.py, where its recording child can run kernels on this Triton's interpreter."""
    problem = backend.interpreter_numpy_problem()
    if problem is not None:
        pytest.skip(problem)
    return e2e_script("offline_compile")


def test_recorded_launches_compile_for_hopper(offline_compile, capsys):
    script = offline_compile
    assert script.main(["--ops", "softmax"]) == 0
    assert "2 launches, 0 failed to compile" in capsys.readouterr().out


def test_a_launch_the_compiler_refuses_is_reported(offline_compile, tmp_path):
    script = offline_compile
    recorded = script._child(["--record", "--ops", "softmax"], interpret=True)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    launches = json.loads(recorded.stdout.strip().splitlines()[-1])
    module, name, args, meta = json.loads(launches[0])
    pointer = next(i for i, a in enumerate(args) if isinstance(a, str))
    args[pointer] = ["fp32", 0.0]  # a float where the kernel loads through a pointer
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([launches[0], json.dumps([module, name, args, meta])]))
    compiled = script._child(["--compile", str(path)], interpret=False)
    assert compiled.returncode == 1, compiled.stderr[-2000:]
    assert "2 launches, 1 failed to compile" in compiled.stdout and f"FAIL {name}" in compiled.stdout


def test_tiles_take_each_candidate_of_the_prefill_kernels(offline_compile):
    """`--tiles`: each recorded prefill launch (d256 here, dK/dV's two launches among them) at every
    autotune candidate of its head dim, through pointers; other launches none."""
    from fk_attention import config

    script = offline_compile
    recorded = script._child(["--record", "--ops", "attention-d256"], interpret=True)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    launches = json.loads(recorded.stdout.strip().splitlines()[-1])
    assert {json.loads(s)[1] for s in launches} >= set(script.TILED)
    parts = set()
    for spec in launches:
        _, name, _, meta = json.loads(spec)
        tiled = [json.loads(s)[3] for s in script._at_candidates(spec)]
        if name not in script.TILED:
            assert tiled == [], name
            continue
        want = config.candidates(config.Kind(script.TILED[name]), 256, False)
        assert [(m["BLOCK_M"], m["BLOCK_N"], m["num_warps"], m["num_stages"]) for m in tiled] == \
            [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in want]
        assert all(m["USE_DESC"] == 0 and m["HEAD_DIM_PADDED"] == 256 and m.get("PART") == meta.get("PART")
                   for m in tiled)
        parts.add(meta.get("PART"))
    assert {1, 2} <= parts

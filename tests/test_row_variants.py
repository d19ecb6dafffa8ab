"""e2e/row_variants.py: chosen benchmark rows timed under variants of an op's numbers, in one process (and
e2e/host_variants.py, which takes its variants)."""

import json
import os

import pytest
from fk_runtime import backend
from fk_softmax import bench as softmax_bench
from fk_softmax import plan as softmax_plan


def _first_softmax_row() -> str:
    """The table's first softmax forward row on this device (the GPU's full tables or the interpreter's small ones)."""
    case = next(c for c in softmax_bench.cases(not backend.is_interpreter()) if c.direction == "fwd")
    return f"softmax fwd {case.shape.replace('×', 'x')} {str(case.dtype).removeprefix('torch.')}"


def test_variants_take_effect_and_are_undone(tmp_path, e2e_script, capsys, monkeypatch):
    """Each variant's numbers reach the plan (its rows bind again), a row's variants run back to
    back in an order reversed every other round, and the module and the environment are as they
    were afterwards; the table and JSON name every variant."""
    variants = e2e_script("row_variants")
    monkeypatch.delenv("FK_ROW_VARIANTS_PROBE", raising=False)
    seen = []
    real = softmax_plan.plan

    def spy(*args, **kwargs):
        seen.append((softmax_plan.FUSED_TILE_BYTES, os.environ.get("FK_ROW_VARIANTS_PROBE")))
        return real(*args, **kwargs)

    monkeypatch.setattr(softmax_plan, "plan", spy)
    before = softmax_plan.FUSED_TILE_BYTES
    row = _first_softmax_row()
    assert variants.main(["--out", str(tmp_path), "--rounds", "2", "--rows", row,
                          "--variant", "small", "fk_softmax.plan:FUSED_TILE_BYTES=1024;env:FK_ROW_VARIANTS_PROBE='1'"]) == 0
    order = [v for i, v in enumerate(seen) if i == 0 or seen[i - 1] != v]
    assert order == [(before, None), (1024, "1"), (before, None)]  # base, small | small, base
    assert softmax_plan.FUSED_TILE_BYTES == before and "FK_ROW_VARIANTS_PROBE" not in os.environ
    (path,) = tmp_path.glob("row-variants-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["row"], r["variant"]) for r in rows] == [(row, "base"), (row, "small")]
    assert all(len(r["ms"]) == 2 for r in rows)
    assert all(r["median"] > 0 for r in rows)
    assert f"| {row} | " in capsys.readouterr().out


def test_an_unknown_row_is_refused(tmp_path, e2e_script):
    variants = e2e_script("row_variants")
    with pytest.raises(SystemExit, match="no such rows"):
        variants.main(["--out", str(tmp_path), "--rows", "softmax fwd 3x3 float32"])


def test_a_value_may_be_built_from_the_patched_modules_names(e2e_script):
    """A value that is no literal is an expression in the module's own names (an attention tile)."""
    from fk_attention import config

    variants = e2e_script("row_variants")
    spec = ("fk_attention.config:DEFAULTS_16BIT=((64, {**DEFAULTS_16BIT[0][1], Kind.FORWARD: Config(64, 64, 4, 2)}),)"
            " + DEFAULTS_16BIT[1:];env:FK_AUTOTUNE='1'")
    (module, name, table), (_, env_name, env_value) = variants.patches(spec)
    assert (module, name, env_name, env_value) == (config, "DEFAULTS_16BIT", "FK_AUTOTUNE", "1")
    assert table[0][1][config.Kind.FORWARD] == config.Config(64, 64, 4, 2)
    assert table[0][1][config.Kind.DQ] == config.DEFAULTS_16BIT[0][1][config.Kind.DQ]
    assert table[1:] == config.DEFAULTS_16BIT[1:]


def test_the_autotuners_picks_are_kept_per_row(tmp_path, e2e_script, capsys, monkeypatch):
    """What the attention tuner picks while a row is timed (keys new in `plan.WINNERS`) is written
    beside the times, under the variant and row that tuned it: the configs a fixed default may take."""
    from fk_attention import config
    from fk_attention import plan as attention_plan

    variants = e2e_script("row_variants")
    monkeypatch.setattr(attention_plan, "WINNERS", {})
    key = ((config.Kind.DQ, 128, 1, False, True, None, (1, 2, 3, 4), 0), True)
    real = variants._time

    def tuning(case, variant, bench, torch):  # a tune that happens while the "tuned" variant is timed
        if os.environ.get("FK_ROW_VARIANTS_PROBE") == "1":
            attention_plan.WINNERS.setdefault(key, config.Config(64, 32, 4, 3, True))
        return real(case, variant, bench, torch)

    monkeypatch.setattr(variants, "_time", tuning)
    row = _first_softmax_row()
    assert variants.main(["--out", str(tmp_path), "--rounds", "2", "--rows", row,
                          "--variant", "tuned", "env:FK_ROW_VARIANTS_PROBE='1'"]) == 0
    (path,) = tmp_path.glob("row-variants-*.json")
    assert json.loads(path.read_text())["tuned_picks"] == {f"tuned {row}": ["dq 64x32 w4 s3 tma"]}
    assert f"tuned picks, tuned {row}: dq 64x32 w4 s3 tma" in capsys.readouterr().out


def test_another_variant_of_the_row_may_be_timed(tmp_path, e2e_script, monkeypatch):
    """--time NAME times the row's variant NAME under the patches (the decode table's 'fk paged'),
    not fk's: here torch's softmax, so fk's plan is never bound."""
    variants = e2e_script("row_variants")
    calls = []
    real = softmax_plan.plan
    monkeypatch.setattr(softmax_plan, "plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    row = _first_softmax_row()
    case = next(c for c in softmax_bench.cases(not backend.is_interpreter()) if c.direction == "fwd")
    other = next(name for name in case.variants if name != "fk")
    assert variants.main(["--out", str(tmp_path), "--rounds", "1", "--rows", row, "--time", other,
                          "--variant", "small", "fk_softmax.plan:FUSED_TILE_BYTES=1024"]) == 0
    (path,) = tmp_path.glob("row-variants-*.json")
    assert [r["variant"] for r in json.loads(path.read_text())["rows"]] == ["base", "small"] and not calls
    with pytest.raises(SystemExit, match="no such rows"):
        variants.main(["--out", str(tmp_path), "--rows", row, "--time", "nobody"])


def test_a_variant_reaches_the_modules_that_imported_the_name(e2e_script):
    """A config number another module bound by value (`from .config import NAME`) is set there too, and
    restored in both after: a variant of it would otherwise change nothing where it is read."""
    from fk_attention import config, decode

    variants = e2e_script("row_variants")
    before = config.DECODE_DESCRIPTOR_MIN_HEAD_DIM
    assert decode in variants.importers(config, "DECODE_DESCRIPTOR_MIN_HEAD_DIM")
    with variants.applied(variants.patches("fk_attention.config:DECODE_DESCRIPTOR_MIN_HEAD_DIM=64")):
        assert config.DECODE_DESCRIPTOR_MIN_HEAD_DIM == decode.DECODE_DESCRIPTOR_MIN_HEAD_DIM == 64
    assert config.DECODE_DESCRIPTOR_MIN_HEAD_DIM == decode.DECODE_DESCRIPTOR_MIN_HEAD_DIM == before


@pytest.mark.skipif(backend.backend() is not backend.Backend.INTERPRETER, reason="a machine without a GPU")
def test_host_variants_refuses_a_machine_without_a_gpu(e2e_script):
    """e2e/host_variants.py times CUDA launches: without a GPU it says so, timing nothing."""
    with pytest.raises(SystemExit, match="GPU machine"):
        e2e_script("host_variants").main(["--variant", "nocache", "fk_runtime.launch:DESCRIPTOR_CACHE=0"])


@pytest.mark.skipif(backend.backend() is not backend.Backend.INTERPRETER, reason="a machine without a GPU")
def test_host_floor_refuses_a_machine_without_a_gpu(e2e_script):
    """e2e/host_floor.py times CUDA calls: without a GPU it says so, timing nothing."""
    with pytest.raises(SystemExit, match="GPU machine"):
        e2e_script("host_floor").main([])

import json

import torch

from fk_runtime.harness import bench, cli, testing


def _cases():
    def make():
        return [testing.randn((32, 64), requires_grad=True)]

    def failing(x):
        raise ValueError("peer refuses this shape")

    return [
        bench.Case("toy", direction, "32×64", torch.float32, bench.GBPS, 2 * 32 * 64 * 4, make,
                   {"fk": wrap(lambda x: x * 2), "peer": wrap(lambda x: x + x), "broken": wrap(failing)})
        for direction, wrap in [("fwd", bench.forward), ("bwd", bench.backward)]
    ]


def test_harness_times_reports_and_records_failures(tmp_path):
    ceilings = bench.Ceilings(copy_gbps=100.0, matmul_tflops=1.0)
    results = bench.run_cases(_cases(), ceilings, progress=False)
    assert len(results) == 6
    ok = [r for r in results if r.variant != "broken"]
    assert all(r.ms and r.ms > 0 and r.rate > 0 and r.pct_of_ceiling > 0 for r in ok)
    broken = [r for r in results if r.variant == "broken"]
    assert all(r.ms is None and "refuses" in r.error for r in broken)
    table = bench.markdown_table(results, "toy")
    assert "| 32×64 | float32 | fwd |" in table and "fails" in table and "fk / peer" in table
    # fk's row carries the copy of the same bytes (a GPU measurement), no other row does.
    assert all(r.copy_pct is None for r in results if r.variant != "fk")
    fk = [r for r in results if r.variant == "fk"]
    if testing.on_gpu():
        assert all(r.copy_pct > 0 for r in fk) and "same-bytes copy % ceiling" in table
    else:
        assert all(r.copy_pct is None for r in fk) and "same-bytes copy" not in table
    bench.write_json(results, ceilings, bench.environment(), tmp_path / "toy.json")
    payload = json.loads((tmp_path / "toy.json").read_text())
    assert {s["peer"] for s in payload["speedups"]} == {"peer", "broken"}
    assert bench.plot(results, "toy", ceilings, tmp_path / "toy.png").stat().st_size > 1000


def test_ceilings_are_measured():
    c = bench.measure_ceilings()
    assert c.copy_gbps > 0 and c.matmul_tflops > 0


def test_benchmarks_md_is_rebuilt_from_sections(tmp_path):
    out = tmp_path / "benchmarks"
    out.mkdir()
    (out / "a.md").write_text("## a\n")
    (out / "b.md").write_text("## b\n")
    (out / "c.md").write_text("## c\n![c.png](c.png)\n![d.png](benchmarks/d.png)\n")
    text = cli.rebuild_benchmarks_md(out).read_text()
    assert text.index("## a") < text.index("## b")
    # Plots are linked from BENCHMARKS.md, beside the folder, whichever folder a section was written in.
    assert "![c.png](benchmarks/c.png)" in text and "![d.png](benchmarks/d.png)" in text


def test_host_cases_time_only_their_modes():
    """An inference op's case (forward only) times its forward alone: no failing backward row."""
    case = bench.HostCase("toy", "4×64", torch.float32, lambda: [testing.randn((4, 64))],
                          {"fk": lambda x: x * 2, "peer": lambda x: x + x}, modes=("infer",))
    results = bench.run_host_cases([case], progress=False)
    assert {(r.variant, r.mode) for r in results} == {("fk", "infer"), ("peer", "infer")}
    assert all(r.us > 0 and r.error is None for r in results)


def test_host_time_per_call_is_measured_and_tabled(tmp_path):
    def failing(x, w):
        raise ValueError("peer refuses this input")

    case = bench.HostCase(
        "toy", "4×64", torch.float32,
        lambda: [testing.randn((4, 64), requires_grad=True), testing.randn((64,), requires_grad=True)],
        {"fk": lambda x, w: x * w, "peer": lambda x, w: (x * w).clone(), "broken": failing},
    )
    results = bench.run_host_cases([case], progress=False)
    assert {(r.variant, r.mode) for r in results} == {
        (v, m) for v in ("fk", "peer", "broken") for m in bench.HOST_MODES}
    ok = [r for r in results if r.variant != "broken"]
    assert all(r.us > 0 and r.error is None for r in ok)
    assert all(r.us is None and "refuses" in r.error for r in results if r.variant == "broken")
    # Device time comes from the profiler on a GPU only.
    assert all((r.device_us is not None and r.device_us > 0) == testing.on_gpu() for r in ok)
    table = bench.host_markdown_table(results)
    assert "| toy | 4×64 | float32 | fwd |" in table and "| fwd+bwd |" in table and "| infer |" in table
    assert "fk ÷ peer" in table and "fails" in table
    bench.write_host_json(results, {"device": "x"}, tmp_path / "host.json")
    payload = json.loads((tmp_path / "host.json").read_text())
    assert len(payload["results"]) == 3 * len(bench.HOST_MODES) and payload["meta"] == {"device": "x"}


def test_host_section_leads_benchmarks_md(tmp_path):
    out = tmp_path / "benchmarks"
    out.mkdir()
    for name in ("a", "host", "decoder"):
        (out / f"{name}.md").write_text(f"## {name}\n")
    text = cli.rebuild_benchmarks_md(out).read_text()
    assert text.index("## decoder") < text.index("## host") < text.index("## a")


def test_a_one_op_host_run_keeps_the_other_ops_rows(tmp_path, monkeypatch):
    """`--ops X` re-measures X's host rows and keeps the other ops' rows of the last run on the same
    device (it rewrote the section with X's rows alone); rows from another device are dropped."""
    def module(op):
        case = bench.HostCase(op, "4", torch.float32, lambda: [testing.randn((4,), requires_grad=True)],
                              {"fk": lambda x: x * 2, "peer": lambda x: x + x})
        return type("M", (), {"host_cases": staticmethod(lambda: [case])})

    monkeypatch.setattr(bench, "run_host_cases", lambda cases, progress=True: [
        bench.HostResult(c.op, c.shape, "float32", v, m, 1.0) for c in cases for v in c.variants
        for m in bench.HOST_MODES])
    meta = dict(device="dev", torch="t", triton="t", date="first", command="c")
    cli.run_host({"a": module("a"), "b": module("b")}, tmp_path, meta)
    cli.run_host({"a": module("a")}, tmp_path, dict(meta, date="second"))
    rows = json.loads((tmp_path / "host.json").read_text())["results"]
    assert sorted({r["op"] for r in rows}) == ["a", "b"] and len(rows) == 2 * 2 * len(bench.HOST_MODES)
    text = (tmp_path / "host.md").read_text()
    assert "| b | 4 |" in text and "kept from the run of first" in text
    cli.run_host({"a": module("a")}, tmp_path, dict(meta, device="other", date="third"))
    assert {r["op"] for r in json.loads((tmp_path / "host.json").read_text())["results"]} == {"a"}
    assert "kept from" not in (tmp_path / "host.md").read_text()

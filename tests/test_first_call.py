"""e2e/first_call.py (GPU-only measurement): its section from a run's numbers."""


def test_section_reports_cold_warm_sweep_and_packed_loop(e2e_script):
    first_call = e2e_script("first_call")
    rows = [dict(op="attention", case="B2 H8 N1024 d128 causal", dtype="bfloat16", fk_ms=4100.0, peer_ms=900.0)]
    warm = [dict(rows[0], fk_ms=310.0, peer_ms=60.0)]
    sweep = dict(fk=[2500.0] + [0.4] * 99 + [61.0], sdpa=[900.0] + [0.3] * 100)
    run = dict(meta=dict(device="H100", torch="2.11", triton="3.8.0", date="today", command="python e2e/first_call.py"),
               cold=rows, warm=warm, sweep=sweep, packed=dict(fk=[30000.0, 10.0, 12.0, 9.0, 30.0]))
    text = first_call.report(run)
    assert "| attention | B2 H8 N1024 d128 causal | bfloat16 | 4100 | 310 | 900 | 60 |" in text
    assert "slowest call fk 61.0 ms" in text
    assert "slowest 30.0 ms (2.73x the median)" in text
    assert "collector" not in text  # (a run from before the collector's time was kept)
    run["packed"]["gc"] = [120.0, 0.0, 0.1, 0.0, 5.25]
    assert "Python's collector inside them: 120.0, 0.0, 0.1, 0.0, 5.2 ms." in first_call.report(run)


def test_collector_pauses_are_recorded_as_they_end(e2e_script):
    import gc

    first_call = e2e_script("first_call")
    pauses = first_call._collector_pauses()
    try:
        gc.collect(1)
        assert [g for g, _ in pauses] == [1] and pauses[0][1] >= 0
    finally:
        gc.callbacks.pop()


def test_section_reports_the_decode_loop(e2e_script):
    first_call = e2e_script("first_call")
    steps = [list(s) for s in first_call.DECODE_STEPS[:4]]
    run = dict(meta=dict(device="H100", torch="2.11", triton="3.8.0", date="today", command="python e2e/first_call.py"),
               cold=[], warm=[], sweep=dict(fk=[1.0, 1.0], sdpa=[1.0, 1.0]), packed=dict(fk=[1.0, 1.0]),
               decode={"steps": steps, "fk": [900.0, 0.1, 75.0, 0.2], "fk paged": [800.0, 0.1, 0.1, 0.1],
                       "sdpa": [300.0, 60.0, 55.0, 0.3]},
               decode_warm={"warmup": 4321.0, "fk": [0.2, 0.1, 0.1, 0.1], "fk paged": [0.3, 0.2, 51.0, 0.1]})
    text = first_call.report(run)
    assert "for both caches first (4321 ms):" in text
    assert "| fk, warmed | 0 | 0.1 | 0.10 | 0 of 3 |" in text and "| fk paged, warmed | 0 | 51.0 | 0.20 | 1 of 3 |" in text
    assert "(batch, longest: 1 300, 2 700, 3 1500, 5 2500)" in text
    assert "| fk | 900 | 75.0 | 0.20 | 1 of 3 |" in text
    assert "| fk paged | 800 | 0.1 | 0.10 | 0 of 3 |" in text
    assert "| sdpa | 300 | 60.0 | 55.00 | 2 of 3 |" in text


def test_each_norm_and_the_triton_floor_get_processes_of_their_own(e2e_script, monkeypatch, tmp_path):
    """Cold and warm first calls: attention's cases in one process, each of NORM_OPS and Triton's floor
    in their own, each case's warm process on the caches its cold one filled."""
    import torch

    first_call = e2e_script("first_call")
    spawned = []

    def spawn(case, cache):
        spawned.append((case, cache))
        return [{"op": case}] if case.startswith(("first", "floor")) else {}

    monkeypatch.setattr(first_call, "_spawn", spawn)
    monkeypatch.setattr(first_call, "compile_bytecode", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    run = first_call.measure(tmp_path)
    firsts = ["first", "first-rms_norm", "first-layer_norm", "first-softmax", "floor"]
    assert [row["op"] for row in run["cold"]] == firsts and [row["op"] for row in run["warm"]] == firsts
    pairs = spawned[:2 * len(firsts)]
    assert [case for case, _ in pairs] == [case for case in firsts for _ in range(2)]
    caches = [cache for _, cache in pairs]
    assert caches[0::2] == caches[1::2] and len(set(caches)) == len(firsts)


def test_bytecode_is_compiled_first_unless_asked_not_to(e2e_script, monkeypatch, tmp_path):
    """By default Triton's and fk's bytecode is compiled before the first child starts (a measurement
    as pip installs packages); `--bytecode-as-found` compiles none."""
    import torch

    first_call = e2e_script("first_call")
    events = []
    monkeypatch.setattr(first_call, "compile_bytecode", lambda: events.append("compiled"))
    monkeypatch.setattr(first_call, "_spawn", lambda case, cache: events.append(case) or (
        [] if case.startswith(("first", "floor")) else {}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    run = first_call.measure(tmp_path)
    assert events[0] == "compiled" and events.count("compiled") == 1 and run["meta"]["bytecode"] == "compiled first"
    shown = {key: value for key, value in run.items() if not key.startswith("decode")}
    assert "as `pip install` leaves them" in first_call.report(dict(shown, sweep=dict(fk=[1.0, 1.0], sdpa=[1.0, 1.0]),
                                                                   packed=dict(fk=[1.0, 1.0])))
    events.clear()
    run = first_call.measure(tmp_path, bytecode=False)
    assert "compiled" not in events and "--bytecode-as-found" in run["meta"]["command"]


def test_bytecode_lands_in_the_package(e2e_script, monkeypatch, tmp_path):
    """Each module's bytecode in its package's __pycache__, where Python reads it."""
    first_call = e2e_script("first_call")
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first_call.compile_bytecode(packages=("probe_pkg",))
    assert {p.name.split(".")[0] for p in (package / "__pycache__").glob("*.pyc")} == {"__init__", "mod"}


def test_the_trace_records_each_wrapped_call_with_its_thread_and_names_subprocesses(e2e_script):
    """e2e/first_call_trace.py: a wrapped function or staticmethod still returns its result and
    records (thread, name, start, ms), also when it raises; a subprocess is named by its program."""
    import threading

    import pytest

    trace = e2e_script("first_call_trace")
    trace.EVENTS.clear()

    class Owner:
        @staticmethod
        def stage(x):
            return x + 1

        def method(self, x):
            if x < 0:
                raise ValueError(x)
            return 2 * x

    trace._wrap(Owner, "stage")
    trace._wrap(Owner, "method", lambda a, k: f"method {a[1]}")
    trace._wrap(Owner, "absent")  # (a name this Triton lacks: left alone)
    assert Owner.stage(1) == 2
    worker = threading.Thread(target=lambda: Owner().method(3), name="fk-compile_0")
    worker.start()
    worker.join()
    with pytest.raises(ValueError):
        Owner().method(-1)
    assert [(e[0], e[1]) for e in trace.EVENTS] == [("MainThread", "stage"), ("fk-compile_0", "method 3"),
                                                    ("MainThread", "method -1")]
    assert all(e[3] >= 0 for e in trace.EVENTS)
    assert trace._program((["/usr/bin/gcc", "-O3"],), {}) == "sub:gcc"
    assert trace._program((), {"args": "/opt/cuda/bin/ptxas --version"}) == "sub:ptxas"

"""Where a cold first call's time goes: a timeline of each case's first fwd+bwd in a fresh process.

Each case runs in a child process on an empty Triton and fk cache (cold), then again on that cache
(warm). The child wraps, before fk is imported, what a first call waits for and records each
wrapped call's thread, start (ms from the child's start) and duration: Triton's `compile` and its
stages (`make_ttir` .. `make_cubin`), the C modules it builds with gcc (`build cuda_utils`: its
driver; `build __triton_launcher`: Triton 3.6's launcher per kernel signature), every subprocess
(gcc, ptxas), a compiled kernel's load (`_init_handles`), Triton's cache key (`triton_key`) and
fk's lookup of it (`load_triton_key`); and the call itself (`CALL fwd`, `CALL bwd`, `CALL`).
Cases: `rms_norm`, `layer_norm`, `softmax` and `floor` (Triton's own first launch of a one-line kernel,
without fk), `e2e/first_call.py`'s (`norm_calls`, `triton_floor`).

    bash shared/from-source.sh python e2e/first_call_trace.py [CASE ...] > trace.log

prints per case and kind a `== CASE KIND: CALL ms` line, then the events by start (a warm run's
events over 5 ms only). A subprocess run through `check_output` shows twice (it calls `run`).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

CASES = ("floor", "rms_norm", "layer_norm", "softmax")
STAGES = ("make_ttir", "make_ttgir", "make_llir", "make_ptx", "make_cubin")
T0 = time.perf_counter()
EVENTS: list = []


def _record(name: str, began: float) -> None:
    EVENTS.append((threading.current_thread().name[:14], name, round((began - T0) * 1e3, 1),
                   round((time.perf_counter() - began) * 1e3, 1)))


def _wrap(owner, attr: str, label=None) -> None:
    """`owner.attr` records each call (`label(args, kwargs)` or `label` or attr names it)."""
    raw = inspect.getattr_static(owner, attr, None)
    if raw is None:
        return
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw

    def recorded(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(label(args, kwargs) if callable(label) else (label or attr), began)

    setattr(owner, attr, staticmethod(recorded) if isinstance(raw, staticmethod) else recorded)


def _program(args, kwargs) -> str:
    cmd = args[0] if args else kwargs.get("args")
    first = cmd[0] if isinstance(cmd, (list, tuple)) else str(cmd).split()[0]
    return "sub:" + os.path.basename(str(first))


def _timed(name: str, fn):
    import torch

    torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    _record(name, began)
    return out


def child(case: str) -> None:
    for name in ("run", "check_call", "check_output"):
        _wrap(subprocess, name, _program)
    import torch

    torch.zeros(1, device="cuda")
    import triton.compiler.compiler as compiler
    import triton.runtime.build as build
    import triton.runtime.cache as cache
    from triton.backends.nvidia import compiler as cuda_compiler
    from triton.backends.nvidia import driver as cuda_driver

    _wrap(compiler, "compile", lambda a, k: "compile " + getattr(getattr(a[0], "fn", None), "__name__", "?"))
    for stage in STAGES:
        _wrap(cuda_compiler.CUDABackend, stage)
    for builder in ("compile_module_from_src", "compile_module_from_file"):
        _wrap(build, builder, lambda a, k: "build " + str(k.get("name", "?")))
        if hasattr(cuda_driver, builder):
            setattr(cuda_driver, builder, getattr(build, builder))
    _wrap(compiler.CompiledKernel, "_init_handles")
    _wrap(cache, "triton_key")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import first_call  # (its cases, not copies: imports nothing but the standard library at the top)

    if case == "floor":
        began = time.perf_counter()
        EVENTS.append(("MainThread", "CALL", round((began - T0) * 1e3, 1), first_call.triton_floor()[0]["fk_ms"]))
    else:
        import fk_runtime.ahead as ahead

        _wrap(ahead, "load_triton_key")
        fk, _ = first_call.norm_calls(case)
        began = time.perf_counter()
        y = _timed("CALL fwd", fk)
        _timed("CALL bwd", lambda: y.sum().backward())
        _record("CALL", began)
    print("RESULT " + json.dumps(EVENTS))


def main(cases) -> None:
    for case in cases:
        with tempfile.TemporaryDirectory() as cache_dir:
            for kind in ("cold", "warm"):
                env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "FK_CACHE_DIR": os.path.join(cache_dir, "fk")}
                done = subprocess.run([sys.executable, __file__, "--child", case], env=env, capture_output=True,
                                      text=True, check=False)
                line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"== {case} {kind}: failed\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
                    continue
                events = json.loads(line[len("RESULT "):])
                call = next(e for e in events if e[1] == "CALL")
                print(f"== {case} {kind}: CALL {call[3]} ms")
                for thread, name, start, ms in sorted(events, key=lambda e: e[2]):
                    if kind == "cold" or ms > 5:
                        print(f"   {thread:14s} {name:40s} start {start:8.1f}  {ms:8.1f} ms")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        unknown = set(sys.argv[1:]) - set(CASES)
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; cases: {', '.join(CASES)}")
        main(sys.argv[1:] or CASES)

import subprocess
import sys

import pytest
import torch

from fk_runtime import Backend, backend


def test_backend_matches_the_machine():
    expected = {Backend.INTERPRETER} if not torch.cuda.is_available() else {Backend.CUDA, Backend.HIP}
    if backend.interpreter_requested():
        expected = {Backend.INTERPRETER}
    assert backend.backend() in expected
    assert backend.default_device().type == backend.kernel_device_type()
    assert backend.multiprocessor_count() >= 1
    assert backend.warp_size() in (backend.CUDA_WARP, backend.HIP_WAVEFRONT)
    # The interpreter has no shared memory to size for; a CUDA GPU has tens of KiB at least.
    shared = backend.shared_memory_per_program()
    if backend.is_interpreter():
        assert shared == 0
    elif backend.backend() is Backend.CUDA:
        assert shared >= 48 << 10


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full_env = {k: v for k, v in os.environ.items() if k != backend.INTERPRET_ENV}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env)


def test_detection_never_touches_the_triton_driver():
    """With no GPU, `triton.runtime.driver.active` raises; the runtime must not call it."""
    code = (
        "import fk_runtime.backend as b, fk_runtime.sizing as s\n"
        "b.use_interpreter_without_gpu()\n"
        "print(b.backend().value, s.num_warps_for(4096), b.multiprocessor_count())\n"
    )
    out = _run(code, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "interpreter"


def test_interpreter_must_be_set_before_triton_import():
    code = (
        "import triton, fk_runtime.backend as b\n"
        "try:\n    b.use_interpreter_without_gpu()\nexcept RuntimeError as e:\n    print('raised', e)\n"
    )
    out = _run(code, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 0, out.stderr
    assert "raised" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


def test_backend_is_decided_outside_compiled_code():
    """torch.compile of a function calling an fk check traces without a graph break."""
    from fk_runtime import checks

    def f(x):
        checks.check_tensor("x", x, min_dim=1)
        return x * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x * 2)


def test_interpreter_numpy_pairs_that_cannot_run_say_so(monkeypatch):
    """Triton 3.6's interpreter under numpy >= 2.4 fails deep inside a kernel; the setup says why
    first, naming the fix. Other pairs pass."""
    import numpy
    import triton

    for triton_version, numpy_version, refused in (("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False),
                                                   ("3.7.1", "2.4.6", False), ("3.9.0", "2.5.0rc1", False),
                                                   ("3.6.0", "2.10.0", True)):
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        if refused:
            with pytest.raises(RuntimeError, match=r"numpy < 2\.4"):
                backend.check_interpreter_numpy()
        else:
            backend.check_interpreter_numpy()


def test_release_reads_major_and_minor():
    """One reading of a version string for every per-version choice (launch layout, Gluon, plans)."""
    import triton

    assert backend.release("3.8.0") == (3, 8)
    assert backend.release("3.10.0rc1") == (3, 10)
    assert backend.release("3.9.0+git1a2b3c") == (3, 9)
    assert backend.release("main") is None
    assert backend.triton_release() == backend.release(triton.__version__)
    assert backend.triton_at_least((3, 6)) and not backend.triton_at_least((99, 0))


def test_every_supported_triton_has_the_cache_key_fk_hashes_ahead():
    """`launch.hash_triton` (run in a thread at import on a GPU) finds Triton's cache-key function
    on this Triton, so the first compile of a process does not wait for it."""
    from fk_runtime import launch

    assert launch.hash_triton()


def test_triton_key_is_read_back_from_the_cache_file(tmp_path, monkeypatch):
    """The first process hashes Triton's sources and stores the key under their sizes and times;
    the next reads it back, and Triton's cache then uses the same key (`ahead.load_triton_key`)."""
    import sys

    from fk_runtime import ahead
    from triton.runtime import cache

    monkeypatch.setenv(ahead.CACHE_DIR_ENV, str(tmp_path))
    original = cache.triton_key
    holders = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("triton") and getattr(m, "triton_key", None) is original]
    for module in holders:
        monkeypatch.setattr(module, "triton_key", original)
    expected = original()
    assert ahead.load_triton_key() is False  # hashed, then stored
    assert len(list(tmp_path.glob("triton-key-*.json"))) == 1
    assert cache.triton_key() == expected and cache.triton_key is not original
    for module in holders:
        monkeypatch.setattr(module, "triton_key", original)
    assert ahead.load_triton_key() is True  # read back
    assert all(m.triton_key() == expected and m.triton_key is not original for m in holders)
    signature = ahead.triton_signature()
    assert signature == ahead.triton_signature()


def test_compiles_submitted_ahead_finish_before_their_kernel_is_waited_for():
    """`ahead.submit` runs a kernel's compile in the pool; `ahead.wait(kernel)` returns only once
    every compile submitted for that kernel ran; a failing compile is left to the launch."""
    import threading
    import time

    from fk_runtime import ahead

    kernel, other, done = object(), object(), []
    gate = threading.Event()

    def slow():
        gate.wait(5)
        time.sleep(0.05)
        done.append("slow")

    def fails():
        raise RuntimeError("a compile error: the launch reports it")

    ahead.submit(kernel, slow)
    ahead.submit(kernel, fails)
    ahead.submit(other, lambda: done.append("other"))
    assert "slow" not in done
    gate.set()
    ahead.wait(kernel)
    assert "slow" in done
    ahead.wait(other)
    assert "other" in done
    ahead.wait(kernel)  # nothing left: returns at once


def test_finish_waits_for_every_compile_submitted_ahead():
    """`ahead.finish()` returns only once every kernel's submitted compiles ran (what a host timing
    waits for after its warm-up), and leaves `wait` nothing to wait for."""
    import threading
    import time

    from fk_runtime import ahead

    kernels, done = (object(), object()), []
    gate = threading.Event()

    def slow(name):
        def compile_fn():
            gate.wait(5)
            time.sleep(0.05)
            done.append(name)
        return compile_fn

    for i, kernel in enumerate(kernels):
        ahead.submit(kernel, slow(i))
    assert done == []
    gate.set()
    ahead.finish()
    assert sorted(done) == [0, 1]
    ahead.wait(kernels[0])


def test_compile_ahead_is_off_on_the_interpreter_and_with_fk_prewarm_0(monkeypatch):
    from fk_runtime import ahead, backend

    with ahead.compile_ahead():
        assert ahead.active() is (not backend.is_interpreter())
    assert not ahead.active()
    monkeypatch.setenv(ahead.PREWARM_ENV, "0")
    with ahead.compile_ahead():
        assert not ahead.active()
    assert not ahead.useful(torch.zeros(1))


def _bare_launch(kernel, grid=(1, 1, 1), tail=(), meta=None):
    """A Launch of a stand-in `kernel` (Launch() refuses a kernel the interpreter did not make)."""
    from fk_runtime import launch

    run = launch.Launch.__new__(launch.Launch)
    run.kernel, run.grid, run.tail, run.meta, run.device = kernel, grid, tail, meta or {}, None
    return run


def test_a_compile_ahead_loads_what_it_compiled():
    """The pool's compile also loads the kernel (`CompiledKernel._init_handles`, where Triton 3.6
    builds the launcher for its signature with a C compiler), so its first launch waits for
    neither; an autotuner's warm-up (a list) is left alone."""
    import triton.compiler.compiler

    assert callable(getattr(triton.compiler.compiler.CompiledKernel, "_init_handles", None))
    loaded, warmed = [], []

    class Compiled:
        def _init_handles(self):
            loaded.append(True)

    class Kernel:
        def __init__(self, result):
            self.result = result

        def warmup(self, *args, grid, **meta):
            warmed.append((args, grid, meta))
            return self.result

    for result in (Compiled(), [Compiled()]):
        _bare_launch(Kernel(result), (3, 1, 1), (7,), {"BLOCK": 4})._compile((5,))
    assert warmed == [((5, 7), (3, 1, 1), {"BLOCK": 4})] * 2
    assert loaded == [True]


def test_the_launcher_built_alongside_is_the_source_triton_36_loads(monkeypatch):
    """`ahead._launcher_source` is the C source Triton's `CudaLauncher` builds for the same kernel
    (a plain one, and a Gluon one with descriptors), so the build during the compile is the cache
    entry the load finds; a tl kernel's descriptors are left to the load. Read against Triton 3.6
    (the oldest-Triton test run has it); later Tritons build no launcher per signature."""
    import types

    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from fk_runtime import ahead

    if backend.triton_release() not in ahead.LAUNCHER_ALONGSIDE_VERSIONS:
        pytest.skip("this Triton builds no launcher per kernel signature (nothing to build alongside)")
    cuda = pytest.importorskip("triton.backends.nvidia.driver")

    def kernel(x_ptr, desc, n, BLOCK):
        pass

    fn = JITFunction(kernel)
    built = []
    monkeypatch.setattr(cuda, "library_dirs", lambda: [])  # (no libcuda here: its lookup asserts)
    monkeypatch.setattr(cuda, "compile_module_from_src", lambda src, **kw: built.append(src) or types.SimpleNamespace(
        launch=None))
    meta = dict(num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False)
    plain = {"x_ptr": "*fp32", "desc": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    described = {**plain, "desc": "tensordesc<bf16[64, 64],NVMMASharedLayout(swizzle=128)>"}
    for signature, tensordesc_meta, gluon in ((plain, [], False), (plain, None, False),
                                              (described, [{"swizzle": 128}], True)):
        src = ASTSource(fn, signature, {(3,): 1024}, {})
        cuda.CudaLauncher(src, types.SimpleNamespace(tensordesc_meta=tensordesc_meta, **meta))
        assert ahead._launcher_source(src, gluon) == built[-1]
        # a descriptor taken as a TMA descriptor, not as pointer, shapes and strides
        assert (cuda.make_launcher(src.constants, signature, None) != built[-1]) is gluon
    assert ahead._launcher_source(ASTSource(fn, described, {(3,): 1024}, {}), False) is None


def test_a_wrapped_build_returns_only_once_its_launcher_is_built(monkeypatch):
    """The wrapped compile hands back the compile's result after the launcher's build has ended
    (the load then finds it built); a build that fails raises nothing."""
    import time

    from fk_runtime import ahead

    events = []

    def build(src, gluon):
        time.sleep(0.05)
        events.append(("built", src, gluon))

    monkeypatch.setattr(ahead, "_build_launcher", build)
    wrapped = ahead._compile_alongside(lambda src, **kw: events.append(("compiled", src, kw)) or "kernel", gluon=True)
    assert wrapped.fk_alongside
    assert wrapped("src", target="t") == "kernel"
    assert sorted(events, key=str) == [("built", "src", True), ("compiled", "src", {"target": "t"})]
    monkeypatch.undo()
    ahead._build_launcher(object(), False)  # its own errors stay inside (the load builds and reports)


def test_ptxas_is_asked_ahead_only_where_compiles_ahead_are_on(monkeypatch):
    """`ahead.start_tools` starts no thread with FK_PREWARM=0 nor off a CUDA GPU (the interpreter)."""
    from fk_runtime import ahead

    monkeypatch.setattr(ahead, "_tools_asked", type(ahead._tools_asked)())
    started = list(ahead._starting)
    monkeypatch.setenv(ahead.PREWARM_ENV, "0")
    ahead.start_tools(None)
    assert ahead._starting == started and not ahead._tools_asked.is_set()
    monkeypatch.delenv(ahead.PREWARM_ENV)
    ahead.start_tools(None)
    assert ahead._tools_asked.is_set() is (backend.backend() is Backend.CUDA)
    ahead.wait_key()


def test_launcher_alongside_wraps_a_kernel_once_and_only_where_it_builds(monkeypatch):
    """On Triton 3.6 compiling for a GPU, a kernel's compile is wrapped once (a second call leaves
    it); on the interpreter, on other Tritons and with FK_PREWARM=0 it is left as it is."""
    from triton.runtime.jit import JITFunction

    from fk_runtime import ahead

    def kernel(x_ptr, n):
        pass

    builds = not backend.is_interpreter() and backend.triton_release() in ahead.LAUNCHER_ALONGSIDE_VERSIONS
    fn = JITFunction(kernel)
    ahead.launcher_alongside(fn)
    assert getattr(getattr(fn, "compile", None), "fk_alongside", False) is builds
    wrapped = getattr(fn, "compile", None)
    ahead.launcher_alongside(fn)
    assert getattr(fn, "compile", None) is wrapped
    monkeypatch.setenv(ahead.PREWARM_ENV, "0")
    other = JITFunction(kernel)
    ahead.launcher_alongside(other)
    assert not getattr(getattr(other, "compile", None), "fk_alongside", False)


def test_a_launch_that_compiled_runs_the_collector_once_its_burst_is_over(monkeypatch):
    """After a first launch slower than `COMPILED_LAUNCH_S` (it compiled, or waited for a compile
    ahead: a kernel Triton's cache does not date) with no compile left in the pool, one full pass of
    Python's collector; none after a fast launch, none while the pool still compiles, none where
    the collector is off."""
    import gc
    import time
    import types

    from fk_runtime import ahead, launch

    monkeypatch.setattr(backend, "is_interpreter", lambda: False)
    monkeypatch.setattr(launch, "_compiled_launcher", lambda compiled: False)
    monkeypatch.setattr(ahead, "idle", lambda: True)  # (an earlier test's compiles may still run in the pool)
    passes = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: passes.append(generation))
    # The launch's own clock, moved only by the kernel: a loaded host's thread switches take no part.
    clock = [0.0]
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))

    class Kernel:
        def __init__(self, seconds):
            self.seconds = seconds

        def __getitem__(self, grid):
            return lambda *args, **meta: clock.__setitem__(0, clock[0] + self.seconds)

    def launched(seconds):
        _bare_launch(Kernel(seconds))._slow((1.0,))

    slow = 2 * launch.COMPILED_LAUNCH_S
    launched(0)
    assert passes == []
    launched(slow)
    assert passes == [2]
    monkeypatch.setattr(ahead, "idle", lambda: False)
    launched(slow)
    assert passes == [2]
    monkeypatch.setattr(ahead, "idle", lambda: True)
    gc.disable()
    try:
        launched(slow)
    finally:
        gc.enable()
    assert passes == [2]


def test_the_collector_follows_kernels_compiled_here_not_ones_loaded_from_an_earlier_process(monkeypatch, tmp_path):
    """A slow first launch runs the collector only where a kernel was compiled in this process since
    the last pass (its file in Triton's cache newer than fk's import), by this launch or ahead in
    the pool; a kernel loaded from an earlier process's cache (an older file) takes none."""
    import gc
    import os
    import time
    import types

    from fk_runtime import ahead, launch

    monkeypatch.setattr(backend, "is_interpreter", lambda: False)
    monkeypatch.setattr(launch, "_compiled_launcher", lambda compiled: False)
    monkeypatch.setattr(ahead, "idle", lambda: True)
    passes = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: passes.append(generation))
    launch._COMPILED.clear()

    def cached(name, age_s):
        path = tmp_path / f"{name}.json"
        path.write_text("{}")
        stamp = launch._IMPORTED_AT + age_s
        os.utime(path, (stamp, stamp))
        return types.SimpleNamespace(metadata_group={f"{name}.cubin": str(tmp_path / "absent"),
                                                     f"{name}.json": str(path)})

    class Kernel:
        def __init__(self, result):
            self.result = result

        def __getitem__(self, grid):
            def run(*args, **meta):
                time.sleep(2 * launch.COMPILED_LAUNCH_S)
                return self.result
            return run

        def warmup(self, *args, **meta):
            return self.result

    def first_launch(result, in_pool=False):
        run = _bare_launch(Kernel(result))
        if in_pool:
            run._compile((1.0,))
        else:
            run._slow((1.0,))

    first_launch(cached("loaded", -3600))
    assert passes == []
    first_launch(cached("compiled", 1))
    assert passes == [2]
    first_launch(cached("loaded", -3600))
    assert passes == [2]
    first_launch(cached("ahead", 1), in_pool=True)
    assert passes == [2]
    first_launch(cached("loaded", -3600))
    assert passes == [2, 2]
    first_launch(types.SimpleNamespace(metadata_group={"gone.json": str(tmp_path / "gone.json")}))
    assert passes == [2, 2, 2]  # no file to read: the launch's time decides, as without a cache


def test_the_pool_is_idle_once_its_compiles_end():
    """`ahead.idle` is false while a compile submitted ahead runs, true once it has ended."""
    import threading

    from fk_runtime import ahead

    go = threading.Event()
    assert ahead.idle()
    try:
        ahead.submit("kernel", go.wait)
        assert not ahead.idle()
    finally:
        go.set()
    ahead.wait("kernel")
    assert ahead.idle()


def test_a_key_binds_ahead_once_and_first_gradients_take_both_layouts(monkeypatch):
    """`ahead.first` says yes once per key, and only where compiling ahead serves the tensors;
    `ahead.upstream_gradients` gives a dense and a broadcast (zero-stride) placeholder like y."""
    from fk_runtime import ahead
    from fk_runtime.launch import PlanCache

    cache, x = PlanCache(), torch.zeros(3, 4)
    monkeypatch.setattr(ahead, "useful", lambda *tensors: False)
    assert not ahead.first(cache, "k", x) and "k" not in cache
    monkeypatch.setattr(ahead, "useful", lambda *tensors: True)
    assert ahead.first(cache, "k", x) and not ahead.first(cache, "k", x)
    dense, broadcast = ahead.upstream_gradients(x)
    assert dense.shape == broadcast.shape == x.shape and dense.is_contiguous() and broadcast.stride() == (0, 0)

"""First calls that wait less: Triton's cache key read back instead of hashed, and kernels
compiled ahead of their first launch, in threads.

- Triton keys its on-disk cache by `triton_key()`, a sha256 of its sources and of libtriton
  (about 500 MB) computed once per process: 0.4-0.5 s before a process's first kernel is compiled
  or loaded from the cache. `start_key()` (at import on a GPU) looks the key up in a file
  keyed by the size and modification time of every file under the folders Triton hashes; on a
  miss a thread hashes as before and stores it. Either way `triton.runtime.cache.triton_key` (and
  each module's copy of that name) then returns the key, as Triton's own compile pools set it.
- `compile_ahead()`: a context in which a launch's first call (the one that would compile) hands
  its compile to a thread pool and returns without running: an op builds its backward's plan
  while its forward compiles, and the compiles overlap (Triton's MLIR and LLVM passes and ptxas
  run without the GIL: on a 2-core CPU, three large kernels compiled in 1.3 s in threads
  against 2.1 s one after the other). The launch that needs a kernel first waits for its compile.
- Two C modules Triton builds with gcc on an empty cache, 0.25-0.7 s each on the H200s' hosts, are
  built beside other work rather than after it: `start_driver()` (at import) makes Triton's CUDA
  driver, whose `cuda_utils` module every first launch waits for, while the key is read or hashed;
  `launcher_alongside(kernel)` builds Triton 3.6's per-signature launcher while the kernel compiles
  (3.7 on launch every kernel through one generic launcher, in `cuda_utils`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

from . import backend
from .ops import traced, transforms_active

# FK_PREWARM=0: neither the key lookup at import nor compiles ahead (every launch compiles itself).
PREWARM_ENV = "FK_PREWARM"
# Where the Triton key is kept: FK_CACHE_DIR, else ~/.cache/fk (as the tuning picks).
CACHE_DIR_ENV = "FK_CACHE_DIR"
# The folders of the Triton package that `triton_key` hashes (with runtime/cache.py itself).
HASHED_FOLDERS = ("_C", "backends", "compiler", "language")
# Compiles at once in the pool (each one mostly outside the GIL).
AHEAD_WORKERS = 4
# (major, minor) Tritons whose launcher `launcher_alongside` builds during the compile: those whose
# `make_launcher` / `CudaLauncher` it was read against (3.6.0).
LAUNCHER_ALONGSIDE_VERSIONS = ((3, 6),)

_starting: list[threading.Thread] = []  # the key's, the driver's, ptxas's threads (`wait_key` joins them)
_driver_thread: threading.Thread | None = None
_THREAD = threading.local()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# kernel -> futures of its compiles in flight (a launch that compiles the kernel waits for them)
_pending: dict = {}


def enabled() -> bool:
    return os.environ.get(PREWARM_ENV, "1") != "0"


def useful(*tensors) -> bool:
    """Whether compiling ahead can serve a call on `tensors`: on (FK_PREWARM), a GPU's tensors,
    Triton compiling for it (not its interpreter), eager (no tracer or torch.func transform)."""
    # the interpreter first: there it is asked on every recorded call (nothing is bound ahead)
    return (not backend.is_interpreter() and enabled() and all(t is None or t.device.type != "cpu" for t in tensors)
            and not traced(tuple(t for t in tensors if t is not None)) and not transforms_active())


def first(cache, key, *tensors) -> bool:
    """Whether a recorded call of `key` binds its backward ahead now: compiling ahead serves
    `tensors` (`useful`) and no call of `key` did so before (`cache`, the op's PlanCache, keeps it)."""
    if key in cache or not useful(*tensors):
        return False
    cache.get_or_build(key, lambda: True)
    return True


def upstream_gradients(y) -> tuple:
    """Placeholders of the upstream gradients a first backward of output `y` brings, which compile
    apart: laid out like y (a model's) and one value broadcast over y (`y.sum().backward()`: zero
    strides)."""
    return y.new_empty(y.shape), y.new_empty(()).expand(y.shape)


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "fk")


def triton_signature() -> str | None:
    """A digest of the version, path, size and modification time of every file `triton_key`
    reads (and a few more); None where this Triton has no `triton_key`."""
    try:
        import triton
        from triton.runtime import cache
    except ImportError:
        return None
    if not hasattr(cache, "triton_key"):
        return None
    root = Path(triton.__file__).parent
    facts = [triton.__version__, str(root), sys.version]
    for folder in (root / name for name in HASHED_FOLDERS):
        for path, _, files in sorted(os.walk(folder)):
            for name in sorted(files):
                st = os.stat(os.path.join(path, name))
                facts.append(f"{os.path.relpath(os.path.join(path, name), root)} {st.st_size} {st.st_mtime_ns}")
    st = os.stat(cache.__file__)
    facts.append(f"cache.py {st.st_size} {st.st_mtime_ns}")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()


def _key_file(signature: str) -> Path:
    return _cache_root() / f"triton-key-{signature[:32]}.json"


def _use_key(key: str) -> None:
    """Every loaded Triton module's `triton_key` returns `key` (the original's value)."""
    from triton.runtime import cache

    original = cache.triton_key

    def triton_key():
        return key

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("triton") and getattr(module, "triton_key", None) is original:
            module.triton_key = triton_key


def load_triton_key() -> bool:
    """Set Triton's cache key from the file its signature names, or hash it and store it there.
    True where the key came from the file; False where it was hashed (or there is no such key)."""
    signature = triton_signature()
    if signature is None:
        return False
    from triton.runtime import cache

    path = _key_file(signature)
    try:
        key = json.loads(path.read_text())["triton_key"]
    except (OSError, ValueError, KeyError, TypeError):
        key = None
    if isinstance(key, str):
        _use_key(key)
        return True
    key = cache.triton_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"triton_key": key}))
        os.replace(scratch, path)  # whole files only, with several processes at once
    except OSError:
        pass  # a read-only home: hashed again in the next process
    _use_key(key)
    return False


def start_key() -> None:
    """`load_triton_key` in a thread (file reads and hashlib release the GIL); `wait_key` joins it."""
    thread = threading.Thread(target=load_triton_key, name="fk-triton-key", daemon=True)
    _starting.append(thread)
    thread.start()


def start_driver() -> None:
    """Triton's CUDA driver made in a thread (making it builds or loads `cuda_utils`, a gcc run of
    0.25-0.7 s on an empty cache: a subprocess, outside the GIL); `wait_key` joins it, so that no
    launch makes a second driver meanwhile (each of five compile threads built its own: a cold
    process's trace, H200, Triton 3.6)."""
    global _driver_thread
    _driver_thread = threading.Thread(target=_make_driver, name="fk-triton-driver", daemon=True)
    _starting.append(_driver_thread)
    _driver_thread.start()


_tools_asked = threading.Event()


def start_tools(device: int | None) -> None:
    """At a process's first launch on a CUDA GPU, ask ptxas for its version in a thread (the
    compile's cache key and its PTX version each run `ptxas --version`: 5-120 ms each in a cold
    process's load) while the key is awaited; `wait_key` joins it."""
    if _tools_asked.is_set() or not enabled() or backend.backend() is not backend.Backend.CUDA:
        return
    _tools_asked.set()
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    thread = threading.Thread(target=_ask_tools, args=(major * 10 + minor,), name="fk-ptxas", daemon=True)
    _starting.append(thread)
    thread.start()


def _ask_tools(arch: int) -> None:
    if _driver_thread is not None:
        _driver_thread.join()  # (the backends' modules import with it: one thread importing them at a time)
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        compiler = make_backend(GPUTarget("cuda", arch, 32))
        compiler.hash()  # `ptxas --version` into its cache
        sys.modules[type(compiler).__module__].get_ptxas(arch).version  # noqa: B018 (and the tool's own)
    except Exception:  # noqa: BLE001 (the compile asks again and reports)
        pass


def _make_driver() -> None:
    try:
        from triton.runtime import driver

        driver.active  # noqa: B018 (made on first read; nothing asked of CUDA: a fork after import stays legal)
    except Exception:  # noqa: BLE001 (the first launch makes it again and raises)
        pass


def wait_key() -> None:
    """Wait for the key's, the driver's and ptxas's threads, if any: else Triton hashes its sources
    again (and builds its driver again) rather than wait."""
    for thread in _starting:
        thread.join()


_alongside_lock = threading.Lock()


def launcher_alongside(kernel) -> None:
    """On LAUNCHER_ALONGSIDE_VERSIONS, `kernel`'s compiles on the current device build its launcher
    (Triton 3.6's C module per kernel signature, 0.2-0.3 s of gcc that loading the compiled kernel
    waits for) in a thread during the compile: the load then finds it in Triton's cache. Only a
    cache warmed ahead: the load builds its own source as ever, so a guess that differs costs a
    build, never a wrong launcher. Elsewhere (the interpreter, other Tritons) nothing."""
    if not enabled() or backend.is_interpreter() or backend.triton_release() not in LAUNCHER_ALONGSIDE_VERSIONS:
        return
    fn = kernel
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):  # an autotuner's JIT function
        fn = fn.fn
    if not hasattr(fn, "device_caches"):
        return
    from triton.runtime import driver

    with _alongside_lock:
        fn.device_caches[driver.active.get_current_device()]  # its binder, which sets `fn.compile`
        compile_fn = getattr(fn, "compile", None)
        if compile_fn is None or getattr(compile_fn, "fk_alongside", False):
            return
        fn.compile = _compile_alongside(compile_fn, gluon=getattr(fn, "is_gluon", lambda: False)())


def _compile_alongside(compile_fn, gluon: bool):
    def compile_and_build(src, *args, **kwargs):
        thread = threading.Thread(target=_build_launcher, args=(src, gluon), name="fk-launcher", daemon=True)
        thread.start()
        try:
            return compile_fn(src, *args, **kwargs)
        finally:
            thread.join()

    compile_and_build.fk_alongside = True
    return compile_and_build


def _launcher_source(src, gluon: bool) -> str | None:
    """The C source Triton 3.6's `CudaLauncher` will build for `src` (an ASTSource), as it computes
    it; None where it depends on the compile: a tl kernel's tensor descriptors (lowered to TMA or
    not). A Gluon kernel's descriptors are TMA descriptors, and the source reads only that."""
    from triton.backends.nvidia import driver as cuda

    signature = dict(src.signature)
    descriptors = sum(isinstance(s, str) and s.startswith("tensordesc") for s in signature.values())
    if descriptors and not gluon:
        return None
    constants = {((src.fn.arg_names.index(k),) if isinstance(k, str) else k): v
                 for k, v in getattr(src, "constants", {}).items()}
    return cuda.make_launcher(constants, signature, [{}] * descriptors or None)


def _build_launcher(src, gluon: bool) -> None:
    """Build (or find in Triton's cache) `_launcher_source(src, gluon)` as `CudaLauncher` would."""
    try:
        from triton.backends.nvidia import driver as cuda

        text = _launcher_source(src, gluon)
        if text is not None:
            cuda.compile_module_from_src(src=text, name="__triton_launcher", library_dirs=cuda.library_dirs(),
                                         include_dirs=cuda.include_dirs, libraries=cuda.libraries)
    except Exception:  # noqa: BLE001 (the load builds its own and reports)
        pass


@contextlib.contextmanager
def compile_ahead():
    """In this thread, a launch that would compile submits the compile (`submit`) and returns."""
    previous = getattr(_THREAD, "ahead", False)
    _THREAD.ahead = enabled() and not backend.is_interpreter()
    try:
        yield
    finally:
        _THREAD.ahead = previous


def active() -> bool:
    """Whether this thread is inside `compile_ahead()`."""
    return getattr(_THREAD, "ahead", False)


def submit(kernel, compile_fn) -> None:
    """Run `compile_fn()` (a warm-up compile of `kernel`) in the pool; errors are dropped (the
    launch that needs the kernel compiles it again and raises)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(AHEAD_WORKERS, thread_name_prefix="fk-compile")
        future = _pool.submit(_quietly, compile_fn)
        _pending.setdefault(kernel, []).append(future)


def _quietly(compile_fn) -> None:
    wait_key()
    try:
        compile_fn()
    except Exception:  # noqa: BLE001 (the launch that needs the kernel reports it)
        pass


def finish() -> None:
    """Wait for every compile submitted ahead and for the key thread: a timing that starts after
    it sees no compile thread holding the GIL (a recorded forward whose backward never ran leaves
    its backward's compiles running for seconds)."""
    wait_key()
    with _pool_lock:
        futures = [f for pending in _pending.values() for f in pending]
    for future in futures:
        future.result()


def idle() -> bool:
    """Whether every compile submitted ahead has ended."""
    with _pool_lock:
        return all(future.done() for pending in _pending.values() for future in pending)


def wait(kernel) -> None:
    """Wait for the compiles of `kernel` submitted ahead, so that its launch finds it compiled."""
    if not _pending:
        return
    with _pool_lock:
        futures = _pending.pop(kernel, ())
    for future in futures:
        future.result()

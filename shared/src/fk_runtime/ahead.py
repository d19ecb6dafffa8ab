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

_hashing: list[threading.Thread] = []
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
    _hashing.append(thread)
    thread.start()


def wait_key() -> None:
    """Wait for the key thread, if any: else Triton hashes its sources again rather than wait."""
    for thread in _hashing:
        thread.join()


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

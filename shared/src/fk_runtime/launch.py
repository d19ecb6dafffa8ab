"""Kernel launches that cost what a compiled kernel's launch costs, not Triton's JIT dispatch.

`kernel[grid](*args, **meta)` binds and specializes every argument, builds a cache key string and
checks globals on each call: tens of microseconds, more than a memory-bound kernel on a few MB
takes on the GPU. An op decides its plan once per (shape, strides, dtype, device, flags) and binds
each launch of that plan here: grid, the arguments fixed by the plan (sizes, strides: the tail)
and the meta-parameters. A call passes only what changes from call to call (the tensors, leading
the kernel's arguments) and, after the first call of a specialization, goes straight to the
compiled kernel's launcher.

What Triton specializes on must stay in the key of whatever reaches the compiled kernel: the
plan's key holds shapes, strides, dtypes and the device (so every int argument and every
constexpr), and a `Launch` keys its compiled kernels on the 16-byte alignment of the tensors it
is given (Triton's pointer specialization). The stream is read at every call (CUDA graphs and
side streams see their own).

The compiled launcher's argument layout is Triton's internal business, and it changed in 3.7:
- 3.5 and 3.6 build a C launcher per kernel signature, which takes every argument positionally
  after 13 leading ones (`PER_SIGNATURE_VERSIONS`);
- 3.7 on launch every kernel through one C function, `driver.active.utils.launch`, which takes the
  kernel's arguments as one sequence and drops the constexprs itself, by annotations the
  kernel's launcher object holds (`GENERIC_VERSIONS`). From 3.8 a `CompiledKernel` unloads its
  module when it is freed, so an entry keeps it alive as long as it keeps its function handle.
The direct path is taken only under those versions, whose layouts were read and checked. On the
interpreter, with a launch hook set (profilers), or under any other Triton version (with a
warning, once), every call takes `kernel[grid](...)`: right everywhere, tens of microseconds
slower.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import threading
import time
import warnings

import torch

from . import ahead, backend

# (major, minor) Triton versions whose compiled launcher takes the arguments `_launcher_entry`
# passes (13 leading arguments) and whose descriptor wrapper `_tensordesc_fast_path` mirrors: 3.4
# passes 12 and expands only its own descriptor classes.
PER_SIGNATURE_VERSIONS = ((3, 5), (3, 6))
# Versions whose one generic C launcher `_generic_entry` calls (read in 3.7.1, 3.8.0 and 3.9.0).
GENERIC_VERSIONS = ((3, 7), (3, 8), (3, 9))
LAUNCHER_VERSIONS = PER_SIGNATURE_VERSIONS + GENERIC_VERSIONS
# Triton specializes pointers on this alignment (bytes).
POINTER_ALIGN = 16
# Compiled kernels one Launch keeps (one per alignment pattern of its tensors).
MAX_SPECIALIZATIONS = 16
# Floating-point contraction (a * b + c as one FMA), pinned: Triton 3.9 warns while it is left to
# its default and 3.10 turns the default off; fk's kernels were written and measured with it on.
FP_FUSION = True
# FK_PREWARM=0: no Triton cache key looked up or hashed at import, no compiles ahead (`ahead`).
PREWARM_ENV = ahead.PREWARM_ENV
# A first launch slower than this (s), its wait for a compile ahead included, runs Python's collector
# where a kernel was compiled since the last pass and no compile is left (`_collect_after_compile`).
COMPILED_LAUNCH_S = 0.05
# Bound plans an op keeps (and the size of its plan functions' caches): a model uses a handful of
# shapes; a sweep over thousands should not grow without bound.
PLAN_CACHE_SIZE = 1024


@dataclasses.dataclass(slots=True)  # (built per call: a slotted init is the cheaper one)
class Descriptor:
    """A TMA tensor descriptor as the compiled launcher reads it (base, shape, strides, padding),
    built without Triton's per-call checks: the op validates once per plan. The first launch of a
    specialization hands Triton a real `TensorDescriptor` (`real`): Gluon's, with its shared-memory
    `layout`, for a Gluon kernel."""

    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    padding: str = "zero"
    layout: object = None
    round_f32_to_tf32 = False  # what Triton >= 3.7's descriptor wrapper also reads (fk never rounds)

    def real(self):
        if self.layout is not None:
            from .gluon import TensorDescriptor as GluonDescriptor

            return GluonDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                   self.layout, self.padding)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                self.padding)


# The raw current device and stream, as Triton's own launch reads them (public APIs as fallback).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                   or (lambda index: torch.cuda.current_stream(index).cuda_stream))


# Threads whose CUDA context this module has made current (see `bind_context`).
_THREAD = threading.local()


def bind_context(device: int | None = None) -> None:
    """Make `device`'s (default: the current one's) primary CUDA context current in this thread
    where none is, once per thread. A fresh thread (autograd's backward thread, a server's worker)
    has none until some CUDA runtime call binds one, and Triton's launcher fills TMA descriptors
    before its launch would: "invalid device context". Driver calls only (legal under capture)."""
    if getattr(_THREAD, "bound", False):
        return
    if backend.backend() is backend.Backend.CUDA:
        import ctypes

        if device is None:
            device = _current_device()
        driver = ctypes.CDLL("libcuda.so.1")
        context = ctypes.c_void_p()
        if driver.cuCtxGetCurrent(ctypes.byref(context)) == 0 and not context.value:
            handle = ctypes.c_int()
            if driver.cuDeviceGet(ctypes.byref(handle), device) == 0 and \
                    driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle) == 0:
                driver.cuCtxSetCurrent(context)
    _THREAD.bound = True  # other backends: nothing to bind, and the fast path must stay open


def _interpreted(kernel) -> bool:
    """Whether Triton made `kernel` for its interpreter (it decides when `@triton.jit` runs): with
    no GPU and TRITON_INTERPRET unset then, a launch dies in Triton's driver lookup instead."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _idle(hook) -> bool:
    """No launch hook: None (older Triton) or an empty hook chain (Triton >= 3.5)."""
    return hook is None or getattr(hook, "calls", True) == []


def _runtime_knobs():
    """Triton's runtime knobs (launch hooks), or None where this Triton has none: no fast path."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


def _trailing_constexprs(kernel, meta: dict) -> tuple | None:
    """The values of `kernel`'s constexpr parameters in order, when they all come after its other
    parameters (the compiled launcher takes every parameter positionally); else None."""
    params = getattr(kernel, "params", None)
    if params is None:
        return None
    flags = [p.is_constexpr for p in params]
    first = flags.index(True) if True in flags else len(flags)
    if not all(flags[first:]):
        return None
    values = []
    for p in params[first:]:
        if p.name in meta:
            values.append(meta[p.name])
        elif p.has_default:
            values.append(p.default)
        else:
            return None
    return tuple(values)


def _compiled_launcher(compiled) -> bool:
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


@functools.cache
def launcher_layout(version: str | None = None) -> str | None:
    """How this Triton's (or `version`'s) compiled kernels are launched directly: "per-signature"
    (3.5, 3.6), "generic" (3.7 on), or None where fk has not read the layout (Triton's dispatch)."""
    v = backend.triton_release(version)
    if v in PER_SIGNATURE_VERSIONS:
        return "per-signature"
    return "generic" if v in GENERIC_VERSIONS else None


def launcher_layout_known(version: str | None = None) -> bool:
    """Whether this Triton's (or `version`'s) compiled launcher is one `Launch` may call directly."""
    return launcher_layout(version) is not None


@functools.cache
def _warn_unknown_layout() -> None:
    """Once per process: this Triton's launches take its own dispatch (slower, still right)."""
    import triton

    warnings.warn(f"fk: Triton {triton.__version__}'s kernel launcher is not one fk has checked "
                  f"({', '.join(f'{a}.{b}' for a, b in LAUNCHER_VERSIONS)}); kernels launch through Triton's "
                  "own dispatch, tens of microseconds more per call", RuntimeWarning, stacklevel=4)


# The closure of Triton 3.6's per-call descriptor wrapper (`wrap_handle_tensordesc`'s `inner`).
_TENSORDESC_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")


def _fill_tma_descriptor():
    import triton

    return triton.runtime.driver.active.utils.fill_tma_descriptor


def _tensordesc_fast_path(wrapper, n_head: int, fill=None) -> tuple | None:
    """(C launcher, descriptor expansions) where `wrapper` is Triton 3.6's Python wrapper that
    expands host TMA descriptors on every launch (a loop over every argument: about 10 µs of
    Python per launch on a server CPU): `_expand` does the same for fk's descriptors, which all
    lie in the head. None where the wrapper is another one (other Triton versions): it is used."""
    import sys

    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or closure is None or tuple(sorted(code.co_freevars)) != _TENSORDESC_WRAPPER_CELLS:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
    to_host = getattr(sys.modules.get(wrapper.__module__), "TMA_DTYPE_DEVICE_TO_HOST", None)
    indices, metas = sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
    if to_host is None or not metas or len(metas) != len(indices) or indices[-1] >= n_head:
        return None
    fill = fill or _fill_tma_descriptor()
    expansions = []
    for i, m in zip(indices, metas, strict=True):
        if m is None or m.get("fp4_padded"):
            return None
        expansions.append((i, m["swizzle"], m["elem_size"], to_host[m["elem_type"]], m["block_size"], fill, {}))
    return cells["launcher"], tuple(expansions)


# Filled tensor maps a launch keeps per descriptor argument, keyed by what a map encodes besides the
# kernel's own box, swizzle and type (base address, shape, strides, padding): a decode step's KV cache, a
# forward's output in the allocator's same block, skip the driver's encode (0: every launch fills its own).
DESCRIPTOR_CACHE = 8


def _expand(args: list, expansions: tuple) -> list:
    """`args` as Triton 3.6's launcher takes them: each descriptor (at an expansion's position)
    becomes its filled CUtensorMap (the expansion's `filled` one where its key is there), then its
    shape and strides."""
    out, start = [], 0
    for i, swizzle, elem_size, dtype, block, fill, filled in expansions:
        d = args[i]
        out += args[start:i]
        key = (d.base.data_ptr(), d.padding, *d.shape, *d.strides)
        tensor_map = filled.get(key) if DESCRIPTOR_CACHE else None
        if tensor_map is None:
            tensor_map = fill(key[0], swizzle, elem_size, dtype, block, d.shape, d.strides,
                              1 if d.padding == "nan" else 0)
            if len(filled) >= DESCRIPTOR_CACHE:
                filled.clear()
            if DESCRIPTOR_CACHE:
                filled[key] = tensor_map
        out.append(tensor_map)
        out += d.shape
        out += d.strides
        start = i + 1
    out += args[start:]
    return out


def _plain(runner) -> bool:
    """The kernel needs no scratch memory and no sanitizer state (which Triton's Python wrapper
    allocates per launch): the C launcher may be called without it."""
    return (all(getattr(runner, name, None) == 0 for name in ("global_scratch_size", "profile_scratch_size"))
            and not getattr(runner, "gsan_enabled", False))


def _launcher_entry(compiled, n_head: int) -> tuple | None:
    """(launch, function, arguments between the function and the kernel's own, descriptor
    expansions, whether the kernel's arguments go as one sequence, the compiled kernel kept
    alive), or None where no direct call is known. Launch hooks are None: `Launch` takes this path
    only when none is set."""
    runner = compiled.run
    if launcher_layout() == "generic":
        return _generic_entry(compiled, runner, n_head)
    direct = getattr(runner, "launch", None)
    if direct is not None and _plain(runner) and hasattr(runner, "launch_cooperative_grid") \
            and hasattr(runner, "launch_pdl"):
        middle = (runner.launch_cooperative_grid, runner.launch_pdl, None, None, compiled.packed_metadata, None,
                  None, None)
        fast = _tensordesc_fast_path(direct, n_head)
        if fast is not None:
            return fast[0], compiled.function, middle, fast[1], False, compiled
        return direct, compiled.function, middle, (), False, compiled
    return runner, compiled.function, (compiled.packed_metadata, None, None, None), (), False, compiled


# The launcher attributes `_generic_entry` reads (Triton 3.7-3.9's `CudaLauncher`).
_GENERIC_ATTRIBUTES = ("arg_annotations", "kernel_signature", "launch_cooperative_grid", "launch_pdl")


def _generic_entry(compiled, runner, n_head: int) -> tuple | None:
    """Triton 3.7 on: `driver.active.utils.launch(grid, stream, function, cooperative, pdl,
    packed metadata, launch metadata, enter hook, exit hook, global scratch, profile scratch,
    annotations, signature, arguments)`. The annotations and signature are the launcher's, made for
    the arguments with each TMA descriptor expanded (tensor map, shape, strides) and constexprs
    in place; fk expands its descriptors itself (`_expand`), as Triton's per-call wrapper would.
    None (Triton's dispatch) for what fk does not expand: im2col, fp4 padding, descriptors that
    were not lowered to TMA or that lie past the head, and kernels that need scratch memory."""
    import sys

    import triton

    if not (_plain(runner) and all(hasattr(runner, name) for name in _GENERIC_ATTRIBUTES)):
        return None
    signature = list(getattr(compiled.src, "signature", {}).values())
    indices = [i for i, sig in enumerate(signature) if isinstance(sig, str) and sig.startswith("tensordesc")]
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or ())
    expansions = []
    if indices:
        to_host = getattr(sys.modules.get(type(runner).__module__), "TMA_DTYPE_DEVICE_TO_HOST", None)
        if to_host is None or len(metas) != len(indices) or indices[-1] >= n_head:
            return None
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor_tiled
        for i, m in zip(indices, metas, strict=True):
            if m is None or m.get("fp4_padded") or m.get("is_im2col"):
                return None
            expansions.append((i, m["swizzle"], m["elem_size"], to_host[m["elem_type"]], m["block_size"], fill, {}))
    middle = (runner.launch_cooperative_grid, runner.launch_pdl, compiled.packed_metadata, None, None, None, None,
              None, runner.arg_annotations, runner.kernel_signature)
    return triton.runtime.driver.active.utils.launch, compiled.function, middle, tuple(expansions), True, compiled


class Launch:
    """`kernel` over `grid` with the plan's `tail` arguments and `meta` (constexprs and launch
    options such as num_warps): `launch(*head)` runs `kernel[grid](*head, *tail, **meta)`.

    The head holds what changes per call: tensors (or `Descriptor`s) and floats, never ints (an
    int would be specialized on, and the compiled kernel is reused without looking at it)."""

    __slots__ = ("kernel", "grid", "tail", "meta", "device", "_tail", "_compiled", "_tensors", "_knobs")

    def __init__(self, kernel, grid, tail=(), meta=None, device: torch.device | None = None):
        if backend.is_interpreter() and not _interpreted(kernel):
            raise RuntimeError(backend.NO_GPU_HINT)
        self.kernel = kernel
        grid = tuple(int(g) for g in grid)
        self.grid = grid + (1,) * (3 - len(grid))
        self.tail = tuple(tail)
        self.meta = {"enable_fp_fusion": FP_FUSION, **(meta or {})}
        self.device = None if device is None or device.type != "cuda" else device.index
        self._tail: tuple = ()  # tail, then the constexprs: every parameter after the head
        self._compiled: dict = {}
        self._tensors: tuple | None = None
        self._knobs = None

    def __call__(self, *head) -> None:
        if self._tensors is not None and self._device_ready():
            # Pointers go as ints: the launcher then skips its data_ptr() call and pointer query.
            args = list(head)
            bits = 0
            for bit, i in enumerate(self._tensors):
                ptr = args[i] = head[i].data_ptr()
                if ptr % POINTER_ALIGN:
                    bits |= 1 << bit
            entry = self._compiled.get(bits)
            if entry is not None:
                launch, function, middle, expansions, packed, _ = entry
                if expansions:
                    args = _expand(args, expansions)
                if packed:  # Triton >= 3.7: the kernel's arguments as one sequence
                    args += self._tail
                    launch(*self.grid, _current_stream(self.device), function, *middle, args)
                else:
                    launch(*self.grid, _current_stream(self.device), function, *middle, *args, *self._tail)
                return
        self._slow(head)

    def _device_ready(self) -> bool:
        knobs = self._knobs
        return (_current_device() == self.device and _idle(knobs.launch_enter_hook)
                and _idle(knobs.launch_exit_hook) and getattr(_THREAD, "bound", False))

    def _slow(self, head) -> None:
        real = tuple(a.real() if isinstance(a, Descriptor) else a for a in head)
        ahead.start_tools(self.device)
        ahead.wait_key()
        if ahead.active():  # compiled in the pool; this call runs nothing (`ahead.compile_ahead`)
            ahead.submit(self.kernel, functools.partial(self._compile, real))
            return
        began = time.perf_counter()
        ahead.wait(self.kernel)
        with self._on_device():
            bind_context(self.device)
            ahead.launcher_alongside(self.kernel)
            compiled = self.kernel[self.grid](*real, *self.tail, **self.meta)  # compiles on first use
        took = time.perf_counter() - began
        _note_compile(compiled, took)
        if took > COMPILED_LAUNCH_S and _COMPILED.is_set() and ahead.idle():
            _collect_after_compile()
        if backend.is_interpreter() or not _compiled_launcher(compiled):
            return
        if not launcher_layout_known():
            _warn_unknown_layout()
            return
        if self._tensors is None:
            constexprs = _trailing_constexprs(self.kernel, self.meta)
            knobs = _runtime_knobs()
            if constexprs is None or knobs is None:
                return
            self._tail, self._knobs = self.tail + constexprs, knobs
            self._tensors = tuple(i for i, a in enumerate(head) if isinstance(a, torch.Tensor))
        bits = 0
        for bit, i in enumerate(self._tensors):
            if head[i].data_ptr() % POINTER_ALIGN:
                bits |= 1 << bit
        if len(self._compiled) < MAX_SPECIALIZATIONS:
            entry = _launcher_entry(compiled, len(head))
            if entry is not None:
                self._compiled[bits] = entry

    def _compile(self, real) -> None:
        """Compile what `real` (the head) would launch and load it, without launching (a pool
        thread): loading builds Triton 3.6's launcher for the kernel's signature, a C compile of
        0.2-0.5 s that the first launch would otherwise wait for."""
        began = time.perf_counter()
        with self._on_device():
            bind_context(self.device)
            ahead.launcher_alongside(self.kernel)
            compiled = self.kernel.warmup(*real, *self.tail, grid=self.grid, **self.meta)
            load = getattr(compiled, "_init_handles", None)  # (an autotuner's warm-up returns a list)
            if load is not None:
                load()
        _note_compile(compiled, time.perf_counter() - began)

    def _on_device(self):
        if self.device is None or backend.is_interpreter() or _current_device() == self.device:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)


# Wall-clock time of this module's import: a kernel whose file in Triton's cache is newer was compiled
# in this process's lifetime, not loaded from an earlier process's cache.
_IMPORTED_AT = time.time()
# Set once a kernel was compiled since the collector's last pass after compiles (`_collect_after_compile`).
_COMPILED = threading.Event()


def _compiled_here(compiled) -> bool | None:
    """Whether Triton compiled `compiled` (what a launch or warm-up returned) since this process
    imported fk: its metadata file in Triton's cache is newer. None where that file is unknown."""
    group = getattr(compiled, "metadata_group", None)
    if not isinstance(group, dict):
        return None
    try:
        path = next(p for name, p in group.items() if str(name).endswith(".json"))
        return os.stat(path).st_mtime >= _IMPORTED_AT
    except (StopIteration, OSError, TypeError, ValueError):
        return None


def _note_compile(compiled, seconds: float) -> None:
    """Mark a compile (`_COMPILED`) where `compiled`, returned after `seconds`, was compiled in this
    process (`_compiled_here`; where unknown, where it took over COMPILED_LAUNCH_S). A kernel loaded
    from an earlier process's cache is not one: a warm process's first calls take no pass."""
    fresh = _compiled_here(compiled)
    if fresh or (fresh is None and seconds > COMPILED_LAUNCH_S):
        _COMPILED.set()


def _collect_after_compile() -> None:
    """One full pass of Python's collector, once a burst of compiles is over: what the compiles
    left behind moves to the oldest generation now, rather than into a later pass that lands in
    whichever fast call allocates next (a 3 ms step of a packed training loop took 7.3 ms, 4.3 of
    them the collector: H200, Triton 3.6, `e2e/first_call.py`). Here it costs a call that waited
    for compiles anyway (about 0.1 s in a cold process; shared/TUNING.md). Not where the collector
    is off, nor on the interpreter (every launch is slow there)."""
    _COMPILED.clear()
    if gc.isenabled() and not backend.is_interpreter():
        gc.collect()


def layout_key(*tensors) -> tuple:
    """What a bound plan is specialized on, for each tensor: (shape, strides, dtype, device index),
    None for None. A plan's key is this and the op's other arguments."""
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors])


class PlanCache(dict):
    """A bounded dict of an op's bound plans: `get_or_build(key, build)`; cleared when full."""

    def __init__(self, max_size: int = PLAN_CACHE_SIZE):
        super().__init__()
        self.max_size = max_size

    def cache_clear(self) -> None:  # as functools.lru_cache names it
        self.clear()

    def get_or_build(self, key, build):
        plan = self.get(key)
        if plan is None:
            if len(self) >= self.max_size:
                self.clear()
            plan = self[key] = build()
        return plan


def hash_triton() -> bool:
    """Compute Triton's own cache key once for this process (`triton_key`: a hash of its sources and
    of libtriton, about 500 MB), which the first kernel a process compiles or loads from Triton's
    cache otherwise waits for (a cache hit: 0.40 s with it, 0.02 s after it, on a 2-core CPU).
    False where this Triton has no such function. (At import, `ahead.start_key` reads the key back
    from fk's cache instead, where an earlier process stored it.)"""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return False
    triton_key()
    return True


# Started at import, the key is read back (or hashed) while the caller builds its model and inputs;
# the first launch waits for what is left of it.
if ahead.enabled() and not backend.interpreter_requested() and torch.cuda.is_available():
    ahead.start_key()
    ahead.start_driver()

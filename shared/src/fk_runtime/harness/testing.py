"""The reference harness every package's tests (and the main job's check) use.

- device choice: the GPU when there is one, else the CPU through the Triton interpreter, set up
  by `setup()` before any kernel is defined (the pytest plugin calls it);
- fresh random inputs on every run (never zeros), optionally as strided, non-contiguous views;
- comparison against a float64 reference by relative error ||out - ref|| / ||ref||, bounded per
  dtype, or relative to PyTorch's own error on the same inputs (the flash-attn test suite's
  rule) where PyTorch is the baseline;
- outputs poisoned with NaN so any element a kernel did not write fails the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import torch

from .. import alloc, backend, sizing

# Relative error ||out - ref|| / ||ref|| allowed against a float64 reference, by input dtype.
# fp32 math with fp32 inputs lands near 1e-7..1e-6; half precisions are bound by their rounding
# of inputs and outputs (2^-11 for fp16, 2^-8 for bf16).
TOLERANCE = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float64: 1e-12,
}
# Per-element magnitude below which a reference counts as zero (see rel_error), by input dtype:
# a gradient that vanishes in exact arithmetic comes out as rounding noise of about this size.
ZERO_FLOOR = {
    torch.float32: 1e-6,
    torch.float16: 1e-4,
    torch.bfloat16: 1e-3,
    torch.float64: 1e-12,
}
# With a baseline (PyTorch run on the same inputs in the same dtype), fk may be at most this many
# times as far from the float64 reference as PyTorch is, plus the dtype's tolerance above.
BASELINE_FACTOR = 2.0

# Where the check seeds its generator; printed in failures so a run can be repeated.
SEED_ENV = "FK_TEST_SEED"


def setup() -> torch.device:
    """Pick the test device, turning the interpreter on when there is no GPU."""
    if backend.use_interpreter_without_gpu():
        backend.check_interpreter_numpy()
    seed = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    os.environ[SEED_ENV] = str(seed)
    torch.manual_seed(seed)
    return backend.default_device()


def device() -> torch.device:
    return backend.default_device()


def on_gpu() -> bool:
    return not backend.is_interpreter()


def seed() -> str:
    return os.environ.get(SEED_ENV, "unset")


def randn(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    scale: float = 1.0,
    shift: float = 0.0,
    requires_grad: bool = False,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Fresh normal samples (times `scale`, plus `shift`) on the test device.

    `layout` makes kernels honour strides: "contiguous"; "padded_rows", a view whose rows lie
    further apart than their length; "strided_cols", a view whose last dim has stride 2. The
    gaps hold random numbers too, so reading them shows up as a wrong answer.
    """
    shape = tuple(shape)
    last = shape[-1] if shape else 1
    widths = {"contiguous": last, "padded_rows": last + 3, "strided_cols": 2 * last}
    if layout not in widths:
        raise ValueError(f"layout must be one of {sorted(widths)}, got {layout!r}")
    base_shape = shape[:-1] + (widths[layout],) if shape else ()
    base = torch.randn(base_shape, device=device(), dtype=torch.float32).mul_(scale).add_(shift)
    base = base.to(dtype)
    if layout == "padded_rows":
        base = base[..., :last]
    elif layout == "strided_cols":
        base = base[..., ::2]
    return base.requires_grad_(requires_grad)


INT32_OFFSET_LIMIT = sizing.INT32_OFFSET_LIMIT


def column_major_past_int32(cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh (rows, cols) view of column-major storage (column stride = rows) whose last column
    starts past INT32_OFFSET_LIMIT elements, so kernels must form column offsets in 64 bits.
    Over 2**31 elements (4 GiB in 16 bits): for GPU tests."""
    rows = INT32_OFFSET_LIMIT // (cols - 1) + 1
    return torch.randn((cols, rows), device=device(), dtype=dtype).t()


def sampled_rows(n_rows: int, count: int = 8) -> torch.Tensor:
    """Row indices at both ends and in the middle of `n_rows` rows, for checking row-wise
    outputs of tensors too large to compare whole."""
    ends = list(range(count)) + list(range(n_rows - count, n_rows))
    middle = torch.randint(count, n_rows - count, (count,)).tolist()
    return torch.tensor(sorted(set(ends + middle)), device=device())


def rel_error(
    actual: torch.Tensor, reference: torch.Tensor, zero_floor: float = ZERO_FLOOR[torch.float32]
) -> float:
    """||actual - reference|| / ||reference|| in float64; inf when anything is NaN or shapes differ."""
    if actual.shape != reference.shape:
        return math.inf
    a = actual.detach().to(torch.float64)
    r = reference.detach().to(torch.float64)
    finite_ref = torch.isfinite(r)
    # Infinite reference entries must be matched exactly (e.g. a log of 0 is -inf).
    if not torch.equal(torch.isfinite(a), finite_ref) or not torch.equal(
        a[~finite_ref].nan_to_num(), r[~finite_ref].nan_to_num()
    ):
        return math.inf
    a, r = a[finite_ref], r[finite_ref]
    if a.numel() == 0:
        return 0.0
    diff = torch.linalg.vector_norm(a - r).item()
    # A reference that is zero up to float64 rounding (e.g. a gradient that sums to 0)
    # is compared in absolute terms against this floor instead of its own vanishing norm.
    norm = max(torch.linalg.vector_norm(r).item(), zero_floor * math.sqrt(r.numel()))
    if math.isnan(diff):
        return math.inf
    return diff / norm


@dataclasses.dataclass
class Comparison:
    name: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: rel. error {self.error:.3g} (bound {self.bound:.3g}) {verdict}"


def compare(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype,
    baseline: torch.Tensor | None = None,
) -> Comparison:
    """Error of `actual` against the float64 `reference`, and the bound it must stay under."""
    bound = TOLERANCE[dtype]
    floor = ZERO_FLOOR[dtype]
    if baseline is not None:
        # As the flash-attn test suite bounds it: PyTorch's own error, scaled, plus the dtype's
        # tolerance (a max of the two failed bf16 gradients of tiny rows where PyTorch's
        # rounding happened to land closer: 0.019 against 0.016, seed 101).
        bound += BASELINE_FACTOR * rel_error(baseline, reference, floor)
    return Comparison(name, rel_error(actual, reference, floor), bound)


def assert_close(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype,
    baseline: torch.Tensor | None = None,
) -> None:
    c = compare(name, actual, reference, dtype, baseline)
    if not c.ok:
        raise AssertionError(f"{c} [seed {seed()}; shape {tuple(actual.shape)}, dtype {dtype}]")


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def to_reference(t):
    """A float64 leaf copy of a tensor input (other inputs pass through)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64).requires_grad_(t.requires_grad)
    return t


def check_against_reference(
    fn: Callable,
    reference_fn: Callable,
    inputs: Sequence,
    *,
    dtype: torch.dtype,
    names: Sequence[str] | None = None,
    backward: bool = True,
    baseline_fn: Callable | None = None,
) -> list[Comparison]:
    """Run `fn` (under poisoned outputs) and `reference_fn` (on float64 copies) on `inputs`;
    compare each output and, with `backward`, the gradient of each input that requires grad,
    using one fresh random upstream gradient. `baseline_fn` (PyTorch in `dtype`) widens the
    bound to BASELINE_FACTOR times its own error."""
    inputs = list(inputs)
    ref_inputs = [to_reference(t) for t in inputs]
    with alloc.poisoned_outputs():
        outs = _as_tuple(fn(*inputs))
    refs = _as_tuple(reference_fn(*ref_inputs))
    bases = _as_tuple(baseline_fn(*inputs)) if baseline_fn is not None else (None,) * len(refs)
    names = list(names or [f"arg{i}" for i in range(len(inputs))])
    results = [
        compare(f"out{i}", o, r, dtype, b) for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True))
    ]
    if not backward:
        return results
    grad_idx = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grad_idx:
        return results
    diff_outs = [(o, r) for o, r in zip(outs, refs, strict=True) if o.requires_grad]
    upstream = [randn(o.shape, o.dtype) for o, _ in diff_outs]
    with alloc.poisoned_outputs():
        grads = torch.autograd.grad(
            [o for o, _ in diff_outs], [inputs[i] for i in grad_idx], upstream, allow_unused=True
        )
    ref_grads = torch.autograd.grad(
        [r for _, r in diff_outs],
        [ref_inputs[i] for i in grad_idx],
        [u.to(torch.float64) for u in upstream],
        allow_unused=True,
    )
    base_grads: Sequence = (None,) * len(grad_idx)
    if baseline_fn is not None:
        base_outs = [b for b, o in zip(bases, outs, strict=True) if o.requires_grad]
        base_grads = torch.autograd.grad(
            base_outs, [inputs[i] for i in grad_idx], upstream, allow_unused=True
        )
    for i, g, rg, bg in zip(grad_idx, grads, ref_grads, base_grads, strict=True):
        if rg is None:
            rg = torch.zeros_like(ref_inputs[i])
        if g is None:
            g = torch.full_like(inputs[i], math.nan)
        results.append(compare(f"grad {names[i]}", g, rg, dtype, bg))
    return results


def assert_matches_reference(*args, **kwargs) -> None:
    """`check_against_reference`, raising with every comparison when one fails."""
    results = check_against_reference(*args, **kwargs)
    if not all(r.ok for r in results):
        lines = "\n  ".join(str(r) for r in results)
        raise AssertionError(f"mismatch against float64 reference [seed {seed()}]:\n  {lines}")


@contextlib.contextmanager
def siblings_give_up_at_once(*plan_caches):
    """Split-row programs stop waiting for their siblings at once (fk_runtime.siblings), so the
    hand-off of chunks to a row's last program runs on every backend. `plan_caches` (lru-cached
    plan functions, which hold the spin limit) are cleared on the way in and out."""
    from .. import siblings  # defines Triton helpers: only once the backend is set up

    saved = siblings.SPIN_LIMIT, siblings.INTERPRETER_SPIN_LIMIT
    siblings.SPIN_LIMIT = siblings.INTERPRETER_SPIN_LIMIT = 0
    for cache in plan_caches:
        cache.cache_clear()
    try:
        yield
    finally:
        siblings.SPIN_LIMIT, siblings.INTERPRETER_SPIN_LIMIT = saved
        for cache in plan_caches:
            cache.cache_clear()


def compile_modes() -> list[str]:
    """How tests call an op: eager, and through `torch.compile(fullgraph=True)`. On the CPU the
    compiled mode traces with the `aot_eager` backend (graph breaks and fake kernels are checked
    there too; Inductor's codegen is exercised on the GPU)."""
    return ["eager", "compile"]


def mode_cases(shapes: Sequence, dtypes: Sequence) -> list[tuple]:
    """(shape, dtype, mode) for a test over shapes and dtypes in every `compile_modes()` mode: eager
    takes every pair; each other mode each shape once, the dtypes in turn, so that every shape and
    every dtype is traced (tracing depends on neither's pairing; the kernels run eager on all)."""
    modes = compile_modes()
    cases = [(shape, dtype, modes[0]) for shape in shapes for dtype in dtypes]
    for mode in modes[1:]:
        cases += [(shape, dtypes[i % len(dtypes)], mode) for i, shape in enumerate(shapes)]
    return cases


def maybe_compile(fn: Callable, mode: str) -> Callable:
    if mode == "eager":
        return fn
    torch._dynamo.reset()
    compile_backend = "inductor" if on_gpu() else "aot_eager"
    return torch.compile(fn, fullgraph=True, backend=compile_backend, dynamic=False)


def compiled_graph_ops(fn: Callable, *args) -> set[str]:
    """Every call target in the forward and backward graphs that `torch.compile(fn,
    fullgraph=True)` runs for `args` (AOTAutograd's, nested graphs included; the backward of a
    differentiable output is run once): a test asserts an fk op is among them, i.e. the compiled
    model runs the fk kernels and not a decomposition or a fallback."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: set[str] = set()

    def capture(gm, example_inputs):
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                seen.update(str(n.target) for n in module.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    outputs = torch.compile(fn, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture),
                            fullgraph=True)(*args)
    differentiable = [o for o in _as_tuple(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        sum(o.float().sum() for o in differentiable).backward()
    return seen


# ---- compiles: what a call added to Triton's in-memory caches -------------------------------------


def compiled_variants(*modules) -> dict:
    """{name: its compiled variants' keys} of every `*_kernel` of `modules` in this process (Triton's
    in-memory JIT caches), once the compiles submitted ahead for them (`fk_runtime.ahead`) finished:
    a test compares it before and after a call that should compile nothing."""
    from .. import ahead

    kernels = {name: getattr(m, name) for m in modules for name in dir(m) if name.endswith("_kernel")}
    for fn in kernels.values():
        ahead.wait(fn)
    return {name: {str(key) for cache in getattr(fn, "device_caches", {}).values() for key in cache[0]}
            for name, fn in kernels.items()}


def upstream_grad(y: torch.Tensor, kind: str) -> torch.Tensor:
    """A first backward's gradient for y: "dense" (a model's, laid out like y) or "sum" (what
    `y.sum().backward()` brings: one value broadcast, zero strides)."""
    if kind == "dense":
        return torch.randn_like(y)
    return torch.ones((), device=y.device, dtype=y.dtype).expand(y.shape)


# ---- process groups: gloo on CPU processes, NCCL on GPUs ------------------------------------------

# A rank waiting this long on another has met a deadlock: fail instead of hanging the suite.
RANK_TIMEOUT_S = 120
# NCCL with NVLink multicast off (the lent multi-GPU machines do not support it).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def gpu_ranks_available(world: int) -> bool:
    """Whether `world` NCCL ranks, one GPU each, can run here."""
    import torch.distributed as dist

    return torch.cuda.is_available() and torch.cuda.device_count() >= world and dist.is_nccl_available()


def init_rank(rank: int, world: int, store: str, backend: str = "gloo") -> torch.device:
    """In a rank started by `spawn_ranks`: the default process group over a file store, and the
    rank's device. gloo: a CPU process with one thread (the ranks share the machine's cores: more
    threads only contend); nccl: GPU `rank`."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=RANK_TIMEOUT_S)
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{store}", timeout=timeout, rank=rank,
                                world_size=world, device_id=device)
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", timeout=timeout, rank=rank, world_size=world)
    return torch.device("cpu")


def shared_across_workers(tmp_path_factory, name: str, build: Callable[[], object]):
    """`build()`'s result, built once per test session: pytest-xdist's workers each run a
    module-scoped fixture, so one builds it under a file lock and the others load its
    `torch.save`d copy (a spawn of distributed ranks costs a minute on the interpreter)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build()
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # shared by the session's workers
    path = root / f"{name}.pt"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return torch.load(path, weights_only=False)
        result = build()
        torch.save(result, path)
        return result


def shared_gloo_runs(tmp_path_factory, name: str, run: Callable[..., object]):
    """`run(folder)` (a spawn of gloo CPU ranks) once per test session (`shared_across_workers`),
    skipped where the ranks' kernels cannot run on the interpreter beside this numpy."""
    import pytest

    problem = backend.interpreter_numpy_problem()
    if problem is not None:
        pytest.skip(problem)
    return shared_across_workers(tmp_path_factory, name, lambda: run(tmp_path_factory.mktemp(name)))


def spawn_ranks(fn: Callable, world: int, args: tuple, join: bool = True, backend: str = "gloo"):
    """Run fn(rank, *args) in `world` fresh processes: gloo, CPU processes under the Triton
    interpreter; nccl, one GPU each, compiled kernels, NVLink multicast off. They import fn's
    module afresh, so its tests' root goes on their sys.path. join=False returns the processes'
    context at once (join it later, doing other work meanwhile)."""
    from pathlib import Path

    import pytest
    import torch.multiprocessing as mp

    root = Path(fn.__code__.co_filename).parents[fn.__module__.count(".")]
    env = NCCL_ENV if backend == "nccl" else {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        if backend == "nccl":
            patch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels on the GPUs
        patch.syspath_prepend(str(root))
        return mp.start_processes(fn, args=args, nprocs=world, join=join, start_method="spawn")

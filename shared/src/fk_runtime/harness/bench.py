"""The benchmark harness every op uses.

An op's `bench.py` returns `Case`s: one shape, dtype and direction each, with the work it must do
(bytes moved or flops) and its variants (fk and its peers). `run_cases` measures this card's
ceilings (copy bandwidth, matmul rate) in the same run, times every variant with `do_bench`
medians over rotating input sets, and reports ms, GB/s or TFLOP/s, % of the ceiling and fk's
speed ratio to each peer. `write_report` writes JSON, markdown and PNG plots.

On a GPU each variant's calls are captured in CUDA graphs and `do_bench` times their replays:
the device time of the kernels, without the launch gaps that Python (fk's autograd functions,
Liger's, torch.compile's wrappers) leaves when one short call is timed alone. fk's eager time,
host work included, is reported beside it.

`HostCase`s measure the other side, what a user pays per call where the device is idle most of
the time: `run_host_cases` times back-to-back eager calls on a tiny input (forward, and forward
plus backward) with one synchronization at the end, and beside each the device time of one call
(its kernels' durations from `torch.profiler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import ahead, backend, sizing, timing

FK = "fk"
TORCH_COMPILE = "torch.compile"
GBPS = "GB/s"
TFLOPS = "TFLOP/s"
# Input sets are rotated until their bytes are this many times the L2 cache, so a variant cannot
# run out of cache; capped to bound memory.
ROTATE_L2_FACTOR = 3
MAX_INPUT_SETS = 4
# On the interpreter nothing is worth timing precisely: one host-timed run, no warm-up (each run is
# a second or more of Python; CI's whole main job is its budget).
INTERPRETER_REPS = 1
# Calls run before capture, so that compilation, autotuning and lazy allocations stay outside it.
GRAPH_WARMUP_CALLS = 3
COPY_BYTES_GPU = 1 << 30
COPY_BYTES_CPU = 1 << 24
MATMUL_N_GPU = 8192
MATMUL_N_CPU = 256


@dataclasses.dataclass
class Case:
    """One benchmark point.

    `make_inputs()` returns fresh random inputs; each variant maps inputs to a zero-argument
    callable that does the timed work (see `forward` and `backward`). `work` counts the fewest
    bytes (unit GB/s) or flops (unit TFLOP/s) the op must do.
    """

    op: str
    direction: str
    shape: str
    dtype: torch.dtype
    unit: str
    work: float
    make_inputs: Callable[[], Sequence]
    variants: dict[str, Callable[[Sequence], Callable[[], object]]]
    input_bytes: int = 0
    memory: bool = False

    def row(self, dtype: bool = True) -> str:
        """The case as scripts name a table row: `op direction shape dtype` (`x` for `×`; `dtype` False: without it)."""
        name = f"{self.op} {self.direction} {self.shape.replace('×', 'x')}"
        return f"{name} {str(self.dtype).removeprefix('torch.')}" if dtype else name


@dataclasses.dataclass
class Result:
    op: str
    direction: str
    shape: str
    dtype: str
    variant: str
    unit: str
    ms: float | None
    rate: float | None
    pct_of_ceiling: float | None
    error: str | None = None
    peak_mib: float | None = None
    # "graph": device time of captured replays; "eager": launched from Python each call.
    timing: str = "eager"
    eager_ms: float | None = None
    # GB/s cases on a GPU, fk's row only: a plain copy moving the case's bytes (half read, half
    # written), as % of the ceiling. Short problems cannot reach the large copy's rate (launch
    # ramp and tail): this is what the same bytes reach at best.
    copy_pct: float | None = None


@dataclasses.dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float

    def of(self, unit: str) -> float:
        return self.copy_gbps if unit == GBPS else self.matmul_tflops


def forward(fn: Callable) -> Callable[[Sequence], Callable[[], object]]:
    """Variant timing `fn(*inputs)`."""
    return lambda inputs: (lambda: fn(*inputs))


def backward(fn: Callable) -> Callable[[Sequence], Callable[[], object]]:
    """Variant timing the backward of `fn(*inputs)` (forward run once, outside the timing),
    for every input that requires grad, with a fresh random upstream gradient."""

    def prepare(inputs):
        out = fn(*inputs)
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)

    return prepare


def _synchronize() -> None:
    if not backend.is_interpreter():
        torch.cuda.synchronize()


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs `calls` (one per input set) in turn."""
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def time_ms(calls: Sequence[Callable[[], object]]) -> float:
    """Median milliseconds of one call, rotating through `calls` (one per input set)."""
    step = rotating(calls)
    if backend.is_interpreter():
        samples = []
        for _ in range(INTERPRETER_REPS):
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    return timing.do_bench(step)


def graphed(calls: Sequence[Callable[[], object]], stream) -> list[Callable[[], object]]:
    """Each call captured in its own CUDA graph on `stream` (which must be current and must have
    run the calls' forward, so autograd's backward streams match); returns the replays."""
    for _ in range(GRAPH_WARMUP_CALLS):
        for call in calls:
            call()
    stream.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            call()
        graphs.append(graph)
    return [graph.replay for graph in graphs]


@contextlib.contextmanager
def captured(prepare, sets: Sequence):
    """A variant's replays as the tables time them, to be run inside the block: `prepare`d on each input set on
    a side stream, current in the block, each call captured in its own CUDA graph (`graphed`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield graphed([prepare(inputs) for inputs in sets], stream)
    torch.cuda.synchronize()


def measure_ceilings() -> Ceilings:
    """This card's device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate,
    on random data."""
    dev = backend.default_device()
    nbytes = COPY_BYTES_CPU if backend.is_interpreter() else COPY_BYTES_GPU
    src = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
    copy_ms = time_ms([functools.partial(torch.empty_like(src).copy_, src)])
    del src
    n = MATMUL_N_CPU if backend.is_interpreter() else MATMUL_N_GPU
    mm_dtype = torch.float32 if backend.is_interpreter() else torch.bfloat16
    a = torch.randn(n, n, device=dev, dtype=mm_dtype)
    b = torch.randn(n, n, device=dev, dtype=mm_dtype)
    mm_ms = time_ms([lambda: a @ b])
    return Ceilings(copy_gbps=2 * nbytes / copy_ms / 1e6, matmul_tflops=2 * n**3 / mm_ms / 1e9)


def compiled_peer(fn: Callable) -> dict[str, Callable]:
    """`{TORCH_COMPILE: torch.compile(fn)}` as a peer on a GPU; none on the interpreter, where
    inductor's CPU kernels compile for seconds per shape and time nothing worth comparing."""
    return {} if backend.is_interpreter() else {TORCH_COMPILE: torch.compile(fn)}


def input_sets(case: Case) -> int:
    """How many input sets a case rotates through: enough to cover the L2 cache ROTATE_L2_FACTOR times."""
    if backend.is_interpreter() or case.input_bytes <= 0:
        return 1
    wanted = sizing.cdiv(ROTATE_L2_FACTOR * backend.l2_cache_bytes(), case.input_bytes)
    return max(1, min(MAX_INPUT_SETS, wanted))


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:120]


def _peak_mib(prepare, inputs) -> float | None:
    if backend.is_interpreter():
        return None
    call = prepare(inputs)
    call()  # steady state: workspaces a variant keeps (cuBLAS's) exist
    # Tensors of earlier calls held only by reference cycles would otherwise be freed inside the
    # measured call, and their bytes would hide that call's own allocations.
    gc.collect()
    _synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    _synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _time_variant(prepare, sets, eager: bool) -> tuple[float, str, float | None]:
    """(ms, timing, eager ms): graph replays on a GPU, falling back to eager timing for a
    variant that cannot be captured; `eager` also times the plain calls."""
    if backend.is_interpreter():
        ms = time_ms([prepare(inputs) for inputs in sets])
        return ms, "eager", ms
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls = [prepare(inputs) for inputs in sets]
        eager_ms = time_ms(calls) if eager else None
        try:
            ms, timing = time_ms(graphed(calls, stream)), "graph"
        except RuntimeError:
            torch.cuda.synchronize()
            ms, timing = eager_ms if eager_ms is not None else time_ms(calls), "eager"
    torch.cuda.synchronize()
    return ms, timing, eager_ms


def _same_bytes_copy_pct(case: Case, ceilings: Ceilings) -> float | None:
    """A device copy of `case.work` bytes (half read, half written), timed like the variants
    (graph replays over as many buffer pairs as the case has input sets), as % of the ceiling.

    The copy is an elementwise kernel (`neg`): a captured `copy_` becomes a memcpy node, which on
    an H100 (2026-11-24) ran at 73-81% of the ceiling at some sizes (64.06, 258 MB, 1 GB) where
    the kernel ran at 89-101%, as `copy_` itself did at 64, 128 and 384 MB."""
    if backend.is_interpreter() or case.unit != GBPS:
        return None
    half = int(case.work) // 2 // 2  # bf16 elements in half the bytes
    if half == 0:
        return None
    pairs = [[torch.empty(half, dtype=torch.bfloat16, device=backend.default_device()) for _ in range(2)]
             for _ in range(input_sets(case))]
    for src, _ in pairs:
        src.normal_()
    ms, _, _ = _time_variant(lambda pair: functools.partial(torch.neg, pair[0], out=pair[1]), pairs, eager=False)
    del pairs
    return 100.0 * (4 * half / ms / 1e6) / ceilings.copy_gbps


def run_case(case: Case, ceilings: Ceilings) -> list[Result]:
    results = []
    sets = [case.make_inputs() for _ in range(input_sets(case))]
    for name, prepare in case.variants.items():
        ms = rate = pct = peak = eager_ms = None
        timing = "eager"
        error = None
        try:
            ms, timing, eager_ms = _time_variant(prepare, sets, eager=name == FK)
            scale = 1e6 if case.unit == GBPS else 1e9
            rate = case.work / ms / scale
            pct = 100.0 * rate / ceilings.of(case.unit)
            if case.memory:
                peak = _peak_mib(prepare, sets[0])
        except Exception as exc:  # a peer that refuses a shape is a result, not a crash
            error = _short(exc)
        results.append(
            Result(
                case.op, case.direction, case.shape, str(case.dtype).removeprefix("torch."),
                name, case.unit, ms, rate, pct, error, peak, timing, eager_ms,
            )
        )
        if not backend.is_interpreter():
            torch.cuda.empty_cache()
    # Last, with the case's inputs freed: measured first, its buffers (cached by the allocator)
    # left fk's timings 2-4% lower in one H100 run, the peers' unchanged.
    del sets
    gc.collect()  # inputs held by reference cycles (autograd graphs) go too
    if not backend.is_interpreter():
        torch.cuda.empty_cache()
    try:
        copy_pct = _same_bytes_copy_pct(case, ceilings)
    except Exception:  # context only: a copy that cannot run (out of memory) leaves it blank
        copy_pct = None
    for r in results:
        if r.variant == FK:
            r.copy_pct = copy_pct
    if not backend.is_interpreter():
        torch.cuda.empty_cache()
    return results


def run_cases(cases: Sequence[Case], ceilings: Ceilings, progress: bool = True) -> list[Result]:
    from tqdm import tqdm

    # Backward is timed repeatedly over one graph (retain_graph=True); compiled peers must not
    # donate their saved buffers to the first call.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    results: list[Result] = []
    bar = tqdm(cases, desc="bench", unit="case", disable=not progress)
    for case in bar:
        bar.set_postfix_str(f"{case.op} {case.direction} {case.shape} {case.dtype}")
        results.extend(run_case(case, ceilings))
    return results


def _groups(results: Sequence[Result]):
    key = lambda r: (r.op, r.direction, r.shape, r.dtype)  # noqa: E731
    groups: dict = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return groups


def speedups(results: Sequence[Result]) -> list[dict]:
    """fk's speed over each peer (peer ms / fk ms), one row per case."""
    rows = []
    for (op, direction, shape, dtype), group in _groups(results).items():
        ours = next((r for r in group if r.variant == FK), None)
        if ours is None or ours.ms is None:
            continue
        for peer in group:
            if peer.variant == FK:
                continue
            ratio = None if peer.ms is None else peer.ms / ours.ms
            rows.append(
                dict(op=op, direction=direction, shape=shape, dtype=dtype, peer=peer.variant,
                     ratio=ratio, peer_error=peer.error)
            )
    return rows


def _fmt(x: float | None, digits: int = 0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _eager_mark(r: Result) -> str:
    """Marks a time that could not come from graph replays (interpreter, or capture failed)."""
    return "" if r.timing == "graph" or backend.is_interpreter() else " (eager)"


def markdown_table(results: Sequence[Result], op: str) -> str:
    """One row per case: fk's time, rate and % of ceiling, then each peer's rate and fk's ratio."""
    groups = {k: v for k, v in _groups(results).items() if k[0] == op}
    peers: list[str] = []
    for group in groups.values():
        for r in group:
            if r.variant != FK and r.variant not in peers:
                peers.append(r.variant)
    has_memory = any(r.peak_mib is not None for g in groups.values() for r in g)
    has_copy = any(r.copy_pct is not None for g in groups.values() for r in g)
    head = ["shape", "dtype", "dir", "fk ms", "fk rate", "% ceiling"]
    if has_copy:
        head += ["same-bytes copy % ceiling"]
    head += ["fk eager ms"]
    for p in peers:
        head += [f"{p} rate", f"fk / {p}"]
    if has_memory:
        head += ["fk peak MiB"] + [f"{p} peak MiB" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (_, direction, shape, dtype), group in groups.items():
        by_name = {r.variant: r for r in group}
        ours = by_name.get(FK)
        if ours is None:
            continue
        unit = ours.unit
        row = [shape, dtype, direction, _fmt(ours.ms, 3) + _eager_mark(ours),
               f"{_fmt(ours.rate)} {unit}", _fmt(ours.pct_of_ceiling, 1)]
        if has_copy:
            row += [_fmt(ours.copy_pct, 1)]
        row += [_fmt(ours.eager_ms, 3)]
        for p in peers:
            r = by_name.get(p)
            if r is None:
                row += ["", ""]
            elif r.ms is None:
                row += ["fails", "–"]
            else:
                ratio = r.ms / ours.ms if ours.ms else None
                row += [_fmt(r.rate) + _eager_mark(r), f"{_fmt(ratio, 2)}×"]
        if has_memory:
            row += [_fmt(ours.peak_mib)] + [_fmt(by_name[p].peak_mib) if p in by_name else ""
                                            for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    errors = [r for g in groups.values() for r in g if r.error]
    for r in errors:
        lines.append(f"\n- {r.variant} fails at {r.shape} {r.dtype} {r.direction}: `{r.error}`")
    return "\n".join(lines)


def plot(results: Sequence[Result], op: str, ceilings: Ceilings, path: Path) -> Path | None:
    """Bar chart of each variant's rate per case, fwd and bwd side by side, ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in results if r.op == op]
    if not mine:
        return None
    directions = sorted({r.direction for r in mine}, key=lambda d: (d != "fwd", d))
    fig, axes = plt.subplots(1, len(directions), figsize=(7 * len(directions), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], directions, strict=True):
        rows = [r for r in mine if r.direction == direction]
        cases = list(dict.fromkeys(f"{r.shape}\n{r.dtype}" for r in rows))
        variants = list(dict.fromkeys(r.variant for r in rows))
        width = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            rates = {f"{r.shape}\n{r.dtype}": r.rate or 0.0 for r in rows if r.variant == v}
            xs = [j + i * width for j in range(len(cases))]
            ax.bar(xs, [rates.get(c, 0.0) for c in cases], width, label=v)
        unit = rows[0].unit
        ax.axhline(ceilings.of(unit), ls="--", c="k", lw=1, label="ceiling")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels(cases, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel(unit)
        ax.set_title(f"{op} {direction}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(results: Sequence[Result], ceilings: Ceilings, meta: dict, path: Path) -> None:
    payload = dict(
        meta=meta,
        ceilings=dataclasses.asdict(ceilings),
        results=[dataclasses.asdict(r) for r in results],
        speedups=speedups(results),
    )
    path.write_text(json.dumps(payload, indent=1))


def environment() -> dict:
    import triton

    return dict(
        device=backend.device_name(),
        backend=backend.backend().value,
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


# Host time per call: back-to-back eager calls on a tiny input, one synchronization at the end.
HOST_CALLS_GPU = 200
HOST_REPEATS_GPU = 7
HOST_WARMUP_GPU = 20
# The interpreter runs every kernel in Python: one timed call shows that everything runs (the
# check call before the timing warms up).
HOST_CALLS_INTERPRETER = 1
HOST_REPEATS_INTERPRETER = 1
HOST_WARMUP_INTERPRETER = 0
# Calls under torch.profiler whose kernel durations are averaged into one call's device time.
PROFILED_CALLS = 10
HOST_MODES = ("fwd", "fwd+bwd", "infer")


@dataclasses.dataclass
class HostCase:
    """One tiny input on which each variant's per-call cost is measured.

    `make_inputs()` returns the inputs, those that take a gradient with `requires_grad` set;
    every variant maps them to one output tensor (`fn(*inputs)`). `op` names the table's row,
    `shape` and `dtype` describe the input; `modes` (of HOST_MODES) the calls timed: an
    inference op has no backward.
    """

    op: str
    shape: str
    dtype: torch.dtype
    make_inputs: Callable[[], Sequence]
    variants: dict[str, Callable[..., torch.Tensor]]
    modes: tuple[str, ...] = HOST_MODES


@dataclasses.dataclass
class HostResult:
    op: str
    shape: str
    dtype: str
    variant: str
    # "fwd": `fn(*inputs)` with autograd recording (inputs require grad), as in training;
    # "fwd+bwd": that, then the gradient of every input that requires one; "infer": the forward
    # under torch.no_grad() (inference, a decode step).
    mode: str
    us: float | None
    device_us: float | None = None
    error: str | None = None


def host_call(fn: Callable, inputs: Sequence, mode: str) -> Callable[[], object]:
    """One eager call of `fn(*inputs)` as the host section times it in `mode` (HostResult.mode)."""
    if mode == "fwd":
        return lambda: fn(*inputs)
    if mode == "infer":
        def infer():
            with torch.no_grad():
                return fn(*inputs)
        return infer
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grad = torch.randn_like(fn(*inputs))
    # autograd.grad rather than backward(): no accumulation into .grad, so every call does the
    # same work (backward() would add an accumulation kernel per input from the second call on).
    return lambda: torch.autograd.grad(fn(*inputs), leaves, grad)


def host_settings() -> tuple[int, int, int]:
    """(warm-up calls, calls per repeat, repeats)."""
    if backend.is_interpreter():
        return HOST_WARMUP_INTERPRETER, HOST_CALLS_INTERPRETER, HOST_REPEATS_INTERPRETER
    return HOST_WARMUP_GPU, HOST_CALLS_GPU, HOST_REPEATS_GPU


def interleaved_seconds(calls: dict[str, Callable[[], object]], warmup: int, count: int,
                        repeats: int) -> dict[str, float]:
    """Median wall seconds per call of each of `calls` (`interleaved_samples`)."""
    return {name: statistics.median(s) for name, s in interleaved_samples(calls, warmup, count, repeats).items()}


def interleaved_samples(calls: dict, warmup: int, count: int, repeats: int) -> dict[object, list[float]]:
    """`repeats` samples of wall seconds per call of each of `calls`: `count` calls back to back between two
    synchronizations make one sample; the samples of all calls are interleaved so that a slow
    stretch of the machine weighs on each alike. Host work included: what a user pays, once the
    compiles that the warm-up started ahead are done (`ahead.finish`): per call, not per process."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    ahead.finish()
    samples: dict[object, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            _synchronize()
            start = time.perf_counter()
            for _ in range(count):
                call()
            _synchronize()
            samples[name].append((time.perf_counter() - start) / count)
    return samples


def time_per_call_us(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median microseconds per call of each of `calls` (`interleaved_seconds`, host settings)."""
    warmup, count, repeats = host_settings()
    return {name: s * 1e6 for name, s in interleaved_seconds(calls, warmup, count, repeats).items()}


def device_us_by_kernel(call: Callable[[], object], calls: int = PROFILED_CALLS) -> dict[str, float] | None:
    """Each kernel's (and copy's) device duration per call, by name, summed over `calls` calls from
    torch.profiler; None on the interpreter."""
    if backend.is_interpreter():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        # GPU-side user annotations (record_function ranges) span kernels: counted, they would count
        # those kernels twice.
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    return kernels


def device_us_per_call(call: Callable[[], object], calls: int = PROFILED_CALLS,
                       kernel: str | None = None) -> float | None:
    """Sum of the device's kernel (and copy) durations over `calls` calls, per call, from
    torch.profiler (only the kernel named `kernel`, if given); None on the interpreter."""
    kernels = device_us_by_kernel(call, calls)
    if kernels is None:
        return None
    return sum(us for name, us in kernels.items() if kernel is None or name == kernel)


def run_host_cases(cases: Sequence[HostCase], progress: bool = True) -> list[HostResult]:
    """Host time per call of every variant of every case, in both modes, then (a second pass,
    so that the profiler cannot slow any timed launch) each call's device time."""
    from tqdm import tqdm

    results: list[HostResult] = []
    prepared = []
    bar = tqdm(cases, desc="host", unit="case", disable=not progress)
    for case in bar:
        bar.set_postfix_str(f"{case.op} {case.shape} {case.dtype}")
        inputs = case.make_inputs()
        dtype = str(case.dtype).removeprefix("torch.")
        for mode in case.modes:
            calls, rows = {}, {}
            for name, fn in case.variants.items():
                row = HostResult(case.op, case.shape, dtype, name, mode, None)
                rows[name] = row
                results.append(row)
                try:
                    calls[name] = host_call(fn, inputs, mode)
                    calls[name]()  # a variant that refuses the input fails here, not mid-timing
                except Exception as exc:  # a peer that refuses an input is a result, not a crash
                    calls.pop(name, None)
                    row.error = _short(exc)
            for name, us in time_per_call_us(calls).items():
                rows[name].us = us
            prepared += [(rows[name], call) for name, call in calls.items()]
    for row, call in prepared:
        try:
            row.device_us = device_us_per_call(call)
        except Exception:  # context only: a profiler that cannot run leaves it blank
            row.device_us = None
    return results


def host_markdown_table(results: Sequence[HostResult]) -> str:
    """One row per op, input and mode: fk's eager and device microseconds per call, then each
    peer's and fk's time over the peer's (below 1: fk costs less)."""
    peers = list(dict.fromkeys(r.variant for r in results if r.variant != FK))
    has_device = any(r.device_us is not None for r in results)
    head = ["op", "shape", "dtype", "call", "fk µs"]
    if has_device:
        head += ["fk device µs"]
    for p in peers:
        head += [f"{p} µs", f"fk ÷ {p}"]
    if has_device:
        head += [f"{p} device µs" for p in peers]
    groups: dict = {}
    for r in results:
        groups.setdefault((r.op, r.shape, r.dtype, r.mode), {})[r.variant] = r
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (op, shape, dtype, mode), by_name in groups.items():
        ours = by_name.get(FK)
        row = [op, shape, dtype, mode, "fails" if ours is None or ours.us is None else _fmt(ours.us, 1)]
        if has_device:
            row += [_fmt(ours.device_us if ours else None, 1)]
        for p in peers:
            r = by_name.get(p)
            if r is None:
                row += ["", ""]
            elif r.us is None:
                row += ["fails", "–"]
            else:
                ratio = ours.us / r.us if ours is not None and ours.us else None
                row += [_fmt(r.us, 1), f"{_fmt(ratio, 2)}×"]
        if has_device:
            row += [_fmt(by_name[p].device_us, 1) if p in by_name else "" for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    for r in results:
        if r.error:
            lines.append(f"\n- {r.variant} fails at {r.op} {r.shape} {r.dtype} {r.mode}: `{r.error}`")
    return "\n".join(lines)


def write_host_json(results: Sequence[HostResult], meta: dict, path: Path) -> None:
    rows = [dataclasses.asdict(r) for r in results]
    path.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))

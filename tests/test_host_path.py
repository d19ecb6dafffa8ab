"""The lean host path: each op binds its launches once per (shape, strides, dtype, device, flags)
and reuses them. What it caches must stay right when any of those changes between calls, and on
a GPU the bound launches (compiled kernels launched directly) must equal the first, JIT-launched
call, under side streams and CUDA graph capture too."""

import contextlib
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from fk_runtime import launch
from fk_runtime.harness import testing
from fk_runtime import ops as fk_ops

from fk_attention import attention, attention_varlen
from fk_layernorm import layer_norm, rms_norm
from fk_softmax import softmax
from fk_weightedsum import weighted_sum

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if testing.on_gpu() else [])


def _cases():
    """name: (fk function, float64 reference, make(dtype, layout) -> inputs); attention takes
    any layout but "contiguous" as (B, N, H, D) storage transposed, attention_varlen its packed
    (total, H, D) as (H, total, D) storage."""
    def rows(dtype, layout, extra=()):
        x = testing.randn((6, 40), dtype, layout=layout, requires_grad=True)
        return [x, *(testing.randn((40,), dtype, requires_grad=True) for _ in extra)]

    def qkv(dtype, layout):
        return [testing.randn((1, 2, 24, 16), dtype, requires_grad=True) if layout == "contiguous"
                else testing.randn((1, 24, 2, 16), dtype).transpose(1, 2).requires_grad_()
                for _ in range(3)]

    def packed(dtype, layout):  # two sequences (7 and 17 tokens) packed as (24, H, D)
        return [testing.randn((24, 2, 16), dtype, requires_grad=True) if layout == "contiguous"
                else testing.randn((2, 24, 16), dtype).transpose(0, 1).requires_grad_()
                for _ in range(3)]

    bounds = {}

    def varlen(q, k, v):  # the bounds made once per device, outside any CUDA graph capture
        cu = bounds.get(q.device)
        if cu is None:
            cu = bounds[q.device] = torch.tensor([0, 7, 24], dtype=torch.int32, device=q.device)
        return attention_varlen(q, k, v, cu, cu, 17, 17, causal=True)

    def varlen_reference(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                         is_causal=True).transpose(0, 1) for a, b in ((0, 7), (7, 24))])

    return {
        "softmax": (lambda x: softmax(x), lambda x: torch.softmax(x, -1), rows),
        "layer_norm": (layer_norm, lambda x, w, b: F.layer_norm(x, (40,), w, b),
                       lambda dtype, layout: rows(dtype, layout, (0, 1))),
        "rms_norm": (rms_norm, lambda x, w: F.rms_norm(x, (40,), w, 1e-6), lambda dtype, layout: rows(dtype, layout, (0,))),
        "weighted_sum": (weighted_sum, lambda x, w: x @ w, lambda dtype, layout: rows(dtype, layout, (0,))),
        "attention": (lambda q, k, v: attention(q, k, v, causal=True),
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv),
        "attention_varlen": (varlen, varlen_reference, packed),
    }


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_bound_plans_follow_strides_and_dtypes(name):
    """One op called in turn on contiguous, strided and padded inputs of one shape, in
    every dtype, twice each: every call matches the float64 reference (a plan cached for one
    layout or dtype and reused for another would not)."""
    fn, ref, make = CASES[name]
    for _ in range(2):
        for dtype in DTYPES:
            for layout in ("contiguous", "strided_cols", "padded_rows"):
                if name.startswith("attention") and layout == "padded_rows":
                    continue  # attention's second layout: (B, N, H, D) storage seen as (B, H, N, D)
                inputs = make(dtype, layout)
                testing.assert_matches_reference(fn, ref, inputs, dtype=dtype)


def test_plan_cache_is_bounded():
    cache = launch.PlanCache(max_size=3)
    for i in range(10):
        assert cache.get_or_build(i, lambda i=i: i * 2) == i * 2
        assert len(cache) <= 3


def test_bound_launch_reuses_its_compiled_kernel(monkeypatch):
    """After the first call of a specialization, a Launch launches the compiled kernel directly
    (GPU: no more slow-path calls); a tensor of the same shape and strides that is not 16-byte
    aligned takes the slow path once, for a kernel of its own, and gets the right answer."""
    if not testing.on_gpu():
        pytest.skip("compiled kernels exist on a GPU only (the interpreter runs each call)")
    if not launch.launcher_layout_known():
        pytest.skip("this Triton's launcher is not called directly: every call takes kernel[grid]")
    import fk_weightedsum.plan as plan

    slow = []
    real_slow = launch.Launch._slow

    def counted(self, head):
        slow.append(self)
        return real_slow(self, head)

    monkeypatch.setattr(launch.Launch, "_slow", counted)
    monkeypatch.setattr(plan, "BOUND", launch.PlanCache())
    x = testing.randn((64, 256), torch.float32)
    w = testing.randn((256,), torch.float32)
    first = weighted_sum(x, w)
    bound = len(slow)
    assert bound > 0
    again = weighted_sum(x, w)
    assert len(slow) == bound, "a bound launch went through Triton's JIT again"
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    # The same shape and strides, 4 bytes into a storage: same plan, a different specialization.
    storage = testing.randn((64 * 256 + 4,), torch.float32)
    x_odd = storage[1:1 + 64 * 256].view(64, 256)
    assert x_odd.stride() == x.stride() and x_odd.data_ptr() % 16
    testing.assert_close("misaligned", weighted_sum(x_odd, w), x_odd.double() @ w.double(), torch.float32)
    assert len(slow) > bound
    assert any(len(c._compiled) == 2 for run in plan.BOUND.values() for c in _launches(run))


# Triton 3.6's `make_tensordesc_arg` / `wrap_handle_tensordesc` (triton/backends/nvidia/driver.py),
# as that version expands host TMA descriptors before its C launcher: the reference for `_expand`.
TMA_DTYPE_DEVICE_TO_HOST = dict((i, i) for i in range(16)) | {8: 10, 9: 8, 10: 9}
BASE_ARGS = 13


_FILL = []  # the tensor-map filler that `_make_tensordesc_arg` calls (Triton's is the driver's)


def _make_tensordesc_arg(arg, metadata):
    padding = 1 if arg.padding == "nan" else 0
    tensor_map = _FILL[0](arg.base.data_ptr(), metadata["swizzle"], metadata["elem_size"],
                          TMA_DTYPE_DEVICE_TO_HOST[metadata["elem_type"]], metadata["block_size"], arg.shape,
                          arg.strides, padding)
    return [tensor_map, *arg.shape, *arg.strides]


def _triton36_wrapper(launcher, signature, tensordesc_meta):
    tensordesc_indices = {i for i, sig in enumerate(signature.values()) if sig.startswith("tensordesc")}

    def inner(*args):
        final_args = list(args[:BASE_ARGS])
        tensordesc_idx = 0
        for i, arg in enumerate(args[BASE_ARGS:]):
            if i in tensordesc_indices:
                final_args.extend(_make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


def test_descriptor_arguments_expand_as_triton_36_does():
    """`launch._expand` hands the C launcher what Triton 3.6's per-call wrapper would: each
    descriptor's filled tensor map, shape and strides in place, other arguments untouched."""
    signature = {"q": "tensordesc<bf16[1,1,64,128]>", "x": "*fp32", "k": "tensordesc<fp16[1,1,32,64]>",
                 "scale": "fp32", "n": "i32", "BLOCK": "constexpr"}
    metas = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 1, 64, 128], fp4_padded=False),
             dict(swizzle=2, elem_size=2, elem_type=8, block_size=[1, 1, 32, 64], fp4_padded=False)]
    filled = []

    def fill(*args):  # a tensor map that shows what it was filled from
        filled.append(args)
        return ("map", args[0], *args[1:5])

    calls = []
    _FILL[:] = [fill]
    wrapper = _triton36_wrapper(lambda *a: calls.append(a), signature, metas)
    wrapper.__module__ = __name__  # where `_tensordesc_fast_path` finds the dtype table
    q, k = torch.zeros(2, 3, 64, 128), torch.zeros(1, 1, 32, 64)
    head = [launch.Descriptor(q, [2, 3, 64, 128], [24576, 8192, 128, 1], [1, 1, 64, 128]), 12345,
            launch.Descriptor(k, [1, 1, 32, 64], [2048, 2048, 64, 1], [1, 1, 32, 64], padding="nan"), 0.5]
    base, tail = list(range(BASE_ARGS)), [7, 64]
    wrapper(*base, *head, *tail)
    raw, expansions = launch._tensordesc_fast_path(wrapper, len(head), fill)
    raw(*base, *launch._expand(head, expansions), *tail)
    assert len(calls) == 2 and len(filled) == 4
    assert calls[0] == calls[1] and filled[:2] == filled[2:]
    q_map, k_map = ("map", q.data_ptr(), 3, 2, 8, [1, 1, 64, 128]), ("map", k.data_ptr(), 2, 2, 10, [1, 1, 32, 64])
    assert calls[1][BASE_ARGS:] == (q_map, 2, 3, 64, 128, 24576, 8192, 128, 1, 12345, k_map, 1, 1, 32, 64, 2048,
                                    2048, 64, 1, 0.5, 7, 64)
    assert filled[3][-1] == 1 and filled[2][3] == 8 and filled[3][3] == 10
    # Other wrappers (other Triton versions), fp4 padding or a descriptor past the head: no fast path.
    assert launch._tensordesc_fast_path(lambda *a: None, len(head), fill) is None
    assert launch._tensordesc_fast_path(wrapper, 1, fill) is None
    metas[0]["fp4_padded"] = True
    assert launch._tensordesc_fast_path(wrapper, len(head), fill) is None


def test_filled_descriptors_are_kept_per_base_shape_and_strides(monkeypatch):
    """`launch._expand` fills a descriptor's tensor map once for a base address, shape, strides and
    padding and hands the same map to later launches (a decode step's KV cache); another base, view or
    padding fills its own; at most `DESCRIPTOR_CACHE` kept per argument; 0 fills on every launch."""
    filled = []

    def fill(*args):
        filled.append(args)
        return ("map", len(filled))

    expansions = ((0, 3, 2, 10, [1, 1, 64, 128], fill, {}),)
    k = torch.zeros(4, 2, 64, 128)
    desc = [64 * 128 * 2, 64 * 128, 128, 1]

    def maps(t, shape=(4, 2, 64, 128), strides=desc, padding="zero"):
        return launch._expand([launch.Descriptor(t, list(shape), list(strides), [1, 1, 64, 128], padding), 7],
                              expansions)[0]

    first = maps(k)
    assert maps(k) is first and maps(k.view(4, 2, 64, 128)) is first and len(filled) == 1
    assert maps(k[1:], (3, 2, 64, 128)) != first and len(filled) == 2  # another base and shape
    assert maps(k, strides=[128, 64 * 128, 128, 1]) != first and len(filled) == 3  # other strides
    assert maps(k, padding="nan") != first and filled[-1][-1] == 1 and len(filled) == 4
    assert maps(k) is first and len(filled) == 4
    monkeypatch.setattr(launch, "DESCRIPTOR_CACHE", 2)
    others = [torch.zeros(4, 2, 64, 128) for _ in range(3)]
    for t in others:
        maps(t)
    assert len(expansions[0][-1]) <= 2 and len(filled) == 7
    monkeypatch.setattr(launch, "DESCRIPTOR_CACHE", 0)
    maps(others[-1]), maps(others[-1])
    assert len(filled) == 9


def test_direct_launches_only_under_checked_triton_versions():
    """The compiled launcher's argument layout differs across Triton versions (3.4: 12 leading
    arguments; 3.5-3.6: a launcher per signature; 3.7-3.9: one generic launcher): `Launch` calls
    it directly only under the checked ones, each with its own layout."""
    for version in ("3.5.1", "3.6.0"):
        assert launch.launcher_layout(version) == "per-signature", version
    for version in ("3.7.0", "3.7.1", "3.8.0", "3.9.0", "3.9.1"):
        assert launch.launcher_layout(version) == "generic", version
    for version in ("3.4.0", "3.10.0", "4.0.0", "3", "nightly", "3.x"):
        assert launch.launcher_layout(version) is None and not launch.launcher_layout_known(version), version


def _stub_triton_driver(monkeypatch, calls: list, filled: list):
    """Triton's active driver with its C parts replaced: `utils.launch` records its arguments,
    `fill_tma_descriptor_tiled` a tensor map that shows what it was filled from; the launcher
    module's argument annotations as plain tuples (its C type, built when the real driver loads)."""
    import types

    import triton.backends.nvidia.driver as nvidia

    def fill(*args):
        filled.append(args)
        return ("map", args[0], *args[1:5])

    utils = types.SimpleNamespace(launch=lambda *a: calls.append(a), build_signature_metadata=tuple,
                                  fill_tma_descriptor_tiled=fill)
    stub = types.SimpleNamespace(utils=utils, get_current_device=lambda: 0)
    monkeypatch.setattr(importlib.import_module("triton.runtime.driver").driver, "_active", stub)
    monkeypatch.setattr(nvidia, "PyKernelArg", lambda nested_tuple, type: (type, nested_tuple), raising=False)
    for i, name in enumerate(("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE")):
        monkeypatch.setattr(nvidia, name, i, raising=False)
    return nvidia


@pytest.mark.skipif(launch.launcher_layout() != "generic", reason="Triton 3.7-3.9's generic launcher")
def test_generic_launches_pass_what_tritons_launcher_passes(monkeypatch):
    """Under Triton 3.7-3.9, a bound launch hands `driver.active.utils.launch` exactly what this
    Triton's own `CudaLauncher` (its argument annotations, signature and per-call descriptor
    wrapper, run here with the C parts stubbed) would for the same kernel and arguments: fk's
    descriptors expanded in place as tensor map, shape and strides, constexprs left for the C
    launcher to drop. Descriptors fk does not expand (fp4 padding) and kernels that need scratch
    memory get no direct entry (Triton's dispatch then runs them)."""
    import types

    calls, filled = [], []
    nvidia = _stub_triton_driver(monkeypatch, calls, filled)
    signature = {"q": "tensordesc<bf16[1,1,64,128]>", "x": "*fp32", "k": "tensordesc<fp16[1,1,32,64]>",
                 "scale": "fp32", "n": "i32", "BLOCK": "constexpr", "CAUSAL": "constexpr"}
    metas = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 1, 64, 128], fp4_padded=False),
             dict(swizzle=2, elem_size=2, elem_type=8, block_size=[1, 1, 32, 64], fp4_padded=False)]
    src = types.SimpleNamespace(signature=signature, constants={}, fn=types.SimpleNamespace(arg_names=list(signature)))
    metadata = types.SimpleNamespace(tensordesc_meta=metas, num_ctas=1, global_scratch_size=0,
                                     global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                                     launch_cooperative_grid=False, launch_pdl=True, instrumentation_mode="")
    runner = nvidia.CudaLauncher(src, metadata)
    compiled = types.SimpleNamespace(run=runner, function=777, packed_metadata=(4, 1, 1024), src=src,
                                     metadata=metadata)
    q, k = torch.zeros(2, 3, 64, 128), torch.zeros(1, 1, 32, 64)
    head = [launch.Descriptor(q, [2, 3, 64, 128], [24576, 8192, 128, 1], [1, 1, 64, 128]), 12345,
            launch.Descriptor(k, [1, 1, 32, 64], [2048, 2048, 64, 1], [1, 1, 32, 64], padding="nan"), 0.5]
    tail = (64, 64, True)  # n, then the constexprs
    runner(3, 2, 1, 99, 777, (4, 1, 1024), None, None, None, *head, *tail)  # as Triton's JIT calls it
    fn, function, middle, expansions, packed, kept = launch._generic_entry(compiled, runner, len(head))
    assert packed and kept is compiled and function == 777
    fn(3, 2, 1, 99, function, *middle, launch._expand(list(head), expansions) + list(tail))  # as Launch does
    assert len(calls) == 2 and len(filled) == 4 and filled[:2] == filled[2:]
    assert calls[0][:-1] == calls[1][:-1] and list(calls[0][-1]) == list(calls[1][-1])
    q_map = ("map", q.data_ptr(), 3, 2, nvidia.TMA_DTYPE_DEVICE_TO_HOST[9], [1, 1, 64, 128])
    assert list(calls[1][-1])[:9] == [q_map, 2, 3, 64, 128, 24576, 8192, 128, 1]
    assert filled[3][-1] == 1 and filled[2][-1] == 0  # padding "nan", "zero"
    metas[0]["fp4_padded"] = True
    assert launch._generic_entry(compiled, runner, len(head)) is None
    metas[0]["fp4_padded"] = False
    assert launch._generic_entry(compiled, runner, 1) is None  # a descriptor past the head
    runner.global_scratch_size = 128
    assert launch._generic_entry(compiled, runner, len(head)) is None


def test_unknown_triton_launches_through_tritons_dispatch(monkeypatch):
    """A Triton whose launcher fk has not read: a Launch still runs every call (through
    `kernel[grid]`), warns once per process, and caches no direct entry."""
    monkeypatch.setattr(launch, "launcher_layout_known", lambda version=None: False)
    launch._warn_unknown_layout.cache_clear()
    x = testing.randn((64, 256), torch.float32)
    w = testing.randn((256,), torch.float32)
    import fk_weightedsum.plan as plan

    monkeypatch.setattr(plan, "BOUND", launch.PlanCache())
    on_gpu = testing.on_gpu()
    with pytest.warns(RuntimeWarning, match="launcher") if on_gpu else contextlib.nullcontext():
        first = weighted_sum(x, w)
    testing.assert_close("unknown launcher", first, x.double() @ w.double(), torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fk: Triton", category=RuntimeWarning)  # once only
        again = weighted_sum(x, w)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert all(not c._compiled for run in plan.BOUND.values() for c in _launches(run))
    launch._warn_unknown_layout.cache_clear()


def test_descriptor_launches_skip_tritons_wrapper():
    """On a GPU whose Triton fk launches directly (3.5-3.9), bound launches with TMA descriptors
    go to the C launcher with fk's own expansion (and still give the right answer)."""
    if not testing.on_gpu() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host TMA descriptors: Hopper or newer GPUs")
    if not launch.launcher_layout_known():
        pytest.skip("this Triton's launcher is not called directly")
    import fk_attention.plan as plan

    q, k, v = (testing.randn((1, 4, 256, 128), torch.bfloat16) for _ in range(3))
    attention(q, k, v, causal=True)
    out = attention(q, k, v, causal=True)
    expanded = [e for run in plan.BOUND.values() for c in _launches(run) for e in c._compiled.values() if e[3]]
    assert expanded, "no bound launch expands its own descriptors"
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    testing.assert_close("attention", out, ref, torch.bfloat16)


def _launches(run):
    """The Launch objects a bound plan's closure holds."""
    found = []
    for cell in run.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, launch.Launch):
            found.append(value)
        elif callable(value) and getattr(value, "__closure__", None):
            found += _launches(value)
    return found


@pytest.mark.parametrize("name", CASES)
def test_side_stream_and_cuda_graph_match_eager(name):
    """Calls on a side stream, and a CUDA graph's replay (captured after warm-up: tuning and
    allocation outside the capture), give eager's results, forward and backward."""
    if not testing.on_gpu():
        pytest.skip("streams and CUDA graphs need a GPU")
    fn, _, make = CASES[name]
    inputs = make(torch.bfloat16, "contiguous")
    out = fn(*inputs)
    grad = torch.randn_like(out)
    eager = (out, *torch.autograd.grad(out, inputs, grad))
    # Leaves of their own for the side stream: autograd ties a leaf to the stream of its first use,
    # and a capture must not wait on the default stream.
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            out = fn(*leaves)
            side = (out, *torch.autograd.grad(out, leaves, grad))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn(*leaves)
            captured = (out, *torch.autograd.grad(out, leaves, grad))
        graph.replay()
    stream.synchronize()
    for a, b, c in zip(eager, side, captured, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_first_call_in_a_fresh_thread(name):
    """A thread whose first CUDA work is an fk launch (autograd's backward thread, a server's
    worker), its memory from the allocator's cache: no CUDA context is current there until the
    launch binds one (Triton fills TMA descriptors before its launcher would)."""
    import threading

    fn, _, make = CASES[name]
    dtype = torch.bfloat16 if testing.on_gpu() else torch.float32
    inputs = make(dtype, "contiguous")
    if name == "attention":  # past the decode path's rows: the kernels that read through TMA
        inputs = [testing.randn((1, 2, 80, 16), dtype, requires_grad=True) for _ in range(3)]
    want = fn(*inputs).detach().clone()
    fn(*inputs)  # freed at once: a block of the output's size waits in the cache
    got, errors = [], []

    def work():
        try:
            got.append(fn(*inputs).detach())
        except Exception as exc:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


@pytest.mark.skipif(not (testing.on_gpu() and torch.cuda.device_count() > 1), reason="needs two GPUs")
@pytest.mark.parametrize("name", CASES)
def test_second_device(name):
    """The same shapes on another GPU than the current one: plans are bound per device."""
    fn, ref, make = CASES[name]
    inputs = make(torch.float32, "contiguous")
    fn(*inputs)
    moved = [t.detach().to("cuda:1").requires_grad_() for t in inputs]
    testing.assert_matches_reference(fn, ref, moved, dtype=torch.float32)


QUIET = tuple(CASES)


@pytest.mark.parametrize("name", QUIET)
def test_quiet_calls_follow_strides_and_dtypes(name):
    """`test_bound_plans_follow_strides_and_dtypes` for calls autograd does not record (inputs
    that require no grad, or grad mode off): those go from their first call on straight to the
    plan of their key (`fk_runtime.ops.quiet_key`), which must follow every layout and dtype, and
    give outputs that nothing records."""
    fn, ref, make = CASES[name]
    for grad_mode, requires in ((True, False), (False, True), (False, False)):
        for _ in range(2):
            for dtype in DTYPES:
                for layout in ("contiguous", "strided_cols", "padded_rows"):
                    if name.startswith("attention") and layout == "padded_rows":
                        continue
                    inputs = [t.detach().requires_grad_(requires) for t in make(dtype, layout)]
                    with torch.set_grad_enabled(grad_mode):
                        testing.assert_matches_reference(fn, ref, inputs, dtype=dtype, backward=False)
                        out = fn(*inputs)
                    assert out.grad_fn is None and not out.requires_grad and not out._is_view()


# (module of the check an op's full path runs, its name, module of the op's plan cache)
CHECKED = {"attention": ("fk_attention.ops", "check_attention_inputs", "fk_attention.plan"),
           "attention_varlen": ("fk_attention.ops", "check_attention_inputs", "fk_attention.plan"),
           "layer_norm": ("fk_layernorm.plan", "check_inputs", "fk_layernorm.plan"),
           "rms_norm": ("fk_layernorm.plan", "check_inputs", "fk_layernorm.plan"),
           "softmax": ("fk_softmax.plan", "check_dim", "fk_softmax.plan"),
           "weighted_sum": ("fk_weightedsum.plan", "check_inputs", "fk_weightedsum.plan")}


@pytest.mark.parametrize("name", QUIET)
def test_quiet_calls_skip_the_checks_once_a_key_passed(name, monkeypatch):
    """A key's second quiet call does not check again (what makes it cheap), while a call that
    autograd records, or one of another layout, still does."""
    where = CHECKED[name]
    module, check, plans = importlib.import_module(where[0]), where[1], importlib.import_module(where[2])
    fn, _, make = CASES[name]
    monkeypatch.setattr(plans, "BOUND", launch.PlanCache())
    inputs = [t.detach() for t in make(torch.float32, "contiguous")]
    seen = []
    real = getattr(module, check)
    monkeypatch.setattr(module, check, lambda *a, **k: seen.append(1) or real(*a, **k))
    fn(*inputs)
    first = len(seen)
    assert first >= 1
    fn(*inputs)
    assert len(seen) == first
    fn(*[t.requires_grad_() for t in inputs])
    assert len(seen) > first
    now = len(seen)
    with torch.no_grad():
        fn(*[t.detach() for t in make(torch.float32, "strided_cols")])
    assert len(seen) > now


@pytest.mark.parametrize("name", QUIET)
def test_recorded_calls_skip_the_checks_once_a_key_passed(name, monkeypatch):
    """A key's second call that autograd records goes straight to the op's autograd.Function (no
    checks, no argument parsing), with right outputs and gradients; the same inputs unrecorded are
    another key, checked once."""
    where = CHECKED[name]
    module, check, plans = importlib.import_module(where[0]), where[1], importlib.import_module(where[2])
    fn, ref, make = CASES[name]
    monkeypatch.setattr(plans, "BOUND", launch.PlanCache())
    seen = []
    real = getattr(module, check)
    monkeypatch.setattr(module, check, lambda *a, **k: seen.append(1) or real(*a, **k))
    for dtype in DTYPES:
        inputs = [t.detach().requires_grad_() for t in make(dtype, "strided_cols")]
        before = len(seen)
        testing.assert_matches_reference(fn, ref, inputs, dtype=dtype)  # (binding the backward may check too)
        first = len(seen)
        assert first > before
        for _ in range(2):  # fresh inputs of the key: outputs and every gradient against float64
            inputs = [t.detach().requires_grad_() for t in make(dtype, "strided_cols")]
            assert fn(*inputs).grad_fn is not None
            testing.assert_matches_reference(fn, ref, inputs, dtype=dtype)
        assert len(seen) == first
        with torch.no_grad():
            assert fn(*inputs).grad_fn is None
        assert len(seen) > first


# Modules whose plan lookups an op's forward makes (each imported `layout_key`).
LOOKUPS = {"attention": ("fk_attention.plan", "fk_attention.decode"), "attention_varlen": ("fk_attention.plan",),
           "layer_norm": ("fk_layernorm.plan",), "rms_norm": ("fk_layernorm.plan",),
           "softmax": ("fk_softmax.plan",), "weighted_sum": ("fk_weightedsum.plan",)}


@pytest.mark.parametrize("name", QUIET)
def test_recorded_calls_run_the_forward_their_key_bound(name, monkeypatch):
    """A key's later calls that autograd records run the forward its first call bound
    (`fk_runtime.ops.Op.bound`): no plan looked up again, recorded all the same, with right outputs and
    gradients."""
    fn, ref, make = CASES[name]
    for dtype in DTYPES:  # (bf16 on a GPU only: the interpreter widens it, and keeps the full forward)
        fn(*[t.detach().requires_grad_() for t in make(dtype, "contiguous")])
        looked = []
        with monkeypatch.context() as patched:
            for holder in map(importlib.import_module, LOOKUPS[name]):
                real = holder.layout_key
                patched.setattr(holder, "layout_key", lambda *t, real=real, looked=looked: looked.append(1) or real(*t))
            out = fn(*[t.detach().requires_grad_() for t in make(dtype, "contiguous")])
        assert out.grad_fn is not None and not looked, f"{len(looked)} plan lookups"
        testing.assert_matches_reference(fn, ref, [t.detach().requires_grad_() for t in make(dtype, "contiguous")],
                                         dtype=dtype)


def test_quiet_keys_hold_argument_types():
    """A value the checks refuse never meets the plan of an accepted one it equals: 1.0 where an
    int is wanted, 1 where a bool is; a tensor argument is never part of a key."""
    q, k, v = (testing.randn((1, 2, 24, 16), torch.float32) for _ in range(3))
    attention(q, k, v, window=(4, 0), return_lse=True)
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=(4.0, 0), return_lse=True)
    with pytest.raises(TypeError, match="return_lse"):
        attention(q, k, v, window=(4, 0), return_lse=1)
    attention(q, k, v, window=[4, 0], return_lse=True)
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=[4, 0.0], return_lse=True)
    x, w = testing.randn((6, 40), torch.float32), testing.randn((40,), torch.float32)
    rms_norm(x, w, 1e-6)
    assert fk_ops.quiet_key("rms_norm", (x, w), (torch.tensor(1e-6),)) is None
    assert fk_ops.quiet_key("attention", (q, k, v), (False, torch.tensor(0.5), False, None, None)) is None

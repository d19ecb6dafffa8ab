"""The lean host path: each op binds its launches once per (shape, strides, dtype, device, flags)
and reuses them. What it caches must stay right when any of those changes between calls, and on
a GPU the bound launches (compiled kernels launched directly) must equal the first, JIT-launched
call, under side streams and CUDA graph capture too."""

import pytest
import torch
import torch.nn.functional as F
from fk_runtime import launch, testing

from fk_attention import attention
from fk_layernorm import layer_norm, rms_norm
from fk_softmax import softmax
from fk_weightedsum import weighted_sum

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if testing.on_gpu() else [])


def _cases():
    """name: (fk function, float64 reference, make(dtype, layout) -> inputs); attention takes
    any layout but "contiguous" as (B, N, H, D) storage transposed."""
    def rows(dtype, layout, extra=()):
        x = testing.randn((6, 40), dtype, layout=layout, requires_grad=True)
        return [x, *(testing.randn((40,), dtype, requires_grad=True) for _ in extra)]

    def qkv(dtype, layout):
        return [testing.randn((1, 2, 24, 16), dtype, requires_grad=True) if layout == "contiguous"
                else testing.randn((1, 24, 2, 16), dtype).transpose(1, 2).requires_grad_()
                for _ in range(3)]

    return {
        "softmax": (lambda x: softmax(x), lambda x: torch.softmax(x, -1), rows),
        "layer_norm": (layer_norm, lambda x, w, b: F.layer_norm(x, (40,), w, b),
                       lambda dtype, layout: rows(dtype, layout, (0, 1))),
        "rms_norm": (rms_norm, lambda x, w: F.rms_norm(x, (40,), w, 1e-6), lambda dtype, layout: rows(dtype, layout, (0,))),
        "weighted_sum": (weighted_sum, lambda x, w: x @ w, lambda dtype, layout: rows(dtype, layout, (0,))),
        "attention": (lambda q, k, v: attention(q, k, v, causal=True),
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv),
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
                if name == "attention" and layout == "padded_rows":
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

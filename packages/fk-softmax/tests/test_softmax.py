import functools
import math

import pytest
import torch
from fk_runtime import sizing
from fk_runtime.harness import testing
from fk_softmax import plan as plans
from fk_softmax import LogSoftmax, Softmax, log_softmax, softmax

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FUSED, SPLIT, TWO_PASS = plans.Path.FUSED, plans.Path.SPLIT, plans.Path.LONG  # long rows: two passes
# Row lengths and the path each takes (asserted below, so that no path goes untested): whole rows
# (1, 17, 1000, 4097), rows split over sibling programs (40000: 5 chunks of 8192; 36000: 9 of
# 4096 forward, which the wider chunk would pad more, and 5 of 8192 backward), rows past the split
# limit in two passes, both ways (140001 on the interpreter, past 2.16M columns on an H100).
SHAPES = [(1,), (3, 1), (5, 17), (2, 3, 1000), (7, 4097), (9, 40000), (3, 36000)]
LONG = (2, 140001) if not testing.on_gpu() else (2, 2_200_001)
SHAPES.append(LONG)
if testing.on_gpu():
    SHAPES += [(4097, 1024), (3, 262144), (2, 1_000_000), (128, 3, 65537)]


def torch_softmax(x, dim=-1, causal=False):
    if causal:
        keep = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
        x = x.masked_fill(~keep, -math.inf)
    return torch.softmax(x, dim)


def torch_log_softmax(x, dim=-1):
    return torch.log_softmax(x, dim)


def path_of(shape, dtype, backward=False):
    return plans.plan(math.prod(shape[:-1]), shape[-1], dtype, backward).path


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_is_reached(dtype, backward):
    assert path_of((7, 4097), dtype, backward) is FUSED
    assert path_of((9, 40000), dtype, backward) is SPLIT
    assert path_of((3, 36000), dtype, backward) is SPLIT
    if not backward:
        assert plans.plan(9, 40000, dtype).block_cols == plans.SPLIT_WIDE_CHUNK_ELEMENTS
        assert plans.plan(3, 36000, dtype).block_cols == plans.SPLIT_CHUNK_ELEMENTS
    assert path_of(LONG, dtype, backward) is TWO_PASS
    if testing.on_gpu():
        assert {path_of(s, dtype, backward) for s in [(1024, 65536), (3, 262144), (2, 1_000_000)]} == {SPLIT}


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_forward_keeps_its_occupancy(dtype):
    """The split forward's register cap (maxnreg): the programs per multiprocessor of its table,
    for both chunk sizes; the backward and the other paths take none."""
    for shape in ((9, 40000), (3, 36000)):
        p = plans.plan(*shape, dtype)
        programs = plans.SPLIT_FORWARD_PROGRAMS_PER_SM.get((p.block_cols, dtype.itemsize))
        assert p.max_registers == (None if programs is None else sizing.register_cap(programs, p.num_warps))
        assert plans.plan(*shape, dtype, backward=True).max_registers is None
    assert plans.plan(7, 4097, dtype).max_registers is None


@pytest.mark.parametrize("shape,dtype,mode", testing.mode_cases(SHAPES, DTYPES), ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_matches_float64_reference(shape, dtype, mode, log):
    x = testing.randn(shape, dtype, scale=3.0, requires_grad=True)
    fn = testing.maybe_compile(log_softmax if log else softmax, mode)
    ref = torch_log_softmax if log else torch_softmax
    testing.assert_matches_reference(fn, ref, [x], dtype=dtype, names=["x"], baseline_fn=ref)


@pytest.mark.parametrize("shape", [(5, 5), (3, 7, 4), (2, 4, 9), (2, 3, 40000), (2, 3, 66001)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_mask_square_and_rectangular(shape, dtype):
    x = testing.randn(shape, dtype, requires_grad=True)
    ref = functools.partial(torch_softmax, causal=True)
    testing.assert_matches_reference(lambda t: softmax(t, causal=True), ref, [x], dtype=dtype, baseline_fn=ref)


@pytest.mark.skipif(not testing.on_gpu(), reason="GPU shapes; the CPU runs the same test at small sizes above")
@pytest.mark.parametrize("shape", [(4, 1024, 1024), (2, 17, 262144)], ids=str)
def test_causal_mask_large(shape):
    x = testing.randn(shape, torch.bfloat16, requires_grad=True)
    ref = functools.partial(torch_softmax, causal=True)
    testing.assert_matches_reference(
        lambda t: softmax(t, causal=True), ref, [x], dtype=torch.bfloat16, baseline_fn=ref
    )


@pytest.mark.parametrize("shape,dim", [((6, 33, 5), 0), ((6, 33, 5), 1), ((6, 33, 5), -2), ((2, 3, 4, 5), 1),
                                       ((40000, 3), 0), ((2, 66001, 3), 1)], ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_other_dims(shape, dim, log):
    x = testing.randn(shape, requires_grad=True)
    fn = (lambda t: log_softmax(t, dim)) if log else (lambda t: softmax(t, dim))
    ref = (lambda t: torch.log_softmax(t, dim)) if log else (lambda t: torch.softmax(t, dim))
    testing.assert_matches_reference(fn, ref, [x], dtype=torch.float32)


@pytest.mark.parametrize("layout", ["padded_rows", "strided_cols"])
@pytest.mark.parametrize("cols", [300, 40000, 66001])
@pytest.mark.parametrize("log", [False, True])
def test_strided_inputs(layout, cols, log):
    x = testing.randn((3, cols), torch.float16, layout=layout, requires_grad=True)
    fn, ref = (log_softmax, torch_log_softmax) if log else (softmax, torch_softmax)
    testing.assert_matches_reference(fn, ref, [x], dtype=torch.float16, baseline_fn=ref)


def test_permuted_input_and_strided_upstream_gradient():
    x = testing.randn((5, 50, 4), requires_grad=True)
    xt = x.transpose(0, 1)  # (50, 5, 4): rows that no single stride walks
    g = testing.randn((4, 5, 50)).permute(2, 1, 0)
    for dim in (-1, 1):
        (ours,) = torch.autograd.grad(softmax(xt, dim), [x], g)
        (ref,) = torch.autograd.grad(torch.softmax(xt.double(), dim), [x], g.double())
        testing.assert_close("grad x", ours, ref, torch.float32)


@pytest.mark.parametrize("cols", [8, 40000, 66001])
@pytest.mark.parametrize("log", [False, True])
def test_infinities_and_huge_values_as_torch(cols, log):
    x = testing.randn((9, cols)) * 1e4
    x[0, : cols // 2] = -math.inf  # -inf entries (whole chunks of them on the long paths)
    x[1] = -math.inf  # a whole row of -inf: NaN, as torch gives
    x[2, 3] = 3e4  # a dominant entry
    x[3, -1] = math.inf  # +inf: the row is NaN in torch too
    x[4, 1:] = -math.inf  # one finite entry
    x.requires_grad_(True)
    fn, ref_fn = (log_softmax, torch.log_softmax) if log else (softmax, torch.softmax)
    ours = fn(x)
    xd = x.detach().double().requires_grad_(True)
    ref = ref_fn(xd, -1)
    nan_rows = [1, 3]
    assert torch.isnan(ours[nan_rows]).all() and torch.isnan(ref[nan_rows]).all()
    keep = [0, 2, 4, 5, 8]
    testing.assert_close("y", ours[keep], ref[keep], torch.float32)
    g = testing.randn((9, cols))
    g[nan_rows] = 0
    (gx,) = torch.autograd.grad(ours, [x], g)
    (rgx,) = torch.autograd.grad(ref, [xd], g.double())
    # Near-ties at 1e4 scale cancel in fp32 (torch's own error reached 1e-2 in 17 of 3000 seeds).
    xt = x.detach().clone().requires_grad_(True)
    (tgx,) = torch.autograd.grad(ref_fn(xt, -1), [xt], g)
    testing.assert_close("grad x", gx[keep], rgx[keep], torch.float32, baseline=tgx[keep])


def test_empty_and_scalar():
    for shape in [(0, 5), (4, 0), (2, 0, 3)]:
        x = testing.randn(shape, requires_grad=True)
        for y in (softmax(x), log_softmax(x, 0), softmax(x, causal=True) if len(shape) > 1 else softmax(x)):
            assert y.shape == x.shape
            (g,) = torch.autograd.grad(y, [x], torch.ones_like(y))
            assert g.shape == x.shape
    s = testing.randn((), requires_grad=True)
    torch.testing.assert_close(softmax(s), torch.softmax(s, -1))
    torch.testing.assert_close(log_softmax(s), torch.log_softmax(s, -1))


@pytest.mark.parametrize("cols", [50000, 66001])
def test_modules_and_determinism(cols):
    x = testing.randn((2, 3, cols), requires_grad=True)
    g = testing.randn((2, 3, cols))
    first = torch.autograd.grad(Softmax(causal=False)(x), [x], g)[0]
    again = torch.autograd.grad(softmax(x), [x], g)[0]
    assert torch.equal(first, again)
    first = torch.autograd.grad(LogSoftmax()(x), [x], g)[0]
    assert torch.equal(first, torch.autograd.grad(log_softmax(x), [x], g)[0])
    small = x[:, :, :100]
    testing.assert_close("y", LogSoftmax(dim=1)(small), torch.log_softmax(small.double(), 1), torch.float32)
    assert "causal=True" in repr(Softmax(causal=True)) and "dim=1" in repr(LogSoftmax(dim=1))


@pytest.mark.parametrize("log", [False, True])
def test_split_rows_when_siblings_stop_waiting(log):
    """Programs that stop waiting for their siblings at once leave their chunks to the row's last
    program (or take them back): same results. On a GPU this races for real."""
    with testing.siblings_give_up_at_once(plans.plan, plans.BOUND):
        rows = 64 if testing.on_gpu() else 3
        x = testing.randn((rows, 40000), torch.bfloat16, scale=3.0, requires_grad=True)
        assert path_of(x.shape, x.dtype, backward=True) is SPLIT and plans.plan(rows, 40000, x.dtype).spin_limit == 0
        fn, ref = (log_softmax, torch_log_softmax) if log else (softmax, torch_softmax)
        testing.assert_matches_reference(fn, ref, [x], dtype=torch.bfloat16, names=["x"], baseline_fn=ref)


def test_backward_saves_only_the_output():
    for fn in (softmax, log_softmax):
        x = testing.randn((4, 64), requires_grad=True)
        y = fn(x)
        saved = y.grad_fn.saved_tensors
        assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: softmax(testing.randn((5,)), causal=True), ValueError, "at least 2 dims"),
        (lambda: softmax(testing.randn((5, 5)), dim=0, causal=True), ValueError, "dim=-1"),
        (lambda: softmax(torch.ones(3, 3, dtype=torch.int32)), TypeError, "x must have dtype"),
        (lambda: log_softmax(torch.ones(3, 3, dtype=torch.int64)), TypeError, "x must have dtype"),
        (lambda: softmax(testing.randn((3, 3)), dim=2), ValueError, "out of range"),
        (lambda: softmax(testing.randn((3, 3)), dim=1.0), TypeError, "dim must be an int"),
        (lambda: softmax("x"), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compiled_graph_runs_the_fk_op():
    x = testing.randn((4, 8), requires_grad=True)
    ops = testing.compiled_graph_ops(lambda t: softmax(t, causal=True) + log_softmax(t, 0), x)
    assert "fk.softmax.default" in ops, ops


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the placeholders hold whatever memory held
@pytest.mark.parametrize("log", [False, True])
def test_backward_bound_ahead_leaves_the_call_as_it_was(monkeypatch, log):
    """The path that binds the backward ahead (`ops._backward_ahead`; on a GPU it only compiles)
    runs here in full on placeholders: y and x's gradient are those of a call without it, and it
    binds once per what the kernel compiles for (not per row count)."""
    from fk_runtime import ahead
    from fk_runtime.launch import PlanCache

    from fk_softmax import ops

    def run(rows=6):
        torch.manual_seed(0)
        x = torch.randn(rows, 40, device=testing.device(), requires_grad=True)
        y = (log_softmax if log else softmax)(x)
        y.square().sum().backward()
        return y.detach(), x.grad

    expected = run()
    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(ahead, "useful", lambda *tensors: True)
    for got, want in zip(run(), expected, strict=True):
        torch.testing.assert_close(got, want)
    run(rows=9)
    assert len(ops.AHEAD) == 1


@pytest.mark.skipif(not testing.on_gpu(), reason="compiles for the GPU ahead (the interpreter compiles nothing)")
@pytest.mark.parametrize("grad", ["dense", "sum"])
def test_backward_compiles_ahead_for_a_first_backward(monkeypatch, grad):
    """A recorded call binds its backward at once, for a model's upstream gradient (laid out like
    y) and for `y.sum().backward()`'s (one value broadcast): either backward then compiles nothing
    more, and x's gradient is right."""
    from fk_runtime.launch import PlanCache

    from fk_softmax import kernels, ops

    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(plans, "BOUND", PlanCache())
    cols = 3000 + 8 * (grad == "sum")  # a row length no other test compiled
    x = testing.randn((5, 7, cols), dtype=torch.bfloat16, requires_grad=True)
    y = softmax(x)
    before = testing.compiled_variants(kernels)
    dy = testing.upstream_grad(y, grad)
    y.backward(dy)
    assert testing.compiled_variants(kernels) == before, "the backward compiled what was to be compiled ahead"
    ref = x.detach().double().requires_grad_()
    torch.softmax(ref, -1).backward(dy.double())
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-3, rtol=2e-2)

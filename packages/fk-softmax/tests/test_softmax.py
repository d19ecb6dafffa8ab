import math

import pytest
import torch
from fk_runtime import testing

from fk_softmax import LogSoftmax, Softmax, log_softmax, softmax

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Row lengths: fused rows (1, 17, 1000, 4097), rows walked twice by one program (9 rows of 40000:
# enough rows for the interpreter's 4 "multiprocessors"), and rows split across programs (2 x 70001).
SHAPES = [(1,), (3, 1), (5, 17), (2, 3, 1000), (7, 4097), (9, 40000), (2, 70001)]
if testing.on_gpu():
    SHAPES += [(4097, 1024), (3, 262144), (2, 1_000_000), (128, 3, 65537)]


def torch_softmax(x, dim=-1, causal=False):
    if causal:
        keep = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
        x = x.masked_fill(~keep, -math.inf)
    return torch.softmax(x, dim)


def torch_log_softmax(x, dim=-1):
    return torch.log_softmax(x, dim)


@pytest.mark.parametrize("mode", testing.compile_modes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_matches_float64_reference(shape, dtype, mode, log):
    x = testing.randn(shape, dtype, scale=3.0, requires_grad=True)
    fn = testing.maybe_compile(log_softmax if log else softmax, mode)
    ref = torch_log_softmax if log else torch_softmax
    testing.assert_matches_reference(fn, ref, [x], dtype=dtype, names=["x"])


@pytest.mark.parametrize("shape", [(5, 5), (3, 7, 4), (2, 4, 9), (2, 3, 70001), (3, 9, 40000)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_mask_square_and_rectangular(shape, dtype):
    x = testing.randn(shape, dtype, requires_grad=True)
    testing.assert_matches_reference(
        lambda t: softmax(t, causal=True), lambda t: torch_softmax(t, causal=True), [x], dtype=dtype
    )


@pytest.mark.parametrize("dim", [0, 1, -2])
@pytest.mark.parametrize("log", [False, True])
def test_other_dims(dim, log):
    x = testing.randn((6, 33, 5), requires_grad=True)
    fn = (lambda t: log_softmax(t, dim)) if log else (lambda t: softmax(t, dim))
    ref = (lambda t: torch.log_softmax(t, dim)) if log else (lambda t: torch.softmax(t, dim))
    testing.assert_matches_reference(fn, ref, [x], dtype=torch.float32)


@pytest.mark.parametrize("layout", ["padded_rows", "strided_cols"])
@pytest.mark.parametrize("cols", [300, 40000])
def test_strided_inputs(layout, cols):
    x = testing.randn((3, cols), torch.float16, layout=layout, requires_grad=True)
    testing.assert_matches_reference(softmax, torch_softmax, [x], dtype=torch.float16)


def test_strided_upstream_gradient():
    x = testing.randn((4, 50), requires_grad=True)
    g = testing.randn((50, 4)).t()
    (ours,) = torch.autograd.grad(softmax(x), [x], g)
    (ref,) = torch.autograd.grad(torch.softmax(x.double(), -1), [x], g.double())
    testing.assert_close("grad x", ours, ref, torch.float32)


@pytest.mark.parametrize("cols", [8, 40000, 70001])
@pytest.mark.parametrize("log", [False, True])
def test_infinities_and_huge_values_as_torch(cols, log):
    x = testing.randn((9, cols)) * 1e4
    x[0, : cols // 2] = -math.inf  # some -inf entries
    x[1] = -math.inf  # a whole row of -inf: NaN, as torch gives
    x[2, 3] = 3e4  # a dominant entry
    ours = (log_softmax if log else softmax)(x)
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    assert torch.isnan(ours[1]).all() and torch.isnan(ref[1]).all()
    keep = [0, 2, 3, 8]
    testing.assert_close("y", ours[keep], ref[keep], torch.float32)


def test_empty_and_scalar():
    for shape in [(0, 5), (4, 0), (2, 0, 3)]:
        x = testing.randn(shape, requires_grad=True)
        y = softmax(x)
        assert y.shape == x.shape
        (g,) = torch.autograd.grad(y, [x], torch.ones_like(y))
        assert g.shape == x.shape
    s = testing.randn(())
    torch.testing.assert_close(softmax(s), torch.softmax(s, -1))


def test_modules_and_determinism():
    x = testing.randn((3, 4, 50000), requires_grad=True)
    g = testing.randn((3, 4, 50000))
    first = torch.autograd.grad(Softmax(causal=False)(x), [x], g)[0]
    again = torch.autograd.grad(softmax(x), [x], g)[0]
    assert torch.equal(first, again)
    testing.assert_close("y", LogSoftmax(dim=1)(x), torch.log_softmax(x.double(), 1), torch.float32)
    assert "causal=True" in repr(Softmax(causal=True))


def test_backward_saves_only_the_output():
    x = testing.randn((4, 64), requires_grad=True)
    y = softmax(x)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: softmax(testing.randn((5,)), causal=True), ValueError, "at least 2 dims"),
        (lambda: softmax(testing.randn((5, 5)), dim=0, causal=True), ValueError, "dim=-1"),
        (lambda: softmax(torch.ones(3, 3, dtype=torch.int32)), TypeError, "x must have dtype"),
        (lambda: softmax(testing.randn((3, 3)), dim=2), ValueError, "out of range"),
        (lambda: softmax("x"), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compiled_graph_runs_the_fk_op():
    x = testing.randn((4, 8), requires_grad=True)
    ops = testing.compiled_graph_ops(lambda t: softmax(t, causal=True), x)
    assert "fk.softmax.default" in ops, ops

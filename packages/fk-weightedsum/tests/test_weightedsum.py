import pytest
import torch
from fk_runtime.harness import testing
from fk_weightedsum import plan as plans

from fk_weightedsum import WeightedSum, weighted_sum
from fk_weightedsum.plan import backward_2d, forward_2d

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (17,), (3, 17), (2, 5, 1000), (4097, 3), (3, 5000), (2, 3, 4, 33)]
if testing.on_gpu():
    SHAPES += [(65537, 128), (4097, 4097), (2, 1_000_000), (1, 65537), (256, 3, 1024)]


def reference(x, w):
    return x @ w


@pytest.mark.parametrize("shape,dtype,mode", testing.mode_cases(SHAPES, DTYPES), ids=str)
def test_matches_float64_reference(shape, dtype, mode):
    x = testing.randn(shape, dtype, requires_grad=True)
    w = testing.randn(shape[-1:], dtype, requires_grad=True)
    fn = testing.maybe_compile(weighted_sum, mode)
    testing.assert_matches_reference(fn, reference, [x, w], dtype=dtype, names=["x", "weight"])


@pytest.mark.parametrize("layout", ["padded_rows", "strided_cols"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(layout, dtype):
    x = testing.randn((2, 37, 300), dtype, layout=layout, requires_grad=True)
    w = testing.randn((600,), dtype)[::2].detach().requires_grad_()
    assert not x.is_contiguous() and not w.is_contiguous()
    testing.assert_matches_reference(weighted_sum, reference, [x, w], dtype=dtype)


@pytest.mark.skipif(not testing.on_gpu(), reason="a tensor of over 2**31 elements (4 GiB)")
def test_column_offsets_past_int32():
    """A D-major x (column stride = rows) whose last column lies past 2**31 elements, and a weight
    strided as far: read in place through 64-bit offsets. y and grad_x are checked on sampled rows,
    grad_weight against a float64 reference summed in row chunks."""
    dtype, cols = torch.bfloat16, 1024
    x = testing.column_major_past_int32(cols, dtype).requires_grad_()
    # The weight too: x's first row (its own leaf on x's storage), elements 2**31 / (cols - 1) apart.
    w = x[0].detach().requires_grad_()
    assert w.stride(0) * (cols - 1) >= testing.INT32_OFFSET_LIMIT
    gy = testing.randn(x.shape[:1], dtype)
    y = weighted_sum(x, w)
    gx, gw = torch.autograd.grad(y, [x, w], gy)
    rows = testing.sampled_rows(x.shape[0])
    testing.assert_close("y rows", y[rows], x[rows].double() @ w.double(), dtype)
    testing.assert_close("grad_x rows", gx[rows], gy[rows].double()[:, None] * w.double(), dtype)
    gw_ref = torch.zeros(cols, dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], 1 << 16):
        gw_ref += gy[start:start + (1 << 16)].double() @ x[start:start + (1 << 16)].detach().double()
    testing.assert_close("grad_weight", gw, gw_ref, dtype)


def test_strided_rows_are_not_copied(monkeypatch):
    """x with padded rows reaches the kernel as a view of the caller's storage."""
    seen = {}
    real = plans.bind_forward_2d

    def spy(x2, weight, plan=None):
        run = real(x2, weight, plan)

        def spied(x2, weight):
            seen["ptr"] = x2.data_ptr()
            return run(x2, weight)

        return spied

    monkeypatch.setattr(plans, "bind_forward_2d", spy)
    monkeypatch.setattr(plans, "BOUND", plans.PlanCache())
    x = testing.randn((4, 8, 64), layout="padded_rows")
    weighted_sum(x, testing.randn((64,)))
    assert seen["ptr"] == x.data_ptr()


@pytest.mark.parametrize("block_rows,block_cols", [(1, 16), (4, 8), (16, 64)])
def test_every_tiling_walks_all_elements(block_rows, block_cols):
    """Force small tiles, many D splits and many row groups, so every loop runs several times."""
    from fk_runtime.sizing import Tile2D

    x = testing.randn((37, 203), requires_grad=False)
    w = testing.randn((203,))
    tile = Tile2D(block_rows, block_cols, 4)
    span = 3 * block_cols  # each D split walks three D tiles
    fwd = plans.Plan(tile, row_programs=-(-37 // block_rows), col_programs=-(-203 // span),
                     span=span)
    testing.assert_close("y", forward_2d(x, w, fwd), x.double() @ w.double(), torch.float32)
    gy = testing.randn((37,))
    bwd = plans.Plan(tile, row_programs=-(-37 // (block_rows * 2)), col_programs=-(-203 // block_cols),
                     span=block_rows * 2)
    gx, gw = backward_2d(gy, x, w, bwd)
    testing.assert_close("grad_x", gx, gy.double()[:, None] * w.double(), torch.float32)
    testing.assert_close("grad_w", gw, gy.double() @ x.double(), torch.float32)


def test_backward_is_deterministic():
    x = testing.randn((513, 300), requires_grad=True)
    w = testing.randn((300,), requires_grad=True)
    gy = testing.randn((513,))
    first = torch.autograd.grad(weighted_sum(x, w), [x, w], gy)
    for _ in range(3):
        again = torch.autograd.grad(weighted_sum(x, w), [x, w], gy)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (2, 0, 7)], ids=str)
def test_empty_inputs(shape):
    x = testing.randn(shape, requires_grad=True)
    w = testing.randn(shape[-1:], requires_grad=True)
    y = weighted_sum(x, w)
    torch.testing.assert_close(y, (x @ w).detach())
    gx, gw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    assert gx.shape == x.shape and gw.shape == w.shape
    assert torch.all(gw == 0) and torch.all(gx == 0)


def test_only_one_input_requires_grad():
    x = testing.randn((9, 40), requires_grad=True)
    w = testing.randn((40,))
    (gx,) = torch.autograd.grad(weighted_sum(x, w).sum(), [x])
    testing.assert_close("grad_x", gx, w.double().expand(9, 40), torch.float32)


def test_module_holds_weight():
    layer = WeightedSum(48, device=testing.device())
    x = testing.randn((3, 7, 48), requires_grad=True)
    y = layer(x)
    testing.assert_close("y", y, x.double() @ layer.weight.double(), torch.float32)
    y.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (48,)
    assert "dim=48" in repr(layer)


@pytest.mark.parametrize(
    "x_shape,w_shape,dtypes,error,match",
    [
        ((4, 8), (4, 8), (torch.float32, torch.float32), ValueError, "weight must have at most 1"),
        ((4, 8), (7,), (torch.float32, torch.float32), ValueError, "x's last dim"),
        ((4, 8), (8,), (torch.float32, torch.float16), TypeError, "one dtype"),
        ((4, 8), (8,), (torch.int32, torch.int32), TypeError, "x must have dtype"),
        ((), (1,), (torch.float32, torch.float32), ValueError, "x must have at least 1"),
    ],
)
def test_bad_inputs_raise_clear_errors(x_shape, w_shape, dtypes, error, match):
    x = torch.ones(x_shape, dtype=dtypes[0], device=testing.device())
    w = torch.ones(w_shape, dtype=dtypes[1], device=testing.device())
    with pytest.raises(error, match=match):
        weighted_sum(x, w)


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        weighted_sum([1.0, 2.0], testing.randn((2,)))


def test_mixed_devices_raise():
    with pytest.raises(ValueError, match="one device"):
        weighted_sum(testing.randn((4, 8)), torch.ones(8, device="meta"))


def test_compiled_graph_runs_the_fk_op():
    ops = testing.compiled_graph_ops(weighted_sum, testing.randn((4, 8), requires_grad=True),
                                     testing.randn((8,), requires_grad=True))
    assert "fk.weighted_sum.default" in ops, ops


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["x only", "weight only"])
def test_one_sided_gradients_compute_only_what_is_asked(needs, dtype):
    """A frozen weight (or a frozen x) gets no gradient and the other one is still right, eager and
    under torch.compile; the backward op hands back an empty tensor, uncomputed, for the frozen one."""
    x = testing.randn((3, 37, 70), dtype, requires_grad=needs[0])
    w = testing.randn((70,), dtype, requires_grad=needs[1])
    gy = testing.randn((3, 37), dtype)
    inputs = [t for t, need in zip((x, w), needs, strict=True) if need]
    (grad,) = torch.autograd.grad(weighted_sum(x, w), inputs, gy)
    want = gy.double()[..., None] * w.double() if needs[0] else torch.einsum("rn,rnd->d", gy.double(), x.double())
    testing.assert_close("grad", grad, want, dtype)
    (compiled,) = torch.autograd.grad(torch.compile(weighted_sum, fullgraph=True)(x, w), inputs, gy)
    testing.assert_close("compiled grad", compiled, want, dtype)
    gx, gw = torch.ops.fk.weighted_sum_backward(gy, x.detach(), w.detach(), *needs)
    assert (gx.numel() > 0) == needs[0] and (gw.numel() > 0) == needs[1]

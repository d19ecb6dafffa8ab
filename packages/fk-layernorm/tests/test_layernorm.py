import pytest
import torch
import torch.nn.functional as F
from fk_runtime.harness import testing
from fk_layernorm import plan as plans

from fk_layernorm import LayerNorm, RMSNorm, layer_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Feature counts: rows held whole (1, 17, 1000, 4097), rows split over sibling programs (20000;
# fp32 forward and every backward), and rows past the split limit walked in a loop (70001 on the
# interpreter, 1.1M features on an H100). `test_every_path_is_covered` keeps this true.
# (300, 128): short rows, several rows a step and several steps a row group, the last one ragged.
SHAPES = [(3, 1), (5, 17), (2, 3, 1000), (9, 4097), (3, 20000), (300, 128)]
LONG = (2, 70001) if not testing.on_gpu() else (2, 1_100_001)
SHAPES.append(LONG)
if testing.on_gpu():
    SHAPES += [(4097, 1024), (2, 262144), (64, 65537), (1000, 8192)]
FUSED, SPLIT, LOOPED = plans.Path.FUSED, plans.Path.SPLIT, plans.Path.LONG  # long rows: looped


def test_every_path_is_covered():
    rows, cols = 3, 20000
    assert plans.forward_plan(rows, cols, torch.float32).path is SPLIT
    assert plans.backward_plan(rows, cols, torch.bfloat16).path is SPLIT
    assert plans.backward_plan(rows, cols, torch.float32, stable=True).path is LOOPED
    assert plans.forward_plan(*LONG, torch.float32).path is LOOPED
    assert plans.forward_plan(*LONG, torch.bfloat16).path is SPLIT  # bf16 chunks widened after the wait
    assert plans.backward_plan(*LONG, torch.float32).path is LOOPED
    assert plans.backward_plan(9, 4097, torch.float32).path is FUSED
    # The fused backward's two loops: next rows loaded ahead (16-bit) and not (fp32).
    assert plans.backward_plan(9, 4097, torch.bfloat16).prefetch
    assert not plans.backward_plan(9, 4097, torch.float32).prefetch
    # RMSNorm's 16-bit forward on rows of 8193-16384 features: the warps of a row twice as long.
    wide = plans.forward_plan(9, 12000, torch.bfloat16, is_rms=True)
    assert wide.num_warps == 2 * plans.forward_plan(9, 12000, torch.bfloat16).num_warps


def _plans_on_release(monkeypatch, release):
    """The plan module sees `release` as this Triton's (the launcher and the Gluon gate do not)."""
    from fk_runtime import backend

    class OnRelease:
        def __getattr__(self, name):
            return getattr(backend, name)

        def triton_release(self):
            return release

        def triton_at_least(self, wanted):
            return release is not None and release >= wanted

    monkeypatch.setattr(plans, "backend", OnRelease())


@pytest.mark.parametrize("release", [(3, 6), (3, 8), (3, 9), (3, 10), None])
def test_forward_drops_the_column_mask_on_rows_of_a_whole_block(monkeypatch, release):
    """The fused forward takes rows exactly a power of two wide without a column mask (`even_cols`)
    on every release, except fp32 rows of FORWARD_MASKED_32BIT_ROW features; with it gone no release
    takes other warps or a register cap on the 16384-feature rows. Both builds give the reference's
    values, forward and gradients."""
    _plans_on_release(monkeypatch, release)
    plans.forward_plan.cache_clear()
    plans.BOUND.clear()
    try:
        for dtype in DTYPES:
            for is_rms in (False, True):
                assert plans.forward_plan(9, 1024, dtype, is_rms).even_cols
                assert not plans.forward_plan(9, 1000, dtype, is_rms).even_cols
                wide = plans.forward_plan(9, 16384, dtype, is_rms)
                assert wide.path is FUSED and wide.even_cols and wide.max_registers is None
                assert plans.forward_plan(9, 8192, dtype, is_rms).even_cols == (dtype != torch.float32)
        assert plans.forward_plan(9, 16384, torch.float32).num_warps == plans.forward_plan(
            9, 16384, torch.float32, is_rms=True).num_warps
        for cols in (256, 250):
            for dtype in DTYPES:
                x = testing.randn((2, 3, cols), dtype, requires_grad=True)
                w, b = _params(cols, dtype)
                testing.assert_matches_reference(layer_norm, ref_layer_norm, [x, w, b], dtype=dtype,
                                                 names=["x", "weight", "bias"])
                testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=dtype, names=["x", "weight"])
    finally:
        plans.forward_plan.cache_clear()
        plans.BOUND.clear()


@pytest.mark.parametrize("release", [(3, 6), (3, 8), (3, 9), None])
def test_numbers_by_triton_release(monkeypatch, release):
    """The plan's per-release numbers (H100 measurements in TUNING.md) reach the plans of that
    release only: RMSNorm's 16-bit split forward of rows over 131072 features takes 32 KB chunks
    from 3.9, and the 16-bit fused forward caps registers on the rows listed (LayerNorm's of 1024
    features, not RMSNorm's, nor any 8192-feature or fp32 row); on 3.8 LayerNorm's 16-bit fused
    backward takes 4 KB steps on short rows and reads the weight again each step there, as RMSNorm's
    does on rows of 16384 features, and RMSNorm's fp32 fused forward caps registers on rows of 8192.
    Every release gives the reference's values."""
    _plans_on_release(monkeypatch, release)
    for fn in (plans.forward_plan, plans.backward_plan):
        fn.cache_clear()
    plans.BOUND.clear()
    try:
        from_3_9, on_3_8 = release is not None and release >= (3, 9), release == (3, 8)
        split = plans.forward_plan(2, 140000, torch.bfloat16, is_rms=True)
        if split.path is SPLIT:  # (the interpreter splits rows of at most 16 chunks)
            assert split.block_cols == (16384 if from_3_9 else 8192)
        assert plans.forward_plan(2, 140000, torch.bfloat16).block_cols != 16384  # LayerNorm keeps 16 KB
        capped = plans.forward_plan(64, 1024, torch.bfloat16)
        assert capped.path is FUSED and capped.max_registers == (64 if from_3_9 else None)
        assert plans.forward_plan(64, 1024, torch.bfloat16, is_rms=True).max_registers is None
        assert plans.forward_plan(64, 1024, torch.float32).max_registers is None
        assert plans.forward_plan(8, 8192, torch.bfloat16).max_registers is None  # a cap raised its count
        rms_fp32 = plans.forward_plan(8, 8192, torch.float32, is_rms=True)
        assert rms_fp32.path is FUSED and rms_fp32.max_registers == (56 if on_3_8 else None)
        assert plans.forward_plan(8, 8192, torch.float32).max_registers is None  # RMSNorm's only
        short, short_fp32 = plans.backward_plan(64, 1024, torch.bfloat16), plans.backward_plan(64, 1024, torch.float32)
        assert short.block_rows == (2 if on_3_8 else 4) and short_fp32.block_rows == 2
        assert short.reread_w == on_3_8 and not short_fp32.reread_w
        short_rms = plans.backward_plan(64, 1024, torch.bfloat16, is_rms=True)
        assert short_rms.block_rows == 4 and not short_rms.reread_w  # LayerNorm's only
        wide = plans.backward_plan(64, 16384, torch.bfloat16, is_rms=True)
        assert wide.path is FUSED and wide.recompute and wide.reread_w == on_3_8
        assert not plans.backward_plan(64, 8192, torch.bfloat16, is_rms=True).reread_w  # (no recompute)
        x = testing.randn((5, 1024), torch.bfloat16, requires_grad=True)
        w, b = _params(1024, torch.bfloat16)
        testing.assert_matches_reference(layer_norm, ref_layer_norm, [x, w, b], dtype=torch.bfloat16,
                                         names=["x", "weight", "bias"])
        x = testing.randn((3, 8192), torch.float32, requires_grad=True)
        w, _ = _params(8192, torch.float32, bias=False)
        testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=torch.float32, names=["x", "weight"])
        x = testing.randn((3, 12000), torch.bfloat16, requires_grad=True)
        w, _ = _params(12000, torch.bfloat16, bias=False)
        testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=torch.bfloat16, names=["x", "weight"])
    finally:
        for fn in (plans.forward_plan, plans.backward_plan):
            fn.cache_clear()
        plans.BOUND.clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_backward_keeps_16bit_rows_to_16384_whole(dtype):
    """RMSNorm's backward holds 16-bit rows of up to 16384 features in one program; LayerNorm and
    fp32 split them over siblings. Both give the reference's gradients."""
    rows, cols = (64, 16384) if testing.on_gpu() else (3, 12000)
    expected = FUSED if dtype.itemsize == 2 else SPLIT
    assert plans.backward_plan(rows, cols, dtype, is_rms=True).path is expected
    wide = plans.backward_plan(rows, cols, dtype, is_rms=True)
    assert not wide.prefetch  # too wide to hold two steps
    assert wide.recompute == (dtype.itemsize == 2)  # 16-bit x and dy widened again after the sums
    assert plans.backward_plan(rows, cols, dtype).path is SPLIT
    x = testing.randn((rows, cols), dtype, scale=2.0, shift=0.5, requires_grad=True)
    w, _ = _params(cols, dtype, bias=False)
    testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=dtype, names=["x", "weight"],
                                     baseline_fn=ref_rms_norm)


def ref_layer_norm(x, w=None, b=None, stable=False):
    if stable:
        scale = torch.amax(x.abs(), dim=-1, keepdim=True)
        x = x / torch.where(scale > 0, scale, 1)
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def ref_rms_norm(x, w=None):
    return F.rms_norm(x, x.shape[-1:], w, 1e-6)


def _params(d, dtype, weight=True, bias=True):
    w = testing.randn((d,), dtype, shift=1.0, requires_grad=True) if weight else None
    b = testing.randn((d,), dtype, requires_grad=True) if bias else None
    return w, b


@pytest.mark.parametrize("shape,dtype,mode", testing.mode_cases(SHAPES, DTYPES), ids=str)
def test_layer_norm_matches_float64(shape, dtype, mode):
    x = testing.randn(shape, dtype, scale=2.0, shift=0.5, requires_grad=True)
    w, b = _params(shape[-1], dtype)
    fn = testing.maybe_compile(layer_norm, mode)
    testing.assert_matches_reference(fn, ref_layer_norm, [x, w, b], dtype=dtype,
                                     names=["x", "weight", "bias"], baseline_fn=ref_layer_norm)


@pytest.mark.parametrize("shape,dtype,mode", testing.mode_cases([(3, 2)] + SHAPES[1:], DTYPES), ids=str)
def test_rms_norm_matches_float64(shape, dtype, mode):
    x = testing.randn(shape, dtype, scale=2.0, requires_grad=True)
    w, _ = _params(shape[-1], dtype, bias=False)
    fn = testing.maybe_compile(rms_norm, mode)
    testing.assert_matches_reference(fn, ref_rms_norm, [x, w], dtype=dtype, names=["x", "weight"],
                                     baseline_fn=ref_rms_norm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_one_feature(dtype):
    """With one feature RMSNorm's input gradient is w*dy * rstd * (1 - x-hat^2): a cancellation
    that fp32 resolves only to about 1e-7 of w*dy*rstd, so the relative-norm harness does not
    apply. Checked element-wise against the exact formula with that absolute slack; grad w against
    the sum of its terms, relative to their magnitudes."""
    x = testing.randn((64, 1), dtype, requires_grad=True)
    w = testing.randn((1,), dtype, shift=1.0, requires_grad=True)
    y = rms_norm(x, w)
    testing.assert_close("y", y, ref_rms_norm(x.double(), w.double()), dtype)
    g = testing.randn((64, 1), dtype)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    xd, wg = x.double(), (g.double() * w.double())
    rstd = (xd**2 + 1e-6).rsqrt()
    exact = wg * rstd * (1 - (xd * rstd) ** 2)
    slack = 1e-5 * wg.abs() * rstd + 4 * testing.TOLERANCE[dtype] * exact.abs() + 1e-7
    assert ((gx.double() - exact).abs() <= slack).all()
    # grad w sums 64 terms dy * x-hat of about |dy| each, which may cancel (about 1 seed in 300
    # left it 1e-4 of its own size in fp32): bounded relative to the terms' magnitudes
    terms = g.double() * x.double() * rstd
    assert ((gw.double() - terms.sum(0)).abs() <= testing.TOLERANCE[dtype] * terms.abs().sum(0)).all()


# The longest rows (walked in a loop) take the mixed rows alone: they hold a negative row, a zero max
# and an all-zero row among random ones (the interpreter's 70001-wide rows take 15-20 s a case).
STABLE_ROWS = [(cols, sign) for cols in (40, 20000, LONG[-1]) for sign in ("positive", "negative", "mixed")
               if cols != LONG[-1] or sign == "mixed" or testing.on_gpu()]


@pytest.mark.parametrize("cols, sign", STABLE_ROWS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stable_divides_by_row_max_magnitude_with_correct_gradient(cols, dtype, sign):
    """Rows divided by max |x|: a negative row keeps its sign (dividing by its max flipped it), a
    row whose max is 0 stays finite (it gave NaN), and the gradient through the max |x| (its sign
    included) matches float64 torch."""
    shift = {"positive": 0.5, "negative": -0.5, "mixed": 0.0}[sign]
    x = testing.randn((4, cols), dtype, shift=shift).detach()
    if sign == "mixed":
        x[1] = -x[1].abs() - 0.5
        x[1, cols // 2] = 0.0  # the row's max is 0
        x[2].zero_()  # an all-zero row
    x.requires_grad_(True)
    w, b = _params(cols, dtype)
    testing.assert_matches_reference(
        lambda *a: layer_norm(*a, stable=True), lambda *a: ref_layer_norm(*a, stable=True),
        [x, w, b], dtype=dtype, names=["x", "weight", "bias"],
    )


def test_stable_rows_of_the_issue():
    """#19's rows: all negative (sign was flipped) and a max of 0 (was NaN). Equal to plain
    LayerNorm but for eps, which the division by max|x| (here 0.5 to 2) scales."""
    for x in (-torch.rand(3, 6) - 0.5, torch.tensor([[-1.0, 0.0, -2.0]])):
        x = x.to(testing.device())
        y = layer_norm(x, stable=True)
        testing.assert_close("y", y, ref_layer_norm(x.double(), stable=True), torch.float32)
        # plain LayerNorm with each row's eps scaled by max|x|^2 (what dividing by it does)
        plain = torch.cat([F.layer_norm(r[None], r.shape, eps=1e-5 * float(r.abs().max()) ** 2) for r in x])
        torch.testing.assert_close(y, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cols", [7, 1000, 20000, LONG[-1]])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_huge_finite_rows_are_right_or_flagged(cols, rms):
    """An fp32 row holding 1e30 (its sum of squares overflows fp32): rows held whole come back
    right (float64 torch), split and looped rows come back NaN; never the bias alone."""
    x = testing.randn((3, cols), torch.float32)
    x[1, 0] = 1e30
    x[2, : cols // 2 + 1] = -3e36
    w, b = _params(cols, torch.float32, bias=not rms)
    fn = (lambda x: rms_norm(x, w, 1e-6)) if rms else (lambda x: layer_norm(x, w, b))
    ref = ref_rms_norm(x.double(), w.double()) if rms else ref_layer_norm(x.double(), w.double(), b.double())
    y = fn(x)
    path = plans.forward_plan(3, cols, torch.float32, rms).path
    if path is FUSED:
        testing.assert_close("y", y, ref, torch.float32)
    else:
        assert y[1:].isnan().all(), path
    testing.assert_close("y row 0", y[0], ref[0], torch.float32)


@pytest.mark.parametrize("rms", [False, True])
def test_split_rows_when_siblings_stop_waiting(rms):
    """Programs that stop waiting for their siblings at once leave their chunks to the row's last
    program (or take them back): same results. On a GPU this races for real."""
    with testing.siblings_give_up_at_once(plans.forward_plan, plans.backward_plan, plans.BOUND):
        rows = 300 if testing.on_gpu() else 3
        x = testing.randn((rows, 30000), torch.float32, scale=3.0, shift=1.0, requires_grad=True)
        w, b = _params(30000, torch.float32)
        assert plans.forward_plan(rows, 30000, x.dtype).spin_limit == 0
        assert plans.backward_plan(rows, 30000, x.dtype).path is SPLIT
        if rms:
            testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=x.dtype)
        else:
            testing.assert_matches_reference(layer_norm, ref_layer_norm, [x, w, b], dtype=x.dtype)


@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("cols", [33, 20000])
def test_optional_parameters(weight, bias, cols):
    x = testing.randn((4, cols), requires_grad=True)
    w, b = _params(cols, torch.float32, weight, bias)
    inputs = [t for t in (x, w, b)]
    testing.assert_matches_reference(layer_norm, ref_layer_norm, inputs, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["padded_rows", "strided_cols"])
@pytest.mark.parametrize("cols", [300, 20000])
def test_strided_inputs(layout, cols):
    x = testing.randn((2, 3, cols), torch.float16, layout=layout, requires_grad=True)
    w, b = _params(cols, torch.float16)
    testing.assert_matches_reference(layer_norm, ref_layer_norm, [x, w, b], dtype=torch.float16)
    testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=torch.float16)


@pytest.mark.parametrize("cols", [300, 20000])
def test_strided_parameters(cols):
    """weight and bias as views with stride 2 (e.g. slices of a larger buffer)."""
    x = testing.randn((3, cols), requires_grad=True)
    w = testing.randn((cols,), shift=1.0, layout="strided_cols", requires_grad=True)
    b = testing.randn((cols,), layout="strided_cols", requires_grad=True)
    assert w.stride(0) == b.stride(0) == 2
    testing.assert_matches_reference(layer_norm, ref_layer_norm, [x, w, b], dtype=torch.float32)
    testing.assert_matches_reference(rms_norm, ref_rms_norm, [x, w], dtype=torch.float32)


@pytest.mark.skipif(not testing.on_gpu(), reason="a tensor of over 2**31 elements (4 GiB)")
@pytest.mark.parametrize("cols,path", [(1024, FUSED), (2_200_001, LOOPED)], ids=["whole rows", "looped rows"])
def test_column_offsets_past_int32(cols, path):
    """A feature-major input (column stride = rows) whose last feature lies past 2**31 elements:
    the kernels' 64-bit column offsets read it in place (rows held whole; rows walked in a loop,
    with the parameter-gradient kernel). Row-wise outputs are checked on sampled rows, dweight /
    dbias against a float64 reference summed in row chunks."""
    dtype = torch.bfloat16
    x = testing.column_major_past_int32(cols, dtype).requires_grad_()
    assert plans.forward_plan(*x.shape, dtype).path is path
    assert plans.backward_plan(*x.shape, dtype).path is path
    w, b = _params(cols, dtype)
    dy = testing.randn(x.shape, dtype)
    y = layer_norm(x, w, b)
    dx, dw, db = torch.autograd.grad(y, [x, w, b], dy)
    rows = testing.sampled_rows(x.shape[0])
    xs, ws, bs = (t.detach().double().requires_grad_() for t in (x[rows], w, b))
    ys = ref_layer_norm(xs, ws, bs)
    testing.assert_close("y rows", y[rows], ys, dtype)
    testing.assert_close("dx rows", dx[rows], torch.autograd.grad(ys, xs, dy[rows].double())[0], dtype)
    dw_ref, db_ref = torch.zeros(cols, dtype=torch.float64, device=x.device), 0.0
    step = max(1, (1 << 26) // cols)  # rows per float64 chunk: 512 MB
    for start in range(0, x.shape[0], step):
        xc, dyc = x[start:start + step].detach().double(), dy[start:start + step].double()
        xhat = (xc - xc.mean(-1, keepdim=True)) * torch.rsqrt(xc.var(-1, unbiased=False, keepdim=True) + 1e-5)
        dw_ref += (dyc * xhat).sum(0)
        db_ref += dyc.sum(0)
    testing.assert_close("dweight", dw, dw_ref, dtype)
    testing.assert_close("dbias", db, db_ref, dtype)


def test_mixed_precision_parameters():
    """bf16 activations with fp32 parameters, as autocast training keeps them."""
    x = testing.randn((8, 256), torch.bfloat16, requires_grad=True)
    w, b = _params(256, torch.float32)
    y = layer_norm(x, w, b)
    assert y.dtype == torch.bfloat16
    testing.assert_close("y", y, ref_layer_norm(x.double(), w.double(), b.double()), torch.bfloat16)


@pytest.mark.parametrize("cols", [100, 20000])
def test_backward_is_deterministic(cols):
    rows = 300 if testing.on_gpu() else 16  # the interpreter runs programs one by one: fewer rows
    x = testing.randn((rows, cols), requires_grad=True)
    w, b = _params(cols, torch.float32)
    g = testing.randn((rows, cols))
    first = torch.autograd.grad(layer_norm(x, w, b), [x, w, b], g)
    again = torch.autograd.grad(layer_norm(x, w, b), [x, w, b], g)
    assert all(torch.equal(p, q) for p, q in zip(first, again, strict=True))


def test_saves_only_x_and_row_statistics():
    x = testing.randn((16, 64), requires_grad=True)
    w, b = _params(64, torch.float32)
    y = layer_norm(x, w, b)
    big = [t for t in y.grad_fn.saved_tensors if t is not None and t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    with torch.no_grad():
        y = layer_norm(x, w, b)
    assert y.grad_fn is None


def test_empty_inputs():
    for shape in [(0, 8), (2, 0, 8)]:
        x = testing.randn(shape, requires_grad=True)
        w, b = _params(8, torch.float32)
        y = layer_norm(x, w, b)
        assert y.shape == x.shape
        gx, gw, gb = torch.autograd.grad(y, [x, w, b], torch.ones_like(y))
        assert gx.shape == x.shape and torch.all(gw == 0) and torch.all(gb == 0)


@pytest.mark.parametrize("module", [LayerNorm, RMSNorm])
def test_modules_initialise_from_the_meta_device(module):
    """The usual deferred init: build on "meta", `to_empty`, then `reset_parameters()` (as torch's
    modules have it) gives torch's initial parameters."""
    with torch.device("meta"):
        layer = module(24)
    layer.to_empty(device=testing.device())
    layer.reset_parameters()
    theirs = getattr(torch.nn, module.__name__)(24, device=testing.device())
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(getattr(layer, name), p, rtol=0, atol=0)
    x = testing.randn((3, 24))
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_modules_are_drop_ins_for_torch():
    theirs = torch.nn.LayerNorm(48, device=testing.device())
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = LayerNorm(48, device=testing.device())
    ours.load_state_dict(theirs.state_dict())
    x = testing.randn((2, 5, 48))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert set(LayerNorm(8, bias=False).state_dict()) == set(torch.nn.LayerNorm(8, bias=False).state_dict())
    assert LayerNorm(8, elementwise_affine=False).weight is None
    rms_theirs = torch.nn.RMSNorm(48, device=testing.device())
    rms_ours = RMSNorm(48, device=testing.device())
    rms_ours.load_state_dict(rms_theirs.state_dict())
    torch.testing.assert_close(rms_ours(x), rms_theirs(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNorm((4, 8))
    for bad in (2.5, True, ("8",)):
        with pytest.raises(TypeError, match="normalized_shape must be an int"):
            LayerNorm(bad)
    assert LayerNorm(torch.Size([8])).normalized_shape == LayerNorm([8]).normalized_shape == (8,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_default_eps_is_torchs(dtype):
    """eps=None is torch's default: fp32 machine epsilon for 16-bit inputs too (their own, 7.8e-3
    for bf16, would swamp rows of small values)."""
    x = testing.randn((4, 64), dtype, scale=0.01)
    theirs = torch.nn.RMSNorm(64, device=testing.device(), dtype=dtype)
    ours = RMSNorm(64, device=testing.device(), dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    reference = ref_rms_norm_eps(x.double(), torch.finfo(torch.float32).eps)
    testing.assert_close("RMSNorm(eps=None)", ours(x), reference, dtype)
    testing.assert_close("rms_norm(eps=None)", rms_norm(x, eps=None), reference, dtype)
    testing.assert_close("torch", theirs(x), reference, dtype)


def ref_rms_norm_eps(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("module", [LayerNorm, RMSNorm])
def test_modules_without_parameters_check_the_width(module):
    norm = module(8, elementwise_affine=False)
    with pytest.raises(ValueError, match=r"x's last dim must be normalized_shape \(8,\)"):
        norm(testing.randn((2, 9)))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        norm([1.0] * 8)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: layer_norm(x, testing.randn((7,))), ValueError, "weight must have x's last dim"),
        (lambda x: layer_norm(x, testing.randn((8, 1))), ValueError, "weight must have at most 1"),
        (lambda x: rms_norm(x, torch.ones(8, device="meta")), ValueError, "one device"),
        (lambda x: layer_norm(x.int()), TypeError, "x must have dtype"),
        (lambda x: layer_norm(x, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
        (lambda x: rms_norm(x, eps=float("nan")), ValueError, "eps must be a finite number >= 0"),
        (lambda x: layer_norm(x, eps=True), ValueError, "eps must be a finite number >= 0"),
        (lambda x: layer_norm(x, testing.randn((8,)), testing.randn((8,)).half()), TypeError, "one dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(testing.randn((4, 8)))


@pytest.mark.parametrize("module", [LayerNorm, RMSNorm])
def test_eps_zero_is_torchs(module):
    """eps = 0, which torch's norms take (a constant row then gives NaN in both): the same output."""
    theirs = getattr(torch.nn, module.__name__)(16, eps=0.0, device=testing.device()).double()
    ours = module(16, eps=0.0, device=testing.device())
    x = testing.randn((3, 16))
    testing.assert_close(module.__name__, ours(x), theirs(x.double()), torch.float32)


def test_module_flags_take_bools_only():
    """A truthy string is refused with a TypeError naming the flag (it used to build the parameters
    the string seemed to turn off)."""
    for build, flag in ((lambda f: LayerNorm(4, elementwise_affine=f), "elementwise_affine"),
                        (lambda f: LayerNorm(4, bias=f), "bias"), (lambda f: LayerNorm(4, stable=f), "stable"),
                        (lambda f: RMSNorm(4, elementwise_affine=f), "elementwise_affine")):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            build("False")
        build(False)


def test_fake_stats_match_a_zero_width_input():
    """The registered op's fake gives the statistics' real shape when the last dim is 0."""
    x = testing.randn((3, 0), requires_grad=True)
    torch.library.opcheck(torch.ops.fk.norm.default, (x, None, None, 1e-5, False, False, True))


def test_compiled_graph_runs_the_fk_op():
    x = testing.randn((4, 8), requires_grad=True)
    assert "fk.norm.default" in testing.compiled_graph_ops(rms_norm, x, testing.randn((8,)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the placeholders hold whatever memory held
@pytest.mark.parametrize("rms", [False, True])
def test_backward_bound_ahead_leaves_the_call_as_it_was(monkeypatch, rms):
    """The path that binds the backward ahead (`ops._backward_ahead`; on a GPU it only compiles)
    runs here in full on placeholders: y and every gradient are those of a call without it, and it
    binds once per what the kernels compile for (not per row count)."""
    from fk_runtime import ahead
    from fk_runtime.launch import PlanCache

    from fk_layernorm import ops

    def run(rows=6):
        torch.manual_seed(0)
        x, w, b = (torch.randn(*s, device=testing.device(), requires_grad=True) for s in ((rows, 40), (40,), (40,)))
        y = rms_norm(x, w) if rms else layer_norm(x, w, b)
        y.square().sum().backward()
        return y.detach(), x.grad, w.grad, None if rms else b.grad

    expected = run()
    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(ahead, "useful", lambda *tensors: True)
    for got, want in zip(run(), expected, strict=True):
        if want is not None:
            torch.testing.assert_close(got, want)
    run(rows=9)
    assert len(ops.AHEAD) == 1


@pytest.mark.skipif(not testing.on_gpu(), reason="compiles for the GPU ahead (the interpreter compiles nothing)")
@pytest.mark.parametrize("grad", ["dense", "sum"])
@pytest.mark.parametrize("rms", [False, True])
def test_backward_compiles_ahead_for_a_first_backward(monkeypatch, rms, grad):
    """A recorded call binds its backward at once, for a model's upstream gradient (laid out like
    y) and for `y.sum().backward()`'s (one value broadcast): either backward then compiles nothing
    more, and its gradients are right."""
    from fk_runtime.launch import PlanCache

    from fk_layernorm import kernels, ops

    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(plans, "BOUND", PlanCache())
    cols = 3000 + 8 * rms + 16 * (grad == "sum")  # a row length no other test compiled
    x, w, b = (testing.randn(s, dtype=torch.bfloat16, requires_grad=True) for s in ((5, 7, cols), (cols,), (cols,)))
    y = rms_norm(x, w) if rms else layer_norm(x, w, b)
    before = testing.compiled_variants(kernels)
    dy = testing.upstream_grad(y, grad)
    y.backward(dy)
    assert testing.compiled_variants(kernels) == before, "the backward compiled what was to be compiled ahead"
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = (F.rms_norm(ref[0], (cols,), ref[1], eps=1e-6) if rms
            else F.layer_norm(ref[0], (cols,), ref[1], ref[2], eps=1e-5))
    want.backward(dy.double())
    for t, r in zip((x, w) if rms else (x, w, b), ref, strict=False):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=5e-2, rtol=2e-2)

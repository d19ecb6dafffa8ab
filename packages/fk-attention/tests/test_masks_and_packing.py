"""Sliding windows, softcapping, lower-right causal alignment and packed (varlen) sequences,
forward and every gradient, against float64 references with the masks built explicitly."""

import math

import pytest
import torch
from fk_runtime.harness import testing
from fk_runtime.launch import PlanCache

from fk_attention import attention, attention_varlen, hopper
from fk_attention import ops as fk_ops, plan
from fk_attention.mask import op_args
from fk_attention import config as fk_config, layout as fk_layout, mask as fk_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(plan, "BOUND", PlanCache())
    monkeypatch.setattr(plan, "WINNERS", {})


def visible(n_q, n_k, left=None, right=None, lower_right=False, device=None):
    """The (Nq, Nk) mask, built explicitly: key j for query i when -left <= j - (i + shift) <= right."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    d = j - (i + (n_k - n_q if lower_right else 0))
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left is not None:
        keep &= d >= -left
    if right is not None:
        keep &= d <= right
    return keep


def reference(q, k, v, keep, scale=None, softcap=None, lse=False):
    """Masked softmax attention on (B, H, N, D) tensors; a row with no visible key gives 0 and a
    log-sum-exp of -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    has_key = keep.any(-1, keepdim=True)
    # Rows with no key: softmax over zeros (finite, no NaN in the graph), then multiplied by 0.
    safe = scores.masked_fill(~keep, -math.inf).masked_fill(~has_key, 0.0)
    out = (torch.softmax(safe, -1) * has_key) @ v
    if not lse:
        return out
    return out, torch.where(has_key[..., 0], torch.logsumexp(safe, -1), -math.inf)


def sides(causal, window):
    """(left, right, lower_right) of the public arguments, as a user reads the docs."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right, causal == "lower_right"


def make(shape, dtype, requires_grad=True):
    b, hq, hk, nq, nk, d = shape
    return [testing.randn(s, dtype, requires_grad=requires_grad)
            for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d))]


# (causal, window, softcap): every alignment, one-sided and two-sided windows, softcap alone and
# with a window; "lower_right" with Nq > Nk leaves the first rows without keys.
MASKS = [
    ("lower_right", None, None),
    (True, (5, None), None),
    ("lower_right", (6, 0), None),
    (False, (7, 3), None),
    (False, (None, 4), None),
    (False, (9, None), None),
    (False, None, 4.0),
    ("lower_right", (11, None), 2.5),
]
SHAPES = [(1, 4, 2, 37, 70, 40), (1, 2, 1, 70, 37, 16), (2, 2, 2, 1, 45, 32)]
CASES = [(shape, torch.float32, mask) for shape in SHAPES for mask in MASKS]
# 16 bits: bf16 on a GPU only (the interpreter runs bf16 in fp32, `layout.widened`: the fp32 cases again).
CASES += [((1, 4, 2, 37, 70, 40), dtype, mask) for dtype in (torch.float16, torch.bfloat16)
          for mask in MASKS[:2] + MASKS[-2:] if dtype != torch.bfloat16 or testing.on_gpu()]
if testing.on_gpu():
    # Long and odd lengths in 16 bits, head dims 64 to 256, windows spanning many blocks.
    CASES += [
        ((1, 4, 1, 4097, 4097, 128), torch.bfloat16, (True, (1024, None), None)),
        ((1, 2, 2, 3000, 5000, 64), torch.float16, ("lower_right", (700, None), None)),
        ((1, 2, 1, 2000, 2000, 256), torch.bfloat16, (False, (300, 300), 30.0)),
        ((1, 4, 2, 1500, 1500, 96), torch.float16, ("lower_right", None, 20.0)),
        ((1, 2, 1, 16384, 16384, 128), torch.bfloat16, (True, (1024, None), None)),
    ]


@pytest.mark.parametrize("shape,dtype,mask", CASES, ids=str)
def test_masks_match_float64_reference(shape, dtype, mask):
    causal, window, softcap = mask
    q, k, v = make(shape, dtype)
    keep = visible(q.shape[2], k.shape[2], *sides(causal, window), device=q.device)
    testing.assert_matches_reference(
        lambda q, k, v: attention(q, k, v, causal=causal, window=window, softcap=softcap, return_lse=True),
        lambda q, k, v: reference(q, k, v, keep, softcap=softcap, lse=True),
        [q, k, v], dtype=dtype, names=["q", "k", "v"],
        baseline_fn=None if dtype == torch.float32 else lambda q, k, v: reference(
            q, k, v, keep, softcap=softcap, lse=True),
    )


TILINGS = [(16, 16, False), (32, 16, True), (16, 64, True), (64, 16, False), (16, 32, True)]


@pytest.mark.parametrize("tiling", TILINGS if not testing.on_gpu() else TILINGS[:2], ids=str)
@pytest.mark.parametrize("mask", [fk_mask.Mask(5, 0), fk_mask.Mask(13, 2, True), fk_mask.Mask(None, 0, True, 3.0),
                                  fk_mask.Mask(0, None)], ids=str)
def test_window_edges_on_every_tiling(tiling, mask):
    """Windows narrower and wider than a block, on both load paths: the masked edges and the
    unmasked middle of each walk (forward, dQ, dK/dV) meet where they should."""
    block_m, block_n, descriptors = tiling
    q, k, v = make((1, 4, 2, 53, 77, 40), torch.float32, requires_grad=False)
    if descriptors and testing.on_gpu() and not fk_layout.use_descriptors(q, k, v):
        pytest.skip("tensor descriptors need a Hopper (sm_90+) GPU")
    fwd = fk_config.Config(block_m, block_n, 4, 1, descriptors)
    bwd = (fwd, fk_config.Config(block_n, block_m, 4, 1, descriptors))
    out, lse = plan.forward(q, k, v, mask, 0.3, config=fwd)
    keep = visible(53, 77, mask.left, mask.right, mask.lower_right, device=q.device)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*ref_inputs, keep, 0.3, mask.softcap, lse=True)
    testing.assert_close("out", out, ref_out, torch.float32)
    testing.assert_close("lse", lse, ref_lse, torch.float32)
    g_out, g_lse = testing.randn(out.shape), testing.randn(lse.shape)
    grads = plan.backward(g_out, g_lse, q, k, v, out, lse, mask, 0.3, configs=bwd)
    g_lse_ref = torch.where(ref_lse.isfinite(), g_lse.double(), 0.0)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_inputs, [g_out.double(), g_lse_ref])
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        testing.assert_close(f"grad {name}", g, r, torch.float32)


def test_rows_without_keys_give_zero_and_minus_infinity():
    """Lower-right causal with Nq > Nk: the first Nq - Nk rows see no key (output 0, lse -inf, no
    NaN anywhere, gradients 0 through them)."""
    q, k, v = make((1, 2, 1, 20, 8, 16), torch.float32)
    out, lse = attention(q, k, v, causal="lower_right", return_lse=True)
    assert torch.all(out[:, :, :12] == 0) and torch.all(lse[:, :, :12] == -math.inf)
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 12:]).all()
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :, :12] == 0)


def test_causal_upper_left_is_the_default_alignment():
    q, k, v = make((1, 2, 2, 9, 14, 16), torch.float32, requires_grad=False)
    torch.testing.assert_close(attention(q, k, v, causal=True), attention(q, k, v, causal="upper_left"))
    variant = pytest.importorskip("torch.nn.attention.bias").CausalVariant
    torch.testing.assert_close(attention(q, k, v, causal=variant.LOWER_RIGHT),
                               attention(q, k, v, causal="lower_right"))
    # A window wide enough to see everything is full attention; (None, 0) is causal.
    torch.testing.assert_close(attention(q, k, v, window=(100, 100)), attention(q, k, v))
    torch.testing.assert_close(attention(q, k, v, window=(None, 0)), attention(q, k, v, causal=True))
    torch.testing.assert_close(attention(q, k, v, window=(-1, -1), softcap=0.0), attention(q, k, v))


def test_bad_mask_arguments_raise_clear_errors():
    q, k, v = make((1, 2, 2, 9, 14, 16), torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="causal must be a bool, 'upper_left' or 'lower_right'"):
        attention(q, k, v, causal="bottom_right")
    with pytest.raises(TypeError, match="window must be None or a \\(left, right\\) pair"):
        attention(q, k, v, window=4)
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=(1, 2, 3))
    with pytest.raises(ValueError, match=r"window\[0\] must be >= 0"):
        attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match=r"window\[1\] must be None or an int"):
        attention(q, k, v, window=(2, 1.5))
    for cap in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="softcap"):
            attention(q, k, v, softcap=cap)


# ---- packed sequences --------------------------------------------------------------------------


def packed_inputs(lengths_q, lengths_k, hq, hk, d, dtype, requires_grad=True):
    device = testing.device()
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = testing.randn((sum(lengths_q), hq, d), dtype, requires_grad=requires_grad)
    k = testing.randn((sum(lengths_k), hk, d), dtype, requires_grad=requires_grad)
    v = testing.randn((sum(lengths_k), hk, d), dtype, requires_grad=requires_grad)
    return q, k, v, cu_q, cu_k


def packed_reference(q, k, v, cu_q, cu_k, causal=False, window=None, softcap=None, scale=None):
    """Each sequence through the dense reference on its own, concatenated: (out, lse (H, total))."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        keep = visible(q1 - q0, k1 - k0, *sides(causal, window), device=q.device)
        out, lse = reference(qs, ks, vs, keep, scale, softcap, lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# Lengths with an empty sequence, a one-token one, some longer than a block, and Nq != Nk.
PACKED = [
    ([5, 0, 37, 1, 20], [5, 3, 37, 9, 20]),
    ([16, 33, 7], [40, 33, 2]),
]
PACKED_MASKS = [(False, None, None), (True, None, None), ("lower_right", None, None),
                ("lower_right", (6, 0), None), (False, (4, 3), 3.0)]


# The interpreter runs bf16 in fp32 (`layout.widened`): there bf16 would repeat the fp32 cases, and
# fp16 takes the masks without and with every option (window, softcap), the others in fp32.
PACKED_CASES = [(dtype, lengths, mask) for dtype in DTYPES for lengths in PACKED for mask in PACKED_MASKS
                if testing.on_gpu() or dtype == torch.float32
                or (dtype == torch.float16 and mask in (PACKED_MASKS[0], PACKED_MASKS[-1]))]


@pytest.mark.parametrize("dtype,lengths,mask", PACKED_CASES, ids=str)
def test_packed_sequences_match_each_sequence_alone(lengths, mask, dtype):
    causal, window, softcap = mask
    q, k, v, cu_q, cu_k = packed_inputs(*lengths, 4, 2, 24, dtype)
    max_q, max_k = max(lengths[0]), max(lengths[1])
    testing.assert_matches_reference(
        lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window,
                                         softcap=softcap, return_lse=True),
        lambda q, k, v: packed_reference(q, k, v, cu_q, cu_k, causal, window, softcap),
        [q, k, v], dtype=dtype, names=["q", "k", "v"],
        baseline_fn=None if dtype == torch.float32 else lambda q, k, v: packed_reference(
            q, k, v, cu_q, cu_k, causal, window, softcap),
    )


@pytest.mark.parametrize("max_seqlens", [(1, 1), (20, 40), (0, 0)])
def test_packed_max_seqlen_below_the_longest_still_covers_every_row(max_seqlens):
    """max_seqlen_* size the grid; a smaller value than the longest sequence (0 included) costs
    parallelism only: the extra blocks are walked in turn (the backward's second launch, several
    blocks past a grid of several)."""
    q, k, v, cu_q, cu_k = packed_inputs([70, 3], [50, 90], 2, 1, 16, torch.float32)
    want = attention_varlen(q, k, v, cu_q, cu_k, 70, 90, causal=True)
    got = attention_varlen(q, k, v, cu_q, cu_k, *max_seqlens, causal=True)
    torch.testing.assert_close(got, want)
    grads_want = torch.autograd.grad(want.sum(), [q, k, v])
    grads_got = torch.autograd.grad(got.sum(), [q, k, v])
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b)


def test_packed_equals_dense_on_equal_lengths():
    """Equal lengths packed give the dense batch's values and gradients bit for bit close."""
    b, n, hq, hk, d = 3, 29, 4, 2, 32
    q, k, v = (testing.randn((b, n, h, d), torch.float32, requires_grad=True) for h in (hq, hk, hk))
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=testing.device())
    packed_out = attention_varlen(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, n, n, causal=True)
    dense_out = attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    torch.testing.assert_close(packed_out.view(b, n, hq, d), dense_out)
    g = testing.randn(dense_out.shape)
    for a, c in zip(torch.autograd.grad(packed_out, [q, k, v], g.flatten(0, 1)),
                    torch.autograd.grad(dense_out, [q, k, v], g), strict=True):
        torch.testing.assert_close(a, c)


def test_packed_backward_is_deterministic():
    q, k, v, cu_q, cu_k = packed_inputs([30, 7, 19], [30, 12, 19], 4, 1, 16, torch.float32)
    out = attention_varlen(q, k, v, cu_q, cu_k, 30, 30, causal=True)
    g = testing.randn(out.shape)
    first = torch.autograd.grad(out, [q, k, v], g, retain_graph=True)
    again = torch.autograd.grad(out, [q, k, v], g)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_packed_under_torch_compile(mode):
    q, k, v, cu_q, cu_k = packed_inputs([9, 17], [9, 17], 2, 2, 16, torch.float32)
    fn = testing.maybe_compile(
        lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 17, 17, causal=True, window=(4, 0)), mode)
    testing.assert_matches_reference(
        fn, lambda q, k, v: packed_reference(q, k, v, cu_q, cu_k, True, (4, 0))[0], [q, k, v],
        dtype=torch.float32, names=["q", "k", "v"])


@pytest.fixture
def nan_filled():
    """Deterministic mode for the test, so that fresh allocations come filled with NaN
    (torch.utils.deterministic.fill_uninitialized_memory); the mode as it was after."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("spare_q,spare_k", [(6, 3), (100, 40)])
def test_packed_rows_past_the_last_sequence_are_zero(nan_filled, spare_q, spare_k):
    """A padded buffer (rows past cu_seqlens[-1], other ends for q and k): those rows' outputs are
    0 with a log-sum-exp of -inf and their gradients 0, never the memory's old contents (fresh
    allocations filled with NaN here; before, they came back NaN and spread into the projections'
    weight gradients); the sequences' own rows as before. Fewer spare rows than a query block, and
    more than the grid's blocks a head cover at once (the forward walks them in turn)."""
    q, k, v, cu_q, cu_k = packed_inputs([5, 9], [7, 4], 4, 2, 16, torch.float32, requires_grad=False)
    spare = [torch.cat([t, testing.randn((n, *t.shape[1:]), torch.float32)]).requires_grad_()
             for t, n in ((q, spare_q), (k, spare_k), (v, spare_k))]
    out, lse = attention_varlen(*spare, cu_q, cu_k, 9, 7, causal=True, return_lse=True)
    want, want_lse = packed_reference(q, k, v, cu_q, cu_k, True, None)
    testing.assert_close("out", out[:14], want, torch.float32)
    assert out.shape[0] == 14 + spare_q
    assert torch.equal(out[14:], torch.zeros_like(out[14:])) and bool((lse[:, 14:] == -math.inf).all())
    grads = torch.autograd.grad(out, spare, testing.randn(out.shape))
    for g, n in zip(grads, (14, 11, 11), strict=True):
        assert torch.isfinite(g[:n]).all() and torch.equal(g[n:], torch.zeros_like(g[n:]))


def test_packed_buffer_without_sequences_is_all_spare_rows(nan_filled):
    """cu_seqlens = [0] over a buffer of rows: every row is past the last sequence, so zeros, -inf and zero
    gradients (the forward returned uninitialized memory)."""
    q, k, v = (testing.randn((5, 2, 16), torch.float32, requires_grad=True) for _ in range(3))
    cu = torch.zeros(1, dtype=torch.int32, device=testing.device())
    out, lse = attention_varlen(q, k, v, cu, cu, 4, 4, causal=True, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    for g in torch.autograd.grad(out, [q, k, v], testing.randn(out.shape)):
        assert torch.equal(g, torch.zeros_like(g))


# Packed sequences on the Gluon forward: an empty sequence, one row, tiles cut by a sequence's end, Nq != Nk
# both ways, GQA; max_seqlen_q the longest or a third of it (the grid's slots cover every block either way).
GLUON_PACKED = [([700, 0, 1, 129, 1000], [700, 3, 1, 300, 1000]), ([300, 1025, 64], [1300, 77, 64])]


@pytest.mark.skipif(not (testing.on_gpu() and hopper.gluon_device(0)), reason="the Gluon forward: Hopper")
@pytest.mark.parametrize("cut", [1, 3])
@pytest.mark.parametrize("mask", [(False, None, None), (True, None, None), ("lower_right", None, None),
                                  ("lower_right", (100, 0), None), (False, (50, 37), 20.0)], ids=str)
@pytest.mark.parametrize("lengths", GLUON_PACKED, ids=str)
@pytest.mark.parametrize("d", [40, 64, 128, 200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_forward_on_hopper_matches_each_sequence_alone(monkeypatch, dtype, d, lengths, mask, cut):
    """Packed sequences through the Gluon forward at every head dim it has
    (`config.GLUON_FORWARD_PACKED_HEAD_DIMS` switched to all; d40 pads to 64, d200 to 256; d64 takes full
    and causal masks only): output and log-sum-exp against each sequence's float64 reference, within the
    tl kernel's own error on the same inputs (its forced config runs tl)."""
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_PACKED_HEAD_DIMS", (64, 128, 256))
    ran = []
    bind = hopper.bind
    monkeypatch.setattr(hopper, "bind", lambda *args: ran.append(args[-1]) or bind(*args))
    causal, window, softcap = mask
    q, k, v, cu_q, cu_k = packed_inputs(*lengths, 4, 2, d, dtype, requires_grad=False)
    packing = fk_layout.Packing(len(lengths[0]), max(lengths[0]) // cut, max(lengths[1]))
    as_mask = fk_mask.from_op_args(op_args(causal, window, softcap))
    scale = 1 / math.sqrt(d)
    out, lse = plan.forward_packed(q, k, v, cu_q, cu_k, packing, as_mask, scale)
    assert ran == ([packing] if d > 64 or not (window or softcap) else [])
    tl_config = fk_config.default_config(fk_config.Kind.FORWARD, d, dtype, True)
    tl_out, tl_lse = plan.forward_packed(q, k, v, cu_q, cu_k, packing, as_mask, scale, config=tl_config)
    want, want_lse = packed_reference(*(t.double() for t in (q, k, v)), cu_q, cu_k, causal, window, softcap,
                                      scale)
    for name, got, tl_got, ref in (("out", out, tl_out, want), ("lse", lse, tl_lse, want_lse)):
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), finite), name
        err = (got.double() - ref).where(finite, 0).norm() / ref.where(finite, 0).norm()
        tl_err = (tl_got.double() - ref).where(finite, 0).norm() / ref.where(finite, 0).norm()
        assert err <= 1.1 * tl_err + 1e-6, f"{name}: Gluon {err:.2e} against tl {tl_err:.2e}"


def test_packed_backward_of_an_expanded_gradient():
    """An upstream gradient with a zero stride over tokens (from `out.sum(0) * w`), not all equal:
    the same gradients as its contiguous copy (the packed backward read it with the strides of
    another copy: wrong gradients, hidden where every value is equal)."""
    q, k, v, cu_q, cu_k = packed_inputs([7, 13], [7, 13], 2, 2, 16, torch.float32)
    out = attention_varlen(q, k, v, cu_q, cu_k, 13, 13, causal=True)
    grad = testing.randn((2, 16), torch.float32).expand(out.shape)
    assert grad.stride()[0] == 0
    got = torch.autograd.grad(out, [q, k, v], grad, retain_graph=True)
    want = torch.autograd.grad(out, [q, k, v], grad.contiguous())
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_packed_inputs_past_the_tile_offset_bound_reach_the_kernels_as_copies(monkeypatch):
    """A packed input whose in-tile offsets would overflow (limit shrunk, a head-dim-major q) reaches the
    kernels as a copy laid out as its plan bound it, the others as given (their own bases, read through
    the bound views' strides): values and every gradient still match each sequence alone."""
    hq, d = 2, 16
    q, k, v, cu_q, cu_k = packed_inputs([9, 20], [9, 20], hq, hq, d, torch.float32)
    q = q.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0).requires_grad_()  # (total, H, D), D outermost
    monkeypatch.setattr(fk_layout, "TILE_OFFSET_LIMIT", (fk_layout.MAX_TILE_EXTENT - 1) * (hq * d + 2))
    assert not fk_layout.tile_offsets_fit(fk_layout.packed(q)) and fk_layout.tile_offsets_fit(fk_layout.packed(k))
    seen = []
    real = plan.Kernel.__call__

    def spy(self, *args):
        seen.append((args[0].data_ptr() == q.data_ptr(), args[1].data_ptr() == k.data_ptr()))
        return real(self, *args)

    monkeypatch.setattr(plan.Kernel, "__call__", spy)
    testing.assert_matches_reference(
        lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 20, 20, causal=True, return_lse=True),
        lambda q, k, v: packed_reference(q, k, v, cu_q, cu_k, causal=True), [q, k, v], dtype=torch.float32,
        names=["q", "k", "v"])
    assert seen and all(got == (False, True) for got in seen), seen


def test_packed_bounds_are_read_through_their_strides():
    """cu_seqlens as a strided view (every other entry of a buffer): the same result as contiguous."""
    q, k, v, cu_q, cu_k = packed_inputs([4, 9], [6, 9], 2, 1, 16, torch.float32, requires_grad=False)
    strided = [torch.stack([cu, torch.full_like(cu, 9)], 1)[:, 0] for cu in (cu_q, cu_k)]
    assert strided[0].stride() == (2,)
    torch.testing.assert_close(attention_varlen(q, k, v, *strided, 9, 9), attention_varlen(q, k, v, cu_q, cu_k, 9, 9))


def test_packed_repeated_calls_skip_the_checks_and_read_each_calls_bounds(monkeypatch):
    """A call whose key was seen (layouts, the bounds' shape, max_seqlens, mask) goes straight to its bound plan
    (no grad) or its autograd.Function (recorded): no checks run; the bounds are still read on each call, so other
    lengths of the same count give their own outputs and gradients."""
    q, k, v, cu_a, _ = packed_inputs([9, 20, 5], [9, 20, 5], 2, 1, 16, torch.float32)
    cu_b = torch.tensor([0, 20, 24, 34], dtype=torch.int32, device=cu_a.device)
    with torch.no_grad():
        attention_varlen(q, k, v, cu_a, cu_a, 20, 20, causal=True)
    attention_varlen(q, k, v, cu_a, cu_a, 20, 20, causal=True)

    def refused(*args, **kwargs):
        raise AssertionError("a repeated call ran the checks")

    monkeypatch.setattr(fk_ops, "check_attention_inputs", refused)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = packed_reference(*refs, cu_b, cu_b, True)[0]
    with torch.no_grad():
        testing.assert_close("out (no grad)", attention_varlen(q, k, v, cu_b, cu_b, 20, 20, causal=True), want,
                             torch.float32)
    out = attention_varlen(q, k, v, cu_b, cu_b, 20, 20, causal=True)
    testing.assert_close("out", out, want, torch.float32)
    g = testing.randn(out.shape)
    for name, got, w in zip("qkv", torch.autograd.grad(out, [q, k, v], g), torch.autograd.grad(want, refs, g.double()),
                            strict=True):
        testing.assert_close(f"d{name}", got, w, torch.float32)


def test_packed_bad_inputs_raise_clear_errors():
    q, k, v, cu_q, cu_k = packed_inputs([4, 5], [4, 5], 2, 2, 16, torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype in \\(int32\\)"):
        attention_varlen(q, k, v, cu_q.long(), cu_k, 5, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have one shape"):
        attention_varlen(q, k, v, cu_q, cu_k[:2], 5, 5)
    with pytest.raises(ValueError, match="q must have at most 3 dims"):
        attention_varlen(q[None], k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        attention_varlen(q, k, v, cu_q, cu_k, 5.0, 5)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0"):
        attention_varlen(q, k, v, cu_q, cu_k, 5, -1)
    # Out-of-range bounds are clamped (wrong rows, never an out-of-range access).
    bad = torch.tensor([0, 4, 1000], dtype=torch.int32, device=q.device)
    out = attention_varlen(q, k, v, bad, bad, 5, 5)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("tiling", TILINGS if not testing.on_gpu() else TILINGS[:2], ids=str)
@pytest.mark.parametrize("causal", [False, True, "lower_right"], ids=str)
def test_packed_on_both_load_paths_keeps_sequences_apart(tiling, causal):
    """Every tiling, through pointers and through descriptors (whose tiles read past a sequence's
    end into the next one's rows): each sequence matches its own reference, and one sequence's
    q, k, v and output gradient, however large, never reach another sequence's results."""
    block_m, block_n, descriptors = tiling
    lengths_q, lengths_k = [21, 3, 40, 9], [21, 30, 40, 9]
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 40, torch.float32, requires_grad=False)
    if descriptors and testing.on_gpu() and not fk_layout.use_descriptors(fk_layout.packed(q), fk_layout.packed(k)):
        pytest.skip("tensor descriptors need a Hopper (sm_90+) GPU")
    poisoned_q, poisoned_k = slice(21, 24), slice(21, 51)  # sequence 1
    q[poisoned_q], k[poisoned_k], v[poisoned_k] = 1e4, -1e4, 1e4
    g_out = testing.randn(q.shape)
    g_out[poisoned_q] = 1e4
    g_lse = testing.randn((4, q.shape[0]))
    mask = fk_mask.from_op_args(op_args(causal, None, None))
    packing = fk_layout.Packing(4, max(lengths_q), max(lengths_k))
    fwd = fk_config.Config(block_m, block_n, 4, 1, descriptors)
    bwd = (fwd, fk_config.Config(block_n, block_m, 4, 1, descriptors))
    out, lse = plan.forward_packed(q, k, v, cu_q, cu_k, packing, mask, 0.3, config=fwd)
    grads = plan.backward_packed(g_out, g_lse, q, k, v, out, lse, cu_q, cu_k, packing, mask, 0.3, configs=bwd)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = packed_reference(*inputs, cu_q, cu_k, causal, scale=0.3)
    clean_q = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    clean_k = torch.ones(k.shape[0], dtype=torch.bool, device=q.device)
    clean_q[poisoned_q], clean_k[poisoned_k] = False, False
    testing.assert_close("out", out[clean_q], ref_out[clean_q], torch.float32)
    testing.assert_close("lse", lse[:, clean_q], ref_lse[:, clean_q], torch.float32)
    g_lse_ref = torch.where(ref_lse.isfinite() & clean_q, g_lse.double(), 0.0)
    g_out_ref = torch.where(clean_q[:, None, None], g_out.double(), 0.0)
    ref_grads = torch.autograd.grad([ref_out[clean_q], ref_lse[:, clean_q]], inputs,
                                    [g_out_ref[clean_q], g_lse_ref[:, clean_q]])
    for name, g, r, clean in zip("qkv", grads, ref_grads, (clean_q, clean_k, clean_k), strict=True):
        testing.assert_close(f"grad {name}", g[clean], r[clean], torch.float32)


def test_bounded_windows_tune_apart_from_unbounded_masks():
    """A window bounded on both sides walks as many keys as its span, not the sequence: its tuning
    key says so (a causal call's tiles ran 15% slower on a 1024 window at N 16384)."""
    args = (16384, 16384, 16, torch.bfloat16)
    causal = plan.tuning_keys(*args, fk_mask.CAUSAL)
    window = plan.tuning_keys(*args, fk_mask.Mask(left=1024, right=0))
    assert causal[1] == plan.length_key(16384) and window[1] == plan.length_key(1025) != causal[1]
    assert plan.tuning_keys(*args, fk_mask.Mask(left=1024)) == causal  # one side unbounded: the whole length


def test_align_places_windows_without_causal():
    """`align` moves a window without causal to the bottom-right corner (FlashAttention's place),
    agrees with causal's own alignment, and is refused where the two disagree or it names no corner."""
    q = testing.randn((1, 2, 4, 16), torch.float32)
    k, v = (testing.randn((1, 2, 9, 16), torch.float32) for _ in range(2))
    shift = 9 - 4  # query i sits at key position i + 5
    keep = torch.zeros(4, 9, dtype=torch.bool)
    for i in range(4):
        keep[i, max(0, i + shift - 1):i + shift + 2] = True  # window (1, 1) around i + shift
    scores = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
    ref = torch.softmax(scores.masked_fill(~keep.to(q.device), -math.inf), -1) @ v.double()
    testing.assert_close("lower-right window", attention(q, k, v, window=(1, 1), align="lower_right"), ref,
                         torch.float32)
    torch.testing.assert_close(attention(q, k, v, causal=True, align="lower_right"),
                               attention(q, k, v, causal="lower_right"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="disagree"):
        attention(q, k, v, causal="upper_left", align="lower_right")
    with pytest.raises(ValueError, match="align"):
        attention(q, k, v, align="bottom_right")

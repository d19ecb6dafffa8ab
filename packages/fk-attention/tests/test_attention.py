import math

import pytest
import torch
import torch.nn.functional as F
from fk_runtime import testing

from fk_attention import attention

# The interpreter's tl.dot is wrong on bf16 (right on fp16 / fp32): bf16 runs on the GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if testing.on_gpu() else [])
# (B, Hq, Hk, Nq, Nk, D): odd lengths, Nq != Nk both ways, GQA and MQA, padded head dims.
SHAPES = [
    (1, 1, 1, 3, 5, 16),
    (2, 4, 2, 33, 33, 40),
    (1, 3, 1, 17, 50, 16),
    (1, 2, 2, 50, 17, 24),
]
if testing.on_gpu():
    SHAPES += [
        (2, 8, 2, 1000, 1000, 64), (1, 4, 4, 333, 1025, 96), (1, 2, 1, 4097, 4097, 128),
        (1, 2, 2, 600, 600, 256), (1, 4, 1, 129, 77, 80), (1, 2, 2, 700, 700, 192),
    ]


def reference(q, k, v, causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def make(shape, dtype, layout="bhnd"):
    b, hq, hk, nq, nk, d = shape
    if layout == "bnhd":  # (B, N, H, D) storage, seen as (B, H, N, D): strided, no copy
        q = testing.randn((b, nq, hq, d), dtype).transpose(1, 2)
        k = testing.randn((b, nk, hk, d), dtype).transpose(1, 2)
        v = testing.randn((b, nk, hk, d), dtype).transpose(1, 2)
    else:
        q, k, v = (testing.randn(s, dtype) for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d)))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, causal):
    inputs = make(shape, dtype)
    testing.assert_matches_reference(
        lambda q, k, v: attention(q, k, v, causal=causal),
        lambda q, k, v: reference(q, k, v, causal),
        inputs, dtype=dtype, names=["q", "k", "v"],
        baseline_fn=None if dtype == torch.float32 else (lambda q, k, v: reference(q, k, v, causal)),
    )


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_strided_bnhd_inputs_and_compile(mode):
    inputs = make((2, 4, 2, 21, 37, 32), torch.float16, layout="bnhd")
    assert not inputs[0].is_contiguous()
    fn = testing.maybe_compile(lambda q, k, v: attention(q, k, v, causal=True), mode)
    ref = lambda q, k, v: reference(q, k, v, True)  # noqa: E731
    testing.assert_matches_reference(fn, ref, inputs, dtype=torch.float16, baseline_fn=ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_key(dtype):
    """One key: the output is v, the gradient goes to v alone; q's and k's gradients vanish in
    exact arithmetic and are rounding noise here (relative error is meaningless on them)."""
    q, k, v = make((2, 2, 1, 3, 1, 16), dtype)
    out = attention(q, k, v)
    torch.testing.assert_close(out, v.expand_as(out))
    g = testing.randn(out.shape, dtype)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], g)
    torch.testing.assert_close(dv, g.sum(dim=(1, 2), keepdim=True).to(dtype), rtol=1e-2, atol=1e-2)
    noise = 1e-5 if dtype == torch.float32 else 1e-2
    assert dq.abs().max() <= noise * g.abs().max() * v.abs().max() * k.abs().max() + noise
    assert dk.abs().max() <= noise * g.abs().max() * v.abs().max() * q.abs().max() * 3 + noise


def test_scale_and_log_sum_exp():
    q, k, v = make((1, 2, 1, 19, 23, 16), torch.float32)
    out, lse = attention(q, k, v, causal=True, sm_scale=0.3, return_lse=True)
    testing.assert_close("out", out, reference(q.double(), k.double(), v.double(), True, 0.3), torch.float32)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    keep = torch.ones(19, 23, dtype=torch.bool, device=q.device).tril()
    ref_lse = torch.logsumexp(scores.masked_fill(~keep, -math.inf), -1)
    testing.assert_close("lse", lse, ref_lse, torch.float32)
    assert lse.dtype == torch.float32 and not lse.requires_grad


def test_backward_is_deterministic():
    q, k, v = make((1, 4, 1, 40, 40, 16), torch.float16)
    g = testing.randn(q.shape, torch.float16)
    first = torch.autograd.grad(attention(q, k, v, causal=True), [q, k, v], g)
    again = torch.autograd.grad(attention(q, k, v, causal=True), [q, k, v], g)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_compiled_graph_runs_the_fk_op():
    q, k, v = make((1, 2, 1, 8, 8, 16), torch.float32)
    assert "fk.attention.default" in testing.compiled_graph_ops(attention, q, k, v)


@pytest.mark.parametrize(
    "shapes,dtypes,error,match",
    [
        (((1, 2, 8, 16), (1, 2, 8, 24), (1, 2, 8, 24)), None, ValueError, "head dim"),
        (((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), None, ValueError, "multiple of"),
        (((1, 2, 8, 12), (1, 2, 8, 12), (1, 2, 8, 12)), None, ValueError, "multiple of 8"),
        (((1, 2, 8, 16),) * 3, (torch.float32, torch.float16), TypeError, "one dtype"),
        (((2, 8, 16), (2, 8, 16), (2, 8, 16)), None, ValueError, "at least 4 dims"),
    ],
)
def test_bad_inputs_raise_clear_errors(shapes, dtypes, error, match):
    dtypes = dtypes or (torch.float32, torch.float32)
    q = testing.randn(shapes[0], dtypes[0])
    k, v = testing.randn(shapes[1], dtypes[1]), testing.randn(shapes[2], dtypes[1])
    with pytest.raises(error, match=match):
        attention(q, k, v)


def test_mixed_devices_raise():
    q = testing.randn((1, 1, 4, 16))
    with pytest.raises(ValueError, match="one device"):
        attention(q, torch.ones(1, 1, 4, 16, device="meta"), torch.ones(1, 1, 4, 16, device="meta"))

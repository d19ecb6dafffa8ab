"""ALiBi slopes (FlashAttention's `alibi_slopes`): -slope * |j - (i + shift)| added to the scaled
(and capped) score of query i and key j, on every path: dense forward and backward, split-KV
decode, packed sequences, the KV cache, and the flash_attn layer. Float64 references written from
that definition."""

import math

import pytest
import torch
from fk_runtime.harness import testing

from fk_attention import attention, attention_varlen, attention_with_kvcache
from fk_attention import flash_attn as fa

# bf16 on a GPU only: the interpreter runs it in fp32 (`layout.widened`), repeating the fp32 cases.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if testing.on_gpu() else [torch.float32, torch.float16]


def reference(q, k, v, slopes, causal=False, shift=0, softcap=None, window=None):
    """(out, lse) of (B, H, N, D) float64 inputs with ALiBi; rows that see no key: 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    slopes = slopes.to(s.dtype)
    slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
    s = s - slopes * (j - (i + shift)).abs()
    seen = torch.ones_like(s, dtype=torch.bool)
    if causal:
        seen = seen & (j <= i + shift)
    if window is not None:
        seen = seen & (j - (i + shift) >= -window[0]) & (j - (i + shift) <= window[1])
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
    return p @ v, lse


# (B, Hq, Hk, Nq, Nk, D), causal ("lower_right": shift Nk - Nq), slopes shape, softcap, window
CASES = [
    ((1, 4, 2, 67, 67, 16), True, "heads", None, None),  # past DECODE_MAX_QUERIES: the prefill kernels
    ((1, 2, 1, 20, 45, 24), "lower_right", "batch", None, None),
    ((2, 2, 2, 45, 20, 16), False, "heads", 4.0, None),
    ((1, 4, 4, 33, 33, 21), False, "batch", None, (5, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][3]}x{c[0][4]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_forward_and_gradients(case, dtype):
    (b, hq, hk, n_q, n_k, d), causal, slopes_shape, softcap, window = case
    slopes = torch.rand((hq,) if slopes_shape == "heads" else (b, hq), device=testing.device())
    shift = n_k - n_q if causal == "lower_right" else 0
    inputs = [testing.randn(shape, dtype, requires_grad=True)
              for shape in ((b, hq, n_q, d), (b, hk, n_k, d), (b, hk, n_k, d))]
    testing.assert_matches_reference(
        lambda q, k, v: attention(q, k, v, causal=causal, softcap=softcap, window=window, alibi_slopes=slopes,
                                  return_lse=True),
        lambda q, k, v: reference(q, k, v, slopes, bool(causal), shift, softcap, window),
        inputs, dtype=dtype, names=["q", "k", "v"])


@pytest.mark.parametrize("n_q", [1, 3])
def test_decode_rows(n_q):
    """Few query rows take the split-KV path, each row its own head's slope."""
    slopes = torch.rand(2, 8, device=testing.device())
    q = testing.randn((2, 8, n_q, 16), torch.float16)
    k, v = (testing.randn((2, 2, 70, 16), torch.float16) for _ in range(2))
    testing.assert_matches_reference(
        lambda q, k, v: attention(q, k, v, causal="lower_right", alibi_slopes=slopes, return_lse=True),
        lambda q, k, v: reference(q, k, v, slopes, True, 70 - n_q), [q, k, v], dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_sequences(dtype):
    """Slopes per (sequence, head); each sequence's own lengths set its lower-right shift."""
    dev = testing.device()
    cu_q = torch.tensor([0, 17, 60], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 30, 75], dtype=torch.int32, device=dev)
    slopes = torch.rand(2, 4, device=dev)
    q = testing.randn((60, 4, 16), dtype, requires_grad=True)
    k, v = (testing.randn((75, 2, 16), dtype, requires_grad=True) for _ in range(2))

    def ref(q, k, v):
        outs = []
        for s, ((a, b), (c, e)) in enumerate((((0, 17), (0, 30)), ((17, 60), (30, 75)))):
            one = [t.transpose(0, 1)[None] for t in (q[a:b], k[c:e], v[c:e])]
            outs.append(reference(*one, slopes[s], True, (e - c) - (b - a))[0][0].transpose(0, 1))
        return torch.cat(outs)

    testing.assert_matches_reference(
        lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 43, 45, causal="lower_right", alibi_slopes=slopes),
        ref, [q, k, v], dtype=dtype, names=["q", "k", "v"])


@pytest.mark.parametrize("n_q", [1, 70])
def test_kv_cache(n_q):
    dev = testing.device()
    lengths = torch.tensor([90, 40], dtype=torch.int32, device=dev)
    old_k, old_v = (testing.randn((2, 2, 90, 16), torch.float32) for _ in range(2))
    k_cache = torch.zeros(2, 2, 200, 16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :, :90], v_cache[:, :, :90] = old_k, old_v
    q = testing.randn((2, 4, n_q, 16), torch.float32)
    k_new, v_new = (testing.randn((2, 2, n_q, 16), torch.float32) for _ in range(2))
    slopes = torch.rand(4, device=dev)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, causal=True, alibi_slopes=slopes)
    for b, n in enumerate(lengths.tolist()):
        keys = torch.cat([old_k[b:b + 1, :, :n], k_new[b:b + 1]], 2).double()
        values = torch.cat([old_v[b:b + 1, :, :n], v_new[b:b + 1]], 2).double()
        ref, _ = reference(q[b:b + 1].double(), keys, values, slopes, True, n)
        testing.assert_close(f"out[{b}]", out[b:b + 1], ref, torch.float32)


def test_flash_attn_layer_takes_slopes():
    q = testing.randn((2, 9, 4, 16), torch.float16, requires_grad=True)
    k, v = (testing.randn((2, 13, 2, 16), torch.float16, requires_grad=True) for _ in range(2))
    slopes = torch.rand(2, 4, device=q.device)
    testing.assert_matches_reference(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes),
        lambda q, k, v: reference(*(t.transpose(1, 2) for t in (q, k, v)), slopes, True, 4)[0].transpose(1, 2),
        [q, k, v], dtype=torch.float16, names=["q", "k", "v"])


def test_bad_slopes_raise_naming_them():
    q, k = testing.randn((2, 4, 8, 16)), testing.randn((2, 2, 8, 16))
    dev = q.device
    for slopes, error, match in [
        (torch.rand(4, device=dev).half(), TypeError, "alibi_slopes must have dtype"),
        (torch.rand(3, device=dev), ValueError, r"alibi_slopes must be \(4,\) or \(2, 4\)"),
        (torch.rand(3, 4, device=dev), ValueError, r"alibi_slopes must be \(4,\) or \(2, 4\)"),
        (torch.rand(1, 2, 4, device=dev), ValueError, "alibi_slopes must have at most 2 dims"),
        (torch.rand(4, device=dev, requires_grad=True), ValueError, "alibi_slopes must not require grad"),
        ([0.5] * 4, TypeError, "alibi_slopes must be a torch.Tensor"),
    ]:
        with pytest.raises(error, match=match):
            attention(q, k, k, alibi_slopes=slopes)


@pytest.mark.parametrize("n_q, window", [(1, None), (70, None), (3, (6, 0))])
def test_kv_cache_left_padding_with_slopes(n_q, window):
    """`cache_leftpad`: sequence b's keys start at row pad[b]; the rows before it are seen by no
    query, and distances (ALiBi's, the window's) stay the cache's."""
    dev = testing.device()
    lengths, pads = [90, 40], [7, 33]
    old_k, old_v = (testing.randn((2, 2, 90, 16), torch.float32) for _ in range(2))
    k_cache, v_cache = torch.zeros(2, 2, 200, 16, device=dev), torch.zeros(2, 2, 200, 16, device=dev)
    k_cache[:, :, :90], v_cache[:, :, :90] = old_k, old_v
    q = testing.randn((2, 4, n_q, 16), torch.float32)
    k_new, v_new = (testing.randn((2, 2, n_q, 16), torch.float32) for _ in range(2))
    slopes = torch.rand(4, device=dev)
    out = attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=dev),
                                 k_new, v_new, causal=True, window=window, alibi_slopes=slopes,
                                 cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=dev))
    for b, (n, pad) in enumerate(zip(lengths, pads, strict=True)):
        keys = torch.cat([old_k[b:b + 1, :, pad:n], k_new[b:b + 1]], 2).double()
        values = torch.cat([old_v[b:b + 1, :, pad:n], v_new[b:b + 1]], 2).double()
        ref, _ = reference(q[b:b + 1].double(), keys, values, slopes, True, n - pad, window=window)
        testing.assert_close(f"out[{b}]", out[b:b + 1], ref, torch.float32)

"""fk_attention.flash_attn against a float64 reference written from FlashAttention 2's documented
semantics: (batch, seqlen, heads, headdim) layouts, masks aligned to the bottom-right corner
(causal and windows), +inf log-sum-exp for rows that see no key, padded head dims, packed forms,
the KV-cache call's in-place append, rotary, cache_batch_idx and paged caches; and the
arguments it does not honour refused by name."""

import math

import pytest
import torch
from fk_runtime.harness import testing

from fk_attention import flash_attn as fa

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if testing.on_gpu() else [])


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """FlashAttention's attention on (batch, seqlen, heads, headdim) float64 tensors: query i sees
    key j when i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: unbounded; causal: right 0);
    out 0 and lse +inf where a row sees no key. Returns (out, lse (batch, heads, seqlen_q))."""
    n_q, n_k, heads = q.shape[1], k.shape[1], q.shape[2]
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    right = 0 if causal else right
    i = torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
    j = torch.arange(n_k, device=q.device)[None, :]
    seen = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, torch.where(torch.isinf(lse), math.inf, lse)


# (batch, seqlen_q, seqlen_k, heads, heads_k, headdim, causal, window, softcap): Nq != Nk both ways (the
# bottom-right alignment shows), GQA, a head dim that is padded inside (20) and one below 16 (12).
CASES = [
    (2, 5, 9, 4, 2, 16, False, (-1, -1), 0.0),
    (2, 9, 5, 4, 2, 16, True, (-1, -1), 0.0),
    (1, 5, 9, 2, 2, 20, False, (2, 1), 0.0),
    (1, 9, 5, 4, 1, 16, True, (3, -1), 5.0),
    (1, 7, 7, 2, 1, 12, False, (0, 0), 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}-d{c[5]}-{'causal' if c[6] else 'full'}"
                         f"-w{c[7][0]}{c[7][1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attn_func_is_flash_attention(case, dtype):
    """Out, softmax_lse (+inf where a row sees no key) and every gradient, FlashAttention's way."""
    b, n_q, n_k, h, hk, d, causal, window, softcap = case
    q = testing.randn((b, n_q, h, d), dtype, requires_grad=True)
    k, v = (testing.randn((b, n_k, hk, d), dtype, requires_grad=True) for _ in range(2))
    testing.assert_matches_reference(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           return_attn_probs=True)[:2],
        lambda q, k, v: reference(q, k, v, causal, window, softcap), [q, k, v], dtype=dtype,
        names=["q", "k", "v"])


def test_window_as_a_tensor_and_scale():
    q, k, v = (testing.randn((1, 6, 2, 16), torch.float32) for _ in range(3))
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, window_size=torch.tensor([1, 0]))
    testing.assert_close("out", out, reference(q.double(), k.double(), v.double(), False, (1, 0), 0.0, 0.3)[0],
                         torch.float32)
    assert fa.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None  # no probabilities without dropout


def test_deterministic_gradients_repeat_bit_for_bit():
    """`deterministic=True` (FlashAttention's switch for a repeatable backward): the gradients of two
    calls are equal bit for bit, and equal those of the default call (fk's backward is deterministic
    but for the 5-matmul one, which these inputs do not take)."""
    q = testing.randn((1, 19, 2, 16), torch.float32, requires_grad=True)
    k, v = (testing.randn((1, 35, 1, 16), torch.float32, requires_grad=True) for _ in range(2))
    dout = testing.randn((1, 19, 2, 16), torch.float32)

    def grads(deterministic):
        out = fa.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads(True)
    for name, a, b, c in zip("qkv", first, grads(True), grads(False), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), f"grad {name} differs between calls"


def test_packed_forms_are_the_unpacked_calls():
    qkv = testing.randn((2, 7, 3, 2, 16), torch.float32)
    full = fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, causal=True), full, rtol=0, atol=0)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True), full,
                               rtol=0, atol=0)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32, device=qkv.device)
    packed = qkv.flatten(0, 1)  # (total, 3, heads, headdim)
    torch.testing.assert_close(fa.flash_attn_varlen_qkvpacked_func(packed, cu, 7, causal=True),
                               full.flatten(0, 1), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 7, 7,
                                                                  causal=True), full.flatten(0, 1),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 20])
def test_varlen_aligns_each_sequence_bottom_right(causal, d):
    """Each packed sequence against its own keys, bottom-right aligned with its own lengths (a
    longer query sequence has rows that see no key: 0 and +inf), gradients too."""
    lengths_q, lengths_k = [3, 7, 1], [5, 2, 4]
    cu_q = torch.tensor([0, 3, 10, 11], dtype=torch.int32, device=testing.device())
    cu_k = torch.tensor([0, 5, 7, 11], dtype=torch.int32, device=testing.device())
    q = testing.randn((11, 4, d), torch.float32, requires_grad=True)
    k, v = (testing.randn((11, 2, d), torch.float32, requires_grad=True) for _ in range(2))

    def per_sequence(q, k, v):
        outs, lses = [], []
        for i in range(3):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            out, lse = reference(q[None, qs], k[None, ks], v[None, ks], causal, (2, -1), 0.0)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    testing.assert_matches_reference(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  causal=causal, window_size=(2, -1), return_attn_probs=True)[:2],
        per_sequence, [q, k, v], dtype=torch.float32, names=["q", "k", "v"])


def _rotate(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary (float64): x (batch, seqlen, heads, headdim) at positions (batch, seqlen)."""
    half = cos.shape[1]
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]
    r = x[..., :2 * half]
    if interleaved:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        r = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    else:
        x1, x2 = r[..., :half], r[..., half:]
        r = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((r, x[..., 2 * half:]), -1)


@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
def test_kvcache_appends_rotates_and_attends(layout, rotary, leftpad):
    """New rows land in the caches at each sequence's length (rotated, where rotary is given), and q
    (rotated at its own positions) attends bottom-right to each sequence's rows, causal; with
    `cache_leftpad`, only to the rows from each sequence's pad on (positions stay the cache's)."""
    b, hq, hk, d, n_new, n_q, capacity = 2, 4, 2, 32, 2, 2, 12
    lengths = [5, 9]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=testing.device())
    q = testing.randn((b, n_q, hq, d), torch.float32)
    k_new, v_new = (testing.randn((b, n_new, hk, d), torch.float32) for _ in range(2))
    rows = 3 if layout == "batch_idx" else b  # batch_idx: the sequences use cache rows 2 and 0
    cache_k, cache_v = (testing.randn((rows, capacity, hk, d), torch.float32) for _ in range(2))
    index = torch.tensor([2, 0], dtype=torch.int32, device=q.device) if layout == "batch_idx" else None
    pads = [2, 4] if leftpad else [0, 0]
    pad_arg = dict(cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=q.device)) if leftpad else {}
    table = None
    if layout == "paged":  # pages of 4 rows, shuffled: sequence b's page p is page table[b, p]
        page = 4
        table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32, device=q.device)
        pages_k, pages_v = (torch.empty(6, page, hk, d, device=q.device) for _ in range(2))
        for s in range(b):
            for p in range(3):
                pages_k[int(table[s, p])] = cache_k[s, p * page:(p + 1) * page]
                pages_v[int(table[s, p])] = cache_v[s, p * page:(p + 1) * page]
    ro = 16
    theta = torch.arange(ro, dtype=torch.float64, device=q.device)[:, None] * torch.linspace(
        0.1, 1.0, d // 4, dtype=torch.float64, device=q.device)  # rotary_dim = d / 2
    cos, sin = theta.cos(), theta.sin()
    rotary_args = {} if rotary is None else dict(rotary_cos=cos.float(), rotary_sin=sin.float(),
                                                 rotary_interleaved=rotary == "interleaved")
    # The expected caches and output, in float64 from the inputs as they were.
    ref_k, ref_v, q64 = cache_k.double().clone(), cache_v.double().clone(), q.double()
    rows_of = [int(index[s]) if index is not None else s for s in range(b)]
    positions = seqlens.long()[:, None] + torch.arange(n_new, device=q.device)
    new_k = k_new.double()
    if rotary is not None:
        new_k = _rotate(new_k, cos, sin, positions, rotary == "interleaved")
        q64 = _rotate(q64, cos, sin, seqlens.long()[:, None] + torch.arange(n_q, device=q.device),
                      rotary == "interleaved")
    outs = []
    for s in range(b):
        r, n = rows_of[s], lengths[s]
        ref_k[r, n:n + n_new], ref_v[r, n:n + n_new] = new_k[s], v_new[s].double()
        p = pads[s]
        out, _ = reference(q64[s:s + 1], ref_k[r:r + 1, p:n + n_new], ref_v[r:r + 1, p:n + n_new], True)
        outs.append(out)
    if layout == "paged":
        got = fa.flash_attn_with_kvcache(q, pages_k, pages_v, k_new, v_new, cache_seqlens=seqlens,
                                         block_table=table, causal=True, **rotary_args, **pad_arg)
        cache_k = torch.stack([torch.cat([pages_k[int(table[s, p])] for p in range(3)]) for s in range(b)])
        cache_v = torch.stack([torch.cat([pages_v[int(table[s, p])] for p in range(3)]) for s in range(b)])
    else:
        got = fa.flash_attn_with_kvcache(q, cache_k, cache_v, k_new, v_new, cache_seqlens=seqlens,
                                         cache_batch_idx=index, causal=True, **rotary_args, **pad_arg)
    testing.assert_close("out", got, torch.cat(outs), torch.float32)
    for s in range(b):
        r, n = rows_of[s], lengths[s]
        testing.assert_close("k_cache rows", cache_k[r, :n + n_new], ref_k[r, :n + n_new], torch.float32)
        testing.assert_close("v_cache rows", cache_v[r, :n + n_new], ref_v[r, :n + n_new], torch.float32)


def test_kvcache_lse_and_an_int_length():
    """cache_seqlens as an int, no new rows, the log-sum-exp returned (batch, heads, seqlen_q)."""
    q = testing.randn((1, 3, 2, 16), torch.float32)
    cache = testing.randn((1, 8, 2, 16), torch.float32)
    out, lse = fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=6, return_softmax_lse=True)
    ref_out, ref_lse = reference(q.double(), cache[:, :6].double(), cache[:, :6].double())
    testing.assert_close("out", out, ref_out, torch.float32)
    testing.assert_close("lse", lse, ref_lse, torch.float32)


def test_kvcache_takes_any_head_dim():
    """Head dims that are not a multiple of 8 run in place too: fk masks the padding inside."""
    q = testing.randn((2, 3, 4, 12), torch.float16)
    cache = testing.randn((2, 10, 2, 12), torch.float16)
    out = fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=7, causal=True)
    ref, _ = reference(q.double(), cache[:, :7].double(), cache[:, :7].double(), causal=True)
    testing.assert_close("out", out, ref, torch.float16)


@pytest.mark.parametrize("call, argument", [
    (lambda q, c, cu: fa.flash_attn_func(q, q, q, dropout_p=1.0), "dropout_p"),
    (lambda q, c, cu: fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3, device=q.device)), "alibi_slopes"),
    (lambda q, c, cu: fa.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, block_table=cu[None]),
     "block_table"),
    (lambda q, c, cu: fa.flash_attn_with_kvcache(q, c, c, cache_seqlens=1, cache_leftpad=cu), "cache_leftpad"),
    (lambda q, c, cu: fa.flash_attn_with_kvcache(q, c, c, cache_seqlens=1, rotary_cos=c[0, :, 0],
                                                 rotary_sin=c[0, :, 0]), "rotary"),
    (lambda q, c, cu: fa.flash_attn_func(q, q, q, window_size=(-2, 0)), "window_size"),
    (lambda q, c, cu: fa.flash_attn_qkvpacked_func(q), "qkv"),
])
def test_what_it_cannot_honour_is_refused_by_name(call, argument):
    q = testing.randn((1, 4, 2, 16), torch.float32)
    cache = testing.randn((1, 8, 2, 16), torch.float32)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=q.device)
    with pytest.raises((ValueError, TypeError), match=argument):
        call(q, cache, cu)

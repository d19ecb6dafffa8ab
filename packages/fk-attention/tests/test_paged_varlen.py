"""Paged KV in the varlen call (`attention_varlen(..., block_table=...)`): mixed serving batches
(decode tokens, multi-row and prefill sequences, empty ones) against float64 references that
gather each sequence's keys from the pages by hand and build its visible keys from the lower-right
rule; new rows written into the right page rows; FlashAttention's layout; the errors."""

import math

import pytest
import torch
from fk_runtime import sizing
from fk_runtime.harness import testing
from fk_runtime.launch import PlanCache

from fk_attention import attention_varlen, attention_with_kvcache, serving
from fk_attention import flash_attn as fa

DEV = testing.device


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(serving, "BOUND", PlanCache())


def seen(n_q, n_k, causal, window):
    """Which of n_k keys each of n_q queries sees, query i at key position i + n_k - n_q: key j
    when -left <= j - position <= right (causal: right at most 0)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    offset = torch.arange(n_k)[None, :] - (torch.arange(n_q)[:, None] + n_k - n_q)
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left is not None:
        keep &= offset >= -left
    if right is not None:
        keep &= offset <= right
    return keep


def gather(pages, table_row, n_k):
    """A sequence's first n_k keys (Hk, n_k, D) from (pages, Hk, page_size, D) by its page row."""
    page_size = pages.shape[2]
    j = torch.arange(n_k)
    return pages.cpu()[table_row.cpu()[j // page_size].long(), :, j % page_size].transpose(0, 1)


def reference(q, k, v, table, cu_q, cu_k, causal, window, softcap, scale):
    """float64 (out (total_q, Hq, D), lse (Hq, total_q)); rows of no sequence or seeing no key: 0, -inf."""
    total_q, hq, d = q.shape
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float64)
    for b in range(table.shape[0]):
        lo, hi = int(cu_q[b]), int(cu_q[b + 1])
        n_k = int(cu_k[b + 1] - cu_k[b])
        if hi == lo:
            continue
        keys, values = gather(k, table[b], n_k).double(), gather(v, table[b], n_k).double()
        group = hq // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = q[lo:hi].cpu().double().transpose(0, 1) @ keys.transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        keep = seen(hi - lo, n_k, causal, window)
        scores = scores.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(scores, -1)
        weights = torch.where(keep, torch.exp(scores - row_lse.clamp_min(-1e300)[..., None]), 0.0)
        out[lo:hi] = (weights @ values).transpose(0, 1)
        lse[:, lo:hi] = row_lse
    return out, lse


def make_batch(lengths, page_size, hq, hk, d, dtype, fa_layout=False):
    """(q, k, v, table, cu_q, cu_k) for sequences of (query rows, keys): pages shuffled with spares,
    q a transposed view; with fa_layout the caches are (pages, page_size, Hk, D) tensors' views."""
    per_seq = max(1, max(sizing.cdiv(n_k, page_size) for _, n_k in lengths))
    pages = len(lengths) * per_seq + 3
    table = torch.randperm(pages)[:len(lengths) * per_seq].view(len(lengths), per_seq).to(torch.int32).to(DEV())
    if fa_layout:
        k, v = (testing.randn((pages, page_size, hk, d), dtype).transpose(1, 2) for _ in range(2))
    else:
        k, v = (testing.randn((pages, hk, page_size, d), dtype) for _ in range(2))
    cu_q = torch.tensor([0] + [sum(n for n, _ in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(n for _, n in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    q = testing.randn((hq, int(cu_q[-1]), d), dtype).transpose(0, 1)
    return q, k, v, table, cu_q.to(DEV()), cu_k.to(DEV())


def check(out, lse, ref_out, ref_lse, dtype):
    testing.assert_close("out", out.double(), ref_out.to(out.device), dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "rows that see no key must get a -inf lse"
    testing.assert_close("lse", lse.cpu()[finite].double(), ref_lse[finite], dtype)


# (query rows, keys): decode tokens (short: split along the keys), a few-row sequence, an empty one,
# one with no cached rows (L = Q), prefill chunks of one and several row tiles.
MIXED = [(1, 45), (3, 61), (0, 9), (12, 12), (1, 1), (20, 50), (2, 30)]
# (dtype, Hq, Hk, page size, causal, window, softcap, sequences per prefix-sum block)
CASES = [
    (torch.float32, 8, 2, 5, True, None, None, None),
    (torch.bfloat16, 4, 1, 16, True, (9, None), None, 4),
    (torch.float16, 2, 2, 3, False, None, 4.0, None),
    (torch.float32, 4, 4, 8, False, (7, 3), None, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-H{c[1]}:{c[2]}-page{c[3]}")
def test_mixed_batch_matches_the_reference(case, monkeypatch):
    """One call over decode, few-row and prefill sequences (GQA 4:1 and 4:1 MQA-like, MHA), odd and
    power-of-two pages, causal or not, windows, softcap; the prefix sums in blocks of a few
    sequences (a loop) where asked."""
    dtype, hq, hk, page_size, causal, window, softcap, block_s = case
    if block_s is not None:
        monkeypatch.setattr(serving, "SERVING_BLOCK_S", block_s)
    q, k, v, table, cu_q, cu_k = make_batch(MIXED, page_size, hq, hk, 16, dtype)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 20, 61, causal=causal, window=window, softcap=softcap,
                                block_table=table, return_lse=True)
    ref_out, ref_lse = reference(q, k, v, table, cu_q, cu_k, causal, window, softcap, 0.25)
    check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_rows_land_in_their_page_rows(dtype, monkeypatch):
    """k_new / v_new (packed like q) written at [L - Q, L) of each sequence's pages, nothing else
    touched; the call attends to them; FlashAttention's cache layout through .transpose(1, 2)."""
    monkeypatch.setattr(serving, "SERVING_WRITE_BLOCK_S", 2)  # the write's sequence search loops
    lengths = [(1, 33), (0, 4), (6, 6), (2, 17), (9, 40)]
    q, k, v, table, cu_q, cu_k = make_batch(lengths, 4, 4, 2, 16, dtype, fa_layout=True)
    k_new, v_new = (testing.randn((q.shape[0], 2, 16), dtype) for _ in range(2))
    expected_k, expected_v = k.clone(), v.clone()
    for b, (n_q, n_k) in enumerate(lengths):
        for i in range(n_q):
            pos = n_k - n_q + i
            page = int(table[b, pos // 4])
            expected_k[page, :, pos % 4] = k_new[int(cu_q[b]) + i]
            expected_v[page, :, pos % 4] = v_new[int(cu_q[b]) + i]
    version = k._version
    out = attention_varlen(q, k, v, cu_q, cu_k, 9, 40, causal=True, block_table=table, k_new=k_new, v_new=v_new)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert k._version > version
    ref_out, _ = reference(q, expected_k, expected_v, table, cu_q, cu_k, True, None, None, 0.25)
    testing.assert_close("out", out.double(), ref_out.to(out.device), dtype)


def test_a_uniform_batch_matches_attention_with_kvcache():
    """Every sequence appending two rows: the paged varlen call and the KV-cache call agree, caches
    included."""
    b, hq, hk, d, page_size, n_q = 3, 4, 2, 16, 8, 2
    cached = [13, 30, 5]
    q, k, v, table, cu_q, cu_k = make_batch([(n_q, n + n_q) for n in cached], page_size, hq, hk, d, torch.float32)
    k_new, v_new = (testing.randn((b * n_q, hk, d), torch.float32) for _ in range(2))
    k2, v2 = k.clone(), v.clone()
    out = attention_varlen(q, k, v, cu_q, cu_k, n_q, max(cached) + n_q, causal=True, block_table=table,
                           k_new=k_new, v_new=v_new)
    as_batch = lambda t: t.reshape(b, n_q, *t.shape[1:]).transpose(1, 2)  # noqa: E731
    seqlens = torch.tensor(cached, dtype=torch.int32, device=DEV())
    ref = attention_with_kvcache(as_batch(q), k2, v2, seqlens, as_batch(k_new), as_batch(v_new), block_table=table,
                                 causal=True)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    testing.assert_close("out", out.double(), ref.transpose(1, 2).reshape(out.shape).double(), torch.float32)


def test_flash_attn_varlen_passes_the_block_table_through():
    """FlashAttention's paged varlen call: (pages, page_size, Hk, D) caches, +inf lse for rows
    that see nothing, the same numbers as fk's call."""
    lengths = [(1, 20), (5, 9)]
    q, k, v, table, cu_q, cu_k = make_batch(lengths, 4, 4, 2, 16, torch.float32, fa_layout=True)
    q = q.contiguous()
    out, lse, _ = fa.flash_attn_varlen_func(q, k.transpose(1, 2), v.transpose(1, 2), cu_q, cu_k, 5, 20,
                                            causal=True, window_size=(2, 0), block_table=table,
                                            return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, table, cu_q, cu_k, True, (2, 0), None, 0.25)
    testing.assert_close("out", out.double(), ref_out.to(out.device), torch.float32)
    testing.assert_close("lse", lse.cpu().double(), ref_lse, torch.float32)


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_compiles_without_breaks_and_writes_the_callers_cache(mode):
    lengths = [(1, 11), (4, 7)]
    q, k, v, table, cu_q, cu_k = make_batch(lengths, 4, 4, 2, 16, torch.float32)
    k_new, v_new = (testing.randn((5, 2, 16), torch.float32) for _ in range(2))
    step = testing.maybe_compile(lambda q, k, v, cu_q, cu_k, t, kn, vn: attention_varlen(
        q, k, v, cu_q, cu_k, 4, 11, causal=True, block_table=t, k_new=kn, v_new=vn), mode)
    out = step(q, k, v, cu_q, cu_k, table, k_new, v_new)
    assert torch.equal(gather(k, table[0], 11)[:, 10], k_new[0].cpu())
    ref_out, _ = reference(q, k, v, table, cu_q, cu_k, True, None, None, 0.25)
    testing.assert_close("out", out.double(), ref_out.to(out.device), torch.float32)


def _bad(**change):
    q, k, v, table, cu_q, cu_k = make_batch([(1, 5), (2, 6)], 4, 4, 2, 16, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=6,
                block_table=table)
    for name, fn in change.items():
        args[name] = fn(args)
    return attention_varlen(**args)


@pytest.mark.parametrize("change, error, argument", [
    ({"block_table": lambda a: a["block_table"].long()}, TypeError, "block_table"),
    ({"block_table": lambda a: a["block_table"][:1]}, ValueError, "block_table"),
    ({"block_table": lambda a: a["block_table"][0]}, ValueError, "block_table"),
    ({"k": lambda a: a["k"][0]}, ValueError, "k must be a paged cache"),
    ({"v": lambda a: a["v"][:, :, :2]}, ValueError, "page_size"),
    ({"k_new": lambda a: torch.zeros_like(a["q"][:, :2])}, ValueError, "k_new and v_new"),
    ({"k_new": lambda a: a["q"], "v_new": lambda a: a["q"]}, ValueError, "k_new"),
    ({"alibi_slopes": lambda a: torch.ones(4, device=DEV())}, ValueError, "alibi_slopes"),
    ({"dropout_p": lambda a: 0.1}, ValueError, "dropout_p"),
    ({"causal": lambda a: "upper_left"}, ValueError, "lower-right"),
    ({"block_table": lambda a: None, "k_new": lambda a: a["q"], "v_new": lambda a: a["q"]}, ValueError,
     "block_table"),
    ({"q": lambda a: a["q"].detach().requires_grad_()}, ValueError, "block_table is forward-only"),
])
def test_bad_arguments_are_named(change, error, argument):
    with pytest.raises(error, match=argument):
        _bad(**change)


def test_without_grad_mode_inputs_that_require_grad_are_fine():
    with torch.no_grad():
        _bad(q=lambda a: a["q"].detach().requires_grad_())

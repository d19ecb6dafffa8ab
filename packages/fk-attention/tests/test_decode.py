"""Decode: few query rows through the split-KV path (`attention` with Nq <= 64) and
`attention_with_kvcache` (append, dense and paged caches, ragged lengths), against float64
references that build each row's visible keys explicitly."""

import math

import pytest
import torch
from fk_runtime import backend, sizing
from fk_runtime import gluon as fk_gluon
from fk_runtime.harness import testing
from fk_runtime.launch import PlanCache

from fk_attention import attention, attention_with_kvcache, decode
from fk_attention import plan
from fk_attention import config as fk_config, layout as fk_layout, mask as fk_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(plan, "BOUND", PlanCache())
    monkeypatch.setattr(decode, "BOUND", PlanCache())


def seen(n_q, n_k, causal, window, lower_right):
    """Which of n_k keys each of n_q queries sees: key j for query i when
    -left <= j - (i + shift) <= right, shift = n_k - n_q under lower-right alignment."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    offset = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] - (n_k - n_q if lower_right else 0)
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left is not None:
        keep &= offset >= -left
    if right is not None:
        keep &= offset <= right
    return keep


def attend(q, k, v, keep, scale, softcap):
    """float64 attention of q (Hq, Nq, D) on k, v (Hk, Nk, D) where `keep`; rows seeing no key
    give 0 and -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keep = keep.to(q.device)
    scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.where(keep, torch.exp(scores - lse.clamp_min(-1e300)[..., None]), 0.0)
    return weights @ v, lse


def cached_reference(q, k_rows, v_rows, lengths, causal, window, softcap, scale):
    """Per batch row: q against the first lengths[b] rows of k_rows[b] / v_rows[b] (Hk, cap, D),
    lower-right aligned."""
    outs, lses = [], []
    for b, n_k in enumerate(lengths):
        keep = seen(q.shape[2], n_k, causal, window, True)
        out, lse = attend(q[b], k_rows[b][:, :n_k], v_rows[b][:, :n_k], keep, scale, softcap)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def check(name, actual, expected, dtype):
    testing.assert_close(name, actual.double(), expected, dtype)


# (causal, window, softcap)
MASKS = [(False, None, None), (True, None, None), ("lower_right", (13, None), None), (False, (5, 9), None),
         (True, None, 3.0), ("upper_left", (None, 2), None)]
SHAPES = [(2, 4, 2, 1, 70, 32), (1, 6, 2, 3, 45, 37), (3, 2, 2, 7, 33, 16)]  # (B, Hq, Hk, Nq, Nk, D); 37: any head dim


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_few_queries_take_the_decode_path_forward_and_backward(shape, mask, monkeypatch):
    """`attention` with Nq <= 64 runs the split-KV kernels; values, lse and every gradient (the
    backward reads the decode path's lse) against float64."""
    b, hq, hk, n_q, n_k, d = shape
    causal, window, softcap = mask
    dtype = DTYPES[hash((shape, str(mask))) % 3]
    calls = []
    real = decode.takes  # (what every forward path asks: the full one, and a key's bound one)
    monkeypatch.setattr(decode, "takes", lambda q: calls.append(real(q)) or calls[-1])
    q, k, v = (testing.randn(s, dtype, requires_grad=True) for s in ((b, hq, n_q, d), (b, hk, n_k, d), (b, hk, n_k, d)))
    keep = seen(n_q, n_k, bool(causal), window, causal == "lower_right")
    scale = 1 / math.sqrt(d)

    def reference(q, k, v):
        outs = [attend(q[i], k[i], v[i], keep, scale, softcap) for i in range(b)]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])

    fn = lambda q, k, v: attention(q, k, v, causal=causal, window=window, softcap=softcap,  # noqa: E731
                                   return_lse=True)
    results = testing.check_against_reference(fn, reference, [q, k, v], dtype=dtype, names=["q", "k", "v"])
    assert calls and all(calls), "the decode path was not taken"
    assert all(r.ok for r in results), "\n".join(map(str, results)) + f" [seed {testing.seed()}]"


@pytest.mark.parametrize("slices", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_number_of_key_slices_merges_to_the_same_result(slices, dtype):
    """The partial outputs of 1, 2 or 5 slices (some empty: 40 keys in 16-key blocks) merge by
    log-sum-exp to the reference; rows that see no key (window past the start) give 0 and -inf."""
    q = testing.randn((2, 8, 2, 16), dtype)
    k, v = testing.randn((2, 2, 40, 16), dtype), testing.randn((2, 2, 40, 16), dtype)
    mask = fk_mask.Mask(left=3, right=-39)  # row 0 sees nothing, row 1 key 0 only
    out, lse = decode.forward(q, k, v, mask, 0.3, slices)
    keep = seen(2, 40, False, (3, -39), False)
    for i in range(2):
        ref_out, ref_lse = attend(q[i], k[i], v[i], keep, 0.3, None)
        check("out", out[i], ref_out, dtype)
        assert torch.equal(lse[i, :, 0].cpu(), torch.full((8,), -math.inf))
        check("lse", lse[i, :, 1], ref_lse[:, 1], dtype)


@pytest.mark.parametrize("slices, d", [(16, 64), (64, 64), (64, 256)])
def test_many_slices_merge_with_the_warps_that_hold_them(monkeypatch, slices, d):
    """A query row's partial outputs merged by a launch of `merge_warps` warps (one for 16 slices
    at d64, more where a warp would hold over MERGE_VALUES_PER_THREAD values a thread) give the
    float64 result (GQA, ragged lengths)."""
    metas = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: metas.append(meta)
                        or real(kernel, grid, args, meta, device))
    dtype = torch.float32
    block = decode.tiles(2, d, dtype, 0, testing.device().index or 0).block_n
    b, hq, hk, capacity = 2, 4, 2, slices * block
    q = testing.randn((b, hq, 1, d), dtype)
    k, v = testing.randn((b, hk, capacity, d), dtype), testing.randn((b, hk, capacity, d), dtype)
    lengths = [capacity, capacity - block - 3]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    run = decode.bind(q, k, v, fk_mask.Mask(right=0, lower_right=True), d ** -0.5, decode.Cache(), slices)
    out, _ = run(q, k, v, seqlens)
    ref_out, _ = cached_reference(q, k, v, lengths, True, None, None, d ** -0.5)
    check("out", out, ref_out, dtype)
    merge = [m for m in metas if "BLOCK_S" in m]
    warps = decode.merge_warps(slices, d)
    assert merge and all(m["num_warps"] == warps for m in merge)
    values = sizing.next_power_of_2(slices) * fk_layout.padded_head_dim(d)
    assert values <= 32 * warps * fk_config.MERGE_VALUES_PER_THREAD or warps == sizing.MIN_WARPS
    assert warps == 1 or values > 32 * (warps // 2) * fk_config.MERGE_VALUES_PER_THREAD  # no fewer would do


@pytest.mark.parametrize("n_k", [12, 300])  # one slice, several (merged)
@pytest.mark.parametrize("call", ["attention", "kvcache"])
def test_quiet_decode_calls_store_no_lse_they_do_not_return(monkeypatch, call, n_k):
    """Quiet decode calls (no autograd) that do not return the lse bind launches that store none
    (STORE_LSE off: nothing allocated for it) and give the float64 output; the same inputs asking
    for the lse next get a plan of their own and the float64 lse."""
    metas = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: metas.append(meta)
                        or real(kernel, grid, args, meta, device))
    monkeypatch.setattr(plan, "BOUND", PlanCache())
    monkeypatch.setattr(decode, "BOUND", PlanCache())
    dtype = torch.float16
    b, hq, hk, d = 2, 4, 2, 32
    q = testing.randn((b, hq, 1, d), dtype)
    k, v = testing.randn((b, hk, n_k, d), dtype), testing.randn((b, hk, n_k, d), dtype)
    lengths = [n_k, n_k - 5]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    if call == "attention":
        lengths = [n_k, n_k]
        fn = lambda return_lse: attention(q, k, v, return_lse=return_lse)  # noqa: E731
    else:
        fn = lambda return_lse: attention_with_kvcache(q, k, v, seqlens, causal=True,  # noqa: E731
                                                       return_lse=return_lse)
    ref_out, ref_lse = cached_reference(q, k, v, lengths, call == "kvcache", None, None, d ** -0.5)
    with torch.no_grad():
        for _ in range(2):  # the first call binds the quiet plan, the second runs it
            check("out", fn(False), ref_out, dtype)
        # (attention's first call is quiet already; the KV-cache call's first takes the full path)
        unstored = [m for m in metas if "STORE_LSE" in m and not m["STORE_LSE"]]
        assert unstored and (call == "kvcache" or len(unstored) == len([m for m in metas if "STORE_LSE" in m]))
        assert any("BLOCK_S" in m for m in unstored) == (n_k > 100)  # the merge where slices are
        metas.clear()
        for _ in range(2):
            out, lse = fn(True)
            check("out", out, ref_out, dtype)
            check("lse", lse, ref_lse, torch.float32)
        assert all(m["STORE_LSE"] for m in metas if "STORE_LSE" in m)  # (the KV-cache call's: bound before)


def test_key_slices_fill_the_device_and_respect_bounds():
    sms = backend.multiprocessor_count()
    assert decode.key_slices(64 * sms, 1 << 20, 128, 0) == 1  # a full grid is not sliced
    few = decode.key_slices(1, 1 << 20, 128, 0)
    assert 1 < few <= fk_config.MAX_SLICES and few & (few - 1) == 0
    assert decode.key_slices(1, 1 << 20, 64, 0) >= few  # narrower rows: more programs
    assert decode.key_slices(1, 1, 128, 0) == 1  # too few keys to slice
    min_keys = fk_config.INTERPRETER_SLICE_KEYS if not testing.on_gpu() else fk_config.MIN_SLICE_KEYS
    assert decode.key_slices(1, 3 * min_keys, 128, 0) <= 3


@pytest.mark.parametrize("gain", [1.5, 2.5])
def test_short_caches_are_sliced_only_for_their_card_gain(monkeypatch, gain):
    grids = fk_config.DecodeGrids(sliced_programs_d128=1, shallow_pipeline=2, descriptors_below=2, slice_min_gain=gain)
    monkeypatch.setattr(decode, "decode_grids", lambda *args, **kwargs: grids)
    wanted = decode.sliced_programs(128, 0)
    programs = max(1, round(wanted / 2))  # slices would double the programs
    short = fk_config.SHORT_CACHE_KEYS // 2
    assert decode.key_slices(programs, short, 128, 0) == (1 if wanted / programs < gain else 2)
    assert decode.key_slices(programs, fk_config.SHORT_CACHE_KEYS, 128, 0) == 2  # a longer cache is sliced
    assert decode.key_slices(max(1, round(wanted / 8)), short, 128, 0) >= 4  # far from the gain: sliced either way


def _descriptors_here(monkeypatch) -> list:
    """Skip where TMA cannot run; else a list that grows by one per K/V descriptor decode builds."""
    if testing.on_gpu() and not fk_layout.is_hopper_or_newer():
        pytest.skip("tensor descriptors need a Hopper (sm_90+) GPU")
    built = []
    real = decode.Descriptor
    monkeypatch.setattr(decode, "Descriptor", lambda *args, **kwargs: built.append(1) or real(*args, **kwargs))
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [fk_mask.FULL, fk_mask.Mask(right=0, lower_right=True), fk_mask.Mask(left=7, right=3)])
def test_decode_through_tensor_descriptors(dtype, mask, monkeypatch):
    """K/V tiles through TMA descriptors (forced: the interpreter runs them too), pointers beside
    them: odd key counts (the descriptor zero-fills past Nk), a padded head dim, sliced and not;
    no keys at all go through pointers (a descriptor takes no empty dim)."""
    built = _descriptors_here(monkeypatch)
    q = testing.randn((2, 6, 3, 24), dtype)
    k, v = testing.randn((2, 2, 45, 24), dtype), testing.randn((2, 2, 45, 24), dtype)
    keep = seen(3, 45, False, (mask.left, mask.right), mask.lower_right)
    for slices in (1, 3):
        for descriptors in (True, False):
            before = len(built)
            out, lse = decode.forward(q, k, v, mask, 0.3, slices, descriptors)
            assert len(built) - before == (2 if descriptors else 0), "K/V did not take the asked path"
            for i in range(2):
                ref_out, ref_lse = attend(q[i], k[i], v[i], keep, 0.3, None)
                check("out", out[i], ref_out, dtype)
                check("lse", lse[i], ref_lse, dtype)
    out, lse = decode.forward(q, k[:, :, :0], v[:, :, :0], mask, 0.3, None, True)
    assert torch.equal(out.cpu(), torch.zeros(out.shape, dtype=dtype))
    assert torch.equal(lse.cpu(), torch.full(lse.shape, -math.inf))


@pytest.mark.parametrize("page_size", [0, 2 * fk_config.INTERPRETER_BLOCK if not testing.on_gpu() else 128])
def test_kvcache_descriptors_never_read_rows_past_a_length(page_size, monkeypatch):
    """Through TMA a block's rows past a sequence's length are loaded too: cache rows there that
    hold NaN must not reach the output (the masked steps zero them), with and without appends."""
    built = _descriptors_here(monkeypatch)
    monkeypatch.setattr(decode, "kv_descriptors", lambda k, v, grid, paged=False: True)
    monkeypatch.setattr(decode, "row_pages", lambda grid, device_index: False)  # the paged way TMA takes
    b, hq, hk, d, capacity = 3, 4, 2, 32, 4 * max(page_size, 16)
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, page_size)
    lengths = [0, capacity // 2 - 3, 5]
    views = [logical(c).clone() for c in (k_cache, v_cache)]
    for cache, view in zip((k_cache, v_cache), views, strict=True):
        for i, n in enumerate(lengths):
            view[i, :, n:] = math.nan
        if page_size:  # write the poisoned logical rows back into their pages
            pages = view.reshape(b, hk, -1, page_size, d).transpose(1, 2).flatten(0, 1)
            cache[block_table.flatten().long()] = pages
        else:
            cache.copy_(view)
    for n_new in (0, 2):
        q = testing.randn((b, hq, 2, d), torch.float32)
        new = [testing.randn((b, hk, n_new, d), torch.float32) for _ in range(2)] if n_new else [None, None]
        seqlens = torch.tensor([n - n_new for n in lengths], dtype=torch.int32, device=k_cache.device).clamp_min(0)
        out = attention_with_kvcache(q, k_cache, v_cache, seqlens, *new, block_table=block_table, causal=True)
        total = [int(x) + n_new for x in seqlens.tolist()]
        ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), total, True, None, None,
                                      1 / math.sqrt(d))
        assert built, "K/V did not go through descriptors"
        assert not out.isnan().any(), "rows past a length reached the output"
        check("out", out, ref_out, torch.float32)


ON_GLUON_HOPPER = pytest.mark.skipif(
    not (testing.on_gpu() and fk_gluon.supported() and torch.cuda.get_device_capability()[0] == 9),
    reason="the Gluon decode kernel: Hopper and its Triton")

GLUON_CASES = [  # (B, Hq, Hk, Nq, D, capacity, lengths, new rows, (causal, window, softcap))
    (3, 8, 2, 1, 64, 300, [0, 1, 297], 0, (True, None, None)),  # no keys, one key, a partial last block
    (2, 32, 32, 1, 64, 1024, [1024, 1000], 0, (True, None, None)),  # the decode table's shape, unsliced
    (2, 32, 2, 1, 40, 520, [519, 64], 1, (True, None, None)),  # 16 rows a KV head, head dim padded to 64
    (2, 12, 2, 2, 64, 700, [650, 129], 2, (True, None, None)),  # 12 rows: two query positions, causal
    (2, 8, 2, 3, 64, 1000, [999, 300], 0, (True, (100, None), None)),  # a window's first and last blocks
    (1, 4, 1, 4, 64, 2048, [2000], 0, (False, (50, 7), 10.0)),  # a two-sided window and a softcap
    (2, 32, 8, 1, 64, 8192, [8192, 3333], 0, (True, None, 30.0)),  # long: sliced, softcap
]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GLUON_CASES, ids=str)
def test_gluon_decode_matches_float64_and_the_tl_kernel(monkeypatch, case, dtype):
    """The Gluon decode kernel (`decode_hopper`) on a dense cache whose rows past each length hold
    NaN: its launch ran (on grids of any size here); out and lse against float64 within 1.1x the tl
    kernel's error on the same inputs (`config.GLUON_DECODE_TILES` empty: the tl kernel), unsliced and
    with 3 slices forced."""
    b, hq, hk, n_q, d, capacity, lengths, n_new, (causal, window, softcap) = case
    monkeypatch.setattr(fk_config, "GLUON_DECODE_PROGRAMS_PER_SM", (0, math.inf))
    ran = []
    real = decode._bind_gluon

    def spy(*args, **kwargs):
        attend = real(*args, **kwargs)
        return attend and (lambda *call: ran.append(1) or attend(*call))
    monkeypatch.setattr(decode, "_bind_gluon", spy)
    k_cache, v_cache, _, _ = make_cache(b, hk, capacity, d, dtype, 0)
    seqlens = torch.tensor([max(n - n_new, 0) for n in lengths], dtype=torch.int32, device=k_cache.device)
    for cache in (k_cache, v_cache):
        for i, n in enumerate(seqlens.tolist()):
            cache[i, :, n + n_new:] = math.nan
    q = testing.randn((b, hq, n_q, d), dtype)
    new = [testing.randn((b, hk, n_new, d), dtype) for _ in range(2)] if n_new else [None, None]
    scale = 0.7 / math.sqrt(d)

    def call(tiles):
        monkeypatch.setattr(fk_config, "GLUON_DECODE_TILES", tiles)
        monkeypatch.setattr(decode, "BOUND", PlanCache())
        caches = [c.clone() for c in (k_cache, v_cache)]
        out, lse = attention_with_kvcache(q, *caches, seqlens, *new, causal=causal, window=window, softcap=softcap,
                                          sm_scale=scale, return_lse=True)
        return out, lse, caches

    out, lse, caches = call(((64, 64),))
    assert len(ran) == 1, "the Gluon kernel did not run"
    tl_out, tl_lse, _ = call(())
    assert len(ran) == 1
    total = [min(int(n) + n_new, capacity) for n in seqlens.tolist()]
    ref_out, ref_lse = cached_reference(q, *caches, total, causal, window, softcap, scale)
    _assert_within_tl(out, tl_out, ref_out, lse, tl_lse, ref_lse)
    if window is None and softcap is None:  # dense attention, slices forced: the partials and the merge
        i = total.index(max(total))
        q, k, v = q[i:i + 1], *(c[i:i + 1, :, :total[i]] for c in caches)
        mask = fk_mask.Mask(right=0, lower_right=True) if causal else fk_mask.FULL
        monkeypatch.setattr(fk_config, "GLUON_DECODE_TILES", ((64, 64),))
        sliced, sliced_lse = decode.forward(q, k, v, mask, scale, slices=3)
        assert len(ran) == 2
        ref_out, ref_lse = cached_reference(q, k, v, total[i:i + 1], causal, None, None, scale)
        _assert_within_tl(sliced, tl_out[i:i + 1], ref_out, sliced_lse, tl_lse[i:i + 1], ref_lse)


def test_gluon_decode_rings_fill_the_shared_memory_of_the_resident_programs(monkeypatch, hopper_card):
    """`decode.gluon_stages`: the stages that the programs a multiprocessor holds fit in its shared
    memory, within `config.GLUON_DECODE_STAGES`; and a Gluon plan keeps the usual slices (not the tl
    kernel's wide-block ones), on grids of GLUON_DECODE_PROGRAMS_PER_SM programs a multiprocessor."""
    hopper_card("NVIDIA H200")
    monkeypatch.setattr(fk_config, "GLUON_DECODE_STAGES", (2, 4))
    stages = {grid: decode.gluon_stages(grid, 64, 64, torch.bfloat16, 0) for grid in (8, 132, 396, 397, 512, 2048)}
    assert stages == {8: 4, 132: 4, 396: 4, 397: 2, 512: 2, 2048: 2}
    monkeypatch.setattr(fk_config, "GLUON_DECODE_STAGES", (2, 7))  # 7 x 16 KiB and the reserve: one program
    assert [decode.gluon_stages(grid, 64, 64, torch.bfloat16, 0) for grid in (132, 133)] == [7, 2]
    monkeypatch.setattr(fk_config, "GLUON_DECODE_STAGES", (2, 6))
    assert [decode.gluon_stages(grid, 64, 64, torch.bfloat16, 0) for grid in (264, 265)] == [6, 2]
    monkeypatch.setattr(decode, "gluon_block", lambda *args: 64)
    monkeypatch.setattr(decode, "sliced_programs", lambda head_dim, index, fill=1, paged=False: 264 * fill)
    split = decode.split_plan(16, 8, 4, 1 << 15, 64, torch.bfloat16, 0, 0)
    assert split.gluon and split.tile.num_warps == 1 and split.slices == 2  # 128 programs, 264 wanted
    assert split.tile.num_stages == 6
    assert not decode.split_plan(16, 8, 4, 1 << 15, 64, torch.bfloat16, 0, 0, gluon=False).gluon
    # `config.GLUON_DECODE_PROGRAMS_PER_SM`: 2048 programs (16 a multiprocessor) and 128 (a lone warp) take the
    # tl kernel, 512 (one wave) the Gluon one; past 4 a multiprocessor, programs of at most
    # `GLUON_DECODE_SHORT_KEYS` keys take it from Triton `GLUON_DECODE_SHORT_FROM` on
    monkeypatch.setattr(decode.backend, "triton_release", lambda version=None: (3, 6))
    assert not decode.split_plan(64, 32, 1, 1024, 64, torch.bfloat16, 0, 0).gluon
    assert not decode.split_plan(16, 8, 4, 1024, 64, torch.bfloat16, 0, 0).gluon
    assert decode.split_plan(16, 32, 1, 1024, 64, torch.bfloat16, 0, 0).gluon
    for release in ((3, 7), (3, 8)):
        monkeypatch.setattr(decode.backend, "triton_release", lambda version=None, release=release: release)
        assert decode.split_plan(64, 32, 1, 1024, 64, torch.bfloat16, 0, 0).gluon
    assert not decode.split_plan(64, 32, 1, 1025, 64, torch.bfloat16, 0, 0).gluon
    assert not decode.split_plan(64, 32, 1, 8192, 64, torch.bfloat16, 0, 0).gluon
    assert not decode.split_plan(16, 8, 4, 1024, 64, torch.bfloat16, 0, 0).gluon


def test_gluon_decode_leaves_a_short_cache_to_the_tl_kernel_where_it_alone_would_slice_it(hopper_card, monkeypatch):
    """`config.GLUON_DECODE_KEEP_UNSLICED`: on an H200, B16 H32:8 d64 over 1024 keys is one tl launch (wide blocks, no
    slices) but four Gluon slices and their merge: the tl kernel; over 8192 keys both slice, the Gluon kernel."""
    hopper_card("NVIDIA H200")
    monkeypatch.setattr(decode.backend, "is_interpreter", lambda: False)
    monkeypatch.setattr(decode, "gluon_block", lambda *args: 64)
    short = decode.split_plan(16, 8, 4, 1024, 64, torch.bfloat16, 0, 0)
    assert not short.gluon and short.slices == 1
    assert decode.split_plan(16, 8, 4, 8192, 64, torch.bfloat16, 0, 0).gluon
    assert decode.split_plan(16, 8, 4, 1024, 64, torch.bfloat16, 0, 0, slices=4).gluon  # forced slices: no plan
    monkeypatch.setattr(fk_config, "GLUON_DECODE_KEEP_UNSLICED", False)
    sliced = decode.split_plan(16, 8, 4, 1024, 64, torch.bfloat16, 0, 0)
    assert sliced.gluon and sliced.slices == 4


def _assert_within_tl(out, tl_out, ref_out, lse, tl_lse, ref_lse) -> None:
    """Out and lse against float64 within 1.1x the tl kernel's error (rows without keys: 0 and -inf exactly)."""
    assert not out.isnan().any(), "rows past a length reached the output"
    empty = ref_lse == -math.inf
    assert torch.equal(lse[empty].cpu(), ref_lse[empty].float().cpu())
    assert not out[empty].any()
    for name, got, tl_got, want in (("out", out, tl_out, ref_out), ("lse", lse, tl_lse, ref_lse)):
        got, tl_got, want = (t[~empty].double() for t in (got, tl_got, want))
        err = (got - want).norm() / want.norm()
        tl_err = (tl_got - want).norm() / want.norm()
        assert err <= 1.1 * tl_err + 1e-6, f"{name}: Gluon {err:.2e} against tl {tl_err:.2e}"


def make_cache(b, hk, capacity, d, dtype, page_size):
    """A cache holding random rows: dense (B, Hk, capacity, D), or paged (pages, Hk, page_size, D)
    with each sequence's pages shuffled over the pool (one spare page); and its logical view
    (B, Hk, capacity, D) as a function of the cache."""
    if not page_size:
        k, v = testing.randn((b, hk, capacity, d), dtype), testing.randn((b, hk, capacity, d), dtype)
        return k, v, None, lambda cache: cache
    per_seq = capacity // page_size
    pages = b * per_seq + 1
    k, v = testing.randn((pages, hk, page_size, d), dtype), testing.randn((pages, hk, page_size, d), dtype)
    order = torch.randperm(pages)[: b * per_seq]
    block_table = order.view(b, per_seq).to(torch.int32).to(k.device)

    def logical(cache):
        return cache[block_table.long()].transpose(1, 2).reshape(b, hk, capacity, d)

    return k, v, block_table, logical


CACHES = [  # (B, Hq, Hk, D, capacity, page size (0: dense), new rows)
    (3, 4, 2, 32, 48, 0, 1),
    (2, 4, 1, 16, 64, 16, 4),
    (3, 2, 2, 24, 45, 5, 3),
    (2, 8, 2, 16, 32, 8, 0),
]


@pytest.mark.parametrize("case", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_appends_then_attends(case, dtype):
    """New rows land at each sequence's length (the rest of the cache untouched), then q sees the
    first length + Nnew rows, lower-right causal; ragged lengths incl. an empty sequence."""
    b, hq, hk, d, capacity, page_size, n_new = case
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, dtype, page_size)
    lengths = [0, capacity - n_new, 7][:b]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=k_cache.device)
    n_q = max(n_new, 2)
    q = testing.randn((b, hq, n_q, d), dtype)
    new = [testing.randn((b, hk, n_new, d), dtype) for _ in range(2)] if n_new else [None, None]
    before = [logical(c).clone() for c in (k_cache, v_cache)]
    out, lse = attention_with_kvcache(q, k_cache, v_cache, seqlens, *new, block_table=block_table, causal=True,
                                      return_lse=True)
    after = [logical(c) for c in (k_cache, v_cache)]
    expected = [x.clone() for x in before]
    if n_new:
        for i, n in enumerate(lengths):
            for e, rows in zip(expected, new, strict=True):
                e[i, :, n:n + n_new] = rows[i]
    for a, e in zip(after, expected, strict=True):
        assert torch.equal(a, e), "the cache does not hold exactly the old rows plus the new ones"
    ref_out, ref_lse = cached_reference(q, *expected, [n + n_new for n in lengths], True, None, None,
                                        1 / math.sqrt(d))
    check("out", out, ref_out, dtype)
    check("lse", lse.where(lse.isfinite(), 0.0), ref_lse.where(ref_lse.isfinite(), 0.0), dtype)
    assert torch.equal(lse.isfinite().cpu(), ref_lse.isfinite().cpu())


@pytest.mark.parametrize("per_row", [False, True], ids=["pages preloaded", "page per row"])
def test_paged_reads_both_ways(per_row, monkeypatch):
    """Both ways a paged cache's blocks find their page (the slice's pages preloaded on grids of
    few programs, a page index per row in the walk on full ones) read the right rows: shuffled
    pages, ragged lengths, GQA, against float64; the launch took the asked-for way."""
    monkeypatch.setattr(decode, "row_pages", lambda grid, device_index: per_row)
    metas = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: metas.append(meta)
                        or real(kernel, grid, args, meta, device))
    page = 64 if testing.on_gpu() else fk_config.INTERPRETER_BLOCK  # whole key blocks a page
    b, hq, hk, d, capacity = 3, 4, 2, 16, 3 * page
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, page)
    lengths = [capacity, 37, 1]
    q = testing.randn((b, hq, 2, d), torch.float32)
    out = attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=q.device),
                                 block_table=block_table, causal=True)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), lengths, True, None, None, 1 / math.sqrt(d))
    check("out", out, ref_out, torch.float32)
    attend = [m for m in metas if "ROW_PAGES" in m]
    assert attend and all(m["ROW_PAGES"] == per_row and bool(m["SLICE_PAGES"]) != per_row for m in attend)


def test_slices_longer_than_the_preloaded_pages_read_a_page_per_row(monkeypatch):
    """A slice spanning more pages than a program preloads (SLICE_PAGES) reads a page index per row
    instead of forcing more slices, and on a grid of few programs takes ROW_PAGES_FILL times
    the programs: the right rows, shuffled pages, a ragged length, GQA, against float64."""
    monkeypatch.setattr(decode, "SLICE_PAGES", 2)
    monkeypatch.setattr(decode, "row_pages", lambda grid, device_index: False)  # a grid of few programs
    launches = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: launches.append((grid, meta))
                        or real(kernel, grid, args, meta, device))
    # A few slices of more than one page each (the GPU slices (batch, KV head) programs up to
    # about one per multiprocessor, the interpreter up to a handful)
    b, hq, hk, d, page = (4, 16, 8, 128, 64) if testing.on_gpu() else (1, 4, 2, 16, fk_config.INTERPRETER_BLOCK)
    capacity = 10 * page
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, page)
    lengths = [capacity - 5, capacity, 1, 2 * page + 3][:b]
    q = testing.randn((b, hq, 1, d), torch.float32)
    out = attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=q.device),
                                 block_table=block_table, causal=True)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), lengths, True, None, None, 1 / math.sqrt(d))
    check("out", out, ref_out, torch.float32)
    attend = [(grid, meta) for grid, meta in launches if "ROW_PAGES" in meta]
    programs = b * hk
    slices = decode.key_slices(programs, capacity, d, q.device.index or 0, fill=fk_config.ROW_PAGES_FILL, paged=True)
    assert attend and all(meta["ROW_PAGES"] and not meta["SLICE_PAGES"] for _, meta in attend)
    assert all(grid == (programs * slices,) for grid, _ in attend)
    assert slices > decode.key_slices(programs, capacity, d, q.device.index or 0, paged=True)  # the fill took more


@pytest.mark.parametrize("mask", [(False, None, None), (True, (4, None), None), (False, (6, 2), 2.0)])
@pytest.mark.parametrize("page_size", [0, 8])
def test_kvcache_windows_softcap_and_scale(mask, page_size):
    causal, window, softcap = mask
    b, hq, hk, d, capacity = 2, 4, 2, 16, 40
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, page_size)
    lengths = [29, 11]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=k_cache.device)
    q = testing.randn((b, hq, 3, d), torch.float32)
    out = attention_with_kvcache(q, k_cache, v_cache, seqlens, block_table=block_table, causal=causal,
                                 window=window, softcap=softcap, sm_scale=0.2)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), lengths, causal, window, softcap, 0.2)
    check("out", out, ref_out, torch.float32)


def test_kvcache_lengths_past_the_capacity_are_clamped():
    """Lengths past the capacity (a bug upstream) attend to the whole cache; rows that would land
    past it are dropped: no out-of-range access, the rest of the cache intact."""
    b, hk, capacity, d = 2, 2, 24, 16
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, 8)
    before = [logical(c).clone() for c in (k_cache, v_cache)]
    seqlens = torch.tensor([capacity + 5, capacity - 1], dtype=torch.int32, device=k_cache.device)
    q = testing.randn((b, 4, 2, d), torch.float32)
    new = [testing.randn((b, hk, 2, d), torch.float32) for _ in range(2)]
    out = attention_with_kvcache(q, k_cache, v_cache, seqlens, *new, block_table=block_table, causal=True)
    after = [logical(c) for c in (k_cache, v_cache)]
    for a, e, n in zip(after, before, new, strict=True):
        assert torch.equal(a[0], e[0])
        assert torch.equal(a[1, :, :-1], e[1, :, :-1]) and torch.equal(a[1, :, -1], n[1, :, 0])
    ref_out, _ = cached_reference(q, *after, [capacity, capacity], True, None, None, 0.25)
    check("out", out, ref_out, torch.float32)


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_kvcache_decode_loop_compiles_without_breaks(mode):
    """Three decode steps, each appending one row: eager and torch.compile(fullgraph) agree with
    the reference, and the compiled call writes the caller's cache."""
    b, hq, hk, d, capacity = 2, 4, 2, 16, 32
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.float32, 8)
    lengths = [5, 17]
    step = testing.maybe_compile(
        lambda q, kc, vc, n, k, v, t: attention_with_kvcache(q, kc, vc, n, k, v, block_table=t, causal=True), mode)
    for i in range(3):
        seqlens = torch.tensor([n + i for n in lengths], dtype=torch.int32, device=k_cache.device)
        q = testing.randn((b, hq, 1, d), torch.float32)
        k, v = testing.randn((b, hk, 1, d), torch.float32), testing.randn((b, hk, 1, d), torch.float32)
        out = step(q, k_cache, v_cache, seqlens, k, v, block_table)
        ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), [n + i + 1 for n in lengths], True,
                                      None, None, 0.25)
        check("out", out, ref_out, torch.float32)
        assert torch.equal(logical(k_cache)[:, :, lengths[0] + i][0], k[0, :, 0])


@pytest.mark.skipif(not testing.on_gpu(), reason="CUDA graphs need a GPU")
def test_kvcache_decode_step_replays_in_a_cuda_graph():
    b, hq, hk, d, capacity = 4, 32, 8, 128, 4096
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, torch.bfloat16, 64)
    seqlens = torch.tensor([100, 4000, 0, 2047], dtype=torch.int32, device="cuda")
    q = testing.randn((b, hq, 1, d), torch.bfloat16)
    k, v = testing.randn((b, hk, 1, d), torch.bfloat16), testing.randn((b, hk, 1, d), torch.bfloat16)
    attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, block_table=block_table, causal=True)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, block_table=block_table, causal=True)
    seqlens += 1
    q.copy_(testing.randn(q.shape, q.dtype))
    k.copy_(testing.randn(k.shape, k.dtype))
    graph.replay()
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), (seqlens + 1).tolist(), True, None, None,
                                  1 / math.sqrt(d))
    check("out", out, ref_out, torch.bfloat16)


@pytest.mark.skipif(not testing.on_gpu(), reason="long caches are for the GPU (the interpreter runs programs one by one)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(3, 32, 8, 128, 131072, 0, 1), (2, 32, 32, 64, 65536, 256, 4),
                                  (2, 16, 2, 128, 16384, 16, 64)])
def test_kvcache_long_ragged_caches(case, dtype):
    """KV lengths from 1 to 131072 in one batch, dense and paged, Nq 1-64."""
    b, hq, hk, d, capacity, page_size, n_q = case
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, dtype, page_size)
    lengths = [capacity - n_q, 1, capacity // 3][:b]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = testing.randn((b, hq, n_q, d), dtype)
    new = [testing.randn((b, hk, n_q, d), dtype) for _ in range(2)]
    out = attention_with_kvcache(q, k_cache, v_cache, seqlens, *new, block_table=block_table, causal=True)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), [n + n_q for n in lengths], True, None,
                                  None, 1 / math.sqrt(d))
    check("out", out, ref_out, dtype)


def test_kvcache_refuses_bad_inputs_clearly():
    """Also once a plan for the same shapes exists (eager calls check their inputs once per plan)."""
    dev = testing.device()
    q = torch.zeros(2, 4, 1, 16, device=dev)
    cache = torch.zeros(2, 2, 8, 16, device=dev)
    lens = torch.zeros(2, dtype=torch.int32, device=dev)
    attention_with_kvcache(q, cache, cache, lens)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention_with_kvcache(q.tolist(), cache, cache, lens)
    with pytest.raises(TypeError, match="k_cache must be a dense"):
        attention_with_kvcache(q, cache.to_sparse(), cache, lens)
    with pytest.raises(TypeError, match="cache_seqlens"):
        attention_with_kvcache(q, cache, cache, lens.long())
    with pytest.raises(ValueError, match="cache_seqlens"):
        attention_with_kvcache(q, cache, cache, lens[:1])
    with pytest.raises(ValueError, match="k and v"):
        attention_with_kvcache(q, cache, cache, lens, k=torch.zeros(2, 2, 1, 16, device=dev))
    with pytest.raises(ValueError, match="k must be"):
        attention_with_kvcache(q, cache, cache, lens, torch.zeros(2, 3, 1, 16, device=dev),
                               torch.zeros(2, 3, 1, 16, device=dev))
    with pytest.raises(ValueError, match="k_cache must be"):
        attention_with_kvcache(q, cache[:1], cache[:1], lens)
    with pytest.raises(TypeError, match="block_table"):
        attention_with_kvcache(q, cache, cache, lens, block_table=torch.zeros(2, 1, device=dev))
    with pytest.raises(ValueError, match="block_table"):
        attention_with_kvcache(q, cache, cache, lens, block_table=torch.zeros(3, 1, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="lower-right"):
        attention_with_kvcache(q, cache, cache, lens, causal="upper_left")
    with pytest.raises(ValueError, match="forward-only"):
        attention_with_kvcache(q.requires_grad_(), cache, cache, lens)
    with pytest.raises(TypeError, match="return_lse"):
        attention_with_kvcache(q.detach(), cache, cache, lens, return_lse=1)
    with pytest.raises(ValueError, match="multiple"):
        attention_with_kvcache(torch.zeros(2, 3, 1, 16, device=dev), cache, cache, lens)


def test_kvcache_reads_negated_views_and_refuses_negated_caches():
    """A q (and new rows) with the lazy negation bit read as their values (they computed on -q);
    a cache with it is refused: it is written in place."""
    dev = testing.device()
    q, k_new, v_new = (testing.randn((1, 2, 1, 16), torch.float32) for _ in range(3))
    k_cache, v_cache = (testing.randn((1, 2, 12, 16), torch.float32) for _ in range(2))
    lens = torch.tensor([9], dtype=torch.int32, device=dev)
    caches = [t.clone() for t in (k_cache, v_cache)]
    want = attention_with_kvcache(q, *caches, lens, k_new, v_new)
    negated = [torch._neg_view(-t) for t in (q, k_new, v_new)]
    torch.testing.assert_close(attention_with_kvcache(negated[0], k_cache, v_cache, lens, *negated[1:]), want)
    torch.testing.assert_close(k_cache, caches[0])
    with pytest.raises(ValueError, match="k_cache must not be a lazily negated view"):
        attention_with_kvcache(q, torch._neg_view(-k_cache), v_cache, lens)


def test_kvcache_takes_strided_lengths_and_page_tables_and_huge_lengths():
    """Review finds: a strided cache_seqlens or page table is read through its strides; a page
    table narrowed to fewer pages after a wider one binds its own capacity; a length near
    INT32_MAX is clamped before adding rows (no wrap, no write before the cache)."""
    b, hk, d = 2, 1, 16
    k_cache, v_cache, block_table, logical = make_cache(b, hk, 32, d, torch.float32, 8)
    q = testing.randn((b, 2, 1, d), torch.float32)
    lengths = torch.tensor([[3, 99], [20, 99]], dtype=torch.int32, device=k_cache.device)[:, 0]
    table_t = block_table.t().contiguous().t()  # strides (1, B)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table_t, causal=True)
    ref, _ = cached_reference(q, logical(k_cache), logical(v_cache), [3, 20], True, None, None, 0.25)
    check("out", out, ref, torch.float32)
    new = [testing.randn((b, hk, 1, d), torch.float32) for _ in range(2)]
    narrow = block_table[:, :2]  # capacity 16, then the whole table (32): same strides
    attention_with_kvcache(q, k_cache, v_cache, torch.tensor([16, 0], dtype=torch.int32, device=q.device), *new,
                           block_table=narrow, causal=True)
    attention_with_kvcache(q, k_cache, v_cache, torch.tensor([16, 0], dtype=torch.int32, device=q.device), *new,
                           block_table=block_table, causal=True)
    assert torch.equal(logical(k_cache)[0, :, 16], new[0][0, :, 0])
    dense_k, dense_v = torch.zeros(1, 1, 32, d, device=q.device), torch.zeros(1, 1, 32, d, device=q.device)
    huge = torch.tensor([2**31 - 1], dtype=torch.int32, device=q.device)
    attention_with_kvcache(q[:1], dense_k, dense_v, huge, new[0][:1], new[1][:1], causal=True)
    assert not dense_k.any(), "rows past the capacity must be dropped"


@pytest.mark.parametrize("page", [0, 256])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("capacity", [256, 1000])
def test_wide_key_blocks_read_the_right_rows(capacity, d, page, monkeypatch):
    """Decode at head dim 64 or 128 on few programs takes 128-row key blocks where shared memory
    holds them (`wide_blocks`; slices of one block and of several), from a dense cache or pages
    that hold whole blocks (shuffled): ragged lengths, GQA, against float64; where this device
    qualifies, the launch took them."""
    launches = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: launches.append(meta)
                        or real(kernel, grid, args, meta, device))
    monkeypatch.setattr(fk_config, "GLUON_DECODE_TILES", ())  # the tl kernel's blocks (Hopper: Gluon at d64)
    b, hq, hk, dtype = 2, 8, 2, torch.float16
    if page:
        capacity = sizing.cdiv(capacity, page) * page
    lengths = [capacity, capacity // 2 + 1]
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, dtype, page)
    q = testing.randn((b, hq, 1, d), dtype)
    out = attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=q.device),
                                 block_table=block_table, causal=True)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), lengths, True, None, None, 1 / math.sqrt(d))
    check("out", out, ref_out, dtype)
    attend = [meta for meta in launches if "ROW_PAGES" in meta]
    wide = decode.wide_blocks(hq // hk, d, dtype, b * hk, page, q.device.index or 0)
    assert attend and all((meta["BLOCK_N"] == fk_config.WIDE_BLOCK_N) == wide for meta in attend)


def test_preloaded_pages_take_the_smallest_bucket_that_holds_them(monkeypatch):
    buckets = fk_config.SLICE_PAGE_BUCKETS
    assert list(buckets) == sorted(buckets) and buckets[-1] == fk_config.SLICE_PAGES
    for spanned in range(1, fk_config.SLICE_PAGES + 1):
        pages = decode.preloaded_pages(spanned)
        assert pages in buckets and pages >= spanned and not any(spanned <= b < pages for b in buckets)
    monkeypatch.setattr(decode, "SLICE_PAGE_BUCKETS", (1, 2, 4))
    assert [decode.preloaded_pages(n) for n in (1, 2, 3)] == [1, 2, 4]


def test_slices_preload_the_pages_they_span(monkeypatch):
    """A slice preloads the page indices it spans (`preloaded_pages`), one more where it starts
    inside a page: slices of 3 key blocks over pages of 4 start inside one and span two (one page
    by their length alone); shuffled pages, ragged lengths, GQA, against float64."""
    monkeypatch.setattr(decode, "row_pages", lambda grid, device_index: False)  # preloaded on any grid
    metas = []
    real = decode.Launch
    monkeypatch.setattr(decode, "Launch", lambda kernel, grid, args, meta, device: metas.append(meta)
                        or real(kernel, grid, args, meta, device))
    b, hq, hk, d, dtype = 2, 4, 2, 16, torch.float32
    block = decode.tiles(hq // hk, d, dtype, 0, testing.device().index or 0).block_n
    page, capacity = 4 * block, 12 * block
    k_cache, v_cache, block_table, logical = make_cache(b, hk, capacity, d, dtype, page)
    lengths = [capacity, 7 * block - 3]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=k_cache.device)
    q = testing.randn((b, hq, 1, d), dtype)
    run = decode.bind(q, k_cache, v_cache, fk_mask.Mask(right=0, lower_right=True), d ** -0.5,
                       decode.Cache(0, page), 4, block_table)
    out, _ = run(q, k_cache, v_cache, seqlens, block_table)
    ref_out, _ = cached_reference(q, logical(k_cache), logical(v_cache), lengths, True, None, None, d ** -0.5)
    check("out", out, ref_out, dtype)
    attend = [m for m in metas if "ROW_PAGES" in m]
    assert attend and all(m["SLICE_PAGES"] == decode.preloaded_pages(2) and m["BLOCK_N"] == block
                          and not m["ROW_PAGES"] for m in attend)


def test_kvcache_plans_serve_only_their_layouts():
    """Eager calls key one plan on their inputs' layouts (checked once as it is made): calls of
    the same shapes with other strides (FlashAttention's (B, N, H, D) caches and new rows seen
    transposed) or another dtype get plans of their own, each against float64."""
    b, hq, hk, cap, d = 2, 4, 2, 24, 16
    lengths = [17, 5]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=testing.device())
    def make(shape, dtype, transposed):
        if not transposed:
            return testing.randn(shape, dtype)
        return testing.randn((shape[0], shape[2], shape[1], shape[3]), dtype).transpose(1, 2)

    for dtype in (torch.float32, torch.float16):
        for transposed in (False, True):
            q, k_cache, v_cache, k_new, v_new = (make(s, dtype, transposed) for s in [
                (b, hq, 2, d), (b, hk, cap, d), (b, hk, cap, d), (b, hk, 2, d), (b, hk, 2, d)])
            want_k, want_v = k_cache.clone(), v_cache.clone()
            for i, n in enumerate(lengths):
                want_k[i, :, n:n + 2], want_v[i, :, n:n + 2] = k_new[i], v_new[i]
            out = attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, causal=True)
            ref, _ = cached_reference(q, want_k, want_v, [n + 2 for n in lengths], True, None, None, d ** -0.5)
            check("out", out, ref, dtype)
            torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0)


def test_huge_window_sides_are_unbounded():
    q = testing.randn((1, 2, 2, 16), torch.float32)
    k, v = testing.randn((1, 2, 40, 16), torch.float32), testing.randn((1, 2, 40, 16), torch.float32)
    full = attention(q, k, v)
    for side in (2**31 - 1, 2**62):
        torch.testing.assert_close(attention(q, k, v, window=(side, side)), full)


def test_kvcache_writes_into_inference_caches_only_in_inference_mode():
    """Caches made under torch.inference_mode() take new rows inside it, and are refused outside it
    as torch refuses any in-place update there (the kernel's write would bypass that rule): eager
    before anything is written, compiled by torch's own check; reading them works anywhere."""
    with torch.inference_mode():
        k_cache, v_cache = testing.randn((1, 2, 8, 16)), testing.randn((1, 2, 8, 16))
    q, k, v = testing.randn((1, 2, 1, 16)), testing.randn((1, 2, 1, 16)), testing.randn((1, 2, 1, 16))
    lengths = torch.tensor([3], dtype=torch.int32, device=q.device)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="k_cache is an inference tensor"):
        attention_with_kvcache(q, k_cache, v_cache, lengths, k, v, causal=True)
    assert torch.equal(k_cache, before), "a refused call wrote the cache"
    compiled = torch.compile(lambda *args: attention_with_kvcache(*args, causal=True), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(RuntimeError, match="inference tensor"):  # torch's own check, after the functional op ran
        compiled(q, k_cache, v_cache, lengths, k, v)
    attention_with_kvcache(q, k_cache, v_cache, lengths, causal=True)
    with torch.inference_mode():
        attention_with_kvcache(q, k_cache, v_cache, lengths, k, v, causal=True)
    assert torch.equal(k_cache[:, :, 3:4], k)
    with pytest.raises(RuntimeError, match="k_cache is an inference tensor"):  # once a call in the mode bound a plan too
        attention_with_kvcache(q, k_cache, v_cache, lengths, k, v, causal=True)


def test_kvcache_repeated_calls_bump_the_caches_versions():
    """Every call that writes new rows tells autograd the caches changed (their version), the
    repeated calls of one layout too (which skip the checks and the registered op)."""
    k_cache, v_cache = testing.randn((1, 2, 8, 16)), testing.randn((1, 2, 8, 16))
    q, k, v = testing.randn((1, 2, 1, 16)), testing.randn((1, 2, 1, 16)), testing.randn((1, 2, 1, 16))
    lengths = torch.tensor([3], dtype=torch.int32, device=q.device)
    for _ in range(3):
        before = k_cache._version, v_cache._version
        attention_with_kvcache(q, k_cache, v_cache, lengths, k, v, causal=True)
        assert k_cache._version > before[0] and v_cache._version > before[1]


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_first_and_later_kvcache_calls_share_one_plan(return_lse):
    """An eager call binds the plan that the same call's later (quiet) runs take, lse stored only
    where it is returned: one compiled decode kernel per shape, not one for the first call and
    another for the rest."""
    b, hq, hk, cap, d = 2, 4, 2, 40, 16
    q = testing.randn((b, hq, 1, d), torch.float32)
    k_cache, v_cache = (testing.randn((b, hk, cap, d), torch.float32) for _ in range(2))
    seqlens = torch.tensor([cap, 17], dtype=torch.int32, device=q.device)
    first, second = (attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=True, return_lse=return_lse)
                     for _ in range(2))
    plans = [key for key in decode.BOUND if key[0] == "kvcache"]
    assert len(plans) == 1 and plans[0][-1] is return_lse
    for a, b_ in zip(first if return_lse else [first], second if return_lse else [second], strict=True):
        assert torch.equal(a, b_)

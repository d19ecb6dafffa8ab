import pytest
import torch
from fk_runtime.harness import testing

from fk_attention import attention, attention_varlen, hopper, kernels, warmup
from fk_attention import config as fk_config
from fk_attention import mask as fk_mask
from fk_attention import warm as warmup_module


def test_warmup_makes_each_call_and_checks_its_arguments():
    steps = warmup_module._decode_variants(2, 1, 16, torch.float32, 16, 1, 160, testing.device().index or 0)
    assert warmup(2, 1, head_dim=16, dtypes=torch.float32, causal=True, varlen=True, kvcache=True,
                  page_size=16, rows=80) == 4 + len(steps)
    with pytest.raises(ValueError, match="max_batch"):
        warmup(2, head_dim=16, kvcache=True, max_batch=0)
    with pytest.raises(ValueError, match="cache_rows"):
        warmup(2, head_dim=16, kvcache=True, cache_rows=0)
    assert warmup(2, head_dim=16, dtypes=(torch.float16,), window=(8, 0), backward=False, rows=80) == 1
    with pytest.raises(ValueError, match="rows"):
        warmup(2, head_dim=16, rows=64)
    with pytest.raises(ValueError, match="kv_heads"):
        warmup(3, 2, head_dim=16)
    with pytest.raises(TypeError, match="dtypes"):
        warmup(2, head_dim=16, dtypes=("bf16",))


def test_warmup_command_line(capsys):
    warmup_module.main(["--heads", "2", "--head-dim", "16", "--dtype", "float32", "--causal", "--no-backward",
                        "--rows", "80"])
    assert "1 warm-up calls" in capsys.readouterr().out
    steps = warmup_module._decode_variants(2, 2, 16, torch.float32, 0, 3, 200, testing.device().index or 0)
    warmup_module.main(["--heads", "2", "--head-dim", "16", "--dtype", "float32", "--no-backward", "--rows", "80",
                        "--kvcache", "--max-batch", "3", "--cache-rows", "200"])
    assert f"{3 + len(steps)} warm-up calls" in capsys.readouterr().out


def test_warmup_calls_past_each_length_bucket(monkeypatch):
    """Where the dense forward compiles another variant past a length (`hopper.length_buckets`: the
    causal Gluon forward's persistent-grid limit), the warm-up makes one forward past it."""
    from fk_attention import ops

    lengths = []
    real = ops.attention
    monkeypatch.setattr(ops, "attention", lambda q, *a, **kw: (lengths.append(q.shape[2]), real(q, *a, **kw))[1])
    monkeypatch.setattr(hopper, "length_buckets", lambda *args: (130,))
    assert warmup(2, 1, head_dim=16, dtypes=torch.float32, causal=True, backward=False, rows=80) == 2
    assert lengths == [80, 131]


def test_length_buckets_name_the_causal_grid_limit(monkeypatch):
    """On the Gluon forward's tensors (`hopper.on_hopper`), the causal d128 forward changes grid past
    `config.GLUON_PERSISTENT_CAUSAL_N` query rows, the d64 one goes from two consumers to three past its
    `config.GLUON_FORWARD_TWO` rows, causal and full alike (at any length of the tensors asked about); full
    masks at d128, d256, causal kept off the persistent grid and masks d64 never takes compile one variant at
    every length."""
    monkeypatch.setattr(hopper, "on_hopper", lambda *args: True)
    q, q64, q256 = (torch.empty(1, 2, 8, d) for d in (128, 40, 256))
    causal = fk_mask.Mask(right=0)
    assert hopper.length_buckets(q, q, q, causal, 0.1) == (fk_config.GLUON_PERSISTENT_CAUSAL_N,)
    assert hopper.length_buckets(q, q, q, fk_mask.FULL, 0.1) == ()
    assert hopper.length_buckets(q256, q256, q256, causal, 0.1) == ()
    assert hopper.length_buckets(q64, q64, q64, causal, 0.1) == (4096,)
    assert hopper.length_buckets(q64, q64, q64, fk_mask.FULL, 0.1) == (1024,)
    assert hopper.length_buckets(q64, q64, q64, fk_mask.Mask(left=8, right=0), 0.1) == ()
    assert hopper.length_buckets(q, q, q, causal, -0.1) == ()
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_TWO", ((64, 1, 1000), (64, 0, 1000)))
    assert hopper.length_buckets(q64, q64, q64, causal, 0.1) == (1000, fk_config.GLUON_PERSISTENT_CAUSAL_N)
    assert hopper.length_buckets(q64, q64, q64, fk_mask.FULL, 0.1) == (1000,)
    monkeypatch.setattr(fk_config, "GLUON_PERSISTENT_SEEN", (0,))
    assert hopper.length_buckets(q, q, q, causal, 0.1) == ()
    assert hopper.length_buckets(q64, q64, q64, causal, 0.1) == (1000,)


def test_autotuning_only_when_asked(monkeypatch):
    from fk_attention import plan

    monkeypatch.delenv(fk_config.AUTOTUNE_ENV, raising=False)
    monkeypatch.setattr(plan.backend, "is_interpreter", lambda: False)
    big = (torch.bfloat16, 64, 4096, 4096)
    assert not plan.should_autotune(*big)
    monkeypatch.setenv(fk_config.AUTOTUNE_ENV, "1")
    assert plan.should_autotune(*big)


def test_masked_walks_take_their_measured_tiles(monkeypatch):
    """Short windows, packed sequences and softcaps take the masked tiles at d128 (16-bit); dQ, wide
    windows, fp32 and d64 keep the dense ones (Triton 3.8 and later)."""
    monkeypatch.setattr(fk_config.backend, "is_interpreter", lambda: False)
    monkeypatch.setattr(fk_config.backend, "triton_at_least", lambda wanted: wanted <= (3, 8))
    fk_config.default_config.cache_clear()
    fwd, dkdv, dq = fk_config.Kind.FORWARD, fk_config.Kind.DKDV, fk_config.Kind.DQ
    try:
        dense = fk_config.default_config(fwd, 128, torch.bfloat16, True)
        window = fk_config.default_config(fwd, 128, torch.bfloat16, True, 1025)
        wide = fk_config.default_config(fwd, 128, torch.bfloat16, True, 1 << 20)
        assert (window.block_m, window.block_n, window.num_stages) == (64, 64, 3)
        assert wide == dense != window
        assert fk_config.default_config(dq, 128, torch.bfloat16, True, 1025) == \
            fk_config.default_config(dq, 128, torch.bfloat16, True)
        for flags in ({"varlen": True}, {"softcap": True}):
            assert fk_config.default_config(fwd, 128, torch.float16, True, **flags) == window
            got = fk_config.default_config(dkdv, 128, torch.bfloat16, True, **flags)
            assert (got.block_m, got.block_n, got.num_stages) == (64, 64, 2), flags
            assert fk_config.default_config(dq, 128, torch.bfloat16, True, **flags) == \
                fk_config.default_config(dq, 128, torch.bfloat16, True)
            for other in ((fwd, 64, torch.bfloat16), (fwd, 128, torch.float32)):
                assert fk_config.default_config(*other, True, **flags) == fk_config.default_config(*other, True)
    finally:
        fk_config.default_config.cache_clear()


def _compiled() -> dict:
    """{kernel: its compiled variants' keys} of every attention kernel in this process."""
    return testing.compiled_variants(kernels, hopper)


@pytest.mark.skipif(not testing.on_gpu(), reason="counts the GPU compiler's variants (the interpreter compiles nothing)")
@pytest.mark.parametrize("causal", [False, True])
def test_new_lengths_compile_nothing_after_warmup(causal):
    """The kernels do not specialize on lengths: after the warm-up, calls at any length (odd, a
    multiple of 16, packed with new bounds, past the causal Hopper forward's grid limit, which the
    warm-up calls too: `hopper.length_buckets`) add no compiled variant."""
    warmup(4, 2, head_dim=128, dtypes=torch.bfloat16, causal=causal, varlen=True)
    before = _compiled()
    for n in (1000, 1007, 1008, 1024, 1049, 1100, fk_config.GLUON_PERSISTENT_CAUSAL_N + 5):
        q, k, v = (testing.randn((1, h, n, 128), dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
        attention(q, k, v, causal=causal).sum().backward()
        lengths = torch.tensor([0, n // 3, n], device=q.device, dtype=torch.int32)
        flat = [t.detach()[0].transpose(0, 1).requires_grad_() for t in (q, k, v)]
        attention_varlen(*flat, lengths, lengths, n - n // 3, n - n // 3, causal=causal).sum().backward()
    new = {name: keys - before[name] for name, keys in _compiled().items() if keys - before[name]}
    assert not new, "new variants (and one from before each):\n" + "\n".join(
        f"{name}: {sorted(keys)} was {sorted(before[name])[:1]}" for name, keys in new.items())


@pytest.mark.parametrize("release", [(3, 6), (3, 7), (3, 8), (3, 9)])
def test_older_tritons_take_their_measured_tiles(monkeypatch, release):
    """Before Triton 3.8 the 16-bit d64 dK/dV tile of a causal (or windowed) walk is 32 x 64, four
    stages, and a softcapped d128 dK/dV 64 x 128, three stages; from 3.8 on, the defaults. Nothing
    else moves."""
    monkeypatch.setattr(fk_config.backend, "is_interpreter", lambda: False)
    fk_config.default_config.cache_clear()
    flags = ((), ("varlen", True), ("softcap", True), ("span", 1024), ("causal", True))
    cases = [(kind, d, dtype, f) for kind in fk_config.Kind for d in (64, 128, 256)
             for dtype in (torch.bfloat16, torch.float32) for f in flags]

    def tiles():
        return {case: fk_config.default_config(*case[:3], True, **dict([case[3]] if case[3] else []))
                for case in cases}

    try:
        monkeypatch.setattr(fk_config.backend, "triton_at_least", lambda wanted: wanted <= (3, 8))
        new = tiles()
        fk_config.default_config.cache_clear()
        monkeypatch.setattr(fk_config.backend, "triton_at_least", lambda wanted: wanted <= release)
        got = tiles()
    finally:
        fk_config.default_config.cache_clear()
    moved = {(k, d, t, f[:1]): (c.block_m, c.block_n, c.num_warps, c.num_stages)
             for (k, d, t, f), c in got.items() if c != new[(k, d, t, f)]}
    dkdv, bf16 = fk_config.Kind.DKDV, torch.bfloat16
    want = {(dkdv, 64, bf16, ("causal",)): (32, 64, 4, 4), (dkdv, 128, bf16, ("softcap",)): (64, 128, 8, 3)}
    assert moved == ({} if release >= (3, 8) else want)


@pytest.mark.skipif(not testing.on_gpu(), reason="compiles for the GPU ahead (the interpreter compiles nothing)")
def test_backward_compiles_ahead_and_its_gradients_are_right(monkeypatch):
    """A call that autograd records binds its backward at once, whose kernels compile in threads
    during the forward (`ops._backward_ahead`, `fk_runtime.ahead`): the backward then compiles
    nothing more, and its gradients are right. (Every GPU gradient test's first call of a layout
    takes this path too.)"""
    from fk_runtime.launch import PlanCache

    from fk_attention import ops, plan

    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(plan, "BOUND", PlanCache())
    q, k, v = (testing.randn((2, h, 203, 40), dtype=torch.float16, requires_grad=True) for h in (4, 2, 2))
    out = attention(q, k, v, causal=True)
    assert len(ops.AHEAD) == 1
    before = _compiled()
    grad = torch.randn_like(out)
    out.backward(grad)
    assert _compiled() == before, "the backward compiled what was to be compiled ahead"
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        ref[0], *(t.repeat_interleave(2, dim=1) for t in ref[1:]), is_causal=True)
    expected.backward(grad.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)
    for t, r in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the placeholders hold whatever memory held
def test_backward_bound_ahead_leaves_the_call_as_it_was(monkeypatch):
    """The path that binds the backward ahead (`ops._backward_ahead`; on a GPU it only compiles)
    runs here in full on placeholders: the call's output and gradients are those of a call
    without it (packed: the path with the most placeholders), bound once."""
    from fk_runtime import ahead
    from fk_runtime.launch import PlanCache

    from fk_attention import ops, plan

    def run(packed: bool):
        torch.manual_seed(0)
        q, k, v = (torch.randn(20, h, 16, device=testing.device(), requires_grad=True) for h in (2, 1, 1))
        if packed:
            cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=q.device)
            out = attention_varlen(q, k, v, cu, cu, 13, 13, causal=True)
        else:
            out = attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        out.square().sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    expected = run(True)
    monkeypatch.setattr(ops, "AHEAD", PlanCache())
    monkeypatch.setattr(plan, "BOUND", PlanCache())  # (else the call's key goes straight to the Function bound before)
    monkeypatch.setattr(ahead, "useful", lambda *tensors: True)
    for got, ref in zip(run(True), expected, strict=True):
        torch.testing.assert_close(got, ref)
    assert len(ops.AHEAD) == 1


# Steps of decode warm-up (compiled variants) by card, then (page size, head dim).
DECODE_WARMUP_STEPS = {
    "NVIDIA H100 80GB HBM3": {(0, 128): 8, (0, 64): 10, (64, 128): 16, (256, 128): 22, (16, 64): 13},
    "NVIDIA H200": {(0, 128): 9, (0, 64): 10, (64, 128): 16, (256, 128): 22, (16, 64): 13},
}
DECODE_WARMUP_STEPS_GLUON = {"NVIDIA H100 80GB HBM3": {(0, 64): 7}, "NVIDIA H200": {(0, 64): 16}}


@pytest.mark.parametrize("card", list(DECODE_WARMUP_STEPS))
@pytest.mark.parametrize("page_size,head_dim,gluon", [(0, 128, False), (0, 64, False), (64, 128, False),
                                                      (256, 128, False), (16, 64, False), (0, 64, True)], ids=str)
def test_decode_warmup_reaches_every_variant_of_its_range(monkeypatch, hopper_card, page_size, head_dim, card,
                                                          gluon):
    """On an H100 or H200 (132 SMs, 227 KiB of shared memory a program; the H200 takes its own
    decode grids), a decode step of every batch of 1..64 sequences on a dense cache of 32K rows,
    or on tables up to 32K keys of a paged one, picks a compiled variant that one of warmup's
    steps picked, on a cache no larger; with the tl kernel's plans and the Gluon kernel's (dense d64)."""
    from fk_attention import config, decode

    monkeypatch.setattr(decode.backend, "is_interpreter", lambda: False)
    hopper_card(card)
    if gluon:  # the Gluon kernel's plans (Hopper, its Triton): dense d64 only
        monkeypatch.setattr(decode, "gluon_block", lambda *args: 64)
    else:
        monkeypatch.setattr(config, "GLUON_DECODE_TILES", ())
    dtype, rows = torch.bfloat16, 32768

    def variant(b, n):
        return warmup_module.decode_variant(b, n, 32, 8, head_dim, dtype, page_size, 0)

    steps = warmup_module._decode_variants(32, 8, head_dim, dtype, page_size, 64, rows, 0)
    warmed = {variant(b, n) for b, n in steps}
    assert len(warmed) == len(steps) and all(n <= rows for _, n in steps)
    lengths = range(page_size, rows + 1, page_size) if page_size else [rows]
    assert {variant(b, n) for b in range(1, 65) for n in lengths} == warmed
    # what README.md says a server reaches (H32:8 d128 bf16, batches up to 64, 32K keys)
    assert len(steps) == (DECODE_WARMUP_STEPS_GLUON if gluon else DECODE_WARMUP_STEPS)[card][page_size, head_dim]

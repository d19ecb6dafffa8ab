import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from fk_runtime import alloc, backend, gluon as fk_gluon
from fk_runtime.harness import testing
from fk_runtime.launch import PlanCache

from fk_attention import SelfAttention, attention, attention_varlen, hopper, hopper_backward
from fk_attention import plan
from fk_attention import config as fk_config, layout as fk_layout, mask as fk_mask

# bf16 too on the interpreter, whose bf16 tl.dot is wrong: the plan runs it in fp32 there.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hk, Nq, Nk, D): two queries (causal: the first sees one key), odd lengths, Nq != Nk both ways, GQA and MQA, padded head
# dims (21: not a multiple of 8; 40), several blocks per program on the interpreter's 16 x 16 blocks. The two-query case
# spans 8 heads: in one head alone, the causal gradient is a single 2-key row (the first row's is
# rounding noise: delta = rowsum(dO * O) against dP), and where that row's gradient happens to be
# small the fp32 relative error reached 5e-4 (2500 trials, 9 above 1e-4); over 8 heads it stayed
# under 3e-6 (2500 trials), well inside the fp32 bound.
SHAPES = [
    (2, 4, 2, 2, 5, 16),
    (2, 4, 2, 33, 33, 40),
    (1, 3, 1, 17, 50, 16),
    (1, 2, 2, 50, 17, 21),
    (1, 2, 1, 70, 70, 64),
]
# The interpreter runs bf16 in fp32 (`layout.widened`): one bf16 shape there checks the widening.
CASES = [(shape, dtype) for shape in SHAPES for dtype in DTYPES
         if testing.on_gpu() or dtype != torch.bfloat16 or shape == SHAPES[0]]
if testing.on_gpu():
    # The issue's sizes in half precision: long and odd lengths, head dims 64, 80, 96, 128, 192,
    # 256, Nq != Nk, GQA/MQA, N = 16384 (float64 reference of 2 x 16384^2 scores).
    # Each shape in one of the two dtypes (every head dim is a compile per dtype), both overall.
    CASES += [
        ((2, 8, 2, 1000, 1000, 64), torch.bfloat16), ((1, 4, 4, 333, 1025, 96), torch.float16),
        ((1, 2, 1, 4097, 4097, 128), torch.bfloat16), ((1, 2, 2, 600, 600, 256), torch.float16),
        ((1, 4, 1, 129, 77, 80), torch.bfloat16), ((1, 2, 2, 700, 700, 192), torch.float16),
        ((2, 4, 4, 1000, 1000, 96), torch.bfloat16), ((1, 2, 2, 600, 600, 256), torch.bfloat16),
        ((1, 2, 1, 16384, 16384, 128), torch.bfloat16), ((1, 2, 1, 4096, 4096, 64), torch.float16),
        ((1, 4, 2, 300, 300, 100), torch.bfloat16), ((1, 2, 1, 77, 129, 5), torch.float16),
    ]
FP8_DTYPES = fk_layout.FP8_DTYPES


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Each test binds its own plans: tests patch the table's limits and gates, which bound plans
    and tuned winners would otherwise keep from an earlier test."""
    monkeypatch.setattr(plan, "BOUND", PlanCache())
    monkeypatch.setattr(plan, "WINNERS", {})
# fp8 P @ V rounds P to the input's mantissa (3 bits e4m3, 2 bits e5m2): a few % relative error.
FP8_TOLERANCE = {torch.float8_e4m3fn: 0.08, torch.float8_e5m2: 0.15}


def reference(q, k, v, causal=False, scale=None, lse=False):
    """softmax(q k^T * scale + mask) v in the inputs' dtype (float64 in the checks), GQA by
    repeating each KV head over its query heads; top-left causal mask as SDPA's."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    out = torch.softmax(scores, -1) @ v
    return (out, torch.logsumexp(scores, -1)) if lse else out


def sdpa(causal, scale=None):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                          enable_gqa=True)


def make(shape, dtype, layout="bhnd", requires_grad=True):
    b, hq, hk, nq, nk, d = shape
    if layout == "bnhd":  # (B, N, H, D) storage, seen as (B, H, N, D): strided, no copy
        q = testing.randn((b, nq, hq, d), dtype).transpose(1, 2)
        k = testing.randn((b, nk, hk, d), dtype).transpose(1, 2)
        v = testing.randn((b, nk, hk, d), dtype).transpose(1, 2)
    else:
        q, k, v = (testing.randn(s, dtype) for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d)))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def check(fn, inputs, dtype, causal, scale=None):
    """Forward and every gradient against float64, bounds widened by SDPA's own error in half
    precision."""
    testing.assert_matches_reference(
        fn, lambda q, k, v: reference(q, k, v, causal, scale), inputs, dtype=dtype,
        names=["q", "k", "v"], baseline_fn=None if dtype == torch.float32 else sdpa(causal, scale),
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=str)
def test_matches_float64_reference(shape, dtype, causal):
    check(lambda q, k, v: attention(q, k, v, causal=causal), make(shape, dtype), dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_query_decoding(dtype):
    """One new query against a KV cache (GQA), non-causal as decoding calls it."""
    check(lambda q, k, v: attention(q, k, v), make((2, 8, 2, 1, 45, 64), dtype), dtype, False)


@pytest.mark.heavy
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", testing.compile_modes())
def test_strided_bnhd_inputs(mode, causal):
    """(B, N, H, D) tensors transposed: read through their strides, output and gradients come
    back in the same storage order."""
    dtype = torch.float16
    inputs = make((2, 4, 2, 21, 37, 32), dtype, layout="bnhd")
    assert not inputs[0].is_contiguous()
    fn = testing.maybe_compile(lambda q, k, v: attention(q, k, v, causal=causal), mode)
    check(fn, inputs, dtype, causal)
    out = fn(*inputs)
    assert out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)


def test_strided_inputs_reach_the_kernel_without_copies(monkeypatch):
    seen = []
    real = plan.Kernel.__call__

    def spy(self, *args):
        seen.append([a.data_ptr() for a in args[:3]])
        return real(self, *args)

    monkeypatch.setattr(plan.Kernel, "__call__", spy)
    q, k, v = make((1, 2, 1, 20, 20, 16), torch.float32, layout="bnhd")
    attention(q, k, v).sum().backward()
    assert seen and all(ptrs == [q.data_ptr(), k.data_ptr(), v.data_ptr()] for ptrs in seen)


def _head_dim_major(shape, dtype):
    """(B, H, N, D) views of (D, B, N, H) storage: the head-dim stride is the largest, and heads
    lie inside tokens (so outputs and gradients take (B, N, H, D) storage)."""
    b, hq, hk, nq, nk, d = shape
    return [testing.randn((d, b, n, h), dtype).permute(1, 3, 2, 0).requires_grad_()
            for h, n in ((hq, nq), (hk, nk), (hk, nk))]


def test_strides_past_32bit_tile_offsets_are_copied_first(monkeypatch):
    """Tiles are addressed with 32-bit in-tile offsets: inputs whose strides could overflow them
    are copied contiguous before the launch (limit shrunk here so that small head-dim-major
    tensors cross it); values, gradients and output layouts stay right, and inputs under the
    limit still reach the kernel uncopied."""
    shape, dtype = (1, 2, 1, 20, 40, 16), torch.float32
    b, hq, hk, nq, nk, d = shape
    inputs = _head_dim_major(shape, dtype)
    assert fk_layout.tile_offsets_fit(inputs[0])
    seen = []
    real = plan.Kernel.__call__

    def spy(self, *args):
        seen.append(all(a.is_contiguous() for a in args[:3]))
        return real(self, *args)

    monkeypatch.setattr(plan.Kernel, "__call__", spy)
    attention(*inputs).sum().backward()
    assert seen and not any(seen)
    # Just above the (B, N, H, D) outputs' in-tile offsets (token stride Hq * D): the inputs,
    # whose head-dim stride is B * N * H, cross it; the outputs do not.
    monkeypatch.setattr(fk_layout, "TILE_OFFSET_LIMIT", (fk_layout.MAX_TILE_EXTENT - 1) * (hq * d + 2))
    plan.BOUND.clear()
    assert not any(fk_layout.tile_offsets_fit(t) for t in inputs)
    assert fk_layout.tile_offsets_fit(torch.empty((b, nq, hq, d)).transpose(1, 2))
    seen.clear()
    for q in inputs:
        q.grad = None
    check(lambda q, k, v: attention(q, k, v, causal=True), inputs, dtype, causal=True)
    assert seen and all(seen)
    # Outputs keep the inputs' storage order (what the registered fake promises), not the copy's.
    out = attention(*inputs)
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert all(t.transpose(1, 2).is_contiguous() for t in (out, *grads))


def test_tile_offset_bound_covers_every_tile():
    """tile_offsets_fit bounds in-tile offsets by MAX_TILE_EXTENT rows and head-dim columns:
    every block shape the tables can launch, and every padded head dim, must stay within it."""
    blocks = [c.block_m for _, row in fk_config.DEFAULTS_16BIT + fk_config.DEFAULTS_32BIT for c in row.values()]
    blocks += [c.block_n for _, row in fk_config.DEFAULTS_16BIT + fk_config.DEFAULTS_32BIT for c in row.values()]
    blocks += [c.block_m for _, row in fk_config.CANDIDATES for cs in row.values() for c in cs]
    blocks += [c.block_n for _, row in fk_config.CANDIDATES for cs in row.values() for c in cs]
    assert max(blocks + [fk_layout.padded_head_dim(fk_layout.MAX_HEAD_DIM)]) <= fk_layout.MAX_TILE_EXTENT


@pytest.mark.skipif(not testing.on_gpu(), reason="a 4.6 GiB view: GPU only")
def test_token_stride_past_32bit_tile_offsets():
    """64 queries whose tokens lie 36.7M elements apart (an odd stride: pointer loads, no TMA):
    one 64-query tile spans offsets past 2**31, which wrapped in 32 bits before the launch
    learnt to copy such inputs."""
    dtype, n, d = torch.bfloat16, 64, 64
    stride_n = (35 << 20) + 1
    storage = torch.empty((n, stride_n), device=testing.device(), dtype=dtype)
    q = storage[:, :d].view(1, 1, n, d)
    q.copy_(testing.randn(q.shape, dtype))
    assert (n - 1) * q.stride(2) >= fk_layout.TILE_OFFSET_LIMIT and not fk_layout.descriptors_allowed(q)
    k, v = (testing.randn((1, 1, n, d), dtype) for _ in range(2))
    check(attention, [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()], dtype, causal=False)


# Forced launches: uneven block shapes (more queries than keys per step and the reverse; keys twice
# the queries: the causal forward's half-width last step), both load paths (TMA descriptors run on
# the interpreter too), GQA, odd lengths both ways.
# (Fewer on the GPU, where every tiling is a compile and the main test covers the tuned ones.)
TILINGS = [(16, 16, False), (32, 16, True), (16, 64, True), (16, 32, True)] + (
    [] if testing.on_gpu() else [(16, 32, False), (64, 16, True)])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
@pytest.mark.parametrize("lengths", [(37, 70), (70, 37)], ids=str)
def test_every_tiling_and_load_path(tiling, lengths, causal):
    block_m, block_n, descriptors = tiling
    n_q, n_k = lengths
    q, k, v = make((1, 4, 2, n_q, n_k, 40), torch.float32, requires_grad=False)
    if descriptors and testing.on_gpu() and not fk_layout.use_descriptors(q, k, v):
        pytest.skip("tensor descriptors need a Hopper (sm_90+) GPU")
    fwd = fk_config.Config(block_m, block_n, 4, 1, descriptors)
    # dK/dV walks queries in steps of BLOCK_M with BLOCK_N keys held: swap for the other shape.
    bwd = (fwd, fk_config.Config(block_n, block_m, 4, 1, descriptors))
    scale = 0.3
    mask = fk_mask.CAUSAL if causal else fk_mask.FULL
    out, lse = plan.forward(q, k, v, mask, scale, config=fwd)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*ref_inputs, causal=causal, scale=scale, lse=True)
    testing.assert_close("out", out, ref_out, torch.float32)
    testing.assert_close("lse", lse, ref_lse, torch.float32)
    g_out, g_lse = testing.randn(out.shape), testing.randn(lse.shape)
    with alloc.poisoned_outputs():  # scratch rows dK/dV reads that dQ did not write would be NaN
        grads = plan.backward(g_out, g_lse, q, k, v, out, lse, mask, scale, configs=bwd)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_inputs, [g_out.double(), g_lse.double()])
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        testing.assert_close(f"grad {name}", g, r, torch.float32)


def test_dkdv_query_blocks_fit_the_scratch_padding():
    """dK/dV (tl and Gluon) reads delta and lse2 unmasked up to its query block's end: the dQ kernel
    pads their rows to STATS_ALIGN, so every dK/dV query block must divide it."""
    from fk_attention import kernels

    blocks = {fk_config.GLUON_Q_ROWS, fk_config.INTERPRETER_BLOCK}
    for table in (fk_config.DEFAULTS_16BIT, fk_config.DEFAULTS_32BIT, fk_config.MASKED_DEFAULTS_16BIT):
        blocks.update(row[fk_config.Kind.DKDV].block_m for _, row in table if fk_config.Kind.DKDV in row)
    blocks.update(c.block_m for _, row in fk_config.CANDIDATES for c in row[fk_config.Kind.DKDV])
    assert all(int(kernels.STATS_ALIGN) % m == 0 for m in blocks), sorted(blocks)


@pytest.mark.parametrize("features", [dict(causal=True), dict(window=(5, 3), softcap=20.0),
                                      dict(causal=True, dropout_p=0.3)], ids=str)
def test_split_dkdv_matches_one_launch(monkeypatch, features):
    """dK/dV as two launches (dV, then dK: `config.dkdv_parts`) gives what one launch gives, GQA and
    masks, dropout's regenerated mask included; causal also against float64."""
    shape, dtype = (1, 4, 2, 37, 45, 40), torch.float32
    inputs = make(shape, dtype)

    def grads(split):
        monkeypatch.setattr(fk_config, "DKDV_SPLIT_HEAD_DIMS", (64,) if split else ())
        monkeypatch.setattr(plan, "BOUND", PlanCache())
        out = attention(*inputs, generator=torch.Generator(inputs[0].device).manual_seed(3), **features)
        return torch.autograd.grad(out, inputs, torch.ones_like(out))

    assert fk_config.dkdv_parts(40) == (0,) and fk_config.dkdv_parts(256) == (1, 2)
    one, two = grads(False), grads(True)
    for name, a, b in zip("qkv", one, two, strict=True):
        testing.assert_close(f"grad {name}", b, a, dtype)
    if features == dict(causal=True):  # the split launches (still patched on) against float64
        check(lambda q, k, v: attention(q, k, v, causal=True), inputs, dtype, True)


def _fake_tuner_timer(monkeypatch) -> list:
    """The autotuner's timer replaced by one run of the candidate (the interpreter's stand-in):
    the kinds of the candidates it ran, in order."""
    runs = []
    real = plan.autotuned

    def with_fake_timer(kernel, kind, head_dim, descriptors, varlen):
        tuned = real(kernel, kind, head_dim, descriptors, varlen)
        tuned.__dict__["do_bench"] = lambda call, quantiles: (call(), runs.append(kind), [1.0] * 3)[2]
        return tuned

    monkeypatch.setattr(plan, "autotuned", with_fake_timer)
    return runs


@pytest.mark.skipif(testing.on_gpu(), reason="counts the tuner's runs under a fake timer: the interpreter's")
def test_split_dkdv_parts_tune_apart(monkeypatch, tmp_path):
    """Autotuned, the dV and dK launches each time every candidate and keep a pick of their own."""
    monkeypatch.setenv(plan.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plan, "_WINNER_FILES", {})
    monkeypatch.setattr(fk_config, "DKDV_SPLIT_HEAD_DIMS", (64,))
    monkeypatch.setattr(plan, "should_autotune", lambda *args: True)
    runs = _fake_tuner_timer(monkeypatch)
    inputs = make((1, 2, 1, 50, 50, 40), torch.float16)
    check(lambda q, k, v: attention(q, k, v, causal=True), inputs, torch.float16, True)
    dkdv = fk_config.Kind.DKDV
    assert runs.count(dkdv) == 2 * len(fk_config.candidates(dkdv, 40, True))
    assert sorted(key[0][6] for key in plan.WINNERS if key[0][0] is dkdv) == [1, 2]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_descriptors_on_odd_strides(causal):
    """Host TMA descriptors: a dim of one entry may carry any stride (the descriptor gets a valid
    one instead: here unaligned head and token strides of a single-head, single-query q); a
    stepped dim with stride 0 (K/V expanded over heads) is refused and read through pointers."""
    d, n_k = 40, 37
    storage = testing.randn((1, 3, 1, d + 1), torch.float32)
    q = storage[:, :1, :, :d]  # (1, 1, 1, 40), strides (123, 41, 41, 1): 164-byte head/token steps
    k, v = (testing.randn((1, 1, n_k, d), torch.float32) for _ in range(2))
    assert fk_layout.descriptors_allowed(q, k, v) and fk_layout.descriptor_strides(q) == [40, 40, 40, 1]
    if testing.on_gpu() and not fk_layout.use_descriptors(q, k, v):
        pytest.skip("tensor descriptors need a Hopper (sm_90+) GPU")
    config = fk_config.Config(16, 16, 4, 1, True)
    mask = fk_mask.CAUSAL if causal else fk_mask.FULL
    out, lse = plan.forward(q, k, v, mask, 0.3, config=config)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*ref_inputs, causal=causal, scale=0.3, lse=True)
    testing.assert_close("out", out, ref_out, torch.float32)
    # One row's lse (causal: its one score) may sit near 0, where no relative error means anything:
    # its normalizer exp(lse) is compared instead (a relative error there is the lse's absolute one).
    testing.assert_close("lse", lse.exp(), ref_lse.exp(), torch.float32)
    # The backward reads q and the upstream gradient through the same kind of strides.
    g_out = testing.randn((1, 3, 1, d + 1), torch.float32)[:, :1, :, :d]
    # A single-key (causal) row's dQ is its lse gradient alone, left over after delta cancels dO.O
    # against dO.V (fp32 error ~1e-7 of those): kept away from 0, where that error dominates.
    g_lse = testing.randn(lse.shape)
    g_lse = g_lse + g_lse.sign()
    grads = plan.backward(g_out, g_lse, q, k, v, out, lse, mask, 0.3, configs=(config, config))
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_inputs, [g_out.double(), g_lse.double()])
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        testing.assert_close(f"grad {name}", g, r, torch.float32)
    # K and V shared by 4 query heads through a zero head stride: pointers, right answer.
    q4 = testing.randn((1, 4, 5, d), torch.float32)
    k4, v4 = (t.expand(1, 4, n_k, d) for t in (k, v))
    assert not fk_layout.descriptors_allowed(k4) and fk_layout.descriptors_allowed(q4)
    out4 = attention(q4, k4, v4, causal=causal)
    testing.assert_close("out", out4, reference(q4.double(), k4.double(), v4.double(), causal), torch.float32)


ON_GLUON_HOPPER = pytest.mark.skipif(
    not (testing.on_gpu() and fk_gluon.supported() and torch.cuda.get_device_capability()[0] == 9),
    reason="the Gluon path: Hopper and its Triton")


def _hopper_launches(monkeypatch, name: str = "bind") -> list:
    """Records each bind of a Gluon kernel (`hopper.bind` the forward; `hopper_backward.bind_dkdv` the
    backward's dK/dV, `bind_backward` the 5-matmul one) whose launch then runs."""
    ran = []
    module = hopper if name == "bind" else hopper_backward
    real = getattr(module, name)

    def spy(*args):
        run = real(*args)

        def counted(*tensors):
            ran.append(tensors[0].shape)
            return run(*tensors)
        return counted

    monkeypatch.setattr(module, name, spy)
    return ran


# (B, Hq, Hk, Nq, Nk, D), mask: odd lengths, Nq != Nk both ways (lower-right causal leaves the
# first rows of Nq > Nk without keys), GQA, head dims padded to 128, a single query block.
HOPPER_CASES = [
    ((2, 4, 2, 1000, 1000, 128), fk_mask.FULL), ((2, 4, 2, 1000, 1000, 128), fk_mask.CAUSAL),
    ((1, 4, 1, 333, 1025, 96), fk_mask.CAUSAL), ((1, 4, 1, 1025, 333, 96), fk_mask.Mask(right=0, lower_right=True)),
    ((1, 2, 2, 300, 700, 72), fk_mask.Mask(right=0, lower_right=True)), ((1, 2, 2, 77, 77, 128), fk_mask.CAUSAL),
    ((1, 2, 1, 4096, 4096, 128), fk_mask.CAUSAL),
]
# The role-split dK/dV kernel's head dims (`config.GLUON_ROLE_HEAD_DIMS`: 256, padded from 192 too): one query
# block, programs whose keys no query sees (causal, keys past the queries: no step), rows without keys
# (lower-right, Nq > Nk), GQA, odd lengths.
ROLE_CASES = [
    ((1, 4, 2, 600, 600, 256), fk_mask.CAUSAL), ((2, 2, 2, 1000, 1000, 256), fk_mask.FULL),
    ((1, 2, 1, 333, 700, 192), fk_mask.Mask(right=0, lower_right=True)), ((1, 2, 2, 129, 77, 256), fk_mask.FULL),
    ((1, 2, 2, 50, 50, 256), fk_mask.CAUSAL), ((1, 2, 2, 100, 300, 256), fk_mask.CAUSAL),
    ((1, 4, 1, 700, 333, 256), fk_mask.Mask(right=0, lower_right=True)),
]
# The forward's d64 builds (three consumers: full masks past 1024 query rows, causal past 4096; two: up to
# them, `config.GLUON_FORWARD_TWO`), padded from 40 too, and its d256 build
# (`config.GLUON_FORWARD_TILES`: 64 keys a step, V's ring a stage shorter), padded from 192.
FORWARD_64_CASES = [
    ((2, 4, 2, 1000, 1000, 64), fk_mask.FULL), ((1, 4, 1, 333, 1025, 40), fk_mask.FULL),
    ((1, 2, 2, 77, 77, 64), fk_mask.FULL), ((2, 2, 1, 200, 64, 64), fk_mask.FULL),
    ((1, 4, 1, 1025, 333, 40), fk_mask.FULL), ((1, 2, 2, 1300, 700, 64), fk_mask.FULL),
    ((1, 2, 1, 4200, 4200, 64), fk_mask.CAUSAL),
    ((1, 2, 2, 4500, 4200, 40), fk_mask.Mask(right=0, lower_right=True)),
    ((2, 4, 2, 1000, 1000, 64), fk_mask.CAUSAL),
    ((1, 4, 1, 1025, 333, 40), fk_mask.Mask(right=0, lower_right=True)),
]
HOPPER_FORWARD_CASES = HOPPER_CASES + FORWARD_64_CASES + [
    ((1, 4, 2, 600, 600, 256), fk_mask.CAUSAL), ((1, 2, 1, 333, 700, 192), fk_mask.Mask(right=0, lower_right=True)),
    ((1, 2, 2, 129, 77, 256), fk_mask.FULL),
]
# The 5-matmul backward's d64 build too (`config.GLUON_FUSED_HEAD_DIMS`; its steps issued ahead,
# `config.GLUON_BWD_AHEAD_HEAD_DIMS`): a program of one Q block (no step ahead), programs whose keys no
# query sees (no step at all: causal, keys past the queries).
FUSED_CASES = HOPPER_CASES + [
    ((2, 4, 2, 1000, 1000, 64), fk_mask.FULL), ((2, 4, 2, 1000, 1000, 64), fk_mask.CAUSAL),
    ((1, 4, 1, 333, 1025, 40), fk_mask.Mask(right=0, lower_right=True)), ((1, 2, 2, 77, 77, 64), fk_mask.CAUSAL),
    ((1, 2, 2, 50, 50, 64), fk_mask.FULL), ((1, 2, 1, 100, 300, 64), fk_mask.CAUSAL),
    # softcaps (`hopper_backward.fused_mask`): scores near the cap (5), either alignment, both step orders
    ((2, 4, 2, 1000, 1000, 128), fk_mask.Mask(right=0, softcap=30.0)), ((1, 2, 2, 300, 700, 128), fk_mask.Mask(softcap=5.0)),
    ((2, 4, 2, 1000, 1000, 64), fk_mask.Mask(right=0, lower_right=True, softcap=20.0)),
    ((1, 2, 1, 77, 300, 64), fk_mask.Mask(softcap=5.0)), ((1, 4, 1, 1025, 333, 96), fk_mask.Mask(right=0, softcap=5.0)),
    # windows (`config.GLUON_BWD_WINDOWS`): sliding causal, two-sided, one side unbounded, lower-right with rows that
    # see no key, softcapped (Gemma 2's local layers), programs masked at both edges or wholly outside
    ((2, 4, 2, 1000, 1000, 128), fk_mask.Mask(left=200, right=0)),
    ((1, 2, 1, 700, 900, 64), fk_mask.Mask(left=100, right=37)),
    ((1, 2, 2, 900, 300, 128), fk_mask.Mask(left=50, right=80, lower_right=True)),
    ((1, 2, 2, 300, 300, 128), fk_mask.Mask(right=5)), ((1, 2, 2, 500, 500, 64), fk_mask.Mask(left=3)),
    ((1, 4, 1, 1025, 333, 96), fk_mask.Mask(left=64, right=0, softcap=5.0)),
    ((2, 4, 2, 1000, 1000, 64), fk_mask.Mask(left=255, right=0, lower_right=True, softcap=20.0)),
]


def test_5_matmul_backward_takes_softcaps_where_tanh_is_the_gpus(monkeypatch):
    """`hopper_backward.fused_mask`: every key or causal (either alignment), other windows where
    `config.GLUON_BWD_WINDOWS` is on, softcapped too where the scores take `tanh.approx.f32` (16-bit inputs on a
    GPU, `Mask.softcap_build`) and `config.GLUON_BWD_SOFTCAP` is on; never fp32's or the interpreter's capped
    scores."""
    capped = (fk_mask.Mask(softcap=30.0), fk_mask.Mask(right=0, softcap=5.0), fk_mask.Mask(right=0, lower_right=True,
                                                                                         softcap=20.0))
    plain = (fk_mask.FULL, fk_mask.CAUSAL, fk_mask.Mask(right=0, lower_right=True))
    windows = (fk_mask.Mask(left=8, right=0), fk_mask.Mask(left=8, right=0, softcap=5.0), fk_mask.Mask(right=5))
    for gpu in (False, True):
        monkeypatch.setattr(fk_mask.backend, "is_interpreter", lambda gpu=gpu: not gpu)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            approx = gpu and dtype != torch.float32
            assert all(hopper_backward.fused_mask(m, dtype) for m in plain)
            assert [hopper_backward.fused_mask(m, dtype) for m in capped] == [approx] * 3, (gpu, dtype)
            assert [hopper_backward.fused_mask(m, dtype) for m in windows] == [True, approx, True], (gpu, dtype)
    monkeypatch.setattr(fk_config, "GLUON_BWD_SOFTCAP", False)
    assert not hopper_backward.fused_mask(capped[0], torch.bfloat16) and hopper_backward.fused_mask(fk_mask.CAUSAL,
                                                                                                   torch.bfloat16)
    monkeypatch.setattr(fk_config, "GLUON_BWD_WINDOWS", False)
    assert not any(hopper_backward.fused_mask(m, torch.bfloat16) for m in windows)
    assert all(hopper_backward.fused_mask(m, torch.bfloat16) for m in plain)


def test_5_matmul_backward_issues_steps_ahead_where_configured(monkeypatch):
    """The 5-matmul backward's step order, ring, dQ split and dQ sum layout by padded head dim and mask
    (`hopper_backward.fused_builds`): ahead on GLUON_BWD_AHEAD_STAGES stages at the configured head dims,
    else in order on GLUON_BWD_STAGES, its consumers taking turns at dQ under full masks at the head dims
    of GLUON_BWD_DQ_TURNS_HEAD_DIMS, the sum in fragment rows at GLUON_BWD_DQ_FRAGMENT_HEAD_DIMS; the dQ
    sum's box spans what one consumer adds."""
    monkeypatch.setattr(fk_config, "GLUON_BWD_AHEAD_HEAD_DIMS", (64,))
    monkeypatch.setattr(fk_config, "GLUON_BWD_AHEAD_STAGES", 3)
    monkeypatch.setattr(fk_config, "GLUON_BWD_DQ_TURNS_HEAD_DIMS", (64, 128))
    monkeypatch.setattr(fk_config, "GLUON_BWD_DQ_FRAGMENT_HEAD_DIMS", (128,))
    builds = hopper_backward.fused_builds
    in_order = {"AHEAD": False, "STAGES": fk_config.GLUON_BWD_STAGES}
    for seen in (0, 1, 2):  # every key, causal, another window (`hopper.forward_mask_args`' SEEN)
        assert builds(40, seen) == builds(64, seen) == {"AHEAD": True, "STAGES": 3, "DQ_TURNS": False,
                                                        "DQ_FRAGMENTS": False}
        assert builds(96, seen) == builds(128, seen) == {**in_order, "DQ_TURNS": seen == 0, "DQ_FRAGMENTS": True}
    monkeypatch.setattr(fk_config, "GLUON_BWD_AHEAD_HEAD_DIMS", ())
    monkeypatch.setattr(fk_config, "GLUON_BWD_DQ_TURNS_HEAD_DIMS", (128,))
    assert builds(64, 0) == {**in_order, "DQ_TURNS": False, "DQ_FRAGMENTS": False}
    assert hopper_backward.dq_sum_rows(300) == 320
    fields = [hopper_backward.dq_sum_fields([2, 4, 320, d], builds(d, seen)) for d in (128, 64) for seen in (0, 1)]
    # fragment rows (all of a Q block's, or a half's) at d128; rows in order at d64, half the head dim each
    assert [f[2] for f in fields] == [[1, 1, 256, 32], [1, 1, 128, 32], [1, 1, 64, 32], [1, 1, 64, 32]]
    assert [f[0] for f in fields] == [[2, 4, 1280, 32]] * 2 + [[2, 4, 320, 64]] * 2


@pytest.fixture
def switch(monkeypatch):
    """switch(name, value): a `config` switch set for the test (`GLUON_FUSED_DQ` off: the 7-matmul
    pair, tl dQ and Gluon dK/dV; `GLUON_FORWARD_MASKS`: the releases it is on for), bound calls
    dropped then and after it."""
    def set_to(name: str, value):
        plan.BOUND.cache_clear()
        monkeypatch.setattr(fk_config, name, value)
    yield set_to
    plan.BOUND.cache_clear()


@ON_GLUON_HOPPER
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", HOPPER_FORWARD_CASES, ids=str)
def test_hopper_forward_matches_the_tl_kernels_and_float64(monkeypatch, shape, mask, dtype, layout):
    """The Gluon forward against float64, within the tl kernels' own error on the same inputs
    (their forced config runs tl), output and log-sum-exp; its launch ran."""
    ran = _hopper_launches(monkeypatch)
    q, k, v = make(shape, dtype, layout=layout, requires_grad=False)
    scale = 1 / math.sqrt(shape[-1])
    out, lse = plan.forward(q, k, v, mask, scale)
    assert len(ran) == 1
    _assert_gluon_forward(q, k, v, mask, scale, out, lse)
    assert out.stride() == q.stride() if layout == "bnhd" else out.is_contiguous()


def _assert_gluon_forward(q, k, v, mask, scale, out, lse):
    """The Gluon forward's output and log-sum-exp against float64, within the tl kernel's own error
    on the same inputs (its forced config runs tl); rows that see no key exactly 0 and -inf."""
    tl_out, tl_lse = plan.forward(q, k, v, mask, scale, config=fk_config.default_config(
        fk_config.Kind.FORWARD, q.shape[-1], q.dtype, True))
    ref, ref_lse = _masked_reference(q, k, v, mask, scale, with_lse=True)
    for name, got, tl_got, want in (("out", out, tl_out, ref), ("lse", lse, tl_lse, ref_lse)):
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], want[~finite].to(got.dtype))
        err = (got.double() - want).where(finite, 0).norm() / want.where(finite, 0).norm()
        tl_err = (tl_got.double() - want).where(finite, 0).norm() / want.where(finite, 0).norm()
        assert err <= 1.1 * tl_err + 1e-6, f"{name}: Gluon {err:.2e} against tl {tl_err:.2e}"


def _check_gluon_forward(monkeypatch, shape, mask, dtype):
    """One forward of fresh inputs: the Gluon launch ran, and `_assert_gluon_forward` holds."""
    ran = _hopper_launches(monkeypatch)
    q, k, v = make(shape, dtype, requires_grad=False)
    scale = 1 / math.sqrt(shape[-1])
    out, lse = plan.forward(q, k, v, mask, scale)
    assert len(ran) == 1
    _assert_gluon_forward(q, k, v, mask, scale, out, lse)


# Windows (two-sided, one side, either alignment, rows that see no key) and softcaps, GQA.
HOPPER_MASK_CASES = [
    ((1, 4, 2, 1000, 1000, 128), fk_mask.Mask(left=300, right=0)),
    ((1, 4, 2, 777, 1300, 128), fk_mask.Mask(left=100, right=37, lower_right=True)),
    ((1, 2, 1, 1300, 777, 96), fk_mask.Mask(right=200, lower_right=True)),
    ((1, 2, 2, 500, 500, 128), fk_mask.Mask(left=64)),
    ((2, 4, 2, 1000, 1000, 128), fk_mask.Mask(softcap=30.0)),
    ((1, 4, 2, 1000, 1000, 128), fk_mask.Mask(left=255, right=0, softcap=5.0)),
    ((1, 2, 2, 300, 700, 72), fk_mask.Mask(right=0, lower_right=True, softcap=20.0)),
    ((1, 4, 2, 600, 600, 256), fk_mask.Mask(left=100, right=37)), ((1, 2, 1, 333, 500, 200), fk_mask.Mask(softcap=20.0)),
]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", HOPPER_MASK_CASES, ids=str)
def test_hopper_forward_takes_windows_and_softcaps_where_switched_on(monkeypatch, switch, shape, mask, dtype):
    """`config.GLUON_FORWARD_MASKS` (on for this release): the Gluon forward's windows and softcaps
    against float64 and the tl kernel (`_assert_gluon_forward`); its launch ran."""
    switch("GLUON_FORWARD_MASKS", (backend.triton_release(),))
    _check_gluon_forward(monkeypatch, shape, mask, dtype)


# d <= 128 cases of every mask the forward takes; uneven tile counts a program
PERSISTENT_CASES = [case for case in HOPPER_CASES + FORWARD_64_CASES + HOPPER_MASK_CASES if case[0][-1] <= 128]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("programs", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", PERSISTENT_CASES, ids=str)
def test_hopper_forward_persistent_grid_runs_many_tiles_a_program(monkeypatch, switch, shape, mask, dtype, programs):
    """The persistent forward (`config.GLUON_PERSISTENT_SEEN`, causal at any length) as if the GPU
    had 1 or 3 multiprocessors: each program's K/V rings and Q and output buffers run on across many
    tiles, tiles without keys among them; 0: switched off, one tile a program. Against
    float64 and the tl kernel."""
    switch("GLUON_FORWARD_MASKS", (backend.triton_release(),))
    switch("GLUON_PERSISTENT_SEEN", (0, 1, 2) if programs else ())
    switch("GLUON_PERSISTENT_CAUSAL_N", 1 << 30)
    monkeypatch.setattr(hopper.backend, "multiprocessor_count", lambda *args: programs)
    _check_gluon_forward(monkeypatch, shape, mask, dtype)


# Two-consumer builds staggered (`hopper.staggered`): d64 and d128 (d96, d72 padded), every mask, a program
# whose first tile has no keys (lower-right, 2 of 9 tiles with keys on 3 programs), GQA.
STAGGER_CASES = [
    ((2, 4, 2, 1000, 1000, 64), fk_mask.FULL), ((2, 4, 2, 1000, 1000, 64), fk_mask.CAUSAL),
    ((1, 1, 1, 1025, 100, 128), fk_mask.Mask(right=0, lower_right=True)),
    ((1, 2, 1, 1025, 100, 64), fk_mask.Mask(right=0, lower_right=True)),
    ((1, 4, 2, 777, 1300, 96), fk_mask.Mask(left=100, right=37, lower_right=True)),
    ((1, 2, 2, 300, 700, 72), fk_mask.Mask(softcap=20.0)),
]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", STAGGER_CASES, ids=str)
def test_hopper_forward_staggered_consumers_where_switched_on(monkeypatch, switch, shape, mask, dtype, programs):
    """The second consumer held back until the first's first softmax (`config.GLUON_FORWARD_STAGGER`) at
    every two-consumer build on a persistent grid of 1 and 3 programs, a program's first tile without keys
    among them: no hang, and against float64 and the tl kernel."""
    switch("GLUON_FORWARD_MASKS", (backend.triton_release(),))
    switch("GLUON_FORWARD_STAGGER", tuple((d, seen) for d in (64, 128) for seen in (0, 1, 2)))
    monkeypatch.setattr(hopper.backend, "multiprocessor_count", lambda *args: programs)
    _check_gluon_forward(monkeypatch, shape, mask, dtype)


# Row reductions in one chain a thread (`hopper.row_chains`): d64 on two and three consumers (the half-width
# diagonal step among them), d128 windows (d96 padded), d72 softcaps, d256's 64-key steps; GQA.
ROW_CHAIN_CASES = [
    ((2, 4, 2, 1000, 1000, 64), fk_mask.FULL), ((1, 4, 2, 1500, 1500, 64), fk_mask.FULL),
    ((2, 4, 2, 1000, 1000, 64), fk_mask.CAUSAL), ((1, 2, 1, 1025, 100, 64), fk_mask.Mask(right=0, lower_right=True)),
    ((1, 4, 2, 777, 1300, 96), fk_mask.Mask(left=100, right=37, lower_right=True)),
    ((1, 2, 2, 300, 700, 72), fk_mask.Mask(softcap=20.0)), ((1, 4, 2, 600, 600, 256), fk_mask.CAUSAL),
]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("chains", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", ROW_CHAIN_CASES, ids=str)
def test_hopper_forward_row_chains_where_switched_on(monkeypatch, switch, shape, mask, dtype, chains):
    """Each row's max over a thread's scores in `chains` chains and its sum in one (`config.GLUON_FORWARD_ROW_CHAINS`)
    at every build: against float64 and the tl kernel."""
    switch("GLUON_FORWARD_MASKS", (backend.triton_release(),))
    switch("GLUON_FORWARD_ROW_CHAINS", tuple((backend.triton_release(), d, seen, consumers, chains)
                                             for d in (64, 128, 256) for seen in (0, 1, 2) for consumers in (2, 3)))
    _check_gluon_forward(monkeypatch, shape, mask, dtype)


@ON_GLUON_HOPPER
def test_hopper_forward_causal_bound_inside_a_cuda_graph_capture_replays_right(monkeypatch):
    """A causal forward on the persistent grid whose first call of its shape (the bind: the schedule table
    copied from pinned memory, `hopper.pinned_table`) runs inside a CUDA graph's capture, its kernel compiled
    by another length before: the replay gives the float64 answer on inputs written after the capture."""
    ran = _hopper_launches(monkeypatch)
    warm = make((2, 4, 2, 900, 900, 64), torch.bfloat16, requires_grad=False)
    plan.forward(*warm, fk_mask.CAUSAL, 0.125)  # compiles the kernel (not inside the capture)
    q, k, v = make((2, 4, 2, 1000, 1000, 64), torch.bfloat16, requires_grad=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.forward(q, k, v, fk_mask.CAUSAL, 0.125)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert len(ran) == 2
    _assert_gluon_forward(q, k, v, fk_mask.CAUSAL, 0.125, out, lse)


# d64's masks on three consumers (causal either alignment, rows without keys, windows, a softcap; GQA;
# padded from 40): causal up to 4096 query rows takes two (`config.GLUON_FORWARD_TWO`), windows and
# softcaps tl (`config.GLUON_FORWARD_FULL_OR_CAUSAL`).
FORWARD_64_MASK_CASES = [
    ((2, 4, 2, 1000, 1000, 64), fk_mask.CAUSAL), ((1, 4, 1, 333, 1025, 40), fk_mask.CAUSAL),
    ((1, 4, 1, 1025, 333, 64), fk_mask.Mask(right=0, lower_right=True)), ((1, 2, 2, 77, 77, 64), fk_mask.CAUSAL),
    ((1, 4, 2, 777, 1300, 64), fk_mask.Mask(left=100, right=37, lower_right=True)),
    ((1, 2, 2, 500, 500, 64), fk_mask.Mask(left=64)),
    ((1, 2, 1, 1300, 777, 40), fk_mask.Mask(right=200, lower_right=True)),
    ((1, 4, 2, 1000, 1000, 64), fk_mask.Mask(left=255, right=0, softcap=5.0)),
    ((1, 2, 1, 4096, 4096, 64), fk_mask.CAUSAL),
]


@ON_GLUON_HOPPER
@pytest.mark.parametrize("programs", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", FORWARD_64_MASK_CASES, ids=str)
def test_hopper_forward_d64_masks_where_switched_on(monkeypatch, switch, shape, mask, dtype, programs):
    """d64's Gluon forward on three consumers with every mask at any length once
    `config.GLUON_FORWARD_FULL_OR_CAUSAL` and `GLUON_FORWARD_TWO` let it, on a persistent grid of
    3 programs and one tile a program: against float64 and the tl kernel."""
    switch("GLUON_FORWARD_FULL_OR_CAUSAL", ())
    switch("GLUON_FORWARD_TWO", ())
    switch("GLUON_FORWARD_MASKS", (backend.triton_release(),))
    switch("GLUON_PERSISTENT_SEEN", (0, 1, 2) if programs else ())
    switch("GLUON_PERSISTENT_CAUSAL_N", 1 << 30)
    monkeypatch.setattr(hopper.backend, "multiprocessor_count", lambda *args: programs)
    _check_gluon_forward(monkeypatch, shape, mask, dtype)


def test_forward_mask_args_match_the_tl_kernels_scales(monkeypatch):
    """The Gluon forward's mask builds and scales (`hopper.forward_mask_args`): every key, causal, a
    window (an open side as `mask.UNBOUNDED`), a softcap with the tl kernels' `score_scales`: tanh from
    exp2 (its factor times 2 log2(e)) for fp32 and on the interpreter, the GPU's tanh.approx.f32 (the
    factor as it is) for 16-bit inputs on a GPU (`Mask.softcap_build`)."""
    log2e = 1 / math.log(2)
    for mask, seen in ((fk_mask.FULL, 0), (fk_mask.CAUSAL, 1), (fk_mask.Mask(right=0, lower_right=True), 1),
                       (fk_mask.Mask(left=8, right=0), 2), (fk_mask.Mask(right=5), 2), (fk_mask.Mask(left=3), 2)):
        builds, (qk, cap_scale, left, right) = hopper.forward_mask_args(mask, 0.125, torch.bfloat16)
        assert builds == {"SEEN": seen, "SOFTCAP": 0} and cap_scale == 1.0, mask
        assert qk == pytest.approx(0.125 * log2e)
        assert (left, right) == mask.kernel_args()[2:]
    capped = fk_mask.Mask(left=8, right=0, softcap=30.0)
    for dtype, gpu, build, inside in ((torch.float32, True, 1, 2 * log2e), (torch.bfloat16, False, 1, 2 * log2e),
                                      (torch.bfloat16, True, 2, 1.0), (torch.float16, True, 2, 1.0)):
        monkeypatch.setattr(fk_mask.backend, "is_interpreter", lambda gpu=gpu: not gpu)
        assert capped.softcap_build(dtype) == build and fk_mask.CAUSAL.softcap_build(dtype) == 0
        builds, (qk, cap_scale, left, right) = hopper.forward_mask_args(capped, 0.125, dtype)
        assert builds == {"SEEN": 2, "SOFTCAP": build} and (left, right) == (8, 0), (dtype, gpu)
        assert qk == pytest.approx(30.0 * log2e) and cap_scale == pytest.approx(inside * 0.125 / 30.0)


def test_forward_takes_the_diagonal_at_half_width_where_configured(monkeypatch):
    """The half-width diagonal step (`hopper.half_last`): causal builds of the head dims in
    `config.GLUON_FORWARD_HALF_LAST` on two consumers, padded (d40 as d64); never three consumers, full
    masks or windows; as shipped, d64 only."""
    assert fk_config.GLUON_FORWARD_HALF_LAST == ((64, 1),)
    assert hopper.half_last(1, 64, 2) and hopper.half_last(1, 40, 2)
    assert not hopper.half_last(1, 64, 3) and not hopper.half_last(0, 64, 2) and not hopper.half_last(2, 64, 2)
    assert not hopper.half_last(1, 128, 2) and not hopper.half_last(1, 256, 2)
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_HALF_LAST", ((128, 1),))
    assert hopper.half_last(1, 96, 2) and not hopper.half_last(1, 64, 2)


def test_forward_waits_for_p_v_below_the_softmax_where_configured(monkeypatch):
    """The P V wait below a branch after the softmax (`hopper.late_pv_wait`): the (padded head dim, mask
    build, consumers) builds in `config.GLUON_FORWARD_LATE_PV_WAIT`; as shipped, d64 full masks on three
    consumers (padded: d40 as d64) and no other build."""
    assert fk_config.GLUON_FORWARD_LATE_PV_WAIT == ((64, 0, 3),)
    assert hopper.late_pv_wait(0, 64, 3) and hopper.late_pv_wait(0, 40, 3)
    assert not hopper.late_pv_wait(0, 64, 2) and not hopper.late_pv_wait(1, 64, 3)
    assert not hopper.late_pv_wait(0, 128, 2) and not hopper.late_pv_wait(1, 256, 2)
    assert hopper.forward_tiles(64, 0, 4096)[2] == 3 and hopper.forward_tiles(64, 0, 1024)[2] == 2
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_LATE_PV_WAIT", ((128, 1, 2),))
    assert hopper.late_pv_wait(1, 96, 2) and not hopper.late_pv_wait(0, 64, 3)


def test_forward_reduces_rows_in_chains_where_configured(monkeypatch):
    """Each row's sum in one chain a thread and its max in `row_chains` chains (`hopper.row_chains`, 0: a tree):
    the (Triton release, padded head dim, mask build, consumers, max chains) builds of
    `config.GLUON_FORWARD_ROW_CHAINS`; as shipped, d64 (d40 padded) on two consumers: full masks on Triton 3.8 and
    3.9 (one chain), causal on 3.8 (the max in two; 3.6 and 3.7 reduce in a chain already)."""
    assert fk_config.GLUON_FORWARD_ROW_CHAINS == (((3, 8), 64, 0, 2, 1), ((3, 8), 64, 1, 2, 2), ((3, 9), 64, 0, 2, 1))
    for release in ((3, 6), (3, 7), (3, 8), (3, 9)):
        monkeypatch.setattr(hopper.backend, "triton_release", lambda release=release: release)
        assert hopper.row_chains(0, 64, 2) == hopper.row_chains(0, 40, 2) == (1 if release >= (3, 8) else 0)
        assert hopper.row_chains(1, 64, 2) == (2 if release == (3, 8) else 0)
        assert hopper.row_chains(0, 64, 3) == hopper.row_chains(1, 64, 3) == hopper.row_chains(2, 64, 2) == 0
        assert hopper.row_chains(0, 128, 2) == hopper.row_chains(0, 256, 2) == 0
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_ROW_CHAINS", (((3, 9), 128, 1, 2, 4),))
    assert hopper.row_chains(1, 96, 2) == 4 and hopper.row_chains(0, 64, 2) == 0


def test_forward_staggers_its_consumers_where_configured(monkeypatch):
    """The second consumer's late start (`hopper.staggered`): two consumers on the persistent grid, the
    (padded head dim, mask build) pairs of `config.GLUON_FORWARD_STAGGER`; as shipped, d128 (d96 padded) with
    every mask, never d64, d256, three consumers or one tile a program."""
    assert fk_config.GLUON_FORWARD_STAGGER == ((128, 0), (128, 1), (128, 2))
    assert all(hopper.staggered(seen, d, 2, True) for seen in (0, 1, 2) for d in (128, 96))
    assert not hopper.staggered(0, 128, 2, False) and not hopper.staggered(1, 128, 3, True)
    assert not hopper.staggered(0, 64, 2, True) and not hopper.staggered(1, 256, 2, True)
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_STAGGER", ((64, 1),))
    assert hopper.staggered(1, 40, 2, True) and not hopper.staggered(0, 64, 2, True)
    assert not hopper.staggered(1, 128, 2, True)


def _schedule_loads(table, programs, n_q, n_k, shift, rows=128, block_n=128):
    """Each program's tiles and its work (key blocks plus `config.GLUON_CAUSAL_TILE_BLOCKS` a tile) in a
    `hopper.causal_schedule` table."""
    n_blocks = -(-n_q // rows)
    blocks = [-(-min(n_k, max((n_blocks - k) * rows + shift, 0)) // block_n) for k in range(n_blocks)]
    owned = [table[table[p]:table[p + 1]] for p in range(programs)]
    return owned, [sum(blocks[t % n_blocks] + fk_config.GLUON_CAUSAL_TILE_BLOCKS for t in own) for own in owned]


def test_causal_schedule_lists_every_tile_once_and_ends_balanced():
    """The causal persistent forward's order (`hopper.causal_schedule`): programs + 1 offsets, then every
    tile of every head exactly once (lower-right shifts, rows without keys, fewer tiles than programs among
    them); with no tail, units of a head's r-th longest and r-th shortest tile round robin; with a tail, the
    most loaded program within a few percent of the mean where the units' last turn left it 3% above (B16 H32
    N1024), and never more loaded than the units left it."""
    assert dict(fk_config.GLUON_CAUSAL_TAIL_TILES) == {64: 6}
    for n_q, n_k, shift, heads, programs in ((1024, 1024, 0, 512, 132), (4096, 4096, 0, 128, 132),
                                             (2048, 2048, 0, 128, 132), (1000, 1500, 500, 7, 21),
                                             (300, 100, -200, 3, 9), (128, 128, 0, 1, 1), (640, 640, 0, 2, 10)):
        n_blocks = -(-n_q // 128)
        units = hopper.causal_schedule(n_q, n_k, shift, heads, programs, 128, 128, 0)
        tail = hopper.causal_schedule(n_q, n_k, shift, heads, programs, 128, 128, 6)
        for table in (units, tail):
            assert table[0] == programs + 1 and table[programs] == len(table)
            assert sorted(table[programs + 1:]) == list(range(heads * n_blocks)), (n_q, heads)
        owned, unit_loads = _schedule_loads(units, programs, n_q, n_k, shift)
        half = (n_blocks + 1) // 2
        for p in range(min(programs, 4)):  # program p: units p, p + programs, ..., each its pair of tiles
            expected = [u // half * n_blocks + k for u in range(p, heads * half, programs)
                        for k in sorted({u % half, n_blocks - 1 - u % half})]
            assert owned[p] == expected
        _, tail_loads = _schedule_loads(tail, programs, n_q, n_k, shift)
        assert sum(tail_loads) == sum(unit_loads) and max(tail_loads) <= max(unit_loads), (n_q, heads)
    _, unit_loads = _schedule_loads(hopper.causal_schedule(1024, 1024, 0, 512, 132, 128, 128, 0), 132, 1024, 1024, 0)
    _, tail_loads = _schedule_loads(hopper.causal_schedule(1024, 1024, 0, 512, 132, 128, 128, 6), 132, 1024, 1024, 0)
    mean = sum(unit_loads) / 132
    assert max(unit_loads) > 1.03 * mean and max(tail_loads) < 1.01 * mean


def _masked_reference(q, k, v, mask: fk_mask.Mask, scale: float, with_lse: bool = False):
    """float64 attention with GQA and any mask (windows of either alignment, softcap); rows that see
    no key give 0 (and a log-sum-exp of -inf)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask.softcap:
        scores = mask.softcap * torch.tanh(scores / mask.softcap)
    n_q, n_k = q.shape[2], k.shape[2]
    d = torch.arange(n_k, device=q.device) - (torch.arange(n_q, device=q.device)[:, None]
                                              + (n_k - n_q if mask.lower_right else 0))
    hidden = torch.zeros_like(d, dtype=torch.bool)
    if mask.right is not None:
        hidden |= d > mask.right
    if mask.left is not None:
        hidden |= d < -mask.left
    scores = scores.masked_fill(hidden, -math.inf)
    seen = torch.isfinite(scores).any(-1, keepdim=True)
    scores = scores.masked_fill(~seen, 0.0)  # (rows that see no key: no NaN in any gradient)
    out = torch.softmax(scores, -1) * seen @ v
    return (out, torch.logsumexp(scores, -1).where(seen[..., 0], -math.inf)) if with_lse else out


@ON_GLUON_HOPPER
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", HOPPER_CASES + ROLE_CASES, ids=str)
def test_hopper_backward_matches_the_tl_kernels_and_float64(monkeypatch, switch, shape, mask, dtype, layout):
    """dQ, dK, dV with the Gluon dK/dV kernel against float64, within the tl kernels' own error on
    the same inputs (their forced configs run tl); its launch ran."""
    switch("GLUON_FUSED_DQ", False)
    ran = _hopper_launches(monkeypatch, "bind_dkdv")
    q, k, v = make(shape, dtype, layout=layout, requires_grad=False)
    scale = 1 / math.sqrt(shape[-1])
    out, lse = plan.forward(q, k, v, mask, scale)
    grad_out = testing.randn(out.shape, dtype)
    grads = plan.backward(grad_out, None, q, k, v, out, lse, mask, scale)
    assert len(ran) == 1
    configs = tuple(fk_config.default_config(kind, shape[-1], dtype, True) for kind in (fk_config.Kind.DQ, fk_config.Kind.DKDV))
    tl_grads = plan.backward(grad_out, None, q, k, v, out, lse, mask, scale, configs=configs)
    assert len(ran) == 1
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    wants = torch.autograd.grad(_masked_reference(q64, k64, v64, mask, scale), (q64, k64, v64), grad_out.double())
    _assert_backward_close("Gluon", grads, tl_grads, wants, (q, k, v))


def _assert_backward_close(kind: str, grads, tl_grads, wants, given) -> None:
    """dQ, dK, dV against float64 within 1.1x the tl kernels' error on the same inputs, laid out
    like the inputs."""
    for name, got, tl_got, want, like in zip(("dq", "dk", "dv"), grads, tl_grads, wants, given, strict=True):
        err = (got.double() - want).norm() / want.norm()
        tl_err = (tl_got.double() - want).norm() / want.norm()
        assert err <= 1.1 * tl_err + 1e-6, f"{name}: {kind} {err:.2e} against tl {tl_err:.2e}"
        assert [st for st, n in zip(got.stride(), got.shape, strict=True) if n > 1] == \
            [st for st, n in zip(like.stride(), like.shape, strict=True) if n > 1]


@ON_GLUON_HOPPER
def test_hopper_backward_leaves_unaligned_bases_to_tl(monkeypatch, switch):
    """A K whose base is off the 16-byte grid: the tl dK/dV kernel, right gradients; aligned, Gluon."""
    switch("GLUON_FUSED_DQ", False)
    ran = _hopper_launches(monkeypatch, "bind_dkdv")
    q, v, grad_out = (testing.randn((1, 2, 300, 128), torch.bfloat16) for _ in range(3))
    storage = testing.randn((2 * 300 * 128 + 1,), torch.bfloat16)
    for k, launches in ((storage[1:].view(1, 2, 300, 128), 0), (storage[:-1].view(1, 2, 300, 128), 1)):
        out, lse = plan.forward(q, k, v, fk_mask.CAUSAL, 0.1)
        grads = plan.backward(grad_out, None, q, k, v, out, lse, fk_mask.CAUSAL, 0.1)
        assert len(ran) == launches
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        wants = torch.autograd.grad(_masked_reference(q64, k64, v64, fk_mask.CAUSAL, 0.1), (q64, k64, v64),
                                    grad_out.double())
        for name, got, want in zip(("dq", "dk", "dv"), grads, wants, strict=True):
            testing.assert_close(name, got, want, torch.bfloat16)



@ON_GLUON_HOPPER
@pytest.mark.skipif(hopper_backward.tma_reduce_add is None, reason="TMA reduce-adds: Triton >= 3.8")
@pytest.mark.parametrize("grad_lse", [False, True], ids=["", "grad_lse"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", FUSED_CASES, ids=str)
def test_hopper_5_matmul_backward_matches_the_tl_kernels_and_float64(monkeypatch, switch, shape, mask, dtype,
                                                                     layout, grad_lse):
    """dQ, dK, dV of the 5-matmul backward (dQ by TMA reduce-adds) against float64, within the tl
    kernels' own error on the same inputs, a gradient reaching the lse too; its launch ran, and
    not under torch's deterministic algorithms nor for a mask asking for determinism (the 7-matmul
    pair then, bit for bit on reruns)."""
    switch("GLUON_FUSED_DQ", True)
    ran = _hopper_launches(monkeypatch, "bind_backward")
    q, k, v = make(shape, dtype, layout=layout, requires_grad=False)
    scale = 1 / math.sqrt(shape[-1])
    out, lse = plan.forward(q, k, v, mask, scale)
    grad_out = testing.randn(out.shape, dtype)
    g_lse = testing.randn(lse.shape, torch.float32).masked_fill(~lse.isfinite(), 0.0) if grad_lse else None
    grads = plan.backward(grad_out, g_lse, q, k, v, out, lse, mask, scale)
    assert len(ran) == 1
    configs = tuple(fk_config.default_config(kind, shape[-1], dtype, True) for kind in (fk_config.Kind.DQ, fk_config.Kind.DKDV))
    tl_grads = plan.backward(grad_out, g_lse, q, k, v, out, lse, mask, scale, configs=configs)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _masked_reference(q64, k64, v64, mask, scale, with_lse=True)
    outputs, cotangents = ([ref, ref_lse], [grad_out.double(), g_lse.double()]) if grad_lse else ([ref], [grad_out.double()])
    wants = torch.autograd.grad(outputs, (q64, k64, v64), cotangents)
    _assert_backward_close("5-matmul", grads, tl_grads, wants, (q, k, v))
    if grad_lse or layout == "bnhd":
        return
    torch.use_deterministic_algorithms(True)
    try:
        first, again = (plan.backward(grad_out, None, q, k, v, out, lse, mask, scale) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    asked = dataclasses.replace(mask, deterministic=True)  # the call's own `deterministic=True`
    third = plan.backward(grad_out, None, q, k, v, out, lse, asked, scale)
    assert len(ran) == 1
    for name, a, b, c in zip(("dq", "dk", "dv"), first, again, third, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_causal_backward_sections_of_heads_fit_the_l2_budget(monkeypatch):
    """`hopper_backward.causal_section`: the KV heads whose query heads' Q, dO (and fp32 dQ sum) fit
    `config.GLUON_BWD_CAUSAL_L2_BYTES`, at least one, at most all; a budget of 0: one (head by head)."""
    monkeypatch.setattr(fk_config, "GLUON_BWD_CAUSAL_L2_BYTES", 32 << 20)
    section = hopper_backward.causal_section
    assert section(64, 1, 4096, 128, 2, True) == 8  # 4 MiB a head: 4096 rows x 128 x (2 + 2 + 4) bytes
    assert section(64, 1, 4096, 128, 2, False) == 16
    assert section(16, 4, 4096, 128, 2, True) == 2  # a KV head's 4 query heads
    assert section(64, 1, 4096, 64, 4, False) == 16
    assert section(4, 1, 1024, 128, 2, True) == 4  # all there are
    assert section(64, 1, 65536, 128, 2, True) == 1
    monkeypatch.setattr(fk_config, "GLUON_BWD_CAUSAL_L2_BYTES", 0)
    assert section(64, 1, 1024, 128, 2, True) == 1


@ON_GLUON_HOPPER
@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    hopper_backward.tma_reduce_add is None, reason="TMA reduce-adds: Triton >= 3.8"))], ids=["pair", "5-matmul"])
@pytest.mark.parametrize("mask", [fk_mask.CAUSAL, fk_mask.Mask(right=0, lower_right=True)], ids=str)
def test_causal_backward_in_sections_of_heads_matches_the_tl_kernels_and_float64(monkeypatch, switch, fused, mask):
    """A causal backward whose programs go in sections of KV heads, the last one shorter (2, 2, 1 of 5
    heads for the 5-matmul backward, 4 and 1 for the pair's dK/dV): dQ, dK, dV against float64 within
    the tl kernels' error."""
    shape = (1, 5, 5, 700, 900, 128)
    switch("GLUON_FUSED_DQ", fused)
    switch("GLUON_BWD_CAUSAL_L2_BYTES", 2 * 700 * 128 * 8 + 1)
    assert hopper_backward.causal_section(5, 1, 700, 128, 2, fused) == (2 if fused else 4)
    ran = _hopper_launches(monkeypatch, "bind_backward" if fused else "bind_dkdv")
    q, k, v = make(shape, torch.bfloat16, requires_grad=False)
    scale = 1 / math.sqrt(shape[-1])
    out, lse = plan.forward(q, k, v, mask, scale)
    grad_out = testing.randn(out.shape, torch.bfloat16)
    grads = plan.backward(grad_out, None, q, k, v, out, lse, mask, scale)
    assert len(ran) == 1
    configs = tuple(fk_config.default_config(kind, shape[-1], torch.bfloat16, True)
                    for kind in (fk_config.Kind.DQ, fk_config.Kind.DKDV))
    tl_grads = plan.backward(grad_out, None, q, k, v, out, lse, mask, scale, configs=configs)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    wants = torch.autograd.grad(_masked_reference(q64, k64, v64, mask, scale), (q64, k64, v64), grad_out.double())
    _assert_backward_close("sections", grads, tl_grads, wants, (q, k, v))


def test_backward_prep_kernel_writes_the_row_terms_and_clears_the_dq_sum():
    """The 5-matmul backward's prep (`kernels.attn_bwd_prep_kernel`, any Triton, the interpreter
    too): delta = rowsum(dO * O) - dlse and the base-2 lse (+inf where no key was seen) against
    float64, its padding rows (delta 0, lse2 +inf) to STATS_ALIGN, and every dQ-sum row cleared;
    strided O and dO, a head dim below its padding, an odd row count over several blocks (the sum's rows
    to whole Q blocks)."""
    from fk_attention import kernels

    align = int(kernels.STATS_ALIGN)
    assert fk_config.PREP_ROWS % align == 0  # its blocks cover the scratch padding
    b, h, n, d, padded = 2, 3, 77 + fk_config.PREP_ROWS, 72, 128
    out = testing.randn((b, n, h, d), torch.float16).transpose(1, 2)
    grad_out = testing.randn((b, h, n, d + 8), torch.float16)[..., :d]
    lse = testing.randn((b, h, n), torch.float32)
    lse[0, 1, 5] = -math.inf
    padded_n = -(-n // align) * align
    n_sum = hopper_backward.dq_sum_rows(n)
    for dlse in (None, testing.randn((b, h, n), torch.float32)):
        scratch = torch.full((2, b, h, padded_n), math.nan, device=lse.device)
        dq_sum = torch.full((b, h, n_sum, padded), math.nan, device=lse.device)
        kernels.attn_bwd_prep_kernel[(-(-n_sum // fk_config.PREP_ROWS) * b * h,)](
            out, grad_out, lse, lse if dlse is None else dlse, scratch[0], scratch[1], dq_sum, n, h, n_sum,
            *out.stride(), *grad_out.stride(), *lse.stride()[:2], *(lse if dlse is None else dlse).stride(),
            *scratch.stride()[1:3], HAS_DLSE=dlse is not None, HEAD_DIM=d, HEAD_DIM_PADDED=padded,
            BLOCK_M=fk_config.PREP_ROWS)
        delta = (out.double() * grad_out.double()).sum(-1) - (0.0 if dlse is None else dlse.double())
        lse2 = torch.where(lse == -math.inf, math.inf, lse.double() * math.log2(math.e))
        testing.assert_close("delta", scratch[0, ..., :n], delta, torch.float32)
        testing.assert_close("lse2", scratch[1, ..., :n].where(lse2.isfinite(), 0.0), lse2.where(lse2.isfinite(), 0.0),
                             torch.float32)
        assert torch.equal(scratch[1, ..., :n].isinf(), lse2.isinf())
        assert torch.equal(scratch[0, ..., n:], torch.zeros_like(scratch[0, ..., n:]))
        assert bool((scratch[1, ..., n:] == math.inf).all())
        assert torch.equal(dq_sum, torch.zeros_like(dq_sum))


@pytest.mark.parametrize("fragments", [False, True], ids=["in order", "fragments"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [40, 64, 128])
def test_dq_cast_kernel_puts_the_fragment_rows_in_order(dtype, d, fragments):
    """`kernels.attn_bwd_dq_cast_kernel` (any Triton, the interpreter too) reads the 5-matmul backward's fp32 dQ
    sum in order or in fragment rows (`hopper_backward.dq_sum_fields`, here laid out by torch from a sum in
    order) and writes dQ in order, cast, into strided rows; a head dim below its padding, rows past n_q
    left alone."""
    from fk_attention import kernels

    b, h, n = 2, 3, 77
    padded, n_sum = fk_layout.padded_head_dim(d), hopper_backward.dq_sum_rows(n)
    dense = testing.randn((b, h, n_sum, padded), torch.float32)
    # a block's 64 rows: warp, row + 8, lane // 4; columns: half, 8-column group, lane % 4, column pair;
    # fragment rows: half, warp, lane (lane // 4, lane % 4), then 8-column group, row + 8, column pair
    parts = dense.view(b, h, n_sum // 64, 4, 2, 8, 2, padded // 16, 4, 2)
    laid = parts.permute(0, 1, 2, 6, 3, 5, 8, 7, 4, 9).reshape(b, h, n_sum, padded).contiguous() if fragments else dense
    dq = torch.full((b, n + 5, h, d + 3), math.nan, dtype=dtype, device=dense.device)
    view = dq[:, :n, :, :d].transpose(1, 2)
    kernels.attn_bwd_dq_cast_kernel[(n_sum // 64 * b * h,)](laid, view, n, h, n_sum, *view.stride(), HEAD_DIM=d,
                                                            HEAD_DIM_PADDED=padded, FRAGMENTS=fragments)
    # within one rounding (the interpreter rounds bf16 toward zero; fp16 subnormals): a misplaced float is far off
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(view.float(), dense[:, :, :n, :d], rtol=ulp, atol=torch.finfo(dtype).tiny)
    assert bool(dq[:, n:].isnan().all()) and bool(dq[..., d:].isnan().all())


@ON_GLUON_HOPPER
def test_hopper_forward_leaves_unaligned_bases_and_other_masks_to_tl(monkeypatch, switch):
    """A base off the 16-byte grid, a window, a softcap (no release in `config.GLUON_FORWARD_MASKS`),
    a negative scale (the registered op takes one): the tl kernels, right answers."""
    switch("GLUON_FORWARD_MASKS", ())
    ran = _hopper_launches(monkeypatch)
    storage = testing.randn((1, 2, 300, 128 + 8), torch.bfloat16)
    q = storage[..., 8:]  # 16-byte base offset, strides a descriptor takes
    k, v = (testing.randn((1, 2, 300, 128), torch.bfloat16) for _ in range(2))
    q_odd = storage.flatten()[1:1 + q.numel()].view(q.shape)  # base 2 bytes off
    out = attention(q_odd, k, v, causal=True)
    testing.assert_close("out", out, reference(q_odd.double(), k.double(), v.double(), True), torch.bfloat16)
    assert ran == []
    out = attention(q, k, v, causal=True)
    testing.assert_close("out", out, reference(q.double(), k.double(), v.double(), True), torch.bfloat16)
    assert len(ran) == 1
    for kwargs in (dict(window=(64, 0)), dict(softcap=30.0)):
        attention(q, k, v, **kwargs)
    out, _ = plan.forward(q, k, v, fk_mask.CAUSAL, -0.1)
    scores = (q.double() @ k.double().transpose(-1, -2) * -0.1).masked_fill(
        torch.ones(300, 300, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    testing.assert_close("out", out, torch.softmax(scores, -1) @ v.double(), torch.bfloat16)
    assert len(ran) == 1


def test_hopper_forward_gate(monkeypatch, switch):
    """The Gluon path runs only on the Triton versions it was built for, never on the interpreter
    (where the tl kernels serve every test), and its descriptors carry their shared layout."""
    for version in ("3.6.0", "3.7.1", "3.8.0", "3.9.0"):
        assert fk_gluon.supported(version) == (hopper.gluon is not None), version
    assert not fk_gluon.supported("3.5.1") and not fk_gluon.supported("99.0.0")
    switch("GLUON_FORWARD_MASKS", ())
    q = testing.randn((1, 2, 64, 128), torch.bfloat16)
    if not testing.on_gpu():
        assert not hopper.takes(q, q, q, fk_mask.CAUSAL, 0.1)
    assert not hopper.takes(q.float(), q.float(), q.float(), fk_mask.CAUSAL, 0.1)
    assert not hopper.takes(q, q, q, fk_mask.Mask(left=8, right=0), 0.1)
    assert not hopper.takes(q, q, q, fk_mask.CAUSAL, -0.1)
    assert hopper.forward_tiles(72, 1, 64) == (128, 3, 2) and hopper.forward_tiles(192, 0, 64) == (64, 3, 2)
    # d64 (padded from 40): three consumers, but two for causal masks up to 4096 query rows, full up to 1024
    assert hopper.forward_tiles(40, 0, 1025) == hopper.forward_tiles(40, 1, 4097) == (128, 3, 3)
    assert hopper.forward_tiles(40, 1, 4096) == hopper.forward_tiles(40, 0, 1024) == (128, 3, 2)
    assert hopper.forward_tiles(40, 2, 64) == (128, 3, 3)
    assert all(stages >= 2 and consumers in (2, 3) for _, _, stages, consumers in fk_config.GLUON_FORWARD_TILES)
    # Windows and softcaps only on the releases listed (a Hopper GPU assumed, to reach the gate here).
    monkeypatch.setattr(hopper, "on_hopper", lambda *tensors: True)
    for releases, taken in (((), False), ((backend.triton_release(),), True), (((0, 1),), False)):
        switch("GLUON_FORWARD_MASKS", releases)
        for mask in (fk_mask.Mask(left=8, right=0), fk_mask.Mask(softcap=5.0)):
            assert hopper.takes(q, q, q, mask, 0.1) == taken, (releases, mask)
        assert hopper.takes(q, q, q, fk_mask.CAUSAL, 0.1)
        # d64 (`config.GLUON_FORWARD_FULL_OR_CAUSAL`): every key, or causal, only, at any length
        q64, long64 = q[..., :40], testing.randn((1, 2, 4097, 40), torch.bfloat16)
        assert hopper.takes(q64, q64, q64, fk_mask.FULL, 0.1)
        for mask in (fk_mask.CAUSAL, fk_mask.Mask(right=0, lower_right=True)):
            assert hopper.takes(q64, q64, q64, mask, 0.1), mask
            assert hopper.takes(long64, long64, long64, mask, 0.1), mask
        for mask in (fk_mask.Mask(left=8, right=0), fk_mask.Mask(softcap=5.0),
                     fk_mask.Mask(right=0, softcap=5.0)):
            assert not hopper.takes(q64, q64, q64, mask, 0.1), mask
            assert not hopper.takes(long64, long64, long64, mask, 0.1), mask
    if hopper.gluon is not None:
        from fk_runtime.launch import Descriptor

        layout = hopper.shared_layout(64, 128, torch.bfloat16)
        real = Descriptor(q, list(q.shape), list(q.stride()), [1, 1, 64, 128], layout=layout).real()
        assert real.layout == layout and list(real.block_shape) == [1, 1, 64, 128]


@pytest.mark.heavy
def test_autotuned_launch_runs_every_candidate(monkeypatch, tmp_path):
    """The GPU's autotuned path (candidates through TMA where allowed, pruning, grids from the
    chosen blocks), its picks kept on disk for the next process. On the interpreter the tuner's
    timer is replaced by one run per candidate."""
    monkeypatch.setenv(plan.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plan, "WINNERS", {})
    monkeypatch.setattr(plan, "_WINNER_FILES", {})
    plan.BOUND.clear()
    runs = [] if testing.on_gpu() else _fake_tuner_timer(monkeypatch)
    monkeypatch.setattr(plan, "should_autotune", lambda *args: True)
    monkeypatch.setattr(fk_config, "GLUON_FUSED_HEAD_DIMS", ())  # the tl backward, not Hopper's 5-matmul one
    # and the tl forward, not Hopper's Gluon one
    monkeypatch.setattr(fk_config, "GLUON_FORWARD_TILES",
                        tuple(tiles for tiles in fk_config.GLUON_FORWARD_TILES if tiles[0] != 64))
    dtype = torch.float16
    inputs = make((1, 2, 1, 150, 130, 40), dtype)
    check(lambda q, k, v: attention(q, k, v, causal=True), inputs, dtype, True)
    if not testing.on_gpu():
        tried = {kind: runs.count(kind) for kind in fk_config.Kind}
        expected = {kind: len(fk_config.candidates(kind, 40, True)) for kind in fk_config.Kind}
        assert tried == expected
    # Packed sequences tune apart (their own key and kernels).
    q, k, v = (t.detach().transpose(1, 2).flatten(0, 1)[:130].requires_grad_() for t in inputs)
    cu = torch.tensor([0, 60, 130], dtype=torch.int32, device=q.device)
    testing.assert_matches_reference(
        lambda q, k, v: attention_varlen(q, k, v, cu, cu, 70, 70, causal=True),
        lambda q, k, v: torch.cat([reference(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), True)[0]
                                   .transpose(0, 1) for a, b in ((0, 60), (60, 130))]),
        [q, k, v], dtype=dtype, names=["q", "k", "v"])
    if not testing.on_gpu():
        assert {kind: runs.count(kind) for kind in fk_config.Kind} == {kind: 2 * n for kind, n in expected.items()}
    stored = json.loads(plan.winners_file(q.device).read_text())
    assert len(stored) == 2 * len(fk_config.Kind)
    # A new process: nothing in memory, the picks read back from disk, no candidate timed again.
    monkeypatch.setattr(plan, "WINNERS", {})
    monkeypatch.setattr(plan, "_WINNER_FILES", {})
    plan.BOUND.clear()
    tuned = len(runs)
    check(lambda q, k, v: attention(q, k, v, causal=True), inputs, dtype, True)
    assert len(runs) == tuned and len(plan.WINNERS) == 0
    plan.BOUND.clear()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_log_sum_exp_and_its_gradient(causal):
    """return_lse=True: the fp32 natural-log row log-sum-exp, differentiable (what merging
    partial attentions across devices needs)."""
    inputs = make((1, 4, 2, 19, 23, 16), torch.float32)
    results = testing.check_against_reference(
        lambda q, k, v: attention(q, k, v, causal=causal, sm_scale=0.3, return_lse=True),
        lambda q, k, v: reference(q, k, v, causal, 0.3, lse=True),
        inputs, dtype=torch.float32, names=["q", "k", "v"],
    )
    assert len(results) == 5 and all(r.ok for r in results), "\n".join(map(str, results))
    _, lse = attention(*inputs, return_lse=True)
    assert lse.shape == (1, 4, 19) and lse.dtype == torch.float32


def test_merging_two_halves_by_log_sum_exp_gives_the_whole():
    q, k, v = make((1, 2, 1, 9, 40, 16), torch.float32, requires_grad=False)
    o1, l1 = attention(q, k[:, :, :17], v[:, :, :17], return_lse=True)
    o2, l2 = attention(q, k[:, :, 17:], v[:, :, 17:], return_lse=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
    testing.assert_close("merged", merged, reference(q.double(), k.double(), v.double()), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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


@pytest.mark.parametrize("shape", [(1, 2, 1, 0, 5, 16), (1, 2, 1, 4, 0, 16), (0, 2, 2, 4, 4, 16)], ids=str)
def test_empty(shape):
    """No queries or no batch: empty outputs. No keys: zeros (as SDPA), lse -inf, zero grads."""
    q, k, v = make(shape, torch.float32)
    out, lse = attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, reference(q, k, v).nan_to_num())
    assert lse.shape == q.shape[:3] and bool((lse == -math.inf).all())
    grads = torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v), strict=True))


def test_sm_scale_default_and_custom():
    q, k, v = make((1, 2, 2, 11, 13, 24), torch.float32, requires_grad=False)
    for scale in (None, 0.05, 2.0):
        ref = reference(q.double(), k.double(), v.double(), scale=scale)
        testing.assert_close(f"scale {scale}", attention(q, k, v, sm_scale=scale), ref, torch.float32)


def test_large_scores_stay_finite():
    """Scores around +-300 (scaled): the online softmax's running max keeps exp2 in range."""
    q, k, v = make((1, 1, 1, 40, 40, 16), torch.float32, requires_grad=False)
    q = q * 30
    for causal in (False, True):
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = reference(q.double(), k.double(), v.double(), causal, lse=True)
        testing.assert_close("out", out, ref, torch.float32)
        testing.assert_close("lse", lse, ref_lse, torch.float32)


def test_backward_is_deterministic():
    q, k, v = make((1, 4, 1, 40, 40, 16), torch.float16)
    g = testing.randn(q.shape, torch.float16)
    first = torch.autograd.grad(attention(q, k, v, causal=True), [q, k, v], g)
    for _ in range(2):
        again = torch.autograd.grad(attention(q, k, v, causal=True), [q, k, v], g)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_deterministic_reaches_the_backward_and_keys_the_call(monkeypatch):
    """`deterministic=True` (attention's and flash_attn's) rides in the Mask the backward binds for,
    and a call without it binds apart (the quiet key holds it): the 5-matmul backward, not
    deterministic, is then never bound (`hopper_backward.fused_serves`)."""
    from fk_attention import flash_attn as fa

    seen = []
    real = plan.bind_backward

    def spy(grad_out, grad_lse, q, k, v, out, lse, mask, *rest, **kw):
        seen.append(mask.deterministic)
        return real(grad_out, grad_lse, q, k, v, out, lse, mask, *rest, **kw)

    monkeypatch.setattr(plan, "bind_backward", spy)
    q, k, v = make((1, 2, 1, 11, 13, 16), torch.float32)
    g = testing.randn(q.shape, torch.float32)
    grads = [torch.autograd.grad(attention(q, k, v, causal=True, deterministic=d), (q, k, v), g)
             for d in (False, True, False, True)]
    assert seen == [False, True]  # each bound once, apart
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)  # (this head dim's backward is deterministic either way)
    out = fa.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, deterministic=True)
    torch.autograd.grad(out, (q, k, v), g.transpose(1, 2))
    assert seen[-1] is True
    q16 = testing.randn((1, 2, 64, 128), torch.bfloat16)
    assert not hopper_backward.fused_serves(q16, q16, q16, fk_mask.Mask(right=0, deterministic=True))
    on_hopper = testing.on_gpu() and torch.cuda.get_device_capability()[0] == 9
    assert hopper_backward.fused_serves(q16, q16, q16, fk_mask.CAUSAL) == (
        on_hopper and hopper_backward.tma_reduce_add is not None and fk_config.GLUON_FUSED_DQ)
    with pytest.raises(TypeError, match="deterministic"):
        attention(q, k, v, deterministic=1)


def test_compiled_graph_runs_the_fk_ops():
    q, k, v = make((1, 2, 1, 8, 8, 16), torch.float32)
    ops_seen = testing.compiled_graph_ops(lambda q, k, v: attention(q, k, v, causal=True), q, k, v)
    assert {"fk.attention.default", "fk.attention_backward.default"} <= ops_seen


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_registered_op_is_differentiable(mode):
    """torch.ops.fk.attention on its own (register_autograd), eager and compiled."""
    inputs = make((1, 2, 1, 13, 21, 16), torch.float32)
    fn = testing.maybe_compile(lambda q, k, v: torch.ops.fk.attention(q, k, v, 0.25, [-1.0, 0.0, 0.0, 0.0]), mode)
    results = testing.check_against_reference(
        fn, lambda q, k, v: reference(q, k, v, True, 0.25, lse=True), inputs, dtype=torch.float32,
    )
    assert all(r.ok for r in results), "\n".join(map(str, results))


@pytest.mark.parametrize("mode", testing.compile_modes())
def test_self_attention_module(mode):
    torch.manual_seed(0)
    layer = SelfAttention(64, num_heads=4, num_kv_heads=2, causal=True, bias=True, device=testing.device())
    x = testing.randn((2, 19, 64), requires_grad=True)

    def torch_layer(x, w_qkv, b_qkv, w_proj, b_proj):
        q, k, v = F.linear(x, w_qkv, b_qkv).split((64, 32, 32), dim=-1)
        q, k, v = (t.unflatten(-1, (-1, 16)).transpose(1, 2) for t in (q, k, v))
        return F.linear(reference(q, k, v, causal=True).transpose(1, 2).flatten(-2), w_proj, b_proj)

    params = [layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias]
    fn = testing.maybe_compile(lambda x, *p: layer(x), mode)
    testing.assert_matches_reference(fn, torch_layer, [x, *params], dtype=torch.float32,
                                     names=["x", "w_qkv", "b_qkv", "w_proj", "b_proj"])
    assert "num_kv_heads=2" in repr(layer)


def test_self_attention_refuses_bad_shapes_clearly():
    """Head dims the kernels refuse fail at construction; inputs of the wrong rank or width fail
    with a ValueError naming x (not inside einops or nn.Linear)."""
    with pytest.raises(ValueError, match="dim / num_heads .* head dim"):
        SelfAttention(1024, 2)  # head dim 512
    assert SelfAttention(48, 4).head_dim == 12  # any head dim up to 256
    with pytest.raises(TypeError, match="causal must be a bool"):
        SelfAttention(64, 4, causal="yes")
    layer = SelfAttention(64, 4, device=testing.device())
    for bad in (testing.randn((5, 64)), testing.randn((2, 5, 32)), testing.randn((1, 2, 5, 64))):
        with pytest.raises(ValueError, match=r"x must be \(batch, tokens, dim=64\)"):
            layer(bad)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * 64])


@pytest.mark.skipif(not testing.on_gpu(), reason="memory statistics need a GPU")
def test_memory_is_linear_in_length():
    """N = 16384: forward and backward allocate O(N) (N x N bf16 scores would be 1 GiB). One
    warm-up pass first: autotuning's do_bench allocates a 256 MiB cache-flush buffer, and under
    xdist this test may be the first in its worker to meet the shape."""
    q, k, v = make((1, 2, 1, 16384, 16384, 128), torch.bfloat16)

    def forward_backward():
        out = attention(q, k, v, causal=True)
        torch.autograd.grad(out, [q, k, v], torch.ones_like(out))

    forward_backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
    assert peak < 8 * input_bytes, f"peak {peak / 2**20:.0f} MiB for {input_bytes / 2**20:.0f} MiB of inputs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_fp8_forward(dtype, causal):
    """fp8 inputs (inference): bf16 output, on CUDA GPUs of compute capability >= 8.9; a clear
    TypeError elsewhere (the interpreter included)."""
    shape = (1, 4, 2, 300, 300, 64) if testing.on_gpu() else (1, 2, 1, 20, 20, 32)
    q, k, v = (t.to(dtype) for t in make(shape, torch.float32, requires_grad=False))
    supported, _ = fk_layout.fp8_supported()
    if not supported:
        with pytest.raises(TypeError, match="fp8 attention needs"):
            attention(q, k, v, causal=causal)
        return
    out = attention(q, k, v, causal=causal)
    assert out.dtype == fk_layout.FP8_OUTPUT_DTYPE
    ref = reference(q.double(), k.double(), v.double(), causal)
    c = testing.Comparison("fp8 out", testing.rel_error(out, ref), FP8_TOLERANCE[dtype])
    assert c.ok, str(c)


@pytest.mark.parametrize(
    "shapes,dtypes,error,match",
    [
        (((1, 2, 8, 16), (1, 2, 8, 24), (1, 2, 8, 24)), None, ValueError, "head dim"),
        (((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), None, ValueError, "multiple of"),
        (((1, 2, 8, 0),) * 3, None, ValueError, "from 1 to 256"),
        (((1, 2, 8, 264),) * 3, None, ValueError, "from 1 to 256"),
        (((1, 2, 8, 16), (1, 2, 9, 16), (1, 2, 8, 16)), None, ValueError, "one shape"),
        (((2, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), None, ValueError, "batch size"),
        (((1, 2, 8, 16),) * 3, (torch.float32, torch.float16), TypeError, "one dtype"),
        (((1, 2, 8, 16),) * 3, (torch.float64, torch.float64), TypeError, "dtype in"),
        (((2, 8, 16), (2, 8, 16), (2, 8, 16)), None, ValueError, "at least 4 dims"),
        (((1, 1, 2, 8, 16),) * 3, None, ValueError, "at most 4 dims"),
    ],
)
def test_bad_inputs_raise_clear_errors(shapes, dtypes, error, match):
    dtypes = dtypes or (torch.float32, torch.float32)
    q = testing.randn(shapes[0], dtypes[0])
    k, v = testing.randn(shapes[1], dtypes[1]), testing.randn(shapes[2], dtypes[1])
    with pytest.raises(error, match=match):
        attention(q, k, v)


def test_bad_arguments_raise_clear_errors():
    q = testing.randn((1, 1, 4, 16))
    with pytest.raises(ValueError, match="one device"):
        attention(q, torch.ones(1, 1, 4, 16, device="meta"), torch.ones(1, 1, 4, 16, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention(q, q.tolist(), q)
    for scale in (0.0, -1.0):
        with pytest.raises(ValueError, match="sm_scale"):
            attention(q, q, q, sm_scale=scale)
    if FP8_DTYPES:
        f8 = q.to(FP8_DTYPES[0]).requires_grad_()
        with pytest.raises(ValueError, match="forward-only"):
            attention(f8, f8, f8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        SelfAttention(64, num_heads=4, num_kv_heads=3)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        SelfAttention(64, num_heads=True)  # used to build one head
    # Past what fp32 holds (the kernels scale in fp32): NaN outputs before, refused now.
    with pytest.raises(ValueError, match="sm_scale must be at most"):
        attention(q, q, q, sm_scale=1e39)
    with pytest.raises(ValueError, match="softcap must be at most"):
        attention(q, q, q, softcap=1e39)

"""Every op defined through fk_runtime.ops.define honours PyTorch's contracts: `torch.library.opcheck`
on each registered op (schema, fake, autograd registration, AOT dispatch), and `torch.func.grad`,
`vmap` and `jacrev` over each public function agree with torch's own results (float64 reference
on fresh random inputs)."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from fk_runtime.harness import testing

from fk_attention import attention, attention_varlen, attention_with_kvcache
from fk_layernorm import layer_norm, rms_norm
from fk_softmax import log_softmax, softmax
from fk_weightedsum import weighted_sum


def _x(*shape, requires_grad=False):
    return testing.randn(shape, torch.float32, requires_grad=requires_grad)


def _qkv(requires_grad=False):
    q = testing.randn((1, 4, 9, 16), torch.float32, requires_grad=requires_grad)
    k, v = (testing.randn((1, 2, 11, 16), torch.float32, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


def _opcheck_cases():
    """(registered op, args) for every forward and backward op: forwards with inputs that require
    grad (their autograd formula is checked too), backwards without (they are first-order)."""
    x, w, b = _x(5, 24, requires_grad=True), _x(24, requires_grad=True), _x(24, requires_grad=True)
    q, k, v = _qkv(requires_grad=True)
    y = softmax(x.detach())
    out, lse = attention(q.detach(), k.detach(), v.detach(), return_lse=True)
    # Packed: three sequences (query lengths 4, 0, 6; key lengths 7, 3, 5), GQA 4:2.
    cu_q = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device=testing.device())
    cu_k = torch.tensor([0, 7, 10, 15], dtype=torch.int32, device=testing.device())
    qp = testing.randn((10, 4, 16), torch.float32, requires_grad=True)
    kp, vp = (testing.randn((15, 2, 16), torch.float32, requires_grad=True) for _ in range(2))
    outp, lsep = attention_varlen(qp.detach(), kp.detach(), vp.detach(), cu_q, cu_k, 6, 7, return_lse=True)
    stats = torch.ops.fk.norm(x.detach(), w.detach(), b.detach(), 1e-5, False, False, True)[1]
    fk = torch.ops.fk
    return {
        "softmax": (fk.softmax.default, (x, 1, True, False)),
        "softmax_backward": (fk.softmax_backward.default, (y, _x(5, 24), 1, False)),
        "norm": (fk.norm.default, (x, w, b, 1e-5, False, False, True)),
        "norm rms": (fk.norm.default, (x, w, None, 1e-6, True, False, True)),
        "norm_backward": (fk.norm_backward.default, (_x(5, 24), x.detach(), w.detach(), b.detach(), stats,
                                                     False, False)),
        "weighted_sum": (fk.weighted_sum.default, (x, w)),
        "weighted_sum_backward": (fk.weighted_sum_backward.default, (_x(5), x.detach(), w.detach())),
        "attention": (fk.attention.default, (q, k, v, 0.25, [-1.0, 0.0, 0.0, 0.0])),
        "attention window softcap": (fk.attention.default, (q, k, v, 0.25, [3.0, 1.0, 1.0, 5.0])),
        "attention_backward": (fk.attention_backward.default,
                               (testing.randn(out.shape), None, q.detach(), k.detach(), v.detach(), out,
                                lse, 0.25, [-1.0, 0.0, 0.0, 0.0])),
        "attention_varlen": (fk.attention_varlen.default,
                             (qp, kp, vp, cu_q, cu_k, 6, 7, 0.25, [-1.0, 0.0, 1.0, 0.0])),
        "attention_varlen_backward": (fk.attention_varlen_backward.default,
                                      (testing.randn(outp.shape), testing.randn(lsep.shape), qp.detach(),
                                       kp.detach(), vp.detach(), outp, lsep, cu_q, cu_k, 6, 7, 0.25,
                                       [2.0, -1.0, 0.0, 0.0])),
    }


OPCHECK = list(_opcheck_cases())


@pytest.mark.parametrize("name", OPCHECK)
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_registered_ops_check_their_inputs():
    """torch.ops.fk.* called directly (not through the checked public functions) still refuse
    mixed dtypes: a plan bound for one dtype is never reused for another."""
    x, w = _x(4, 8), _x(8)
    torch.ops.fk.weighted_sum(x, w)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.fk.weighted_sum(x, w.double())
    with pytest.raises(TypeError, match="one dtype"):
        torch.ops.fk.weighted_sum(x, w.half())
    q, k, v = _qkv()
    torch.ops.fk.attention(q, k, v, 0.25, [-1.0, -1.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.fk.attention(q, k.double(), v, 0.25, [-1.0, -1.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="one dtype"):
        torch.ops.fk.attention(q, k.half(), v, 0.25, [-1.0, -1.0, 0.0, 0.0])
    # Index tensors: int32 only, read through their strides (the public functions' checks skipped).
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, k))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32, device=q.device)
    strided = [torch.stack([cu, cu.flip(0)], 1)[:, 0] for cu in (cu_q, cu_k)]
    args = (5, 6, 0.25, [-1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(torch.ops.fk.attention_varlen(qp, kp, vp, *strided, *args),
                               torch.ops.fk.attention_varlen(qp, kp, vp, cu_q, cu_k, *args))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        torch.ops.fk.attention_varlen(qp, kp, vp, cu_q.long(), cu_k, *args)
    cache = testing.randn((1, 2, 8, 16), torch.float32)
    lengths = torch.tensor([[5, 1]], dtype=torch.int32, device=q.device)[:, 0]
    kv_args = (None, None, None, 0.25, [-1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(torch.ops.fk.attention_with_kvcache(q[:, :, :1], cache, cache, lengths, *kv_args),
                               torch.ops.fk.attention_with_kvcache(q[:, :, :1], cache, cache, lengths.contiguous(),
                                                                   *kv_args))
    with pytest.raises(TypeError, match="cache_seqlens must have dtype int32"):
        torch.ops.fk.attention_with_kvcache(q[:, :, :1], cache, cache, lengths.long(), *kv_args)


def test_registered_ops_refuse_malformed_inputs():
    """torch.ops.fk.* called directly get the public functions' shape checks (once per bound plan):
    a short weight, mismatched batches, heads or lengths, too few bounds or lengths are refused
    with an error naming the argument, never read past their end (the kernels read raw memory)."""
    x, w = _x(3, 8), _x(8)
    cases = {
        "weight short": (lambda: torch.ops.fk.weighted_sum(x, _x(16)[:4]), "weight"),
        "weight 2-D": (lambda: torch.ops.fk.weighted_sum(x, _x(2, 4)), "weight"),
        "grad_y shape": (lambda: torch.ops.fk.weighted_sum_backward(_x(5), x, w), "grad_y"),
        "softmax causal dim 0": (lambda: torch.ops.fk.softmax(x, 0, True, False), "dim"),
        "softmax dim range": (lambda: torch.ops.fk.softmax(x, 5, False, False), "dim"),
        "softmax int": (lambda: torch.ops.fk.softmax(torch.ones(3, 8, dtype=torch.int32, device=x.device), 1,
                                                     False, False), "x"),
        "softmax grad_y": (lambda: torch.ops.fk.softmax_backward(x, _x(3, 4), 1, False), "grad_y"),
        "norm weight": (lambda: torch.ops.fk.norm(x, _x(4), None, 1e-5, True, False, True), "weight"),
        "norm eps": (lambda: torch.ops.fk.norm(x, None, None, -1.0, True, False, True), "eps"),
        "norm stats": (lambda: torch.ops.fk.norm_backward(x, x, w, None, _x(1, 2), True, False), "stats"),
    }
    q, k, v = _qkv()
    long_q = _x(1, 4, 80, 16)  # past the decode path's query rows: the dense plan
    args = (0.25, [-1.0, -1.0, 0.0, 0.0])
    for name, query in (("decode", q), ("dense", long_q)):
        cases |= {
            f"{name} batch": (lambda query=query: torch.ops.fk.attention(torch.cat([query] * 2), k, v, *args), "batch"),
            f"{name} v short": (lambda query=query: torch.ops.fk.attention(query, k, v[:, :, :5], *args), "k and v"),
            f"{name} heads": (lambda query=query: torch.ops.fk.attention(query[:, :3], k, v, *args), "heads"),
            f"{name} head dim": (lambda query=query: torch.ops.fk.attention(query, _x(1, 2, 11, 32), _x(1, 2, 11, 32),
                                                                           *args), "head dim"),
        }
    out, lse = torch.ops.fk.attention(q, k, v, *args)
    cases["attention lse"] = (lambda: torch.ops.fk.attention_backward(out, None, q, k, v, out, lse[:, :, :4], 0.25,
                                                                      [-1.0, -1.0, 0.0, 0.0]), "lse")
    cases["attention grad_out"] = (lambda: torch.ops.fk.attention_backward(out[:, :, :4], None, q, k, v, out, lse,
                                                                           0.25, [-1.0, -1.0, 0.0, 0.0]), "grad_out")
    qp, kp = (t[0].transpose(0, 1).contiguous() for t in (q, k))
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device=q.device) for b in ([0, 4, 9], [0, 5, 11]))
    cases["cu_seqlens_k short"] = (lambda: torch.ops.fk.attention_varlen(qp, kp, kp, cu_q, cu_k[:2], 5, 6, *args),
                                   "cu_seqlens_k")
    cache, lengths = _x(1, 2, 8, 16), torch.tensor([5], dtype=torch.int32, device=q.device)
    kv = (None, None, None, 0.25, [-1.0, 0.0, 1.0, 0.0])
    cases["kvcache lengths"] = (lambda: torch.ops.fk.attention_with_kvcache(q[:, :, :1], cache, cache,
                                                                            lengths[:0], *kv), "cache_seqlens")
    cases["kvcache new rows"] = (lambda: torch.ops.fk.attention_with_kvcache(
        q[:, :, :1], cache, cache, lengths, _x(1, 1, 1, 16), _x(1, 1, 1, 16), *kv[2:]), "k must be")
    # A plan bound for good inputs is not reused for ones that differ where the check looks.
    torch.ops.fk.norm_backward(x, x, w, None, _x(1, 3), True, False)
    cases["norm stats dtype, plan bound"] = (
        lambda: torch.ops.fk.norm_backward(x, x, w, None, _x(1, 3).half(), True, False), "stats")
    for name, (call, argument) in cases.items():
        with pytest.raises((ValueError, TypeError), match=argument):
            call()
        print("refused:", name)


def _flag_calls():
    x = _x(3, 8)
    q, k, v = _qkv()
    return {
        "softmax causal": lambda flag: softmax(x, causal=flag),
        "layer_norm stable": lambda flag: layer_norm(x, stable=flag),
        "attention causal": lambda flag: attention(q, k, v, causal=flag),
        "attention return_lse": lambda flag: attention(q, k, v, return_lse=flag),
    }


@pytest.mark.parametrize("name", list(_flag_calls()))
def test_flags_take_bools_only(name):
    """A truthy string or a tensor is refused with a TypeError naming the flag (as SDPA refuses a
    non-bool is_causal), where it used to switch the option on; NumPy bools count as bools."""
    call = _flag_calls()[name]
    flag = name.split()[-1]
    for bad in ("False", "no", 1, torch.tensor(False)):
        # attention's causal also takes the strings "upper_left" and "lower_right": others are a
        # ValueError there.
        error = ValueError if name == "attention causal" and isinstance(bad, str) else TypeError
        with pytest.raises(error, match=flag):
            call(bad)
    numpy = pytest.importorskip("numpy")
    call(numpy.bool_(False))
    call(False)


def _reference_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


# name: (fk function, torch function, inputs of one example (float64 reference is computed from
# them), how vmap batches the inputs)
FUNCTIONS = {
    "softmax": (lambda x: softmax(x, -1), lambda x: torch.softmax(x, -1), lambda: [_x(3, 10)]),
    "log_softmax dim 0": (lambda x: log_softmax(x, 0), lambda x: torch.log_softmax(x, 0), lambda: [_x(3, 10)]),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (12,), w, b),
                   lambda: [_x(4, 12), _x(12), _x(12)]),
    "rms_norm": (lambda x, w: rms_norm(x, w), lambda x, w: F.rms_norm(x, (12,), w, 1e-6),
                 lambda: [_x(4, 12), _x(12)]),
    "weighted_sum": (weighted_sum, lambda x, w: x @ w, lambda: [_x(4, 12), _x(12)]),
    "attention": (lambda q, k, v: attention(q, k, v, causal=True), _reference_attention, lambda: list(_qkv())),
}


def _loss(fn):
    return lambda *args: (fn(*args) ** 2).sum()


@pytest.mark.parametrize("name", FUNCTIONS)
def test_func_grad_matches_torch(name):
    fk_fn, torch_fn, make = FUNCTIONS[name]
    inputs = make()
    argnums = tuple(range(len(inputs)))
    got = torch.func.grad(_loss(fk_fn), argnums=argnums)(*inputs)
    want = torch.func.grad(_loss(torch_fn), argnums=argnums)(*[t.double() for t in inputs])
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        testing.assert_close(f"grad {i}", g, r, torch.float32)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_vmap_matches_torch(name):
    fk_fn, torch_fn, make = FUNCTIONS[name]
    batch = [make() for _ in range(3)]
    stacked = [torch.stack(parts) for parts in zip(*batch, strict=True)]
    got = torch.func.vmap(fk_fn)(*stacked)
    want = torch.stack([torch_fn(*[t.double() for t in inputs]) for inputs in batch])
    testing.assert_close("vmap", got, want, torch.float32)


@pytest.mark.parametrize("name", ["softmax", "rms_norm", "weighted_sum"])
def test_jacrev_matches_torch(name):
    fk_fn, torch_fn, make = FUNCTIONS[name]
    inputs = make()
    got = torch.func.jacrev(fk_fn)(*inputs)
    want = torch.func.jacrev(torch_fn)(*[t.double() for t in inputs])
    testing.assert_close("jacobian", got, want, torch.float32)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_forward_mode_ad_raises(name):
    """Forward-mode AD (dual tensors) is not supported: it raises rather than drop the tangent."""
    fk_fn, _, make = FUNCTIONS[name]
    inputs = make()
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(inputs[0], torch.randn_like(inputs[0]))
        with pytest.raises(RuntimeError, match="jvp"):
            fk_fn(dual, *inputs[1:])


def test_vmap_of_grad_matches_torch():
    """Per-example gradients, the usual torch.func pattern."""
    w = _x(12)
    xs = _x(5, 4, 12)
    got = torch.func.vmap(torch.func.grad(_loss(rms_norm), argnums=1), in_dims=(0, None))(xs, w)
    ref = torch.func.grad(_loss(lambda x, w: F.rms_norm(x, (12,), w, 1e-6)), argnums=1)
    want = torch.stack([ref(x.double(), w.double()) for x in xs])
    testing.assert_close("per-example grad", got, want, torch.float32)


def _negated(t: torch.Tensor) -> torch.Tensor:
    """t's values, stored negated with the lazy negation bit set (as `z.conj().imag` gives them)."""
    view = torch._neg_view(-t.detach()).requires_grad_(t.requires_grad)
    assert view.is_neg() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("name", FUNCTIONS)
def test_negated_views_read_as_their_values(name):
    """Inputs with the negation bit (their memory holds -x) and an upstream gradient with it give
    torch's results and gradients, as the dispatcher's resolution would: the kernels read memory as
    stored and used to compute on -x."""
    fk_fn, torch_fn, make = FUNCTIONS[name]
    inputs = [t.requires_grad_() for t in make()]
    views = [_negated(t) for t in inputs]
    got = fk_fn(*views)
    want = torch_fn(*[t.detach().double().requires_grad_() for t in inputs])
    testing.assert_close("out", got, want, torch.float32)
    grad_out = testing.randn(tuple(got.shape), torch.float32)
    got_grads = torch.autograd.grad(fk_fn(*inputs), inputs, _negated(grad_out))
    reference = [t.detach().double().requires_grad_() for t in inputs]
    want_grads = torch.autograd.grad(torch_fn(*reference), reference, grad_out.double())
    for i, (g, r) in enumerate(zip(got_grads, want_grads, strict=True)):
        testing.assert_close(f"grad {i}", g, r, torch.float32)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_sparse_and_nested_inputs_are_refused(name):
    fk_fn, _, make = FUNCTIONS[name]
    inputs = make()
    with pytest.raises(TypeError, match="must be a dense .strided. tensor, got a sparse_coo one"):
        fk_fn(inputs[0].to_sparse(), *inputs[1:])
    if inputs[0].dim() >= 2:
        nested = torch.nested.nested_tensor(list(inputs[0].unbind(0)))
        with pytest.raises(TypeError, match="must be a dense .strided. tensor, got a nested one"):
            fk_fn(nested, *inputs[1:])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_compiled_without_grad_matches_torch(name, backend):
    """torch.compile(fullgraph=True) where nothing requires grad (inference, a frozen model) and
    under no_grad: Dynamo used to hand the autograd.Function's context to the op as an input."""
    fk_fn, torch_fn, make = FUNCTIONS[name]
    inputs = make()
    want = torch_fn(*[t.double() for t in inputs])
    torch._dynamo.reset()
    compiled = torch.compile(fk_fn, backend=backend, fullgraph=True)
    testing.assert_close("out", compiled(*inputs), want, torch.float32)
    with torch.no_grad():
        testing.assert_close("out under no_grad", compiled(*[t.requires_grad_() for t in inputs]), want,
                             torch.float32)


def test_outputs_are_not_views():
    """Outputs made as views of the op's own buffers (a (B, N, H, D) buffer seen as (B, H, N, D), a
    row of a sum) are tensors of their own: an in-place change is allowed as on torch's outputs (it
    raised "is a view and is being modified inplace"); where the backward saved the output (attention,
    as SDPA), autograd's version check refuses the change, as it does for SDPA."""
    x, w = _x(4, 16, requires_grad=True), _x(16, requires_grad=True)
    y = weighted_sum(x, w)
    y.add_(1)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), w)[0], x.detach().sum(0))
    q = testing.randn((1, 8, 2, 16), torch.float32).transpose(1, 2).requires_grad_()
    k = _x(1, 2, 8, 16, requires_grad=True)
    out = attention(q, k, k)
    assert not out._is_view() and out.stride() == q.stride()
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_outputs_without_autograd_are_not_views():
    """With autograd recording nothing (no_grad), outputs are tensors of their own too: an in-place
    change later, with grad enabled, is allowed as on torch's outputs (it raised "a view was
    created in no_grad mode")."""
    bias = _x(requires_grad=True)
    q = testing.randn((1, 8, 2, 16), torch.float32).transpose(1, 2)
    k = _x(1, 2, 8, 16)
    cache, lengths = _x(1, 2, 8, 16), torch.tensor([5], dtype=torch.int32, device=k.device)
    with torch.no_grad():
        outs = [weighted_sum(_x(4, 16), _x(16)), softmax(_x()), attention(q, k, k),
                attention(q[:, :, :1], k, k),
                attention_with_kvcache(q[:, :, :1], cache, cache.clone(), lengths, causal=True)]
    for out in outs:
        assert not out._is_view()
        out.add_(bias)


def test_meta_tensors_give_shapes():
    """Tensors on the meta device (a model built there, a shape-only dry run) go to the registered
    ops' fakes, forward and backward, as torch's ops take them (they were refused: "must be on a
    cpu device")."""
    def meta(*shape, grad=False):
        return torch.randn(*shape, device="meta", requires_grad=grad)

    x, w = meta(4, 16, grad=True), meta(16, grad=True)
    layer_norm(x, w).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    q = meta(1, 4, 80, 16, grad=True)
    attention(q, meta(1, 2, 80, 16), meta(1, 2, 80, 16), causal=True).sum().backward()
    assert q.grad.shape == q.shape and q.grad.is_meta
    assert softmax(meta(2, 8), causal=True).shape == (2, 8)
    assert weighted_sum(meta(2, 8), meta(8)).shape == (2,)
    lengths = torch.zeros(1, dtype=torch.int32, device="meta")
    assert attention_with_kvcache(meta(1, 2, 1, 16), meta(1, 2, 8, 16), meta(1, 2, 8, 16), lengths).is_meta


def test_vmap_over_an_empty_batch():
    """vmap over a batch of 0 gives an empty batch of results, as torch's ops do (it raised IndexError)."""
    x, w = _x(0, 3, 8), _x(8)
    assert torch.func.vmap(softmax)(x).shape == (0, 3, 8)
    assert torch.func.vmap(weighted_sum, (0, None))(x, w).shape == (0, 3)
    assert torch.func.vmap(rms_norm)(x).shape == (0, 3, 8)


def test_saved_tensors_in_other_strides_give_the_same_gradients():
    """A saved-tensor hook may hand the backward its statistics (attention's log-sum-exp, the
    norms' rows) in other strides: the gradients do not change (they were read as contiguous).
    The hook relays out the saved inputs too, which may pick other kernels (on Hopper, the tl
    ones for a head dim of stride > 1): equal to rounding, not bit for bit."""

    def relayout(t):  # same values, transposed storage
        return t.mT.contiguous().mT if t.dim() >= 2 else t

    q, k, v = _qkv(requires_grad=True)
    x, w = _x(6, 24, requires_grad=True), _x(24, requires_grad=True)
    for fn, inputs in ((lambda q, k, v: attention(q, k, v, causal=True, return_lse=True)[1].exp().sum()
                        + attention(q, k, v).sum(), (q, k, v)),
                       (lambda x, w: (layer_norm(x, w) * x).sum(), (x, w))):
        plain = torch.autograd.grad(fn(*inputs), inputs)
        with torch.autograd.graph.saved_tensors_hooks(relayout, lambda t: t):
            hooked = torch.autograd.grad(fn(*inputs), inputs)
        for a, b in zip(plain, hooked, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_calls_with_one_tensor_twice():
    """An input passed twice (`attention(q, kv, kv)`, `cu_seqlens` for both sides, `layer_norm(x, w,
    w)`) compiles under fullgraph with inputs that require grad (Dynamo refused one tensor as two
    Function inputs) and matches torch's values and gradients."""
    torch._dynamo.reset()
    q, kv = _x(1, 2, 8, 16, requires_grad=True), _x(1, 2, 8, 16, requires_grad=True)
    out = torch.compile(lambda q, kv: attention(q, kv, kv, causal=True), backend="aot_eager", fullgraph=True)(q, kv)
    q64, kv64 = (t.detach().double().requires_grad_() for t in (q, kv))
    want = F.scaled_dot_product_attention(q64, kv64, kv64, is_causal=True)
    testing.assert_close("out", out, want, torch.float32)
    for got, exact in zip(torch.autograd.grad(out.sum(), (q, kv)), torch.autograd.grad(want.sum(), (q64, kv64)),
                          strict=True):
        testing.assert_close("grad", got, exact, torch.float32)
    x, w = _x(3, 8, requires_grad=True), _x(8, requires_grad=True)
    y = torch.compile(lambda x, w: layer_norm(x, w, w), backend="aot_eager", fullgraph=True)(x, w)
    testing.assert_close("layer_norm", y, F.layer_norm(x.double(), (8,), w.double(), w.double()), torch.float32)


def test_strict_export_keeps_the_gradients():
    """torch.export with strict=True records the registered ops with their autograd formula: the
    exported module's parameters get gradients (they came back None: the Function ran under
    no-grad tracing)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.scale = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return rms_norm(self.lin(x), self.scale) + x

    block = Block().to(testing.device())
    exported = torch.export.export(block, (_x(3, 8),), strict=True).module()
    exported(_x(3, 8)).sum().backward()
    grads = dict(exported.named_parameters())
    assert all(p.grad is not None for p in grads.values()), [n for n, p in grads.items() if p.grad is None]


def test_autocast_takes_inputs_as_torch_does():
    """Under torch.autocast, attention and weighted_sum take their inputs in autocast's dtype, as
    SDPA and `x @ w` do (mixed fp32/bf16 inputs raised "tensors must share one dtype": RoPE'd fp32
    q and k beside a bf16 v in a transformers model); the norms and softmax keep their dtypes."""
    device = testing.device().type
    q, k = _x(1, 2, 8, 16), _x(1, 2, 8, 16)
    v = _x(1, 2, 8, 16).to(torch.bfloat16)
    x, w = _x(4, 16).to(torch.bfloat16), _x(16)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == want.dtype == torch.bfloat16
        y = weighted_sum(x, w)
        assert y.dtype == (x @ w).dtype == torch.bfloat16
    reference = F.scaled_dot_product_attention(*(t.to(torch.bfloat16).double() for t in (q, k, v)), is_causal=True)
    testing.assert_close("attention", out, reference, torch.bfloat16)
    testing.assert_close("weighted_sum", y, x.double() @ w.to(torch.bfloat16).double(), torch.bfloat16)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_legacy_batched_gradients_raise_clearly(name):
    """autograd's legacy vmap (is_grads_batched=True) reached the kernels with batched tensors
    ("Cannot access storage of BatchedTensorImpl"); it is refused, pointing at torch.func."""
    fk_fn, _, make = FUNCTIONS[name]
    inputs = [t.requires_grad_() for t in make()]
    out = fk_fn(*inputs)
    with pytest.raises(RuntimeError, match="legacy vmap"):
        torch.autograd.grad(out, inputs, testing.randn((2, *out.shape), torch.float32), is_grads_batched=True)


LEAK_CALLS = {  # inputs' shapes (int32 tensors given as lists), the call
    "attention": ([(1, 2, 80, 16)] * 3, lambda q, k, v: attention(q, k, v, causal=True)),
    "attention decode": ([(1, 2, 1, 16), (1, 2, 8, 16), (1, 2, 8, 16)], lambda q, k, v: attention(q, k, v)),
    "attention_with_kvcache": ([(1, 2, 1, 16), (1, 2, 8, 16), (1, 2, 8, 16), [5]],
                               lambda q, k, v, n: attention_with_kvcache(q, k, v, n, causal=True)),
    "attention_varlen": ([(10, 2, 16)] * 3 + [[0, 4, 10]],
                         lambda q, k, v, cu: attention_varlen(q, k, v, cu, cu, 6, 6, causal=True)),
    "layer_norm": ([(4, 32), (32,)], lambda x, w: layer_norm(x, w)),
    "rms_norm": ([(4, 32), (32,)], lambda x, w: rms_norm(x, w)),
    "softmax": ([(4, 32)], lambda x: softmax(x)),
    "weighted_sum": ([(4, 32), (32,)], lambda x, w: weighted_sum(x, w)),
}


@pytest.mark.parametrize("name", LEAK_CALLS)
def test_bound_plans_keep_no_caller_tensor_alive(name):
    """The plans an op binds on its first call, and keeps, hold no tensor of that call: one kept
    alive leaks memory, and under torch.compile's CUDA graphs (mode="reduce-overhead", as
    transformers' static-cache generation compiles) a plan first bound inside the graph left a
    live pool allocation that the graph refused (the decode plan kept the first call's q)."""
    shapes, call = LEAK_CALLS[name]
    inputs = [torch.tensor(s, dtype=torch.int32, device=testing.device()) if isinstance(s, list)
              else _x(*s, requires_grad=name != "attention_with_kvcache") for s in shapes]
    alive = [weakref.ref(t) for t in inputs]
    out = call(*inputs)
    if out.requires_grad:
        out.sum().backward()
    del inputs, out
    gc.collect()
    assert [i for i, ref in enumerate(alive) if ref() is not None] == [], "a bound plan holds a caller's tensor"

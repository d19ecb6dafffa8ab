"""swap_norms: torch's and transformers-style norms replaced in place by fk's, keeping their very
Parameters and eps, outputs and gradients unchanged; norms fk does not compute alike left alone,
named in a warning."""

import warnings

import pytest
import torch
from fk_runtime.harness import testing

from fk_layernorm import LayerNorm, RMSNorm, swap_norms

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
D = 48


class LlamaStyleRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm (and Mistral's, Qwen2's, ...), as written there."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class GemmaStyleRMSNorm(torch.nn.Module):
    """transformers' GemmaRMSNorm: x / rms(x) * (1 + weight), weight starting at 0."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class CenteredLayerNorm(torch.nn.LayerNorm):
    """A torch LayerNorm subclass computing something else (no division by the std)."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) * self.weight + self.bias


def model(dtype):
    """Norms of every kind fk takes, two it does not, and a linear layer it must leave alone."""
    return torch.nn.ModuleDict({
        "ln": torch.nn.LayerNorm(D, eps=1e-4),
        "ln_no_bias": torch.nn.LayerNorm(D, bias=False),
        "ln_plain": torch.nn.LayerNorm(D, elementwise_affine=False),
        "rms": torch.nn.RMSNorm(D, eps=1e-5),
        "rms_default_eps": torch.nn.RMSNorm(D),
        "blocks": torch.nn.ModuleList([LlamaStyleRMSNorm(D, eps=1e-5), torch.nn.Linear(D, D)]),
        "gemma": GemmaStyleRMSNorm(D),
        "ln_2d": torch.nn.LayerNorm((4, D // 4)),
        "centered": CenteredLayerNorm(D),
    }).to(testing.device(), dtype)


SWAPPED = {"ln": LayerNorm, "ln_no_bias": LayerNorm, "ln_plain": LayerNorm, "rms": RMSNorm,
           "rms_default_eps": RMSNorm, "blocks.0": RMSNorm}
KEPT = ["gemma", "ln_2d", "centered", "blocks.1"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_keeps_parameters_and_outputs(dtype):
    net = model(dtype)
    for p in net.parameters():  # away from the ones / zeros they start at
        p.data.copy_(testing.randn(p.shape, dtype))
    before = dict(net.named_modules())
    params = dict(net.named_parameters())
    x = testing.randn((3, 5, D), dtype)
    expected = {name: before[name](x) for name in SWAPPED}

    with pytest.warns(UserWarning, match="swap_norms left") as caught:
        assert swap_norms(net) == len(SWAPPED)
    message = str(caught[0].message)
    for name in ("gemma (GemmaStyleRMSNorm)", "ln_2d (LayerNorm)", "centered (CenteredLayerNorm)"):
        assert name in message

    after = dict(net.named_modules())
    for name, kind in SWAPPED.items():
        old, new = before[name], after[name]
        assert type(new) is kind
        assert new.eps == getattr(old, "variance_epsilon", getattr(old, "eps", None))
        for pname, p in old.named_parameters():
            assert getattr(new, pname) is p
        testing.assert_close(f"{name} output", new(x), expected[name], dtype)
    assert after["ln_no_bias"].bias is None and after["ln_plain"].weight is None
    for name in KEPT:
        assert after[name] is before[name]
    # The same Parameter objects: an optimizer built before the swap still trains them.
    assert dict(net.named_parameters()) == params


def test_swapped_gradients_reach_the_same_parameters():
    dtype = torch.float32
    norm = LlamaStyleRMSNorm(D, eps=1e-5).to(testing.device())
    norm.weight.data.copy_(testing.randn((D,), dtype))
    net = torch.nn.Sequential(norm)
    x = testing.randn((4, D), dtype, requires_grad=True)
    grad_out = testing.randn((4, D), dtype)
    reference = torch.autograd.grad(norm(x), (x, norm.weight), grad_out)
    assert swap_norms(net) == 1 and isinstance(net[0], RMSNorm)
    fk = torch.autograd.grad(net[0](x), (x, norm.weight), grad_out)
    for name, a, r in zip(("dx", "dweight"), fk, reference, strict=True):
        testing.assert_close(name, a, r, dtype)


def test_swap_keeps_an_eps_of_zero():
    """torch's norms take eps = 0; the swapped ones run it (they used to refuse it on the first call)."""
    net = torch.nn.Sequential(torch.nn.LayerNorm(D, eps=0.0), torch.nn.RMSNorm(D, eps=0.0)).to(testing.device())
    x = testing.randn((4, D))
    reference = net(x)
    assert swap_norms(net) == 2 and net[0].eps == net[1].eps == 0.0
    testing.assert_close("out", net(x), reference, torch.float32)


def test_swap_keeps_shared_norms_shared_and_their_hooks():
    """One norm under two names (two places in a Sequential, two parents) becomes one fk module,
    counted once (the second name kept torch's before); its forward hooks still fire and their
    handles still remove them (they were dropped)."""
    norm = torch.nn.LayerNorm(D).to(testing.device())
    net = torch.nn.Sequential(norm, torch.nn.Linear(D, D, device=testing.device()), norm)
    other = torch.nn.Sequential(norm)
    both = torch.nn.ModuleList([net, other])
    calls = []
    handle = norm.register_forward_hook(lambda module, args, out: calls.append(type(module)))
    assert swap_norms(both) == 1
    assert isinstance(net[0], LayerNorm) and net[0] is net[2] is other[0] and net[0].weight is norm.weight
    net(testing.randn((2, D)))
    assert calls == [LayerNorm, LayerNorm]
    handle.remove()
    net(testing.randn((2, D)))
    assert len(calls) == 2


def test_swap_probe_runs_no_hooks():
    """swap_norms tries each norm on its own rows without the norm's hooks: a hook that changes the
    output (or records calls) neither sees the probe nor makes the norm look like another one."""
    norm = LlamaStyleRMSNorm(D).to(testing.device())  # a class fk tries before it swaps
    seen = []
    norm.register_forward_hook(lambda module, args, out: seen.append(1) or out * 2)
    net = torch.nn.Sequential(norm)
    assert swap_norms(net) == 1 and isinstance(net[0], RMSNorm) and seen == []
    x = testing.randn((2, D))
    want = 2 * torch.nn.functional.rms_norm(x, (D,), norm.weight, norm.variance_epsilon)
    testing.assert_close("hooked", net(x), want, torch.float32)


def test_swap_is_idempotent_and_checks_its_argument():
    net = torch.nn.Sequential(torch.nn.LayerNorm(D)).to(testing.device())
    assert swap_norms(net) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swap_norms(net) == 0
    with pytest.raises(TypeError, match="model"):
        swap_norms(net.state_dict())


def test_swap_transformers_models():
    transformers = pytest.importorskip("transformers")  # nox installs it (the "transformers" extra)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = torch.randint(0, 128, (2, 12), device=testing.device())
    for config in (transformers.LlamaConfig(**common), transformers.Qwen2Config(**common)):
        lm = transformers.AutoModelForCausalLM.from_config(config).to(testing.device()).eval()
        for p in lm.parameters():
            if p.dim() == 1:
                p.data.normal_(1.0, 0.3)
        with torch.no_grad():
            expected = lm(ids).logits
            assert swap_norms(lm) == 2 * common["num_hidden_layers"] + 1
            testing.assert_close(f"{type(lm).__name__} logits", lm(ids).logits, expected, torch.float32)
    gemma = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**common))
    with pytest.warns(UserWarning, match="Gemma2RMSNorm"):
        assert swap_norms(gemma) == 0

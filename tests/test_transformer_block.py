"""The ops together, as a transformer layer uses them: pre-norm, scores, masked softmax, a learned
weighted-sum head; forward and every gradient against the same block in float64 PyTorch."""

import math

import pytest
import torch
from fk_runtime.harness import testing

from fk_attention import attention
from fk_layernorm import LayerNorm, RMSNorm, layer_norm, rms_norm
from fk_softmax import softmax
from fk_weightedsum import weighted_sum


def block(x, w_norm, b_norm, w_head, fk: bool):
    """x (B, N, D) -> (B, N): LayerNorm, causal self-attention scores and probabilities, mixing,
    RMSNorm, then a weighted sum over features."""
    ln = layer_norm if fk else (lambda t, w, b: torch.nn.functional.layer_norm(t, t.shape[-1:], w, b))
    rms = rms_norm if fk else (lambda t, w: torch.nn.functional.rms_norm(t, t.shape[-1:], w, 1e-6))
    h = ln(x, w_norm, b_norm)
    scores = h @ h.transpose(-1, -2) / math.sqrt(h.shape[-1])
    if fk:
        p = softmax(scores, causal=True)
    else:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(scores.masked_fill(~keep, -math.inf), -1)
    heads = h.unflatten(-1, (2, h.shape[-1] // 2)).transpose(1, 2)  # (B, 2 heads, N, D/2)
    attend = attention if fk else (lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal))
    attended = attend(heads, heads, heads, causal=True).transpose(1, 2).flatten(-2)
    mixed = rms(p @ h + attended + x, w_norm)
    return weighted_sum(mixed, w_head) if fk else mixed @ w_head


@pytest.mark.parametrize("shape", [(2, 9, 32), (1, 33, 96)], ids=str)
def test_block_matches_float64_pytorch(shape):
    d = shape[-1]
    x = testing.randn(shape, requires_grad=True)
    w_norm = testing.randn((d,), shift=1.0, requires_grad=True)
    b_norm = testing.randn((d,), requires_grad=True)
    w_head = testing.randn((d,), requires_grad=True)
    testing.assert_matches_reference(
        lambda *a: block(*a, fk=True), lambda *a: block(*a, fk=False), [x, w_norm, b_norm, w_head],
        dtype=torch.float32, names=["x", "w_norm", "b_norm", "w_head"],
    )


def test_modules_compose_under_compile():
    norm, final = LayerNorm(64, device=testing.device()), RMSNorm(64, device=testing.device())
    w = testing.randn((64,), requires_grad=True)

    def model(x):
        return weighted_sum(final(softmax(norm(x), dim=-1)), w)

    x = testing.randn((3, 5, 64), requires_grad=True)
    compiled = testing.maybe_compile(model, "compile")
    eager_out, compiled_out = model(x), compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    g_eager = torch.autograd.grad(eager_out.sum(), [x, w])
    g_compiled = torch.autograd.grad(compiled_out.sum(), [x, w])
    for a, b in zip(g_eager, g_compiled, strict=True):
        torch.testing.assert_close(a, b)

"""fk in a transformers training loop: attn_implementation="fk" (fk_attention.hf) and
fk_layernorm.swap_norms against the same small models with transformers' own attention and norms,
a few AdamW steps from one random init on the same batches, losses compared against float64."""

import copy
import warnings

import pytest
import torch
from fk_runtime.harness import testing

from fk_layernorm import RMSNorm, swap_norms

transformers = pytest.importorskip("transformers")  # nox installs it (the "transformers" extra)

import fk_attention.hf  # noqa: E402, F401  (registers "fk")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# (config, transformers' attention for the reference, padded batches): Llama with GQA; Mistral
# with a window shorter than the sequences, on padded batches; Gemma 2 with softcapping and
# alternating sliding layers (SDPA refuses softcap; its norms compute x * (1 + weight): not swapped,
# and eager Gemma 2 in float64 turns padded batches into NaN: unpadded).
MODELS = {
    "llama": (lambda: transformers.LlamaConfig(**COMMON), "sdpa", False),
    "mistral": (lambda: transformers.MistralConfig(**COMMON, sliding_window=8), "sdpa", True),
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, sliding_window=8, attn_logit_softcapping=2.0,
                                                 query_pre_attn_scalar=16), "eager", False),
}
DTYPE = torch.bfloat16 if testing.on_gpu() else torch.float32
STEPS, BATCH, SEQ = 3, 3, 16


def train(model, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """The losses of AdamW steps on the batches, and the first step's gradients (every parameter,
    in named order: swap_norms keeps the names), the part of the loop losses are least sensitive to."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, mask, labels in batches:
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if not losses:
            grads = torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters())])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_transformers(name):
    config, reference_attention, padded = MODELS[name]
    base = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=reference_attention)
    for p in base.parameters():  # random norm weights too (they start at 1 or 0)
        p.data.normal_(0.0, 0.3 if p.dim() == 1 else 0.1)
    base = base.to(testing.device()).train()
    fk, baseline = copy.deepcopy(base).to(DTYPE), copy.deepcopy(base).to(DTYPE)
    fk.set_attn_implementation("fk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapped = swap_norms(fk)
    norms = 2 * COMMON["num_hidden_layers"] + 1
    if name == "gemma2":
        assert swapped == 0 and "Gemma2RMSNorm" in str(caught[0].message)
    else:
        assert swapped == norms == sum(isinstance(m, RMSNorm) for m in fk.modules()) and not caught

    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ), device=testing.device())
        mask = torch.ones_like(ids)
        if padded:  # one row left-padded, one right-padded
            mask[1, :4] = 0
            mask[2, SEQ - 5:] = 0
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))

    (losses, grads), (ref_losses, ref_grads) = train(fk, batches), train(base.to(torch.float64), batches)
    base_losses, base_grads = train(baseline, batches)
    testing.assert_close(f"{name} first gradients", grads, ref_grads, DTYPE, baseline=base_grads)
    testing.assert_close(f"{name} losses", losses, ref_losses, DTYPE, baseline=base_losses)

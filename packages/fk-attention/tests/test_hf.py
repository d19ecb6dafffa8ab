"""attn_implementation="fk" (fk_attention.hf) in small transformers models with random weights,
against the same models run by transformers' own attention ("sdpa", or "eager" for Gemma 2's
softcap) in float64: logits with and without padding, packed sequences, cached generation."""

import copy

import pytest
import torch
from fk_runtime.harness import testing

transformers = pytest.importorskip("transformers")  # nox installs it (the "transformers" extra)

from fk_attention import hf  # noqa: E402

# Tiny decoders: Llama with GQA; Mistral with a sliding window shorter than the sequences; Gemma 2
# with logit softcapping and alternating sliding / full layers (SDPA refuses softcap: eager).
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MODELS = {
    "llama": (lambda: transformers.LlamaConfig(**COMMON), "sdpa"),
    "mistral": (lambda: transformers.MistralConfig(**COMMON, sliding_window=8), "sdpa"),
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, sliding_window=8, attn_logit_softcapping=2.0,
                                                 query_pre_attn_scalar=16), "eager"),
}
DTYPES = [torch.bfloat16, torch.float32] if testing.on_gpu() else [torch.float32]
SEQ = 24


def models(name, dtype):
    """(fk model in dtype, reference in dtype, reference in float64), one random init."""
    config, reference = MODELS[name]
    base = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=reference)
    for p in base.parameters():  # random norm weights too (they start at 1 or 0)
        p.data.normal_(0.0, 0.3 if p.dim() == 1 else 0.1)
    base = base.to(testing.device()).eval()
    fk = copy.deepcopy(base).to(dtype)
    fk.set_attn_implementation("fk")
    return fk, copy.deepcopy(base).to(dtype), base.to(torch.float64)


def padding_mask(batch=3):
    """Row 0 unpadded, row 1 left-padded, row 2 right-padded."""
    mask = torch.ones(batch, SEQ, dtype=torch.long, device=testing.device())
    mask[1, :5] = 0
    mask[2, SEQ - 7:] = 0
    return mask


def test_registered():
    assert transformers.AttentionInterface._global_mapping["fk"] is hf.fk_attention_forward
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping["fk"] is hf.fk_mask
    model = transformers.AutoModelForCausalLM.from_config(MODELS["llama"][0](), attn_implementation="fk")
    assert model.config._attn_implementation == "fk"


def unpadded(model, ids, mask):
    """Each row's logits, the row run alone without its padding: what padding must not change
    (rotary embeddings see relative positions only). Also what the reference gets, as eager Gemma 2
    in float64 turns padded batches into NaN (its fully masked rows)."""
    return [model(row[keep][None]).logits[0] for row, keep in zip(ids, mask.bool(), strict=True)]


def check(name, out, ref, base, dtype):
    # A non-finite reference or baseline would make the bound infinite, and the check vacuous.
    assert torch.isfinite(ref).all() and torch.isfinite(base).all()
    testing.assert_close(name, out, ref, dtype, baseline=base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits(name, padded, dtype):
    fk, baseline, reference = models(name, dtype)
    ids = torch.randint(0, 128, (3, SEQ), device=testing.device())
    with torch.no_grad():
        if padded:
            mask = padding_mask()
            # Padded queries have no meaning (fk writes zeros there): the kept rows only.
            out = fk(ids, attention_mask=mask).logits[mask.bool()]
            ref, base = (torch.cat(unpadded(m, ids, mask)) for m in (reference, baseline))
        else:
            out, ref, base = (m(ids).logits for m in (fk, reference, baseline))
    check(f"{name} logits", out, ref, base, dtype)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences(name):
    """Sequences packed in one row, told apart by restarting position ids (as padding-free
    collators pass them), or by cu_seq_lens: each attends to itself only, windows per sequence."""
    dtype = DTYPES[0]
    fk, baseline, reference = models(name, dtype)
    lengths = [7, 11, 6]
    ids = torch.randint(0, 128, (1, sum(lengths)), device=testing.device())
    positions = torch.cat([torch.arange(n, device=testing.device()) for n in lengths])[None]
    with torch.inference_mode():  # position ids without a version counter
        # Each sequence run alone is what packing must give (no cache: it would end packing in transformers).
        ref = torch.cat([reference(part).logits for part in ids.split(lengths, dim=1)], dim=1)
        base = baseline(ids, position_ids=positions, use_cache=False).logits
        out = fk(ids, position_ids=positions, use_cache=False).logits
        cu = torch.tensor([0, 7, 18, 24], device=testing.device())
        by_cu = fk(ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=11, max_length_k=11).logits
    check(f"{name} packed by positions", out, ref, base, dtype)
    check(f"{name} packed by cu_seq_lens", by_cu, ref, base, dtype)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_cached_generation(name):
    """Greedy decoding with a KV cache from left-padded prompts past the sliding window: fk's
    scores at every step against one forward of each whole generated row."""
    dtype = DTYPES[0]
    fk, baseline, reference = models(name, dtype)
    prompt_len, new = 10, 8
    ids = torch.randint(1, 128, (2, prompt_len), device=testing.device())
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        # No min_new_tokens: its processor writes -inf into the returned logits (an end token may
        # stop rows early; their later tokens are still attended to, alike in both runs).
        gen = fk.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        full_mask = torch.cat([mask, torch.ones_like(gen.sequences[:, prompt_len:])], dim=1)
        # The logits that chose each generated token, from one forward of each whole row.
        steps = gen.sequences.shape[1] - prompt_len
        ref, base = (torch.stack([x[-steps - 1:-1] for x in unpadded(m, gen.sequences, full_mask)])
                     for m in (reference, baseline))
    out = torch.stack(gen.logits, dim=1)
    assert torch.isfinite(out).all()
    check(f"{name} generation", out, ref, base, dtype)


@pytest.mark.parametrize("name", MODELS)
def test_static_cache_without_padding(name):
    """A static cache (keys past the current position unfilled) and no mask: fk attends to the
    filled rows only (it attended to the whole buffer: wrong logits from the prefill on), sliding
    layers too (a window longer than the prompt), with autograd on or off, in a forward against the
    same forward without a cache, and in greedy generation against one forward of each generated row."""
    dtype = DTYPES[0]
    fk, baseline, reference = models(name, dtype)
    ids = torch.randint(1, 128, (2, 10), device=testing.device())
    want, base = reference(ids).logits, baseline(ids).logits
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            cache = transformers.StaticCache(config=fk.config, max_cache_len=32)
            check(f"static cache forward (grad {grad})", fk(ids, past_key_values=cache).logits, want, base, dtype)
    with torch.no_grad():
        gen = fk.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
                          output_logits=True, return_dict_in_generate=True)
        # The logits that chose each generated token, from one forward of each whole row.
        steps = gen.sequences.shape[1] - ids.shape[1]
        ref, base = (m(gen.sequences).logits[:, -steps - 1:-1] for m in (reference, baseline))
    check("static cache generation", torch.stack(gen.logits, dim=1), ref, base, dtype)


def test_cached_rows_at_different_positions_with_and_without_autograd():
    """Queries against a cache longer than they are, rows at different positions, no mask: each row
    reads its own filled keys, with autograd on (the dense path, rows sliced) as off (the kvcache
    path); with autograd on all rows took the longest row's keys."""
    q = testing.randn((2, 4, 2, 16))
    k, v = testing.randn((2, 2, 8, 16)), testing.randn((2, 2, 8, 16))
    positions = torch.tensor([[2, 3], [4, 5]], device=q.device)
    with torch.no_grad():
        off, _ = hf.fk_attention_forward(_Layer(), q, k, v, None, position_ids=positions)
    on, _ = hf.fk_attention_forward(_Layer(), q.clone().requires_grad_(), k, v, None, position_ids=positions)
    for row, n in enumerate((4, 6)):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row:row + 1].double(), *(t[row:row + 1, :, :n].double().repeat_interleave(2, 1) for t in (k, v)),
            attn_mask=torch.ones(2, n, dtype=torch.bool, device=q.device).tril(n - 2))
        for got in (off, on):
            testing.assert_close(f"row {row}", got[row:row + 1].transpose(1, 2), want, torch.float32)


def test_bidirectional_models_with_padding():
    """Bidirectional attention (an encoder; a decoder with is_causal=False) with a padding mask runs
    (every bidirectional mask was refused as an overlay) and matches eager on the kept tokens."""
    dtype = DTYPES[0]
    bert = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for config in (bert, transformers.LlamaConfig(**COMMON, is_causal=False)):
        reference = transformers.AutoModel.from_config(config, attn_implementation="eager").to(testing.device())
        reference = reference.to(torch.float64).eval()
        fk = copy.deepcopy(reference).to(dtype)
        fk.set_attn_implementation("fk")
        ids = torch.randint(3, 128, (2, 12), device=testing.device())
        mask = torch.ones_like(ids)
        mask[1, -4:] = 0
        with torch.no_grad():
            out = fk(ids, attention_mask=mask).last_hidden_state
            want = reference(ids, attention_mask=mask).last_hidden_state
        keep = mask.bool()
        testing.assert_close(type(config).__name__, out[keep], want[keep], dtype)


@pytest.mark.parametrize("n_q", [6, 14])
def test_cross_attention_to_a_padded_encoder(n_q):
    """Non-causal attention with a padding mask over the keys only (cross-attention: decoder queries,
    encoder keys): every query is kept (they were taken from the mask's last columns: zeroed rows,
    or a refusal with more queries than encoder tokens)."""
    q = testing.randn((2, 4, n_q, 16))
    k, v = testing.randn((2, 2, 12, 16)), testing.randn((2, 2, 12, 16))
    mask = torch.ones(2, 12, dtype=torch.bool, device=q.device)
    mask[1, 9:] = False
    layer = _Layer()
    layer.is_causal = False
    out, _ = hf.fk_attention_forward(layer, q, k, v, mask)
    k64, v64 = (t.double().repeat_interleave(2, 1) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask[:, None, None, :])
    testing.assert_close("cross-attention", out.transpose(1, 2), want, torch.float32)


def test_output_attentions_warns():
    """fk computes no attention weights: asked for them, it says so (it returned none silently)."""
    fk, _, _ = models("llama", DTYPES[0])
    with pytest.warns(UserWarning, match="output_attentions gives none"):
        fk(torch.randint(1, 128, (1, 6), device=testing.device()), output_attentions=True)


class _Layer(torch.nn.Module):
    is_causal = True


def test_refusals():
    q = testing.randn((1, 4, 8, 16))
    k = testing.randn((1, 2, 8, 16))
    with pytest.raises(ValueError, match="dropout"):
        hf.fk_attention_forward(_Layer(), q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match="s_aux"):
        hf.fk_attention_forward(_Layer(), q, k, k, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="2-D padding mask"):
        hf.fk_attention_forward(_Layer(), q, k, k, torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask function"):
        hf.fk_mask(batch_size=1, q_length=8, kv_length=8, use_vmap=True)
    # A bidirectional block laid over the causal mask without use_vmap (block_sequence_ids: image
    # tokens 1-3 see each other), as transformers builds it for such models.
    from transformers.masking_utils import causal_mask_function, or_masks

    def image_block(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx >= 1) & (q_idx <= 3) & (kv_idx >= 1) & (kv_idx <= 3)

    with pytest.raises(ValueError, match="see later ones"):
        hf.fk_mask(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0, allow_is_causal_skip=False,
                   mask_function=or_masks(causal_mask_function, image_block))
    assert hf.fk_mask(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0, allow_is_causal_skip=True,
                      mask_function=causal_mask_function) is None
    with pytest.raises(ValueError, match="fewer than the 8 queries"):
        hf.fk_attention_forward(_Layer(), q, k, k, torch.ones(1, 6, dtype=torch.bool))
    # A model trained with attention dropout meets the refusal at its first training forward.
    config = transformers.LlamaConfig(**COMMON, attention_dropout=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fk").to(testing.device())
    with pytest.raises(ValueError, match="dropout"):
        model.train()(torch.randint(0, 128, (1, 8), device=testing.device()))


def test_packed_bounds_follow_the_batch_and_in_place_updates():
    """The bounds read from position ids are reused only for the same ids at the same batch size:
    a (1, N) tensor broadcast to a new batch, or updated in place (inference tensors included),
    is read again."""
    ids = torch.tensor([[0, 1, 2, 0, 1, 0]], device=testing.device())
    assert hf._restarts(ids, 1).tolist() == [0, 3, 5, 6]
    # The tensor itself is held (not its id and address): a later step's ids cannot take them over.
    assert hf._last_positions[0] is ids
    assert hf._restarts(ids.clone(), 1).tolist() == [0, 3, 5, 6]
    assert hf._restarts(ids, 2).tolist() == [0, 3, 5, 6, 9, 11, 12]
    ids[0, 3:] = torch.tensor([3, 4, 5])
    assert hf._restarts(ids, 2) is None
    with torch.inference_mode():
        ids = torch.tensor([[0, 1, 2, 0, 1, 0]], device=testing.device())
        assert hf._restarts(ids, 1).tolist() == [0, 3, 5, 6]
        ids[0, 3:] = torch.tensor([3, 4, 5])
        assert hf._restarts(ids, 1) is None

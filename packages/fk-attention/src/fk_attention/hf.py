"""Hugging Face transformers integration: `import fk_attention.hf` registers fk's attention as the
attention implementation "fk".

    import fk_attention.hf  # noqa: F401
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fk")  # or set_attn_implementation("fk")

The masks reach "fk" as they reach FlashAttention (transformers' `flash_attention_mask` is
registered for it): None, or a 2-D boolean padding mask (B, Nk). Padding goes through
`attention_varlen` (the kept tokens packed, the output scattered back with zeros at padded
queries); packed sequences too, given as `cu_seq_lens_*` / `max_length_*` (padding-free
collators) or as position ids that restart; otherwise the dense `attention`. Causal attention is
aligned lower-right (a KV cache's queries are its last rows), GQA runs natively, `sliding_window`
W keeps the keys of the last W positions (transformers' `kv_idx > q_idx - W`), `softcap` is
Gemma 2's logit softcapping. Refused with a ValueError: dropout, attention sinks (`s_aux`),
position biases, 4-D masks, and masks with model-specific overlays (or/and mask functions, e.g.
bidirectional image tokens). A cache without a mask (a static one holds unfilled rows) is
read to the last position through `attention_with_kvcache` (sliding layers too, their window
passed; under autograd the filled rows are sliced, a host sync, for the dense call). Without a
causal mask (bidirectional, cross-attention) a padding mask covers the keys and every query is
kept. transformers is imported by this module only.

`context_parallel(group)` registers "fk_ring" and returns that name: ring attention over the
ranks of `group`, each rank's model fed its shard of the sequence (`fk_attention.ring`).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .ops import attention, attention_varlen, attention_with_kvcache
from .ring import LAYOUTS, ring_attention, shard_sequence

NAME = "fk"
RING_NAME = "fk_ring"
# Attention-function arguments some models pass that fk's kernels have no term for.
UNSUPPORTED_KWARGS = ("s_aux", "position_bias")


def _sees_next_key(mask_function, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, device=None, **_) -> bool:
    """Whether a causal mask lets some query see the key right after it: a bidirectional block laid
    over the causal mask (image tokens, `block_sequence_ids`), which fk has no term for."""
    q = torch.arange(q_offset, q_offset + q_length, device=device)
    q = q[(q + 1 >= kv_offset) & (q + 1 < kv_offset + kv_length)]
    if q.numel() == 0:
        return False
    batch = torch.arange(batch_size, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    return bool(mask_function(batch, head, q[None, :], q[None, :] + 1).any())


def fk_mask(*args, use_vmap: bool = False, **kwargs):
    """FlashAttention's mask (None or the 2-D padding mask); refuses the overlays it would drop."""
    # transformers sets use_vmap exactly when a model adds an or/and mask function to the base mask.
    if use_vmap:
        raise ValueError("attn_implementation 'fk' supports causal, sliding-window and padding masks only; "
                         "this model adds its own mask function (or_mask_function / and_mask_function)")
    # Causal masks may carry a blockwise overlay without use_vmap (block_sequence_ids, packing); their
    # builders then pass allow_is_causal_skip=False: probe those (a host sync), with more than one
    # query. Bidirectional masks (allow_is_bidirectional_skip) see later keys by design.
    if (not args and kwargs.get("allow_is_causal_skip") is False and kwargs.get("q_length", 1) > 1
            and "mask_function" in kwargs and "allow_is_bidirectional_skip" not in kwargs):
        if _sees_next_key(**kwargs):
            raise ValueError("attn_implementation 'fk' supports causal, sliding-window and padding masks only; "
                             "this model's causal mask lets tokens see later ones (a bidirectional block, "
                             "e.g. image tokens)")
    return flash_attention_mask(*args, **kwargs)


def _gather(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (tokens, H, D) of the tokens (rows[t], cols[t])."""
    return x[rows, :, cols]


def _cu_seqlens(keep: torch.Tensor) -> torch.Tensor:
    lengths = keep.sum(-1, dtype=torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _padded(query, key, value, mask, **mask_args) -> torch.Tensor:
    """Attention of left- or right-padded rows: keys kept where the (B, Nk) mask is True, queries
    where its last Nq columns are (every row's query when Nq = 1, as FlashAttention does). Without
    a causal mask or a window every query is kept: the mask covers the keys only (cross-attention
    to a padded encoder; a padded query of bidirectional attention is a don't-care)."""
    b, _, n_q, _ = query.shape
    n_k = mask.shape[1]
    every_query = not mask_args.get("causal") and mask_args.get("window") is None
    if n_q > n_k and not every_query:
        raise ValueError(f"attention_mask has {n_k} columns, fewer than the {n_q} queries (a padding mask "
                         "covers the keys, the queries being its last columns)")
    if key.shape[2] < n_k:
        raise ValueError(f"attention_mask has {n_k} columns but there are only {key.shape[2]} keys")
    # A static cache holds more key slots than the mask covers: the ones past it are unused.
    rows_k, cols_k = mask.nonzero(as_tuple=True)
    kept_k = (_gather(key[:, :, :n_k], rows_k, cols_k), _gather(value[:, :, :n_k], rows_k, cols_k))
    if every_query:  # the queries as they are, one sequence per batch row
        cu_q = torch.arange(0, (b + 1) * n_q, n_q, dtype=torch.int32, device=query.device)
        out = attention_varlen(query.transpose(1, 2).flatten(0, 1), *kept_k, cu_q, _cu_seqlens(mask), n_q, n_k,
                               **mask_args)
        return out.view(b, n_q, *out.shape[1:])
    keep_q = mask[:, -n_q:] if n_q > 1 else mask.new_ones(b, 1)
    rows_q, cols_q = keep_q.nonzero(as_tuple=True)
    out = attention_varlen(_gather(query, rows_q, cols_q), *kept_k, _cu_seqlens(keep_q), _cu_seqlens(mask),
                           n_q, n_k, **mask_args)
    return out.new_zeros(b, n_q, *out.shape[1:]).index_put((rows_q, cols_q), out)


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, **mask_args) -> torch.Tensor:
    """Attention of sequences packed one after another along (B, N), output (B, N, Hq, D)."""
    b, _, n_q, _ = query.shape
    out = attention_varlen(query.transpose(1, 2).flatten(0, 1), key.transpose(1, 2).flatten(0, 1),
                           value.transpose(1, 2).flatten(0, 1), cu_q.to(torch.int32), cu_k.to(torch.int32),
                           int(max_q), int(max_k), **mask_args)
    return out.view(b, n_q, *out.shape[1:])


# The last position ids seen (the tensor itself, so that neither its id nor its memory can pass to
# a later step's tensor), its version and the batch, and their sequence bounds: every layer of one
# forward gets the same tensor, so the device sync that reading them costs is paid once per
# forward, not once per layer. Inference tensors (no version) are not kept.
_last_positions: list = [None, None, None]


def _restarts(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """cu_seqlens of the sequences packed in (B, N) position ids (a new one wherever a position is
    not its predecessor + 1, as transformers' `find_packed_sequence_indices`), None if unpacked."""
    key = None if position_ids.is_inference() else (position_ids._version, batch)
    if key is not None and _last_positions[0] is position_ids and _last_positions[1] == key:
        return _last_positions[2]
    positions = position_ids.expand(batch, -1)
    starts = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1
    cu = None
    if starts.any():
        starts[:, 0] = True
        cu = torch.nn.functional.pad(starts.flatten().nonzero().flatten().to(torch.int32), (0, 1),
                                     value=starts.numel())
    _last_positions[:] = [None if key is None else position_ids, key, cu]
    return cu


def fk_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Nq, D), key and value (B, Hk, Nk,
    D); returns (output (B, Nq, Hq, D), None)."""
    if dropout:
        raise ValueError(f"attn_implementation 'fk' has no attention dropout, got dropout={dropout} "
                         "(set the config's attention_dropout to 0 to train with it)")
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation 'fk' does not support {name}")
    if kwargs.get("output_attentions"):  # as transformers' sdpa and flash paths say it
        warnings.warn("attn_implementation 'fk' computes no attention weights: output_attentions gives none "
                      "(use attn_implementation='eager' to get them)", stacklevel=2)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"attn_implementation 'fk' takes a 2-D padding mask (batch, keys) or None, got "
                         f"attention_mask of shape {tuple(attention_mask.shape)}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask_args = {
        "causal": "lower_right" if causal else False,
        "sm_scale": scaling,
        # transformers' window W: query i sees keys j with i - j < W (and j - i < W when bidirectional).
        "window": None if sliding_window is None else (sliding_window - 1, sliding_window - 1),
        "softcap": softcap,
    }
    b, _, n_q, _ = query.shape
    if attention_mask is not None:
        return _padded(query, key, value, attention_mask.bool(), **mask_args), None
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        max_q = n_q if max_length_q is None else max_length_q
        max_k = key.shape[2] if max_length_k is None else max_length_k
        return _packed(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_q, max_k, **mask_args), None
    if position_ids is not None and n_q > 1 and key.shape[2] == n_q:
        cu = _restarts(position_ids, b)
        if cu is not None:
            return _packed(query, key, value, cu, cu, n_q, n_q, **mask_args), None
    if _cached_self_attention(query, key, position_ids, causal):
        # A cache without a mask: a static one holds unfilled rows past the current position, which
        # the lower-right dense call would attend to. The keys are the first (last position + 1)
        # (at most those returned: a sliding layer's buffer holds the last W), read on the device.
        lengths = (position_ids[:, -1] + 1).clamp(max=key.shape[2]).to(torch.int32).expand(b).contiguous()
        window = None if sliding_window is None else (sliding_window - 1, 0)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            # attention_with_kvcache is forward-only: the filled rows sliced (a host sync), the dense
            # call (a row at a time where the rows' positions differ).
            filled = lengths.tolist()
            rows = [slice(None)] if len(set(filled)) == 1 else [slice(i, i + 1) for i in range(b)]
            out = torch.cat([attention(query[r], key[r, :, :n], value[r, :, :n], causal="lower_right",
                                       sm_scale=scaling, window=window, softcap=softcap)
                             for r, n in zip(rows, filled, strict=False)])
        else:
            out = attention_with_kvcache(query, key, value, lengths, causal=True, sm_scale=scaling, window=window,
                                         softcap=softcap)
        return out.transpose(1, 2), None
    return attention(query, key, value, **mask_args).transpose(1, 2), None


def _cached_self_attention(query, key, position_ids, causal: bool) -> bool:
    """Causal self-attention against a KV cache longer than the queries, with (B, Nq) position ids
    (or (1, Nq)) that count its filled rows and do not restart (packed sequences); other position
    layouts (multimodal rope) keep the dense call."""
    b, n_q = query.shape[0], query.shape[2]
    return (causal and key.shape[2] > n_q and position_ids is not None and position_ids.dim() == 2
            and position_ids.shape[0] in (1, b) and position_ids.shape[1] == n_q
            and (n_q == 1 or _restarts(position_ids, b) is None))


AttentionInterface.register(NAME, fk_attention_forward)
AttentionMaskInterface.register(NAME, fk_mask)


# The last position ids found to be this rank's shard (the tensor and its version): every layer of
# one forward gets the same tensor, so the check's host sync is paid once per forward.
_checked_positions: list = [None, None]


def ring_mask(*args, attention_mask=None, use_vmap: bool = False, **kwargs):
    """No mask (the ring is causal by itself); refuses padding and models' own mask functions."""
    # transformers' packed-sequence detection fires on a zigzag shard's jump in positions: ignored.
    if use_vmap or (attention_mask is not None and not bool(attention_mask.all())):
        raise ValueError(f"attn_implementation {RING_NAME!r} supports causal and sliding-window masks only: "
                         "no padding mask (pack or trim the batch) and no model-specific mask functions")
    return None


def _check_positions(position_ids: torch.Tensor, n: int, group, layout: str) -> None:
    if _checked_positions[0] is position_ids and _checked_positions[1] == position_ids._version:
        return
    full = torch.arange(n * dist.get_world_size(group), device=position_ids.device)
    if position_ids.shape[-1] != n or not bool((position_ids == shard_sequence(full, 0, group, layout)).all()):
        raise ValueError(f"attn_implementation {RING_NAME!r} needs each rank's GLOBAL position ids, its shard of "
                         f"arange(N): shard_sequence(torch.arange(N), 0, group, {layout!r})")
    if not position_ids.is_inference():  # (no version to tell a later tensor by)
        _checked_positions[:] = [position_ids, position_ids._version]


def fk_ring_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, sliding_window: int | None = None,
                              softcap: float | None = None, is_causal: bool | None = None,
                              position_ids: torch.Tensor | None = None, *, group=None, layout: str = "zigzag",
                              **kwargs) -> tuple[torch.Tensor, None]:
    """`fk_attention_forward` over the ranks of `group`: this rank's shard of query, key and value."""
    refused = [name for name, given in (("dropout", dropout), ("softcap", softcap),
                                        ("a padding mask", attention_mask is not None),
                                        ("a KV cache", key.shape[2] != query.shape[2]))
               if given]
    refused += [name for name in ("cu_seq_lens_q", "cu_seq_lens_k", *UNSUPPORTED_KWARGS)
                if kwargs.get(name) is not None]
    if refused:
        raise ValueError(f"attn_implementation {RING_NAME!r} does not support {', '.join(refused)} "
                         "(a cache: call the model with use_cache=False)")
    if position_ids is not None:  # rotary embeddings must have seen the tokens' global positions
        _check_positions(position_ids, query.shape[2], group, layout)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    out = ring_attention(query, key, value, group=group, causal=bool(causal), sm_scale=scaling, layout=layout,
                         window=window)
    return out.transpose(1, 2), None


def context_parallel(group=None, layout: str = "zigzag") -> str:
    """Registers attn_implementation "fk_ring" (returned): `ring_attention` (causal, GQA, sliding
    windows) over the ranks of `group` (None: the default group) in `layout`. Each rank's model gets
    its shard of the tokens, `shard_sequence(input_ids, 1, group, layout)`, with their GLOBAL
    position ids (the same shard of `arange(N)`; checked once per forward) and use_cache=False;
    combining the loss over the shards is the caller's (e2e/train_context_parallel.py). Refused
    with a ValueError: padding masks, packed sequences, a KV cache, dropout, softcap. One
    registration per process: a later call rebinds the name."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    AttentionInterface.register(RING_NAME, functools.partial(fk_ring_attention_forward, group=group,
                                                             layout=layout))
    AttentionMaskInterface.register(RING_NAME, ring_mask)
    return RING_NAME

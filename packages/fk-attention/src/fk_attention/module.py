"""`SelfAttention`: multi-head (GQA) self-attention on fk attention."""

from __future__ import annotations

import torch
from einops import rearrange
from fk_runtime import checks

from .layout import check_head_dim
from .ops import attention


class SelfAttention(torch.nn.Module):
    """x (B, N, dim) -> (B, N, dim): one fused q/k/v projection, `num_heads` query heads sharing
    `num_kv_heads` key/value heads (GQA; MQA with 1), fk attention, an output projection.

    The heads are strided views of the projection's output ((B, N, H, D) seen as (B, H, N, D)) and
    the attention output comes back in (B, N, H, D) storage: no copies on the way in or out."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, causal: bool = False,
                 bias: bool = False, device=None, dtype=None):
        """dim / num_heads is the head dim: from 1 to 256 (the kernels' range)."""
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        dim, num_heads, num_kv_heads = (checks.check_size(name, value) for name, value in (
            ("dim", dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)))
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = dim // num_heads
        try:
            check_head_dim(self.head_dim)
        except ValueError as e:
            raise ValueError(f"dim / num_heads ({dim} / {num_heads}) is the head dim, and fk attention's {e}") \
                from None
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads
        self.causal = checks.check_flag("causal", causal)
        kv_dim = num_kv_heads * self.head_dim
        self.splits = (dim, kv_dim, kv_dim)
        self.qkv = torch.nn.Linear(dim, dim + 2 * kv_dim, bias=bias, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (batch, tokens, dim={self.dim}), got shape {tuple(x.shape)}")
        q, k, v = self.qkv(x).split(self.splits, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", d=self.head_dim) for t in (q, k, v))
        out = attention(q, k, v, causal=self.causal)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}")

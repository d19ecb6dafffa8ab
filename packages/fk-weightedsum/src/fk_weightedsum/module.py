"""`WeightedSum`: a module holding the weight."""

from __future__ import annotations

import math

import torch

from .ops import weighted_sum


class WeightedSum(torch.nn.Module):
    """y = x @ weight over the last dim, with a learned `weight` of `dim` elements (initialised
    like `nn.Linear(dim, 1)`'s weight)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.dim = dim
        self.weight = torch.nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.dim)
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weighted_sum(x, self.weight)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

"""`WeightedSum`: a module holding the weight."""

from __future__ import annotations

import math

import torch
from fk_runtime import checks

from .ops import weighted_sum


class WeightedSum(torch.nn.Module):
    """y = x @ weight over the last dim, with a learned `weight` of `dim` elements (initialised
    like `nn.Linear(dim, 1)`'s weight)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.dim = checks.check_size("dim", dim)
        self.weight = torch.nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.dim)
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weighted_sum(x, self.weight)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

"""`Softmax` and `LogSoftmax` modules, drop-ins for torch.nn's (plus `causal`)."""

from __future__ import annotations

import torch

from .ops import log_softmax, softmax


class Softmax(torch.nn.Module):
    def __init__(self, dim: int = -1, causal: bool = False):
        super().__init__()
        self.dim, self.causal = dim, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim, self.causal)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, causal={self.causal}"


class LogSoftmax(torch.nn.Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

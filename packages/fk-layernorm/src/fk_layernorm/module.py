"""`LayerNorm` and `RMSNorm`: drop-ins for torch.nn's (same parameters and state_dict keys)."""

from __future__ import annotations

import numbers

import torch

from .ops import layer_norm, rms_norm


def _features(normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
    if len(shape) != 1 or shape[0] <= 0:
        raise ValueError(
            f"normalized_shape must be one positive size (the last dim), got {normalized_shape!r}"
        )
    return int(shape[0])


class LayerNorm(torch.nn.Module):
    """`torch.nn.LayerNorm(normalized_shape)` over the last dim, plus the seed's `stable`."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, stable: bool = False):
        super().__init__()
        self.normalized_shape = (_features(normalized_shape),)
        self.eps, self.elementwise_affine, self.stable = eps, elementwise_affine, stable
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = torch.nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.stable)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, stable={self.stable}")


class RMSNorm(torch.nn.Module):
    """`torch.nn.RMSNorm(normalized_shape)` over the last dim; `eps=None` means the input dtype's
    machine epsilon, as in torch."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = (_features(normalized_shape),)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

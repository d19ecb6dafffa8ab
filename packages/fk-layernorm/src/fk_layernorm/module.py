"""`LayerNorm` and `RMSNorm`: drop-ins for torch.nn's (same parameters and state_dict keys)."""

from __future__ import annotations

import numbers

import torch
from fk_runtime import checks

from .ops import layer_norm, rms_norm


def _features(normalized_shape) -> int:
    if isinstance(normalized_shape, numbers.Integral):
        return checks.check_size("normalized_shape", normalized_shape)
    try:  # any iterable, as torch takes it (tuple, list, torch.Size, a NumPy array)
        shape = tuple(normalized_shape)
    except TypeError:
        raise TypeError(f"normalized_shape must be an int or a sequence of one, got "
                        f"{type(normalized_shape).__name__}") from None
    if len(shape) != 1:
        raise ValueError(
            f"normalized_shape must be one positive size (the last dim), got {normalized_shape!r}"
        )
    return checks.check_size("normalized_shape", shape[0])


def _check_features(module: torch.nn.Module, x) -> None:
    """x's last dim is the module's size (with affine parameters their size check catches it; a
    module without them would otherwise normalise whatever width it is given)."""
    checks.check_tensor("x", x, min_dim=1)
    if x.shape[-1] != module.normalized_shape[0]:
        raise ValueError(
            f"x's last dim must be normalized_shape {module.normalized_shape}, got shape {tuple(x.shape)}"
        )


def _reset(module: torch.nn.Module) -> None:
    if module.weight is not None:
        torch.nn.init.ones_(module.weight)
    if getattr(module, "bias", None) is not None:
        torch.nn.init.zeros_(module.bias)


class LayerNorm(torch.nn.Module):
    """`torch.nn.LayerNorm(normalized_shape)` over the last dim, plus `stable` (rows divided by their max |x| first)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, stable: bool = False):
        super().__init__()
        self.normalized_shape = (_features(normalized_shape),)
        self.eps = eps
        self.elementwise_affine = checks.check_flag("elementwise_affine", elementwise_affine)
        self.stable = checks.check_flag("stable", stable)
        bias = checks.check_flag("bias", bias)
        factory = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight 1, bias 0, as torch's (and after `to_empty` from the meta device)."""
        _reset(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_features(self, x)
        return layer_norm(x, self.weight, self.bias, self.eps, self.stable)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, stable={self.stable}")


class RMSNorm(torch.nn.Module):
    """`torch.nn.RMSNorm(normalized_shape)` over the last dim; `eps=None` means torch's default,
    the machine epsilon of the math dtype (fp32 for 16-bit inputs)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = (_features(normalized_shape),)
        self.eps, self.elementwise_affine = eps, checks.check_flag("elementwise_affine", elementwise_affine)
        if self.elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight 1, as torch's (and after `to_empty` from the meta device)."""
        _reset(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_features(self, x)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

"""Input checks every op shares: clear TypeError / ValueError naming the argument.

Never `assert` (stripped under `python -O`): a bad input must fail loudly, not run out of bounds.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import backend

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    value,
    *,
    dtypes=FLOAT_DTYPES,
    min_dim: int = 0,
    max_dim: int | None = None,
) -> torch.Tensor:
    """`value` is a tensor of an accepted dtype and rank.

    Pure metadata, so `torch.compile` traces it without a graph break; the device check that
    needs the backend (`check_kernel_device`) runs inside the op's eager implementation."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout is not torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} one")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {value.dtype}")
    if value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(value.shape)}")
    if max_dim is not None and value.dim() > max_dim:
        raise ValueError(f"{name} must have at most {max_dim} dims, got shape {tuple(value.shape)}")
    return value


def check_kernel_device(name: str, value: torch.Tensor) -> None:
    """The tensor lives where this backend's kernels can read it."""
    expected = backend.kernel_device_type()
    if value.device.type != expected:
        hint = (
            " (no GPU here: set TRITON_INTERPRET=1 before importing fk ops to run on the CPU)"
            if expected == "cuda" and value.device.type == "cpu"
            else ""
        )
        raise ValueError(f"{name} must be on a {expected} device, got {value.device}{hint}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    if len(present) < 2:
        return
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"tensors must be on one device: {where}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    if len(present) < 2:
        return
    dtypes = {v.dtype for v in present.values()}
    if len(dtypes) > 1:
        which = ", ".join(f"{k} is {v.dtype}" for k, v in present.items())
        raise TypeError(f"tensors must share one dtype: {which}")


def check_shape(name: str, value: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(value.shape)}")


def _finite_real(value, low: float, inclusive: bool) -> bool:
    """A finite real (Python or NumPy scalar; not a bool) above `low` (or equal to it)."""
    if type(value) is float:  # the usual case, without the ABC check
        return (low <= value if inclusive else low < value) and value < math.inf
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and (value >= low if inclusive else value > low)
    except OverflowError:  # an int too large for a float
        return False


def check_positive(name: str, value) -> None:
    """A finite real number above 0 (Python or NumPy scalars; not a bool)."""
    if not _finite_real(value, 0.0, False):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def check_nonnegative(name: str, value) -> None:
    """A finite real number of at least 0 (Python or NumPy scalars; not a bool)."""
    if not _finite_real(value, 0.0, True):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_size(name: str, value, minimum: int = 1) -> int:
    """An integer (Python or NumPy; not a bool) of at least `minimum`, e.g. a module's feature count
    (positive) or a length (minimum 0)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be positive, got {value}" if minimum == 1 else
                         f"{name} must be >= {minimum}, got {value}")
    return int(value)


def normalize_dim(name: str, dim: int, ndim: int) -> int:
    """`dim` (Python or NumPy integer) as a non-negative index into a tensor of `ndim` dims."""
    if not isinstance(dim, numbers.Integral) or isinstance(dim, bool):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    dim = int(dim)
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"{name}={dim} is out of range for a tensor of {ndim} dims")
    return dim % max(ndim, 1)


def check_flag(name: str, value) -> bool:
    """A bool (Python or NumPy), as torch's own flags take it: a truthy string or tensor is refused,
    not read as True."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {kind.__name__}")

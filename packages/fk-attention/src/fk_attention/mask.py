"""The mask: which keys each query sees and how scores are capped, as one value (`Mask`) that the
plans key on and the kernels take as (softcap, lower_right, left, right). The public arguments
(`causal`, `window`, `softcap`) become the one `mask` argument the registered ops carry (`op_args`,
a list of floats), and that a Mask (`from_op_args`). A new kind of mask is a field here (and its
entry in `op_args`), and its branch where the kernels decide what a query sees.
"""

from __future__ import annotations

import dataclasses
import numbers

from fk_runtime import backend, checks

from . import config, layout
from .kernels import TANH_APPROX, TANH_EXP2


# An unbounded window side as the kernels take it: past any sequence length, and small enough that
# their int32 bounds (position +- side) cannot overflow for lengths below 2**29.
UNBOUNDED = 1 << 30


@dataclasses.dataclass(frozen=True)
class Mask:
    """Which keys a query sees and how scores are capped. Query i sees key j when
    -left <= j - (i + shift) <= right (None: unbounded), shift = Nk - Nq with `lower_right`
    (FlashAttention's and torch's CausalVariant.LOWER_RIGHT alignment), else 0 (SDPA's top-left);
    causal is right = 0. `softcap` c: scores s become c * tanh(s / c) before the softmax.
    `deterministic` is no mask but rides with it to the backward: True, no partial sums added in a
    varying order there (the 5-matmul backward's dQ adds are)."""

    left: int | None = None
    right: int | None = None
    lower_right: bool = False
    softcap: float | None = None
    deterministic: bool = False

    @property
    def windowed(self) -> bool:
        return self.left is not None or self.right is not None

    @property
    def full_or_causal(self) -> bool:
        """Every key, or causal (of either alignment), no softcap."""
        return self.left is None and self.right in (None, 0) and self.softcap is None

    @property
    def window_build(self) -> int:
        """The kernels' WINDOW: 0 no window, 1 one whose left side is unbounded (causal's: no
        compares on that side), 2 one bounded on the left."""
        return 0 if not self.windowed else 1 if self.left is None else 2

    def softcap_build(self, dtype) -> int:
        """The kernels' SOFTCAP (`kernels.capped`): 0 no cap; on a GPU, TANH_APPROX (the GPU's tanh.approx.f32,
        FlashAttention's) for inputs of `config.SOFTCAP_APPROX_DTYPES`; else TANH_EXP2 (fp32 rounding)."""
        if self.softcap is None:
            return 0
        if dtype in config.SOFTCAP_APPROX_DTYPES and not backend.is_interpreter():
            return TANH_APPROX.value
        return TANH_EXP2.value

    @property
    def span(self) -> int | None:
        """Keys a query sees at most under a two-sided window; None where a side is unbounded."""
        return None if self.left is None or self.right is None else self.left + self.right + 1

    def kernel_args(self) -> tuple:
        """(softcap, lower_right, left, right) as the kernels take them."""
        return (self.softcap or 1.0, int(self.lower_right), UNBOUNDED if self.left is None else self.left,
                UNBOUNDED if self.right is None else self.right)


CAUSAL = Mask(right=0)
FULL = Mask()


CAUSAL_ALIGNMENTS = ("upper_left", "lower_right")


# How the registered ops carry a mask: one list of floats, so that a new kind of mask changes no
# op's schema. Its entries, in order (a side of -1: unbounded; 0 / 1; a cap of 0.0: none; 0 / 1,
# which direct callers of the ops may leave out).
OP_FIELDS = ("left", "right", "lower_right", "softcap", "deterministic")


def from_op_args(values) -> Mask:
    """The Mask a registered op's `mask` argument (`op_args`) describes."""
    if len(values) not in (len(OP_FIELDS) - 1, len(OP_FIELDS)):
        raise ValueError(f"mask must hold {len(OP_FIELDS)} values {OP_FIELDS}, got {list(values)!r}")
    left, right, lower_right, softcap, *deterministic = values
    return Mask(None if left < 0 else int(left), None if right < 0 else int(right), bool(lower_right),
                float(softcap) if softcap > 0 else None, bool(deterministic and deterministic[0]))


def lower_right(values) -> list[float]:
    """The same `op_args` aligned lower-right (what a KV cache's queries need)."""
    return [*values[:2], 1.0, *values[3:]]


def _window_side(name: str, value) -> int:
    """A window side as the registered op takes it: an int >= 0, or -1 for unbounded (None, or -1
    as FlashAttention writes it)."""
    if value is None:
        return -1
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be None or an int, got {type(value).__name__}")
    if value < -1:
        raise ValueError(f"{name} must be >= 0 (or None / -1: unbounded), got {value}")
    # A side past any length is unbounded (kernels' int32 bounds must not overflow).
    return -1 if value >= UNBOUNDED else int(value)


def op_args(causal, window, softcap, align=None, deterministic=False) -> list[float]:
    """The registered ops' `mask` argument (`OP_FIELDS`) from the public arguments.

    causal: a bool (True: "upper_left"), "upper_left", "lower_right", or torch's CausalVariant;
    window: None or (left, right), each None / -1 (unbounded) or an int >= 0, causal capping right
    at 0; softcap: None (or 0.0, as FlashAttention writes it) or a positive number; align: where
    windows and causal masks sit when Nq != Nk, "upper_left" (SDPA's) or "lower_right"
    (FlashAttention's); None takes causal's ("lower_right" only when causal says so); deterministic:
    a bool."""
    variant = getattr(causal, "name", None) if type(causal).__name__ == "CausalVariant" else None
    if variant is not None:
        causal = variant.lower()
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal must be a bool, 'upper_left' or 'lower_right', got {causal!r}")
        is_causal, lower_right = True, causal == "lower_right"
    else:
        is_causal, lower_right = checks.check_flag("causal", causal), False
    if align is not None:
        if align not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"align must be None, 'upper_left' or 'lower_right', got {align!r}")
        if isinstance(causal, str) and causal != align:
            raise ValueError(f"causal={causal!r} and align={align!r} disagree on the alignment")
        lower_right = align == "lower_right"
    left = right = -1
    if window is not None:
        if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
            raise TypeError(f"window must be None or a (left, right) pair, got {window!r}")
        left, right = _window_side("window[0]", window[0]), _window_side("window[1]", window[1])
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    cap = 0.0
    zero = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) and softcap == 0
    if softcap is not None and not zero:
        cap = layout.check_scale("softcap", softcap)
    return [float(left), float(right), float(lower_right), cap,
            float(deterministic is not False and checks.check_flag("deterministic", deterministic))]

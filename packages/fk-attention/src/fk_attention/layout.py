"""fk-attention's layouts and checks: what q, k, v may be, the checks of the public calls and of
the registered ops (clear errors naming the argument), the tensor-descriptor (TMA) gates, the
kernels' view of dense and packed operands, and the outputs laid out like the inputs. Numbers that
are tuned live in `config`; what is launched for a key, in `plan`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from fk_runtime import alloc, backend, checks, sizing


MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8

# fp8 forward: e4m3/e5m2 tensor-core dots need Ada (8.9) or newer.
FP8_MIN_CAPABILITY = (8, 9)
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, name)
)

# What q, k, v may hold (fp8: forward only).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)

# fp8 attention writes its output in this dtype (P @ V accumulates in fp32).
FP8_OUTPUT_DTYPE = torch.bfloat16

# 8-bit dots need K >= 32: fp8 pads head dims (and the forward's BLOCK_N is >= 32) to this.
FP8_MIN_DOT_K = 32

# TMA: Hopper (sm_90) and newer; base address and every stride but the last 16-byte aligned.
DESCRIPTOR_MIN_CAPABILITY = (9, 0)
DESCRIPTOR_ALIGN_BYTES = 16
DESCRIPTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Flip to False to time the pointer path alone on Hopper or newer (e.g. to see what TMA buys).
DESCRIPTORS_ON_HOPPER = True

# TMA strides are below 2**40 bytes.
DESCRIPTOR_MAX_STRIDE_BYTES = 1 << 40

# The interpreter's tl.dot is wrong on bf16 (NumPy has no bf16; fp16 and fp32 are right): bf16
# inputs run there in fp32, results cast back.
INTERPRETER_WIDENED = (torch.bfloat16,)

# Pointer loads and stores form a tile's offsets (row i x token stride + column j x head-dim
# stride, i < BLOCK_M or BLOCK_N, j < the padded head dim) in 32 bits, the block's start in 64:
# a tensor whose strides could overflow that (a view hopping millions of elements between tokens,
# or a head-dim-major layout) is copied contiguous first. MAX_TILE_EXTENT bounds both tile sides.
TILE_OFFSET_LIMIT = sizing.INT32_OFFSET_LIMIT
MAX_TILE_EXTENT = 256


# ---- checks ---------------------------------------------------------------------------------


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be from 1 to {MAX_HEAD_DIM}, got {head_dim}")


def check_alibi(alibi, q: torch.Tensor, batch: int, heads: int) -> None:
    """ALiBi slopes as FlashAttention takes them: fp32, (heads,) or (batch, heads), on q's device,
    constants (no gradient flows to them)."""
    if alibi is None:
        return
    checks.check_tensor("alibi_slopes", alibi, dtypes=(torch.float32,), min_dim=1, max_dim=2)
    if alibi.shape[-1] != heads or (alibi.dim() == 2 and alibi.shape[0] != batch):
        raise ValueError(f"alibi_slopes must be ({heads},) or ({batch}, {heads}) (query heads; batch: sequences), "
                         f"got shape {tuple(alibi.shape)}")
    checks.check_same_device(q=q, alibi_slopes=alibi)
    if alibi.requires_grad:
        raise ValueError("alibi_slopes must not require grad (FlashAttention's slopes are constants too)")


def check_dropout(dropout_p, generator) -> float:
    """Attention dropout's probability, a float in [0, 1) (FlashAttention's `dropout_p`), and the
    optional torch.Generator its seeds are drawn from."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:  # (NaN fails this too)
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return float(dropout_p)


def alibi_strides(alibi: torch.Tensor | None) -> tuple[int, int]:
    """(batch stride, head stride) of ALiBi slopes as the kernels read them: (0, 0) without."""
    if alibi is None:
        return (0, 0)
    return (0, alibi.stride(0)) if alibi.dim() == 1 else tuple(alibi.stride())


def check_heads(q, k, v, head_axis: int, same: bool = True) -> None:
    """q, k, v share a head dim the kernels take, k and v one shape, and q's heads are a multiple
    of k's; with `same`, one dtype and device (callers that check more tensors together pass False)."""
    if same:
        checks.check_same_dtype(q=q, k=k, v=v)
        checks.check_same_device(q=q, k=k, v=v)
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v must share the head dim, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hk = q.shape[head_axis], k.shape[head_axis]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hk})")
    check_head_dim(d)


def check_inputs(q, k, v, packed: bool = False, dtypes=None) -> None:
    """What the kernels take: q (B, Hq, Nq, D), k and v (B, Hk, Nk, D) (packed: (total, H, D)) as
    `check_heads` wants them. The public calls check these before launching; the binds check
    again, once per plan, for callers of the registered ops (`torch.ops.fk.attention*`)."""
    dims = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtypes=dtypes or DTYPES, min_dim=dims, max_dim=dims)
    if not packed and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise ValueError(f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    check_heads(q, k, v, 1)


def check_bounds(cu_q, cu_k, packing) -> None:
    """Packed sequences' bounds: int32 (S + 1,) each, S the packing's sequences."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.check_tensor(name, cu, dtypes=(torch.int32,), min_dim=1, max_dim=1)
        if cu.shape[0] != packing.sequences + 1:
            raise ValueError(f"{name} must hold {packing.sequences + 1} bounds (sequences + 1), got shape "
                             f"{tuple(cu.shape)}")


def check_backward(grad_out, grad_lse, q, k, v, out, lse, packed: bool) -> None:
    """The backward's inputs as the forward made them (registered-op callers: once per plan)."""
    check_inputs(q, k, v, packed)
    for name, t in (("out", out), ("grad_out", grad_out)):
        checks.check_tensor(name, t, dtypes=DTYPES)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    rows = (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and tuple(t.shape) != rows:
            raise ValueError(f"{name} must have shape {rows} (a row per query and head), got {tuple(t.shape)}")


def check_forward_only_fp8(q, k, v) -> None:
    if q.dtype in FP8_DTYPES and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("fp8 attention is forward-only (inference): q, k, v must not require grad")


def check_attention_inputs(q, k, v, dtypes=DTYPES, packed: bool = False) -> None:
    check_inputs(q, k, v, packed, dtypes)
    check_forward_only_fp8(q, k, v)


# The kernels scale in fp32 (sm_scale * log2(e) included): a larger scale or cap is inf there.
MAX_SCALE = torch.finfo(torch.float32).max / 2


def check_scale(name: str, value) -> float:
    checks.check_positive(name, value)
    if value > MAX_SCALE:
        raise ValueError(f"{name} must be at most {MAX_SCALE:.3g} (the kernels scale in fp32), got {value!r}")
    return float(value)


def softmax_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_scale("sm_scale", sm_scale)


# ---- dtypes and head dims ---------------------------------------------------------------------


def padded_head_dim(head_dim: int, dtype: torch.dtype | None = None) -> int:
    """Head dims are padded to a power of two inside the kernels (masked loads, zero fill); at
    least FP8_MIN_DOT_K for 1-byte inputs (an 8-bit tensor-core dot takes K >= 32)."""
    padded = max(sizing.next_power_of_2(head_dim), MIN_HEAD_DIM)
    if dtype is not None and dtype.itemsize == 1:
        padded = max(padded, FP8_MIN_DOT_K)
    return padded


def fp8_supported(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether fp8 inputs can run on `device` (default: the current GPU), and why not."""
    if backend.backend() is not backend.Backend.CUDA:
        return False, ("fp8 attention needs a CUDA GPU (compute capability >= 8.9), backend is "
                       f"{backend.backend().value}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return False, f"fp8 attention needs compute capability >= 8.9, this GPU has {capability}"
    return True, ""


def precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs get exact fp32 products (tf32 would cost them ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else None


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    return FP8_OUTPUT_DTYPE if dtype in FP8_DTYPES else dtype


def widened(dtype: torch.dtype) -> bool:
    return dtype in INTERPRETER_WIDENED and backend.is_interpreter()


# ---- tensor descriptors (TMA) -----------------------------------------------------------------


def is_hopper_or_newer(device: torch.device | None = None) -> bool:
    return (backend.backend() is backend.Backend.CUDA
            and torch.cuda.get_device_capability(device) >= DESCRIPTOR_MIN_CAPABILITY)


def aligned(t: torch.Tensor) -> bool:
    """What a 4-D TMA descriptor over t needs: base 16-byte aligned, last dim contiguous, every
    other stride (of a dim with more than one entry: the others are replaced, see
    `descriptor_strides`) positive, 16-byte aligned and under the TMA limit."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % DESCRIPTOR_ALIGN_BYTES == 0
        and all(0 < t.stride(i) * size < DESCRIPTOR_MAX_STRIDE_BYTES
                and (t.stride(i) * size) % DESCRIPTOR_ALIGN_BYTES == 0
                for i in range(t.dim() - 1) if t.shape[i] > 1)
    )


def descriptor_strides(t: torch.Tensor) -> list[int]:
    """t's strides, where a dim of one entry (any stride, never stepped) takes the extent of the
    dims inside it rounded up to the alignment: valid for TMA, never overlapping."""
    align = DESCRIPTOR_ALIGN_BYTES // t.element_size()
    strides = list(t.stride())
    extent = t.shape[-1]
    for i in reversed(range(t.dim() - 1)):
        if t.shape[i] == 1:
            strides[i] = sizing.cdiv(extent, align) * align
        extent = max(extent, strides[i] * t.shape[i])
    return strides


def descriptors_allowed(*tensors: torch.Tensor) -> bool:
    """Whether descriptors are valid for these (B, H, N, D) tensors on any backend (tests force
    the descriptor path on the interpreter with this)."""
    return all(t.dtype in DESCRIPTOR_DTYPES and aligned(t) for t in tensors)


def use_descriptors(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors (TMA) for a launch touching these tensors: Hopper or newer CUDA, and
    `descriptors_allowed`."""
    return DESCRIPTORS_ON_HOPPER and is_hopper_or_newer() and descriptors_allowed(*tensors)


def strides_allow_descriptors(t: torch.Tensor) -> bool:
    """`aligned` without the base address (checked per call)."""
    size = t.element_size()
    return t.dtype in DESCRIPTOR_DTYPES and t.stride(-1) == 1 and all(
        0 < t.stride(i) * size < DESCRIPTOR_MAX_STRIDE_BYTES and (t.stride(i) * size) % DESCRIPTOR_ALIGN_BYTES == 0
        for i in range(t.dim() - 1) if t.shape[i] > 1)


def on_hopper_descriptors(device: torch.device) -> bool:
    return DESCRIPTORS_ON_HOPPER and is_hopper_or_newer(device)


def descriptors_may_serve(device: torch.device, tensors) -> bool:
    """Whether TMA descriptors can serve launches over tensors laid out like these on `device`
    (decided once per plan; `bases_aligned` decides per call)."""
    return on_hopper_descriptors(device) and all(strides_allow_descriptors(t) for t in tensors)


def bases_aligned(tensors) -> bool:
    return all(t.data_ptr() % DESCRIPTOR_ALIGN_BYTES == 0 for t in tensors)


# ---- the kernels' view of operands, outputs laid out like the inputs ---------------------------


def tile_offsets_fit(t: torch.Tensor) -> bool:
    """Whether every in-tile offset of the (..., N, D) tensor t fits 32 bits."""
    return (MAX_TILE_EXTENT - 1) * (t.stride(-2) + t.stride(-1)) < TILE_OFFSET_LIMIT


def row_offsets_fit(t: torch.Tensor) -> bool:
    """Whether the (..., N) tensor t's row offsets (row x stride, rows < N) fit 32 bits."""
    return t.shape[-1] * t.stride(-1) < TILE_OFFSET_LIMIT


def fit(t: torch.Tensor, fits=None) -> tuple[torch.Tensor, bool]:
    """t, or a contiguous copy where its strides would overflow the kernels' 32-bit in-tile
    offsets (rare layouts: see `tile_offsets_fit`); and whether t is used as it is."""
    ok = (fits or tile_offsets_fit)(t)
    return (t if ok else t.contiguous()), ok


def packed(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the kernels read it: a (1, H, total, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def kernel_strides(t: torch.Tensor, varlen: bool) -> tuple:
    """(B, H, N, D) strides of a kernel operand; packed operands step no batch (b is the sequence)."""
    return (0, *t.stride()[1:]) if varlen else t.stride()


@dataclasses.dataclass(frozen=True)
class Packing:
    """Packed sequences: how many, and the longest query / key lengths the grids are sized for."""

    sequences: int
    max_q: int
    max_k: int


def heads_inside_tokens(t: torch.Tensor) -> bool:
    """Whether a fresh tensor laid out like t takes (B, N, H, D) storage: t is such a view (so
    that `.transpose(1, 2)` of the result is contiguous again), unless that token stride (H * D)
    would overflow the kernels' in-tile offsets."""
    b, h, n, d = t.shape
    return t.stride(1) < t.stride(2) and (MAX_TILE_EXTENT - 1) * (h * d + 1) < TILE_OFFSET_LIMIT


def bnhd_strides(shape) -> tuple[int, int, int, int]:
    b, h, n, d = shape
    return n * h * d, d, h * d, 1


def new_output(shape, bnhd: bool, like: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, D) tensor in like's dtype and device, on (B, N, H, D) storage where bnhd: a
    tensor of its own, not a view (autograd and torch's in-place rules treat it as torch's)."""
    return alloc.new_empty_strided(like, shape, bnhd_strides(shape)) if bnhd else alloc.new_empty(like, shape)


def fake_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The registered fakes' output laid out like t, as the bound plans allocate it."""
    dtype = dtype or t.dtype
    if heads_inside_tokens(t):
        return t.new_empty_strided(t.shape, bnhd_strides(t.shape), dtype=dtype)
    return t.new_empty(t.shape, dtype=dtype)

"""Block, warp and grid sizing shared by every op.

Op kernels and launchers hold no sizing literals: they ask this module, and their own package's
launch table (`fk_<op>.plan`, where each op's budgets are named), for block sizes, warp counts
and grids. Every shared budget has a name here. HIP differences (64-wide wavefronts,
`waves_per_eu`) live here too, in one place.
"""

from __future__ import annotations

import dataclasses

import torch

from . import backend

# A row that one program holds whole in registers may take at most this many bytes of the
# input dtype (the Triton tutorials' 64 KB budget); longer rows go to a looped/online path.
MAX_FUSED_ROW_BYTES = 65536
# Element offsets past this wrap in 32-bit index arithmetic (`i * stride` in int32): kernels form
# such offsets in 64 bits, or their launchers keep inputs under it.
INT32_OFFSET_LIMIT = 2**31
# Widest global memory access one thread issues; blocks are sized so each thread gets whole
# vectors of this size.
VECTOR_BYTES = 16
# Elements per thread we aim for in a register-resident row: enough independent loads in
# flight to cover memory latency, few enough to avoid spills.
ELEMENTS_PER_THREAD_TARGET = 16
MIN_WARPS = 4
MAX_WARPS_CUDA = 32  # 1024 threads, the CUDA block limit
MAX_WARPS_HIP = 16  # 1024 threads of 64-wide wavefronts
# AMD: ask the compiler for this many waves per execution unit on memory-bound kernels.
HIP_WAVES_PER_EU = 2
# Grids for memory-bound kernels: this many programs per multiprocessor keep enough bytes in
# flight without a tail effect.
PROGRAMS_PER_SM = 8
# 32-bit registers of a multiprocessor (sm_70 to sm_90), and the unit a thread's count is
# allocated in: what `register_cap` divides among the programs an op wants resident.
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 8


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def vector_elements(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one widest vector access."""
    return max(VECTOR_BYTES // element_size(dtype), 1)


def max_fused_row_elements(dtype: torch.dtype) -> int:
    """Longest row (in elements) that one program may hold whole."""
    return MAX_FUSED_ROW_BYTES // element_size(dtype)


def fused_row_block(n_cols: int, dtype: torch.dtype) -> int | None:
    """Power-of-two block covering a whole row, or None when the row is too long to hold."""
    block = next_power_of_2(n_cols)
    return block if block <= max_fused_row_elements(dtype) else None


def looped_row_block(dtype: torch.dtype) -> int:
    """Chunk size for rows walked in a loop: the largest block that still counts as fused."""
    return max_fused_row_elements(dtype)


def rows_per_program(n_rows: int, block_cols: int, dtype: torch.dtype, tile_bytes: int) -> int:
    """Whole rows of `block_cols` one program takes so that it moves about `tile_bytes`: a power of
    two, at least one, and no more than the rows there are."""
    rows = max(1, tile_bytes // (block_cols * element_size(dtype)))
    return min(next_power_of_2(rows), next_power_of_2(n_rows))


def max_warps() -> int:
    return MAX_WARPS_HIP if backend.is_hip() else MAX_WARPS_CUDA


def num_warps_for(block_elements: int) -> int:
    """Warps for a program that touches `block_elements` elements at once.

    One warp per `warp_size * ELEMENTS_PER_THREAD_TARGET` elements, as a power of two between
    MIN_WARPS and the backend's maximum. It counts threads, so a 64-wide wavefront gets half the
    warps a 32-wide warp does.
    """
    per_warp = backend.warp_size() * ELEMENTS_PER_THREAD_TARGET
    warps = next_power_of_2(cdiv(block_elements, per_warp))
    return max(MIN_WARPS, min(warps, max_warps()))


# Warps for a program holding a row (or a few rows, or one chunk) of `elements` values in
# registers: (max elements, warps), first match wins. Counted in 32-wide warps (scaled for HIP).
# 8 to 32 values per thread: 82-99% of copy bandwidth on an H100, against 55-69% for 16-32 KB
# tiles on 16-32 warps (shared/TUNING.md).
ROW_WARPS_BY_ELEMENTS = ((2048, 4), (4096, 8), (16384, 16), (None, 32))


def row_warps(elements: int) -> int:
    """Warps for a program holding `elements` values of whole rows (ROW_WARPS_BY_ELEMENTS)."""
    warps = next(w for limit, w in ROW_WARPS_BY_ELEMENTS if limit is None or elements <= limit)
    warps = warps * 32 // backend.warp_size()
    return max(MIN_WARPS, min(warps, max_warps()))


def launch_options(num_warps: int, num_stages: int | None = None, max_registers: int | None = None) -> dict:
    """Keyword arguments for a kernel launch, with the backend's extras. `max_registers`: a cap on
    each thread's registers (CUDA's maxnreg; ignored elsewhere)."""
    options: dict = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if max_registers is not None and not backend.is_hip():
        options["maxnreg"] = max_registers
    if backend.is_hip():
        options["waves_per_eu"] = HIP_WAVES_PER_EU
    return options


def register_cap(programs_per_sm: int, num_warps: int) -> int:
    """The most registers a thread may take so that `programs_per_sm` programs of `num_warps`
    warps fit one multiprocessor's register file. Newer Tritons allocate more registers for the
    same kernel than 3.6 did, one program less per multiprocessor where a row kernel's speed is
    its occupancy: a plan caps them at the occupancy it was measured at (`launch_options`)."""
    per_thread = REGISTERS_PER_SM // (programs_per_sm * num_warps * backend.warp_size())
    return per_thread - per_thread % REGISTER_ALLOCATION_UNIT


def persistent_grid(n_work_items: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs for a grid that loops over `n_work_items`: at most a few per multiprocessor."""
    return max(1, min(n_work_items, backend.multiprocessor_count() * programs_per_sm))


@dataclasses.dataclass(frozen=True)
class Tile2D:
    """A rows x cols tile walked by one program, with the warps to launch it."""

    block_rows: int
    block_cols: int
    num_warps: int

    @property
    def elements(self) -> int:
        return self.block_rows * self.block_cols


def tile_2d(n_rows: int, n_cols: int, dtype: torch.dtype, tile_bytes: int, max_cols: int) -> Tile2D:
    """A tile of about `tile_bytes` of `dtype`: as wide as the row allows (up to `max_cols`),
    then as many rows as fit. Both sides are powers of two."""
    elems = max(tile_bytes // element_size(dtype), 1)
    block_cols = min(next_power_of_2(n_cols), next_power_of_2(max_cols), elems)
    block_rows = min(max(elems // block_cols, 1), next_power_of_2(n_rows))
    return Tile2D(block_rows, block_cols, num_warps_for(block_rows * block_cols))

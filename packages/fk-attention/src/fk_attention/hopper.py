"""fk-attention's Hopper forward in Gluon, top to bottom: when it is taken, its tiles, kernel and launch,
bound once per plan; the TMA tiles and the Hopper gate that `hopper_backward` shares.

The forward is FlashAttention-3's design, written with Triton's Gluon (`triton.experimental.gluon`):
each tile is 128 query rows of one (batch, head), taken by two 4-warp consumer warpgroups of 64
rows each (at d64 192 rows, three, but for causal masks up to 4096 rows), with one producer warp that
moves Q and rings of K and V blocks into shared memory through TMA (mbarriers: `ready` when a stage
has landed, `empty` when every consumer is done with it). A consumer issues the next block's Q K^T on
the tensor cores before the softmax of this one, so that softmax runs under the P V matmul
(asynchronous wgmma); the producer's registers go to the consumers (`setmaxnreg`). At d64 and d128 a
program takes tile after tile (a persistent grid; causal tiles in the order its plan lists,
`causal_schedule`), the next tile's Q and K loading while this one's output drains.

Taken for what it was built and measured on (TUNING.md: Hopper forward): an H100-class GPU (compute
capability 9.x), the Triton versions in `fk_runtime.gluon.VERSIONS` (whose names for Gluon's API the
kernels use), fp16/bf16, head dims padded to those of `config.GLUON_FORWARD_TILES`, full or causal
masks (either alignment), windows and softcaps on the releases in `config.GLUON_FORWARD_MASKS` (but
not at the head dims of `config.GLUON_FORWARD_FULL_OR_CAUSAL`), dense (B, H, N, D) tensors whose
strides a TMA descriptor takes and whose bases are aligned (checked per call), or packed sequences at
the head dims of `config.GLUON_FORWARD_PACKED_HEAD_DIMS` (one tile a program, the output stored from
registers: a tile's last rows may be the next sequence's), a positive scale.
Everything else, and any Triton where Gluon or this API is missing, runs the `tl` kernels
(`kernels.py`), which stay the reference the GPU tests compare with.
"""

from __future__ import annotations

import heapq

import torch
import triton

from fk_runtime import gluon as fk_gluon
from fk_runtime import backend, sizing
from fk_runtime.gluon import (fence_async_shared, gl, gluon, mbarrier, reinterpret, store_wait, tma_load,
                              tma_store, warpgroup_mma, warpgroup_mma_wait)
from fk_runtime.launch import Descriptor, Launch

from . import config
from .kernels import TANH_APPROX, TANH_APPROX_ASM
from .config import GLUON_CONSUMER_REGISTERS, GLUON_PRODUCER_REGISTERS, GLUON_ROWS
from .layout import Packing, descriptor_strides, descriptors_may_serve, padded_head_dim
from .mask import Mask

DTYPES = (torch.float16, torch.bfloat16)
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32} if gl else {}
LOG2E = 1.4426950408889634


def gluon_device(device_index: int) -> bool:
    """Whether Gluon's Hopper kernels may run on this device: a CUDA GPU of compute capability 9.x and a
    Triton whose Gluon API fk's kernels were built for."""
    return (backend.backend() is backend.Backend.CUDA and fk_gluon.supported()
            and torch.cuda.get_device_capability(device_index)[0] == 9)


def on_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple) -> bool:
    """Whether Gluon's Hopper kernels may take these tensors at one of `head_dims` (padded)."""
    return (q.dtype in DTYPES and padded_head_dim(q.shape[-1]) in head_dims
            and descriptors_may_serve(q.device, (q, k, v)) and gluon_device(q.device.index or 0))


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, sm_scale: float,
          packing: Packing | None = None) -> bool:
    """Whether the forward of these tensors runs here (at any length): the row max is taken on unscaled
    scores, so the scale must be positive; full or causal masks, windows and softcaps too on the releases
    in `config.GLUON_FORWARD_MASKS`, but not at the head dims in `config.GLUON_FORWARD_FULL_OR_CAUSAL`.
    Packed sequences (`packing`, views as `layout.packed` makes): at the head dims of
    `config.GLUON_FORWARD_PACKED_HEAD_DIMS`; a max_seqlen of 0 keeps the tl kernel (it sizes nothing here,
    but only the tl kernel was tested with it)."""
    padded = padded_head_dim(q.shape[-1])
    if padded in config.GLUON_FORWARD_FULL_OR_CAUSAL:
        masks = mask.full_or_causal
    else:
        masks = mask.full_or_causal or backend.triton_release() in config.GLUON_FORWARD_MASKS
    if packing is not None and (padded not in config.GLUON_FORWARD_PACKED_HEAD_DIMS
                                or min(packing.max_q, packing.max_k) == 0):
        return False
    return sm_scale > 0 and masks and on_hopper(q, k, v, tuple(row[0] for row in config.GLUON_FORWARD_TILES))


def two_consumer_rows(head_dim: int, seen: int) -> int | None:
    """Query rows up to which the forward at this head dim, mask build `seen`, takes two consumers
    (`config.GLUON_FORWARD_TWO`); None: always its `GLUON_FORWARD_TILES` count."""
    padded = padded_head_dim(head_dim)
    return next((rows for dim, built, rows in config.GLUON_FORWARD_TWO if (dim, built) == (padded, seen)), None)


def forward_tiles(head_dim: int, seen: int, n_q: int, packed: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, CONSUMERS) of the forward at this head dim (`config.GLUON_FORWARD_TILES`) for
    the mask build `seen` (`forward_mask_args`) on n_q query rows: two up to `two_consumer_rows`; packed
    sequences at most `config.GLUON_FORWARD_PACKED_CONSUMERS`."""
    padded = padded_head_dim(head_dim)
    block_n, stages, consumers = next(tuple(tiles[1:]) for tiles in config.GLUON_FORWARD_TILES
                                      if tiles[0] == padded)
    two = two_consumer_rows(head_dim, seen)
    if two is not None and n_q <= two:
        consumers = 2
    if packed:
        consumers = min(consumers, config.GLUON_FORWARD_PACKED_CONSUMERS)
    return block_n, stages, consumers


def consumer_registers(consumers: int) -> int:
    """Registers a consumer warpgroup asks for (`setmaxnreg`): two share what the producer warp
    leaves, three fit 16 warps' 64K (`config.GLUON_CONSUMER_REGISTERS`, `GLUON_THREE_CONSUMER_REGISTERS`)."""
    return config.GLUON_THREE_CONSUMER_REGISTERS if consumers == 3 else GLUON_CONSUMER_REGISTERS


def forward_mask_args(mask: Mask, sm_scale: float, dtype: torch.dtype) -> tuple[dict, tuple]:
    """The forward kernel's mask constexprs (SEEN: 0 every key, 1 causal, 2 another window; SOFTCAP,
    `Mask.softcap_build`) and (qk_scale, cap_scale, left, right): the base-2 factor on the (capped) scores,
    what the raw scores are multiplied by inside tanh (for tanh from exp2, by exp2), the window's sides
    (`Mask.kernel_args`)."""
    cap, _, left, right = mask.kernel_args()
    seen = 0 if not mask.windowed else 1 if mask.left is None and mask.right == 0 else 2
    softcap = mask.softcap_build(dtype)
    if softcap:
        inside = sm_scale / cap if softcap == TANH_APPROX else 2 * LOG2E * sm_scale / cap
        return {"SEEN": seen, "SOFTCAP": softcap}, (cap * LOG2E, inside, left, right)
    return {"SEEN": seen, "SOFTCAP": 0}, (sm_scale * LOG2E, 1.0, left, right)


def half_last(seen: int, head_dim: int, consumers: int) -> bool:
    """Whether the forward of mask build `seen` at this head dim on `consumers` warpgroups takes a consumer's
    last key block at half width where its rows see none of the block's second half (causal: a 128-row
    tile's first 64 rows on its diagonal block; `config.GLUON_FORWARD_HALF_LAST`, two consumers)."""
    return consumers == 2 and (padded_head_dim(head_dim), seen) in config.GLUON_FORWARD_HALF_LAST


def late_pv_wait(seen: int, head_dim: int, consumers: int) -> bool:
    """Whether the forward of mask build `seen` at this head dim on `consumers` warpgroups waits for a step's
    P V below a branch after the softmax (`config.GLUON_FORWARD_LATE_PV_WAIT`): ptxas moves a wgmma wait up
    to the top of its basic block, which without the branch puts P_{j-1} V_{j-1}'s wait before S_j's softmax."""
    return (padded_head_dim(head_dim), seen, consumers) in config.GLUON_FORWARD_LATE_PV_WAIT


def staggered(seen: int, head_dim: int, consumers: int, persistent: bool) -> bool:
    """Whether the forward's second consumer starts a program's first tile once the first has ended its first
    softmax (`config.GLUON_FORWARD_STAGGER`: two consumers on the persistent grid), so that the two take turns
    at the exponentials and the matmuls from the start rather than meet on both."""
    return (persistent and consumers == 2
            and (padded_head_dim(head_dim), seen) in config.GLUON_FORWARD_STAGGER)


def row_chains(seen: int, head_dim: int, consumers: int) -> int:
    """In how many chains a thread the forward's softmax takes each row's max over its scores, the sum then in one
    chain (`config.GLUON_FORWARD_ROW_CHAINS`, per release); 0: both in the tree Triton 3.8+ reduces in. After the
    tree's short reduction ptxas issued the exponentials in a burst; after a chain, spaced as Triton 3.6 and 3.7
    schedule them."""
    build = (backend.triton_release(), padded_head_dim(head_dim), seen, consumers)
    return next((chains for *key, chains in config.GLUON_FORWARD_ROW_CHAINS if tuple(key) == build), 0)


def consumer_builds(seen: int, head_dim: int, consumers: int, persistent: bool) -> dict:
    """The forward kernel's per-build constexprs of its warpgroups, as `bind` launches them (and
    `tuning/gluon_registers.py` compiles them): registers, and the switches of the functions above."""
    return {"CONSUMER_REGISTERS": consumer_registers(consumers), "PRODUCER_REGISTERS": GLUON_PRODUCER_REGISTERS,
            "HALF_LAST": half_last(seen, head_dim, consumers), "LATE_PV_WAIT": late_pv_wait(seen, head_dim, consumers),
            "STAGGER": staggered(seen, head_dim, consumers, persistent),
            "ROW_CHAINS": row_chains(seen, head_dim, consumers)}


def persistent_grid(seen: int, head_dim: int, n_q: int) -> bool:
    """Whether the forward runs on a persistent grid: its padded head dim in
    `config.GLUON_PERSISTENT_HEAD_DIMS`, its mask in `GLUON_PERSISTENT_SEEN` (causal up to
    `GLUON_PERSISTENT_CAUSAL_N` query rows)."""
    return (seen in config.GLUON_PERSISTENT_SEEN and padded_head_dim(head_dim) in config.GLUON_PERSISTENT_HEAD_DIMS
            and (seen != 1 or n_q <= config.GLUON_PERSISTENT_CAUSAL_N))


def length_buckets(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, sm_scale: float) -> tuple:
    """Query lengths past which the forward of tensors like these (any length) compiles another
    variant: where the Gluon forward's causal grid or consumer count changes
    (`config.GLUON_PERSISTENT_CAUSAL_N`, `GLUON_FORWARD_TWO`), for `warm.warmup` to call past each."""
    if not takes(q, k, v, mask, sm_scale):
        return ()
    seen, d = forward_mask_args(mask, sm_scale, q.dtype)[0]["SEEN"], q.shape[-1]

    def variant(n_q: int) -> tuple[bool, int]:
        return persistent_grid(seen, d, n_q), forward_tiles(d, seen, n_q)[2]

    bounds = {config.GLUON_PERSISTENT_CAUSAL_N, two_consumer_rows(d, seen)} - {None}
    return tuple(sorted(n for n in bounds if variant(n) != variant(n + 1)))


if gluon is not None:

    @triton.constexpr_function
    def mma_layout(cols):
        """Every consumer's wgmma accumulator layout: one 4-warp warpgroup, 16 x `cols` x 16 instructions."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])

    @gluon.jit
    def _fwd_tile(tile, n_q, n_k, n_heads, group, shift, left, right, cu_q, cu_k, total_q, total_k,
                  SEEN: gl.constexpr, TILE: gl.constexpr, BLOCK_N: gl.constexpr, VARLEN: gl.constexpr):
        """(b, h, hk, start_m, first, n_steps, q0, k0, n_q, n_k, shift) of a tile, TILE query rows of one
        (batch, head) (causal: within a head, the blocks that see the most keys come first): key blocks
        [first, first + n_steps) (`kernels._key_range`'s bounds); dense: q0 = k0 = 0. VARLEN: b is a
        packed sequence, rows q0 + [0, n_q) of q against k0 + [0, n_k) of k (`_sequence`); n_q in is the
        sequences' count, shift in the lower-right flag, and the tiles are `_packed_slot`'s."""
        if VARLEN:  # heads innermost: a sequence's block for every head, then its next
            h = tile % n_heads
            b, block = _packed_slot(tile // n_heads, cu_q, total_q, n_q, SEEN, TILE)
            q0, n_q = _sequence(cu_q, b, total_q)
            k0, n_k = _sequence(cu_k, b, total_k)
            shift = shift * (n_k - n_q)
        else:
            n_blocks = gl.cdiv(n_q, TILE)
            bh = tile // n_blocks
            block = tile % n_blocks
            if SEEN == 1:
                block = n_blocks - 1 - block
            b = bh // n_heads
            h = bh % n_heads
            q0 = 0
            k0 = 0
        start_m = block * TILE
        first = 0
        end = n_k
        if SEEN == 1:
            end = gl.minimum(n_k, gl.maximum(start_m + TILE + shift, 0))
        if SEEN == 2:
            first = gl.maximum(start_m + shift - left, 0) // BLOCK_N
            end = gl.maximum(gl.minimum(n_k, start_m + TILE + shift + right), first * BLOCK_N)
        n_steps = gl.cdiv(end, BLOCK_N) - first
        if VARLEN:  # a sequence's spare slot: no rows
            n_steps = gl.where(start_m < n_q, n_steps, 0)
        return b, h, h // group, start_m, first, n_steps, q0, k0, n_q, n_k, shift

    @gluon.jit
    def _sequence(cu, b, total):
        """(first row, length) of packed sequence b, clamped to [0, total] as `kernels._sequence` (bad
        bounds give wrong rows, never an out-of-range access)."""
        first = gl.minimum(gl.maximum(gl.load(cu + b), 0), total)
        return first, gl.minimum(gl.maximum(gl.load(cu + b + 1), first), total) - first

    @gluon.jit
    def _packed_slot(slot, cu_q, total_q, sequences, SEEN: gl.constexpr, TILE: gl.constexpr):
        """(sequence, block) of a head's slot-th tile of packed sequences: sequence b holds slots from
        first_b // TILE + b on, at least its blocks (a spare at most), so total_q // TILE + sequences slots
        hold every block and no search needs the lengths summed; found by bisection (causal: a
        sequence's last blocks, which see the most keys, first)."""
        lo = 0
        hi = sequences
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first, _ = _sequence(cu_q, mid, total_q)
            if first // TILE + mid <= slot:
                lo = mid
            else:
                hi = mid
        first, n = _sequence(cu_q, lo, total_q)
        block = slot - (first // TILE + lo)
        if SEEN == 1:
            block = (first + n) // TILE - first // TILE - block
        return lo, gl.where(block < 0, n // TILE + 1, block)  # (bounds out of order: no rows)

    @gluon.jit
    def _full_blocks(row0, n_k, shift, left, right, SEEN: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_N: gl.constexpr):
        """[full_lo, full_hi): the key blocks that all ROWS query rows from row0 see in full, a consumer's
        own rows, not its tile's (three consumers: a 192-row tile's later rows mask fewer blocks)."""
        full_lo = 0
        full_hi = n_k // BLOCK_N
        if SEEN == 1:
            full_hi = gl.minimum(full_hi, gl.maximum(row0 + shift + 1, 0) // BLOCK_N)
        if SEEN == 2:
            full_lo = gl.cdiv(gl.maximum(row0 + ROWS - 1 + shift - left, 0), BLOCK_N)
            full_hi = gl.minimum(full_hi, gl.maximum(row0 + shift + right + 1, 0) // BLOCK_N)
        return full_lo, full_hi

    @gluon.jit
    def _half_last(row0, last_block, n_k, shift, SEEN: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Whether the ROWS query rows from row0 see no key of the second half of key block last_block
        (causal: the diagonal block of a tile's first 64 rows; other masks: past n_k), so that it can be
        skipped."""
        last_key = n_k - 1
        if SEEN == 1:
            last_key = gl.minimum(last_key, row0 + ROWS - 1 + shift)
        return last_key < last_block * BLOCK_N + BLOCK_N // 2

    @gluon.jit
    def _turns(schedule, n_tiles, SEEN: gl.constexpr):
        """(first, end, stride) of the program's turns on a persistent grid: causal, its entries of the plan's
        table (`causal_schedule`); otherwise tiles pid, pid + programs, ... of the n_tiles."""
        if SEEN == 1:
            first = gl.load(schedule + gl.program_id(0))
            end = gl.load(schedule + gl.program_id(0) + 1)
            stride = 1
        else:
            first = gl.program_id(0)
            end = n_tiles
            stride = gl.num_programs(0)
        return first, end, stride

    @gluon.jit
    def _turn_tile(at, schedule, n_q, ROWS: gl.constexpr, SEEN: gl.constexpr, CONSUMERS: gl.constexpr):
        """The tile of turn `at` (`_turns`) in `_fwd_tile`'s numbering: causal, the table's entry. Three
        consumers, other masks: a head's blocks rotated by the wave its first block falls in, so that a
        program's tiles take every block in turn: wherever the block count divides the program count, the cheap
        last blocks (spare consumers idle there, `_consume_tile`) went to the same programs."""
        if SEEN == 1:
            tile = gl.load(schedule + at)
        elif CONSUMERS == 3:
            n_blocks = gl.cdiv(n_q, CONSUMERS * ROWS)
            head_start = at // n_blocks * n_blocks
            tile = head_start + (at % n_blocks + head_start // gl.num_programs(0)) % n_blocks
        else:
            tile = at
        return tile

    @gluon.jit
    def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                      v_ready, v_empty, tile, j, step, n_q, n_k, n_heads, group, shift, left, right, cu_q, cu_k,
                      total_q, total_k, SEEN: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, VARLEN: gl.constexpr):
        """The program's j-th tile: every consumer's Q tile once it is done with the last tile's
        (after its last Q K^T), then its K and V blocks into their rings (STAGES and as many V stages
        as v_smem holds) from position `step` on, as stages free up. Returns the position after."""
        V_STAGES: gl.constexpr = v_smem.shape[0]
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        b, h, hk, start_m, first, n_steps, q0, k0, _, _, _ = _fwd_tile(
            tile, n_q, n_k, n_heads, group, shift, left, right, cu_q, cu_k, total_q, total_k, SEEN,
            CONSUMERS * ROWS, BLOCK_N, VARLEN)
        if VARLEN:  # packed: one (1, H, total, D) view, the sequence's rows from q0 and k0
            b = 0
        for i in gl.static_range(CONSUMERS):
            mbarrier.wait(q_free.index(i), (j & 1) ^ 1, pred=j > 0)
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma_load(q_desc, [b, h, q0 + start_m + i * ROWS, 0], q_bars.index(i), q_smem.index(i))
        for key_block in range(first, first + n_steps):
            at = step + key_block - first
            stage = at % STAGES
            phase = ((at // STAGES) & 1) ^ 1  # the first lap finds every stage free
            mbarrier.wait(k_empty.index(stage), phase, pred=at >= STAGES)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [b, hk, k0 + key_block * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
            v_stage = at % V_STAGES
            mbarrier.wait(v_empty.index(v_stage), ((at // V_STAGES) & 1) ^ 1, pred=at >= V_STAGES)
            mbarrier.expect(v_ready.index(v_stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [b, hk, k0 + key_block * BLOCK_N, 0], v_ready.index(v_stage), v_smem.index(v_stage))
        return step + n_steps

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                  v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, cu_q, cu_k, total_q, total_k,
                  schedule, SEEN: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  PERSISTENT: gl.constexpr, VARLEN: gl.constexpr):
        if PERSISTENT:  # the rings run on across tiles
            step = 0
            j = 0
            first, end, stride = _turns(schedule, n_tiles, SEEN)
            for at in range(first, end, stride):
                tile = _turn_tile(at, schedule, n_q, ROWS, SEEN, q_smem.shape[0])
                step = _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free,
                                     k_ready, k_empty, v_ready, v_empty, tile, j, step, n_q, n_k, n_heads,
                                     group, shift, left, right, cu_q, cu_k, total_q, total_k, SEEN, ROWS, BLOCK_N,
                                     STAGES, VARLEN)
                j += 1
        else:  # (no loop: one round spills nothing)
            _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                          v_ready, v_empty, gl.program_id(0), 0, 0, n_q, n_k, n_heads, group, shift, left, right,
                          cu_q, cu_k, total_q, total_k, SEEN, ROWS, BLOCK_N, STAGES, VARLEN)

    @gluon.jit
    def tanh_approx(x):
        """`kernels.tanh_approx` in Gluon: the GPU's tanh.approx.f32."""
        return gl.inline_asm_elementwise(TANH_APPROX_ASM, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def capped(s, cap_scale, SOFTCAP: gl.constexpr):
        """Raw scores with a softcap: tanh(s * sm_scale / cap), as `kernels.capped` (`forward_mask_args`:
        cap_scale is sm_scale / cap for TANH_APPROX, 2 log2(e) sm_scale / cap for tanh from exp2; qk_scale then
        holds cap * log2(e)); else s."""
        if SOFTCAP == TANH_APPROX:
            s = tanh_approx(s * cap_scale)
        elif SOFTCAP:
            s = 1.0 - 2.0 / (gl.exp2(s * cap_scale) + 1.0)
        return s

    @gluon.jit
    def _masked(s, rows, cols, key_block, n_k, shift, left, right, full_lo, full_hi, SEEN: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """Scores of keys a row does not see at -inf: past n_k, and (SEEN 1, causal) past a row's
        diagonal, or (SEEN 2, a window) with j - (i + shift) outside [-left, right], as
        `kernels._visible`; key blocks [full_lo, full_hi) every row sees in full pass unmasked."""
        if SEEN == 2:
            edge = (key_block < full_lo) | (key_block >= full_hi)
        else:
            edge = key_block >= full_hi
        if edge:
            keys = gl.expand_dims(cols + key_block * BLOCK_N, 0)
            # n_k folded into each row's bound: one compare and one select a score
            if SEEN == 0:
                keep = keys < n_k
            if SEEN == 1:
                keep = keys < gl.expand_dims(gl.minimum(rows + shift + 1, n_k), 1)
            if SEEN == 2:
                keep = keys < gl.expand_dims(gl.minimum(rows + shift + right + 1, n_k), 1)
                keep = keep & (keys >= gl.expand_dims(rows + shift - left, 1))
            s = gl.where(keep, s, -float("inf"))
        return s

    @gluon.jit
    def _top_halves(x):
        """[rows, cols] -> the columns whose top column bit is 0, and those whose is 1: a bit of the thread's
        registers in the wgmma layout (cols > 4), so that no value moves."""
        return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))

    @gluon.jit
    def _fold(x, acc, MAX: gl.constexpr, WIDTH: gl.constexpr):
        """acc folded with each of x's [rows, WIDTH] column slices in turn (max or sum): WIDTH / 4 chains a thread."""
        if x.shape[1] > WIDTH:
            a, b = _top_halves(x)
            acc = _fold(b, _fold(a, acc, MAX, WIDTH), MAX, WIDTH)
        elif MAX:
            acc = gl.maximum(acc, x)
        else:
            acc = acc + x
        return acc

    @gluon.jit
    def _first_fold(x, MAX: gl.constexpr, WIDTH: gl.constexpr):
        """x's [rows, WIDTH] column slices folded in turn, the first as the start."""
        if x.shape[1] > WIDTH:
            a, b = _top_halves(x)
            return _fold(b, _first_fold(a, MAX, WIDTH), MAX, WIDTH)
        else:
            return x

    @gluon.jit
    def _row_reduce(x, MAX: gl.constexpr, CHAIN: gl.constexpr):
        """Each row's max (MAX) or sum of x in its wgmma layout; CHAIN (`row_chains`): a thread's own values in
        CHAIN chains (the max) or one (the sum), then across its row's 4 threads, 0: `gl.max` / `gl.sum`'s order."""
        if CHAIN:
            WIDTH: gl.constexpr = 4 * CHAIN if MAX else 4
            even, odd = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            part = _fold(odd, _first_fold(even, MAX, WIDTH), MAX, WIDTH)
            r = gl.max(part, axis=1) if MAX else gl.sum(part, axis=1)
            return gl.convert_layout(r, gl.SliceLayout(1, x.type.layout))  # the same layout, another name
        elif MAX:
            return gl.max(x, axis=1)
        else:
            return gl.sum(x, axis=1)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, ROW_CHAINS: gl.constexpr):
        """Online softmax of one block of raw scores (base 2 after scaling by qk_scale > 0, folded
        into the exponent's multiply-add): p, the new row max (raw) and sum, and the factor that
        rescales the output so far (a row that has seen no key keeps max -inf and p 0)."""
        m_new = gl.maximum(m_i, _row_reduce(s, True, ROW_CHAINS))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new) * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i * qk_scale - m_use)
        return p, m_new, l_i * alpha + _row_reduce(p, False, ROW_CHAINS), alpha

    @gluon.jit
    def _half_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_free, acc, m_i, l_i, at, key_block, row0,
                   qk_scale, cap_scale, n_k, shift, left, right, full_lo, full_hi, PART: gl.constexpr,
                   SEEN: gl.constexpr, SOFTCAP: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROW_CHAINS: gl.constexpr):
        """A tile's last step (ring position `at`, `key_block`) on the first BLOCK_N / 2 keys of its K and V,
        after the previous step's P V: Q K^T, softmax, P V, half as wide as `_consume_tile`'s steps.
        Returns the output accumulator and the rows' max and sum."""
        HALF: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        h_layout: gl.constexpr = mma_layout(HALF)
        o_layout: gl.constexpr = mma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = k_smem.dtype
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        V_STAGES: gl.constexpr = v_smem.shape[0]
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, h_layout))
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, h_layout))
        stage = at % STAGES
        mbarrier.wait(k_ready.index(stage), (at // STAGES) & 1)
        k_h = reinterpret(k_smem.index(stage), dtype, [BLOCK_N, HEAD_DIM], kv_2d).slice(0, HALF, dim=0)
        s = warpgroup_mma(q, k_h.permute((1, 0)), gl.zeros([ROWS, HALF], gl.float32, h_layout), use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(stage), count=1)
        mbarrier.arrive(q_free.index(PART), count=1)
        s = _masked(capped(s, cap_scale, SOFTCAP), rows, cols, key_block, n_k, shift, left, right, full_lo, full_hi,
                    SEEN, BLOCK_N)
        p, m_h, l_h, alpha = _softmax(s, gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                                      gl.convert_layout(l_i, gl.SliceLayout(1, h_layout)), qk_scale, ROW_CHAINS)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_h = gl.convert_layout(p.to(dtype), p_layout)
        slot = at % V_STAGES
        mbarrier.wait(v_ready.index(slot), (at // V_STAGES) & 1)
        v_h = reinterpret(v_smem.index(slot), dtype, [BLOCK_N, HEAD_DIM], kv_2d).slice(0, HALF, dim=0)
        acc = warpgroup_mma(p_h, v_h, acc, is_async=True)
        acc, p_h = warpgroup_mma_wait(0, deps=[acc, p_h])
        mbarrier.arrive(v_empty.index(slot), count=1)
        return (acc, gl.convert_layout(m_h, gl.SliceLayout(1, s_layout)),
                gl.convert_layout(l_h, gl.SliceLayout(1, s_layout)))

    @gluon.jit
    def _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                      v_empty, lse_ptr, tile, j, step, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift,
                      left, right, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim,
                      PART: gl.constexpr, SEEN: gl.constexpr, SOFTCAP: gl.constexpr, ROWS: gl.constexpr,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
                      HALF_LAST: gl.constexpr, LATE_PV_WAIT: gl.constexpr, VARLEN: gl.constexpr,
                      ROW_CHAINS: gl.constexpr):
        """One warpgroup's ROWS rows (the tile's PART-th) of the program's j-th tile, its K/V blocks from
        ring position `step` on: S_j = Q K_j^T issued, then P_{j-1} V_{j-1}; the softmax of S_j runs while
        the latter is on the tensor cores (LATE_PV_WAIT: elsewhere ptxas waits for it before the softmax,
        `late_pv_wait`), and P_j, cast to the operand P V takes, is what the next step
        carries (not P_j in fp32 beside S_{j+1}: three consumers fit 160 registers). The output leaves
        through TMA from o_smem: on a persistent grid a buffer of its own, left to drain while the next
        tile runs (Q's buffer frees after the last Q K^T, LATE_PV_WAIT after its softmax, so that the next
        tile's Q and K load under this epilogue); one tile a program, Q's own buffer. VARLEN: through
        masked stores from registers instead (a tile's rows past its sequence are the next one's). Three
        consumers: one whose rows all lie past n_q passes the tile's blocks on, no matmul, no epilogue.
        HALF_LAST: a last block whose second half these rows do not see (causal: the first 64 rows'
        diagonal) is taken at half width (`_half_step`). STAGGER (`staggered`): on the program's first tile
        the second consumer starts once the first has ended its first softmax. ROW_CHAINS (`row_chains`): each
        row's max over a thread's scores in that many chains, its sum in one.
        Returns the ring position after the tile."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        o_layout: gl.constexpr = mma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        q_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_tile = q_smem.index(PART)
        q = reinterpret(q_tile, dtype, [ROWS, HEAD_DIM], q_2d)
        V_STAGES: gl.constexpr = v_smem.shape[0]
        # three consumers only: 192-row tiles leave consumers without rows at most lengths, 128-row ones at
        # few (and there the branch cost the step loops 3-4% at d128 B16 N1024 causal)
        SKIP_EMPTY: gl.constexpr = q_smem.shape[0] == 3
        # q_bars one past the consumers': the first consumer's first softmax (two consumers, `staggered`)
        STAGGER: gl.constexpr = q_bars.shape[0] > q_smem.shape[0]
        o_tile = o_smem.index(PART)
        o_2d = reinterpret(o_tile, dtype, [ROWS, HEAD_DIM], q_2d)
        b, h, hk, start_m, first, n_steps, q0, _, n_q, n_k, shift = _fwd_tile(
            tile, n_q, n_k, n_heads, group, shift, left, right, cu_q, cu_k, total_q, total_k, SEEN,
            q_smem.shape[0] * ROWS, BLOCK_N, VARLEN)
        row0 = start_m + PART * ROWS
        full_lo, full_hi = _full_blocks(row0, n_k, shift, left, right, SEEN, ROWS, BLOCK_N)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        if STAGGER and PART == 1:  # the program's first tile: after the first consumer's first softmax
            mbarrier.wait(q_bars.index(q_smem.shape[0]), 0, pred=j == 0)
        mbarrier.wait(q_bars.index(PART), j & 1)
        if SKIP_EMPTY and row0 >= n_q:  # no row here (a length's last tile): pass the blocks on
            mbarrier.arrive(q_free.index(PART), count=1)
            for i in range(n_steps):
                at = step + i
                mbarrier.wait(k_ready.index(at % STAGES), (at // STAGES) & 1)
                mbarrier.arrive(k_empty.index(at % STAGES), count=1)
                mbarrier.wait(v_ready.index(at % V_STAGES), (at // V_STAGES) & 1)
                mbarrier.arrive(v_empty.index(at % V_STAGES), count=1)
        elif n_steps > 0:
            stage = step % STAGES
            mbarrier.wait(k_ready.index(stage), (step // STAGES) & 1)
            k_0 = reinterpret(k_smem.index(stage), dtype, [BLOCK_N, HEAD_DIM], kv_2d)
            s = warpgroup_mma(q, k_0.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(stage), count=1)
            mbarrier.arrive(q_free.index(PART), count=1, pred=n_steps == 1)
            s = _masked(capped(s, cap_scale, SOFTCAP), rows, cols, first, n_k, shift, left, right, full_lo,
                        full_hi, SEEN, BLOCK_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, ROW_CHAINS)
            p_op = gl.convert_layout(p.to(dtype), p_layout)  # carried as the operand: half p's registers
            if STAGGER and PART == 0:
                mbarrier.arrive(q_bars.index(q_smem.shape[0]), count=1, pred=j == 0)
            half = False
            n_full = n_steps
            if HALF_LAST:
                half = (n_steps > 1) & _half_last(row0, first + n_steps - 1, n_k, shift, SEEN, ROWS, BLOCK_N)
                n_full = n_steps - half.to(gl.int32)
            for i in range(1, n_full):
                at = step + i
                prev = (at - 1) % V_STAGES
                stage = at % STAGES
                mbarrier.wait(k_ready.index(stage), (at // STAGES) & 1)
                k_j = reinterpret(k_smem.index(stage), dtype, [BLOCK_N, HEAD_DIM], kv_2d)
                s = warpgroup_mma(q, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((at - 1) // V_STAGES) & 1)
                v_prev = reinterpret(v_smem.index(prev), dtype, [BLOCK_N, HEAD_DIM], kv_2d)
                acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])  # S_j is done; P V may still run
                mbarrier.arrive(k_empty.index(stage), count=1)
                if not LATE_PV_WAIT:
                    mbarrier.arrive(q_free.index(PART), count=1, pred=i == n_steps - 1)
                s = _masked(capped(s, cap_scale, SOFTCAP), rows, cols, first + i, n_k, shift, left, right,
                            full_lo, full_hi, SEEN, BLOCK_N)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, ROW_CHAINS)
                if LATE_PV_WAIT:  # a basic block ends here, so that ptxas keeps the P V wait below the softmax
                    if i == n_steps - 1:
                        mbarrier.arrive(q_free.index(PART), count=1)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            at = step + n_full - 1
            last = at % V_STAGES
            mbarrier.wait(v_ready.index(last), (at // V_STAGES) & 1)
            v_last = reinterpret(v_smem.index(last), dtype, [BLOCK_N, HEAD_DIM], kv_2d)
            acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(last), count=1)
            if half:  # (after the last full P V: p_op used in a branch cost every step's operand a PRMT)
                acc, m_i, l_i = _half_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_free, acc, m_i,
                                           l_i, at + 1, first + n_steps - 1, row0, qk_scale, cap_scale, n_k, shift,
                                           left, right, full_lo, full_hi, PART, SEEN, SOFTCAP, ROWS, BLOCK_N,
                                           HEAD_DIM, STAGES, ROW_CHAINS)
        else:
            mbarrier.arrive(q_free.index(PART), count=1)
            if STAGGER and PART == 0:
                mbarrier.arrive(q_bars.index(q_smem.shape[0]), count=1, pred=j == 0)
        if not SKIP_EMPTY or row0 < n_q:
            seen = l_i > 0.0  # rows that see no key: output 0, log-sum-exp -inf
            l_safe = gl.where(seen, l_i, 1.0)
            out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
            lse = gl.where(seen, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
            gl.store(lse_ptr + b.to(gl.int64) * slb + h.to(gl.int64) * slh + q0 + rows, lse, mask=rows < n_q)
            if VARLEN:
                o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
                o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                offsets = gl.expand_dims((q0 + o_rows).to(gl.int64) * son, 1) + gl.expand_dims(o_cols, 0)
                keep = gl.expand_dims(o_rows < n_q, 1) & gl.expand_dims(o_cols < head_dim, 0)
                gl.store(o_ptr + h.to(gl.int64) * soh + offsets, out.to(dtype), mask=keep)
            else:
                if PERSISTENT:
                    store_wait(0)  # the last tile's output has left the buffer
                o_2d.store(out.to(dtype))
                fence_async_shared()
                tma_store(o_desc, [b, h, row0, 0], o_tile)
                if not PERSISTENT:
                    store_wait(0)
        return step + n_steps

    @gluon.jit
    def _consumer(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready, v_empty,
                  lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right, n_tiles, slb, slh,
                  cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, PART: gl.constexpr,
                  SEEN: gl.constexpr, SOFTCAP: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr, HALF_LAST: gl.constexpr,
                  LATE_PV_WAIT: gl.constexpr, VARLEN: gl.constexpr, ROW_CHAINS: gl.constexpr):
        if PERSISTENT:  # the rings run on across tiles, the tiles the producer's (`_turns`)
            step = 0
            j = 0
            first, end, stride = _turns(schedule, n_tiles, SEEN)
            for at in range(first, end, stride):
                tile = _turn_tile(at, schedule, n_q, ROWS, SEEN, q_smem.shape[0])
                step = _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready,
                                     k_empty, v_ready, v_empty, lse_ptr, tile, j, step, qk_scale, cap_scale,
                                     n_q, n_k, n_heads, group, shift, left, right, slb, slh, cu_q, cu_k, total_q,
                                     total_k, o_ptr, son, soh, head_dim, PART, SEEN, SOFTCAP, ROWS, BLOCK_N,
                                     HEAD_DIM, STAGES, True, HALF_LAST, LATE_PV_WAIT, VARLEN, ROW_CHAINS)
                j += 1
            store_wait(0)  # before the program's shared memory goes
        else:
            _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                          v_empty, lse_ptr, gl.program_id(0), 0, 0, qk_scale, cap_scale, n_q, n_k, n_heads, group,
                          shift, left, right, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, PART,
                          SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, False, HALF_LAST, LATE_PV_WAIT, VARLEN,
                          ROW_CHAINS)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "shift", "n_tiles", "slb", "slh", "total_q", "total_k"])
    def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q, cu_k, o_ptr, schedule, qk_scale,
                               cap_scale, n_q, n_k, n_heads, group, shift, left, right, n_tiles, slb, slh, total_q,
                               total_k, son, soh, head_dim, SEEN: gl.constexpr,
                               SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
                               CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
                               HALF_LAST: gl.constexpr, LATE_PV_WAIT: gl.constexpr, VARLEN: gl.constexpr,
                               STAGGER: gl.constexpr, ROW_CHAINS: gl.constexpr):
        """Tiles of CONSUMERS (2 or 3) x 64 query rows of one (batch, head) against every key they see
        (SEEN 0 all, 1 causal, 2 a window of `left` and `right` keys, key blocks outside it skipped;
        `_fwd_tile`); PERSISTENT: a program a multiprocessor takes tiles pid, pid + programs, ... of the
        n_tiles, causal ones those `schedule` lists for it (`_turns`, `causal_schedule`), else one tile a
        program. Out and the row log-sum-exp (natural log), as
        `kernels.attn_fwd_kernel` gives them. VARLEN (one tile a program): packed sequences, n_q of them
        (`_fwd_tile`), bounded by the prefix sums cu_q and cu_k over total_q and total_k rows, the output
        stored through o_ptr (strides son, soh; head_dim columns) instead of o_desc; dense: those unread."""
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        # a V is read a step after its K: a stage fewer (on a persistent grid, room for the output's buffer)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES - 1] + v_desc.block_type.shape, v_desc.layout)
        if PERSISTENT:
            o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        else:
            o_smem = q_smem
        # (STAGGER: one more, the first consumer's first softmax; `_consume_tile` reads it from the shape)
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS + STAGGER, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        if STAGGER:
            mbarrier.init(q_bars.index(CONSUMERS), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a stage
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        # (literal tuples, literal 0 / 1 / 2: a constexpr name, or a tuple built by +, reaches the partition as
        # a plain value)
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, 0,
                             SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT, HALF_LAST, LATE_PV_WAIT, VARLEN,
                             ROW_CHAINS)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, 1,
                             SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT, HALF_LAST, LATE_PV_WAIT, VARLEN,
                             ROW_CHAINS)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, 2,
                             SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT, HALF_LAST, LATE_PV_WAIT, VARLEN,
                             ROW_CHAINS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                             v_ready, v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, cu_q, cu_k,
                             total_q, total_k, schedule, SEEN, ROWS, BLOCK_N, STAGES, PERSISTENT, VARLEN)),
            ], [4, 4, 1], [CONSUMER_REGISTERS, CONSUMER_REGISTERS, PRODUCER_REGISTERS])
        else:
            gl.warp_specialize([
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, 0,
                             SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT, HALF_LAST, LATE_PV_WAIT, VARLEN,
                             ROW_CHAINS)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, cu_q, cu_k, total_q, total_k, o_ptr, son, soh, head_dim, schedule, 1,
                             SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT, HALF_LAST, LATE_PV_WAIT, VARLEN,
                             ROW_CHAINS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                             v_ready, v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, cu_q, cu_k,
                             total_q, total_k, schedule, SEEN, ROWS, BLOCK_N, STAGES, PERSISTENT, VARLEN)),
            ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])

def shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The default shared layout of a (1, 1, rows, cols) TMA tile."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], GL_DTYPES[dtype])


def tile_descriptors(tensors, rows, padded: int, dtype: torch.dtype, layouts=None) -> list:
    """Each tensor's TMA descriptor fields after its base, (shape, strides, block, padding, layout), built once
    a plan for `Descriptor(base, *fields)` a call: tiles of `rows` rows, zero padding, in `layouts` where
    given (else the default for the tile)."""
    layouts = layouts or [None] * len(tensors)
    return [(list(t.shape), descriptor_strides(t), [1, 1, r, padded], "zero", layout or shared_layout(r, padded, dtype))
            for t, r, layout in zip(tensors, rows, layouts, strict=True)]


def causal_schedule(n_q: int, n_k: int, shift: int, heads: int, programs: int, rows: int, block_n: int,
                    tail_tiles: int) -> list[int]:
    """The causal forward's tiles on a persistent grid of `programs`, as the kernel reads them: programs + 1
    offsets into the list, then each program's tiles in `_fwd_tile`'s numbering (a head's k-th tile sees its
    k-th most keys). Units of a head's r-th longest and r-th shortest tile (about equal keys) go round robin,
    head by head (a head's K and V stay in L2), but for the last heads, about `tail_tiles` tiles a program
    (`config.GLUON_CAUSAL_TAIL_TILES`): their tiles longest first, each to the program with the least work so
    far (a tile's work its key blocks plus `GLUON_CAUSAL_TILE_BLOCKS`, its start and epilogue), so that the
    grid ends on short tiles rather than on a last turn of units that half the programs have no share in."""
    n_blocks = sizing.cdiv(n_q, rows)
    half = (n_blocks + 1) // 2
    # `_fwd_tile`'s key blocks of a head's k-th tile, plus its own cost
    cost = torch.tensor([sizing.cdiv(min(n_k, max((n_blocks - k) * rows + shift, 0)), block_n)
                         + config.GLUON_CAUSAL_TILE_BLOCKS for k in range(n_blocks)], device="cpu")
    body = heads - min(heads, round(tail_tiles * programs / n_blocks))
    unit = torch.arange(body * half, device="cpu")
    r, first = unit % half, unit // half * n_blocks
    pairs = torch.stack([first + r, first + n_blocks - 1 - r], 1)
    paired = torch.stack([torch.ones_like(r, dtype=torch.bool), 2 * r + 1 != n_blocks], 1)  # (odd counts' middle)
    program = unit % programs
    tiles, owner = pairs[paired], program[:, None].expand(-1, 2)[paired]
    tiles = tiles[torch.sort(owner, stable=True).indices].tolist()
    counts = torch.bincount(owner, minlength=programs).tolist()
    pair_cost = cost[r] + cost[n_blocks - 1 - r] * paired[:, 1]
    work = torch.zeros(programs, dtype=cost.dtype, device="cpu").index_add_(0, program, pair_cost).tolist()
    loads = [(w, p) for p, w in enumerate(work)]  # a heap: the least loaded program first
    heapq.heapify(loads)
    tail: list[list[int]] = [[] for _ in range(programs)]
    for work_k, k in sorted(((c, k) for k, c in enumerate(cost.tolist())), key=lambda item: -item[0]):
        for bh in range(body, heads):
            load, p = loads[0]
            tail[p].append(bh * n_blocks + k)
            heapq.heapreplace(loads, (load + work_k, p))
    offsets, at, table = [programs + 1], 0, []
    for p in range(programs):
        table += tiles[at:at + counts[p]] + tail[p]
        at += counts[p]
        offsets.append(programs + 1 + len(table))
    return offsets + table


def pinned_table(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """values as int32 on device and their pinned source, which lives as long as the table: copied before
    this returns, so that a call on any stream finds it (the current stream's work waits), but inside a CUDA
    graph's capture recorded in the graph, ahead of its launches."""
    source = torch.tensor(values, dtype=torch.int32, device="cpu").pin_memory()
    capturing = torch.cuda.is_current_stream_capturing()
    return torch.empty_like(source, device=device).copy_(source, non_blocking=capturing), source


def bind(q, k, v, out, lse_strides: tuple[int, int], mask: Mask, sm_scale: float, packing: Packing | None = None):
    """launch(q, k, v, out, lse, cu_q, cu_k) of the forward for tensors laid out like these (`takes` holds),
    out like q and lse (B, H, N) fp32 with strides (*lse_strides, 1); the caller checks `bases_aligned`
    per call. A program a multiprocessor where `persistent_grid` holds (causal: in `causal_schedule`'s
    order), else one tile a program. Packed
    sequences (`packing`): the (1, H, total, D) views of (total, H, D) tensors (`layout.packed`), the calls
    passing the tensors themselves and the prefix sums; one tile a program, total // tile + sequences
    tiles a head (`_packed_slot`); dense: cu_q, cu_k unread."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = padded_head_dim(d)
    builds, (qk_scale, cap_scale, left, right) = forward_mask_args(mask, sm_scale, q.dtype)
    block_n, stages, consumers = forward_tiles(d, builds["SEEN"], n_q if packing is None else packing.max_q,
                                               packing is not None)
    q_tile, k_tile, v_tile, o_tile = tile_descriptors((q, k, v, out), (GLUON_ROWS, block_n, block_n, GLUON_ROWS),
                                                      padded, q.dtype)
    if packing is None:
        n_blocks = sizing.cdiv(n_q, consumers * GLUON_ROWS)
        n_tiles = n_blocks * b * hq
        persistent = persistent_grid(builds["SEEN"], padded, n_q)
        programs = min(n_tiles, backend.multiprocessor_count(q.device.index or 0)) if persistent else n_tiles
        lengths = (n_q, n_k, int(mask.lower_right) * (n_k - n_q))
    else:  # the kernel's n_q: the sequences, each with its own shift (`_fwd_tile`), in `_packed_slot`'s tiles
        persistent = False
        programs = n_tiles = hq * (n_q // (consumers * GLUON_ROWS) + packing.sequences)
        lengths = (packing.sequences, packing.max_k, int(mask.lower_right))
    launch = Launch(attn_fwd_hopper_kernel, (programs,),
                    (qk_scale, cap_scale, lengths[0], lengths[1], hq, hq // hk, lengths[2], left, right, n_tiles,
                     *lse_strides, n_q, n_k, out.stride(2), out.stride(1), d),
                    {**builds, "BLOCK_N": block_n, "HEAD_DIM": padded, "STAGES": stages, "CONSUMERS": consumers,
                     "PERSISTENT": persistent, "VARLEN": packing is not None,
                     **consumer_builds(builds["SEEN"], d, consumers, persistent), "num_warps": 4}, q.device)
    table = None  # (the device table and its pinned source, which lives as long as the plan)
    if persistent and builds["SEEN"] == 1:
        tail = dict(config.GLUON_CAUSAL_TAIL_TILES).get(padded, 0)
        table = pinned_table(causal_schedule(n_q, n_k, lengths[2], b * hq, programs, consumers * GLUON_ROWS,
                                             block_n, tail), q.device)

    def run(q, k, v, out, lse, cu_q=None, cu_k=None):  # (no generator a call: 1-2 µs)
        launch(Descriptor(q, *q_tile), Descriptor(k, *k_tile), Descriptor(v, *v_tile), Descriptor(out, *o_tile), lse,
               lse if cu_q is None else cu_q, lse if cu_k is None else cu_k, out, lse if table is None else table[0])

    return run

"""fk-attention's Hopper kernels in Gluon, top to bottom: when they are taken, the forward's tiles,
kernel and launch, then the backward's dK/dV kernel and launch, each bound once per plan.

The forward is FlashAttention-3's design, written with Triton's Gluon (`triton.experimental.gluon`):
each tile is 128 query rows of one (batch, head), taken by two 4-warp consumer warpgroups of 64
rows each (at d64 192 rows, three, but for causal masks up to 4096 rows), with one producer warp that
moves Q and rings of K and V blocks into shared memory through TMA (mbarriers: `ready` when a stage
has landed, `empty` when every consumer is done with it). A consumer issues the next block's Q K^T on
the tensor cores before the softmax of this one, so that softmax runs under the P V matmul
(asynchronous wgmma); the producer's registers go to the consumers (`setmaxnreg`). At d64 and d128 a
program takes tile after tile (a persistent grid), the next tile's Q and K loading while this one's
output drains.

The backward's dK/dV kernel has the same shape: two consumer warpgroups of 64 keys each keep their
K, V and dK, dV accumulators while a producer warp streams Q and dO blocks of every query head of
the group, each with its rows' lse2 and delta. dQ (and those row terms, delta and the base-2 lse)
stays with the tl kernel (`kernels.attn_bwd_dq_kernel`), which runs first: 7 matmuls per block
pair, deterministic.
The 5-matmul backward (Triton >= 3.8, `config.GLUON_FUSED_DQ`) adds dQ = dS K to that kernel's
consumers, FlashAttention-3's way: both warpgroups' dS in shared memory, each forms half the head
dim over all the program's keys and adds it into an fp32 sum with a TMA reduce-add
(`kernels.attn_bwd_prep_kernel` writes the row terms and clears the sum first; a cast ends it).

Taken for what they were built and measured on (TUNING.md: Hopper forward, Hopper backward): an
H100-class GPU (compute capability 9.x), the Triton versions in `fk_runtime.gluon.VERSIONS` (whose names
for Gluon's API the kernels use), fp16/bf16, head dims padded to those of `config.GLUON_FORWARD_TILES`
(the forward), `GLUON_HEAD_DIMS` (dK/dV) and `GLUON_FUSED_HEAD_DIMS` (the 5-matmul backward), full or
causal masks (either alignment; the forward also windows and softcaps on the releases in
`config.GLUON_FORWARD_MASKS`, but at d64 full and causal masks only:
`config.GLUON_FORWARD_FULL_OR_CAUSAL`), dense (B, H, N, D) tensors whose strides a TMA descriptor takes
and whose bases are aligned (checked per call); the forward only for a positive scale. Everything
else, and any Triton where Gluon or this API is missing, runs the `tl` kernels (`kernels.py`), which
stay the reference the GPU tests compare with.
"""

from __future__ import annotations

import torch

from fk_runtime import gluon as fk_gluon
from fk_runtime import alloc, backend, sizing
from fk_runtime.gluon import (fence_async_shared, gl, gluon, mbarrier, reinterpret, store_wait, tma_load,
                              tma_reduce_add, tma_store, warpgroup_mma, warpgroup_mma_wait)
from fk_runtime.launch import Descriptor, Launch

from . import config, kernels
from .config import (GLUON_BWD_STAGES, GLUON_CONSUMER_REGISTERS, GLUON_HEAD_DIMS, GLUON_KEYS,
                     GLUON_PRODUCER_REGISTERS, GLUON_Q_ROWS, GLUON_ROWS, PREP_ROWS)
from .layout import descriptor_strides, descriptors_may_serve, padded_head_dim
from .mask import Mask

DTYPES = (torch.float16, torch.bfloat16)
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32} if gl else {}
LOG2E = 1.4426950408889634


def _on_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple) -> bool:
    return (q.dtype in DTYPES and padded_head_dim(q.shape[-1]) in head_dims and fk_gluon.supported()
            and descriptors_may_serve(q.device, (q, k, v))
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> bool:
    """Whether the dK/dV of dense attention of these tensors runs here (bases are checked per call):
    full or causal masks."""
    return mask.full_or_causal and _on_hopper(q, k, v, GLUON_HEAD_DIMS)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, sm_scale: float) -> bool:
    """Whether the forward of these tensors runs here (at any length): the row max is taken on unscaled
    scores, so the scale must be positive; full or causal masks, windows and softcaps too on the releases
    in `config.GLUON_FORWARD_MASKS`, but not at the head dims in `config.GLUON_FORWARD_FULL_OR_CAUSAL`."""
    if padded_head_dim(q.shape[-1]) in config.GLUON_FORWARD_FULL_OR_CAUSAL:
        masks = mask.full_or_causal
    else:
        masks = mask.full_or_causal or backend.triton_release() in config.GLUON_FORWARD_MASKS
    return sm_scale > 0 and masks and _on_hopper(q, k, v, tuple(row[0] for row in config.GLUON_FORWARD_TILES))


def forward_tiles(head_dim: int, seen: int, n_q: int) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, CONSUMERS) of the forward at this head dim (`config.GLUON_FORWARD_TILES`) for
    the mask build `seen` (`forward_mask_args`) on n_q query rows: two consumers where
    `config.GLUON_FORWARD_CAUSAL_TWO` names causal masks up to as many rows."""
    padded = padded_head_dim(head_dim)
    block_n, stages, consumers = next(tuple(tiles[1:]) for tiles in config.GLUON_FORWARD_TILES
                                      if tiles[0] == padded)
    rows = dict(config.GLUON_FORWARD_CAUSAL_TWO).get(padded)
    if seen == 1 and rows is not None and n_q <= rows:
        consumers = 2
    return block_n, stages, consumers


def consumer_registers(consumers: int) -> int:
    """Registers a consumer warpgroup asks for (`setmaxnreg`): two share what the producer warp
    leaves, three fit 16 warps' 64K (`config.GLUON_CONSUMER_REGISTERS`, `GLUON_THREE_CONSUMER_REGISTERS`)."""
    return config.GLUON_THREE_CONSUMER_REGISTERS if consumers == 3 else GLUON_CONSUMER_REGISTERS


def forward_mask_args(mask: Mask, sm_scale: float) -> tuple[dict, tuple]:
    """The forward kernel's mask constexprs (SEEN: 0 every key, 1 causal, 2 another window; SOFTCAP)
    and (qk_scale, cap_scale, left, right): the base-2 factor on the (capped) scores, what tanh's
    exp2 multiplies the raw scores by, the window's sides (`Mask.kernel_args`)."""
    cap, _, left, right = mask.kernel_args()
    seen = 0 if not mask.windowed else 1 if mask.left is None and mask.right == 0 else 2
    if mask.softcap:
        return {"SEEN": seen, "SOFTCAP": True}, (cap * LOG2E, 2 * LOG2E * sm_scale / cap, left, right)
    return {"SEEN": seen, "SOFTCAP": False}, (sm_scale * LOG2E, 1.0, left, right)


def persistent_grid(seen: int, head_dim: int, n_q: int) -> bool:
    """Whether the forward runs on a persistent grid: its padded head dim in
    `config.GLUON_PERSISTENT_HEAD_DIMS`, its mask in `GLUON_PERSISTENT_SEEN` (causal up to
    `GLUON_PERSISTENT_CAUSAL_N` query rows)."""
    return (seen in config.GLUON_PERSISTENT_SEEN and padded_head_dim(head_dim) in config.GLUON_PERSISTENT_HEAD_DIMS
            and (seen != 1 or n_q <= config.GLUON_PERSISTENT_CAUSAL_N))


def length_buckets(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, sm_scale: float) -> tuple:
    """Query lengths past which the forward of tensors like these (any length) compiles another
    variant: where the Gluon forward's causal grid or consumer count changes
    (`config.GLUON_PERSISTENT_CAUSAL_N`, `GLUON_FORWARD_CAUSAL_TWO`), for `warm.warmup` to call past each."""
    if not takes(q, k, v, mask, sm_scale):
        return ()
    seen, d = forward_mask_args(mask, sm_scale)[0]["SEEN"], q.shape[-1]

    def variant(n_q: int) -> tuple[bool, int]:
        return persistent_grid(seen, d, n_q), forward_tiles(d, seen, n_q)[2]

    bounds = {config.GLUON_PERSISTENT_CAUSAL_N, *(rows for _, rows in config.GLUON_FORWARD_CAUSAL_TWO)}
    return tuple(sorted(n for n in bounds if variant(n) != variant(n + 1)))


def fused_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> bool:
    """Whether the backward binds the 5-matmul kernel (bases are checked per call): full or causal
    masks, its own head dims, switched on in config (both read at bind time, so that a variant may
    set them), a Triton with TMA reduce-adds, no determinism asked for by the call. A call takes it
    only while torch's deterministic algorithms are off."""
    return (mask.full_or_causal and config.GLUON_FUSED_DQ and tma_reduce_add is not None and not mask.deterministic
            and _on_hopper(q, k, v, config.GLUON_FUSED_HEAD_DIMS))


if gluon is not None:

    @gluon.jit
    def _fwd_tile(tile, n_q, n_k, n_heads, group, shift, left, right, SEEN: gl.constexpr, TILE: gl.constexpr,
                  BLOCK_N: gl.constexpr):
        """(b, h, hk, start_m, first, n_steps) of a tile, TILE query rows of one (batch, head) (causal:
        within a head, the blocks that see the most keys come first): key blocks [first, first + n_steps)
        (`kernels._key_range`'s bounds)."""
        n_blocks = gl.cdiv(n_q, TILE)
        bh = tile // n_blocks
        block = tile % n_blocks
        if SEEN == 1:
            block = n_blocks - 1 - block
        b = bh // n_heads
        h = bh % n_heads
        start_m = block * TILE
        first = 0
        end = n_k
        if SEEN == 1:
            end = gl.minimum(n_k, gl.maximum(start_m + TILE + shift, 0))
        if SEEN == 2:
            first = gl.maximum(start_m + shift - left, 0) // BLOCK_N
            end = gl.maximum(gl.minimum(n_k, start_m + TILE + shift + right), first * BLOCK_N)
        return b, h, h // group, start_m, first, gl.cdiv(end, BLOCK_N) - first

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
    def _units(n_q, SEEN: gl.constexpr, TILE: gl.constexpr):
        """(query blocks a head, units a head) of a persistent grid's work: causal, a unit is a head's
        r-th longest block and its r-th shortest, so that every unit holds about the same keys and a
        static round robin balances the programs; otherwise a unit is a tile."""
        n_blocks = gl.cdiv(n_q, TILE)
        if SEEN == 1:
            half = (n_blocks + 1) // 2
        else:
            half = n_blocks
        return n_blocks, half

    @gluon.jit
    def _unit_size(unit, n_blocks, half, SEEN: gl.constexpr):
        """Tiles in a unit: 2, or 1 (not causal; the middle block of an odd count)."""
        if SEEN == 1:
            size = 2 - (2 * (unit % half) + 1 == n_blocks).to(gl.int32)
        else:
            size = 1
        return size

    @gluon.jit
    def _unit_tile(unit, m, n_blocks, half, SEEN: gl.constexpr, CONSUMERS: gl.constexpr):
        """The m-th tile of a unit in `_fwd_tile`'s numbering: causal, longest first within a head.
        Three consumers, other masks: a head's blocks rotated by the wave its first block falls in, so
        that a program's tiles take every block in turn: wherever the block count divides the program
        count, the cheap last blocks (spare consumers idle there, `_consume_tile`) went to the same
        programs."""
        r = unit % half
        if SEEN == 1:
            tile = unit // half * n_blocks + r + m * (n_blocks - 1 - 2 * r)
        elif CONSUMERS == 3:
            head_start = unit // n_blocks * n_blocks
            tile = head_start + (r + head_start // gl.num_programs(0)) % n_blocks
        else:
            tile = unit
        return tile

    @gluon.jit
    def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                      v_ready, v_empty, tile, j, step, n_q, n_k, n_heads, group, shift, left, right, SEEN: gl.constexpr,
                      ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The program's j-th tile: every consumer's Q tile once it is done with the last tile's
        (after its last Q K^T), then its K and V blocks into their rings (STAGES and as many V stages
        as v_smem holds) from position `step` on, as stages free up. Returns the position after."""
        V_STAGES: gl.constexpr = v_smem.shape[0]
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        b, h, hk, start_m, first, n_steps = _fwd_tile(tile, n_q, n_k, n_heads, group, shift, left, right,
                                                     SEEN, CONSUMERS * ROWS, BLOCK_N)
        for i in gl.static_range(CONSUMERS):
            mbarrier.wait(q_free.index(i), (j & 1) ^ 1, pred=j > 0)
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma_load(q_desc, [b, h, start_m + i * ROWS, 0], q_bars.index(i), q_smem.index(i))
        for key_block in range(first, first + n_steps):
            at = step + key_block - first
            stage = at % STAGES
            phase = ((at // STAGES) & 1) ^ 1  # the first lap finds every stage free
            mbarrier.wait(k_empty.index(stage), phase, pred=at >= STAGES)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [b, hk, key_block * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
            v_stage = at % V_STAGES
            mbarrier.wait(v_empty.index(v_stage), ((at // V_STAGES) & 1) ^ 1, pred=at >= V_STAGES)
            mbarrier.expect(v_ready.index(v_stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [b, hk, key_block * BLOCK_N, 0], v_ready.index(v_stage), v_smem.index(v_stage))
        return step + n_steps

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                  v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, SEEN: gl.constexpr,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        if PERSISTENT:  # the rings run on across tiles
            step = 0
            j = 0
            n_blocks, half = _units(n_q, SEEN, q_smem.shape[0] * ROWS)
            for unit in range(gl.program_id(0), n_tiles // n_blocks * half, gl.num_programs(0)):
                for m in range(_unit_size(unit, n_blocks, half, SEEN)):
                    tile = _unit_tile(unit, m, n_blocks, half, SEEN, q_smem.shape[0])
                    step = _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free,
                                         k_ready, k_empty, v_ready, v_empty, tile, j, step, n_q, n_k, n_heads,
                                         group, shift, left, right, SEEN, ROWS, BLOCK_N, STAGES)
                    j += 1
        else:  # (no loop: one round spills nothing)
            _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                          v_ready, v_empty, gl.program_id(0), 0, 0, n_q, n_k, n_heads, group, shift, left, right, SEEN,
                          ROWS, BLOCK_N, STAGES)

    @gluon.jit
    def _capped(s, cap_scale, SOFTCAP: gl.constexpr):
        """Raw scores with a softcap: tanh(s * sm_scale / cap) from exp2 (cap_scale: 2 log2(e) sm_scale
        / cap; qk_scale then holds cap * log2(e)), as `kernels.capped`; else s."""
        if SOFTCAP:
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
    def _softmax(s, m_i, l_i, qk_scale):
        """Online softmax of one block of raw scores (base 2 after scaling by qk_scale > 0, folded
        into the exponent's multiply-add): p, the new row max (raw) and sum, and the factor that
        rescales the output so far (a row that has seen no key keeps max -inf and p 0)."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new) * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i * qk_scale - m_use)
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                      v_empty, lse_ptr, tile, j, step, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left,
                      right, slb, slh, PART: gl.constexpr, SEEN: gl.constexpr, SOFTCAP: gl.constexpr,
                      ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      PERSISTENT: gl.constexpr):
        """One warpgroup's ROWS rows (the tile's PART-th) of the program's j-th tile, its K/V blocks from
        ring position `step` on: S_j = Q K_j^T issued, then P_{j-1} V_{j-1}; the softmax of S_j runs while
        the latter is on the tensor cores, and P_j, cast to the operand P V takes, is what the next step
        carries (not P_j in fp32 beside S_{j+1}: three consumers fit 160 registers). The output leaves
        through TMA from o_smem: on a persistent grid a buffer of its own, left to drain while the next
        tile runs (Q's buffer frees after the last Q K^T, so that the next tile's Q and K load under this
        epilogue); one tile a program, Q's own buffer. Three consumers: one whose rows all lie past n_q
        passes the tile's blocks on, no matmul, no epilogue. Returns the ring position after the tile."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
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
        o_tile = o_smem.index(PART)
        o_2d = reinterpret(o_tile, dtype, [ROWS, HEAD_DIM], q_2d)
        b, h, hk, start_m, first, n_steps = _fwd_tile(tile, n_q, n_k, n_heads, group, shift, left, right,
                                                     SEEN, q_smem.shape[0] * ROWS, BLOCK_N)
        row0 = start_m + PART * ROWS
        full_lo, full_hi = _full_blocks(row0, n_k, shift, left, right, SEEN, ROWS, BLOCK_N)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
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
            s = _masked(_capped(s, cap_scale, SOFTCAP), rows, cols, first, n_k, shift, left, right, full_lo,
                        full_hi, SEEN, BLOCK_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale)
            p_op = gl.convert_layout(p.to(dtype), p_layout)  # carried as the operand: half p's registers
            for i in range(1, n_steps):
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
                mbarrier.arrive(q_free.index(PART), count=1, pred=i == n_steps - 1)
                s = _masked(_capped(s, cap_scale, SOFTCAP), rows, cols, first + i, n_k, shift, left, right,
                            full_lo, full_hi, SEEN, BLOCK_N)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            at = step + n_steps - 1
            last = at % V_STAGES
            mbarrier.wait(v_ready.index(last), (at // V_STAGES) & 1)
            v_last = reinterpret(v_smem.index(last), dtype, [BLOCK_N, HEAD_DIM], kv_2d)
            acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(last), count=1)
        else:
            mbarrier.arrive(q_free.index(PART), count=1)
        if not SKIP_EMPTY or row0 < n_q:
            seen = l_i > 0.0  # rows that see no key: output 0, log-sum-exp -inf
            l_safe = gl.where(seen, l_i, 1.0)
            out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
            lse = gl.where(seen, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
            gl.store(lse_ptr + b.to(gl.int64) * slb + h.to(gl.int64) * slh + rows, lse, mask=rows < n_q)
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
                  PART: gl.constexpr, SEEN: gl.constexpr, SOFTCAP: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        if PERSISTENT:  # the rings run on across tiles
            step = 0
            j = 0
            n_blocks, half = _units(n_q, SEEN, q_smem.shape[0] * ROWS)
            for unit in range(gl.program_id(0), n_tiles // n_blocks * half, gl.num_programs(0)):
                for m in range(_unit_size(unit, n_blocks, half, SEEN)):
                    tile = _unit_tile(unit, m, n_blocks, half, SEEN, q_smem.shape[0])
                    step = _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready,
                                         k_empty, v_ready, v_empty, lse_ptr, tile, j, step, qk_scale, cap_scale,
                                         n_q, n_k, n_heads, group, shift, left, right, slb, slh, PART, SEEN,
                                         SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, True)
                    j += 1
            store_wait(0)  # before the program's shared memory goes
        else:
            _consume_tile(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                          v_empty, lse_ptr, gl.program_id(0), 0, 0, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift,
                          left, right, slb, slh, PART, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, False)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "shift", "n_tiles", "slb", "slh"])
    def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads,
                               group, shift, left, right, n_tiles, slb, slh, SEEN: gl.constexpr,
                               SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
                               CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        """Tiles of CONSUMERS (2 or 3) x 64 query rows of one (batch, head) against every key they see
        (SEEN 0 all, 1 causal, 2 a window of `left` and `right` keys, key blocks outside it skipped;
        `_fwd_tile`); PERSISTENT: a program a multiprocessor takes units pid, pid + programs, ... of the
        n_tiles tiles (`_units`), else one tile a program. Out and the row log-sum-exp (natural log), as
        `kernels.attn_fwd_kernel` gives them."""
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
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
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
                             n_tiles, slb, slh, 0, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, 1, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, 2, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                             v_ready, v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, SEEN, ROWS,
                             BLOCK_N, STAGES, PERSISTENT)),
            ], [4, 4, 1], [CONSUMER_REGISTERS, CONSUMER_REGISTERS, PRODUCER_REGISTERS])
        else:
            gl.warp_specialize([
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, 0, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT)),
                (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_ready, k_empty, v_ready,
                             v_empty, lse_ptr, qk_scale, cap_scale, n_q, n_k, n_heads, group, shift, left, right,
                             n_tiles, slb, slh, 1, SEEN, SOFTCAP, ROWS, BLOCK_N, HEAD_DIM, STAGES, PERSISTENT)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, k_empty,
                             v_ready, v_empty, n_q, n_k, n_heads, group, shift, left, right, n_tiles, SEEN, ROWS,
                             BLOCK_N, STAGES, PERSISTENT)),
            ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])

if gluon is not None:

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                       delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                       n_blocks, Q_ROWS: gl.constexpr, KEYS: gl.constexpr, STAGES: gl.constexpr):
        """K and V of the program's keys once, then (Q, dO) blocks with their rows' lse2 and delta into
        the ring as stages free up (as FlashAttention-3: the consumers then hold no global loads)."""
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for i in gl.static_range(2):
            tma_load(k_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, k_smem.index(i))
            tma_load(v_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, v_smem.index(i))
        per_head = n_blocks - first_block
        for step in range(group * per_head):
            stage = step % STAGES
            h = hk * group + step // per_head
            m0 = (first_block + step % per_head) * Q_ROWS
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1, pred=step >= STAGES)
            bar = ready.index(stage)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse2_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
            tma_load(lse2_desc, [b, h, m0], bar, lse2_smem.index(stage))
            tma_load(delta_desc, [b, h, m0], bar, delta_smem.index(stage))
            tma_load(q_desc, [b, h, m0, 0], bar, q_smem.index(stage))
            tma_load(do_desc, [b, h, m0, 0], bar, do_smem.index(stage))

    @gluon.jit
    def _key_program(n_q, n_k, n_heads_k, shift, CAUSAL: gl.constexpr, Q_ROWS: gl.constexpr, KEYS: gl.constexpr):
        """A backward program over keys: (batch, KV head, its first key, the query blocks, the first
        of them that sees a key: row i sees key j when j <= i + shift under CAUSAL)."""
        n_key_blocks = gl.cdiv(n_k, 2 * KEYS)
        pid = gl.program_id(0)
        bhk = pid // n_key_blocks
        start_n = (pid % n_key_blocks) * 2 * KEYS
        b = bhk // n_heads_k
        hk = bhk % n_heads_k
        n_blocks = gl.cdiv(n_q, Q_ROWS)
        first_block = 0
        if CAUSAL:
            first_block = gl.minimum(gl.maximum(start_n - shift, 0) // Q_ROWS, n_blocks)
        return b, hk, start_n, n_blocks, first_block

    @gluon.jit
    def _store_dkdv(dk_desc, dv_desc, k, v, k_tile, v_tile, dk, dv, b, hk, start_n, HALF: gl.constexpr,
                    KEYS: gl.constexpr):
        """dK and dV of a consumer's keys (from start_n + HALF * KEYS) out through K's and V's buffers."""
        k.store(dk.to(k.dtype))
        v.store(dv.to(v.dtype))
        fence_async_shared()
        tma_store(dk_desc, [b, hk, start_n + HALF * KEYS, 0], k_tile)
        tma_store(dv_desc, [b, hk, start_n + HALF * KEYS, 0], v_tile)
        store_wait(0)

    @gluon.jit
    def _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys, rows, m0, full_from, shift, qk_scale,
                  stage, step, s_zero, dv, op_layout: gl.constexpr, tile_2d: gl.constexpr, CAUSAL: gl.constexpr,
                  Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One (Q, dO) block of a backward consumer over keys (transposed, keys as rows): S^T = K Q^T
        and dP^T = V dO^T issued together, P^T from the saved base-2 log-sum-exp, dV += P^T dO issued;
        (Q, dV, P^T as the operand that matmul reads, dS^T = P^T (dP^T - delta) in fp32)."""
        dtype: gl.constexpr = q_smem.dtype
        # past n_q: Q = dO = 0 (TMA zero fill) and the row terms' padding (lse2 +inf, delta 0, to
        # kernels.STATS_ALIGN rows) weighs them 0
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        q = reinterpret(q_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        do = reinterpret(do_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        row_terms: gl.constexpr = gl.SliceLayout(0, s_zero.type.layout)
        lse2 = reinterpret(lse2_smem.index(stage), gl.float32, [Q_ROWS], flat).load(row_terms)
        delta = reinterpret(delta_smem.index(stage), gl.float32, [Q_ROWS], flat).load(row_terms)
        st = warpgroup_mma_wait(1, deps=[st])
        zt = st * qk_scale - gl.expand_dims(lse2, 0)
        if CAUSAL:
            if m0 < full_from:
                zt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + shift, zt, -float("inf"))
        pt = gl.exp2(zt)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt])
        return q, dv, pt_op, pt * (dpt - gl.expand_dims(delta, 0))

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                       empty, qk_scale, sm_scale, shift, b, hk, start_n, group, first_block, n_blocks,
                       HALF: gl.constexpr, CAUSAL: gl.constexpr, Q_ROWS: gl.constexpr, KEYS: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup's KEYS keys, transposed (keys as rows): S^T = K Q^T and dP^T = V dO^T issued
        together; P^T from the saved base-2 log-sum-exp, dV += P^T dO while dS^T = P^T (dP^T - delta)
        is formed, then dK += dS^T Q. dK (times the scale) and dV leave through K's and V's buffers."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, Q_ROWS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
        k_tile = k_smem.index(HALF)
        v_tile = v_smem.index(HALF)
        k = reinterpret(k_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        v = reinterpret(v_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        keys = start_n + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        # Row blocks from here on see every key of the program: no mask.
        full_from = start_n + 2 * KEYS - shift
        per_head = n_blocks - first_block
        mbarrier.wait(kv_bar, 0)
        for step in range(group * per_head):
            stage = step % STAGES
            m0 = (first_block + step % per_head) * Q_ROWS
            q, dv, pt_op, dst = _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys, m0 + cols, m0,
                                          full_from, shift, qk_scale, stage, step, s_zero, dv, op_layout, tile_2d,
                                          CAUSAL, Q_ROWS, HEAD_DIM, STAGES)
            ds_op = gl.convert_layout(dst.to(dtype), op_layout)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, pt_op, ds_op])
            mbarrier.arrive(empty.index(stage), count=1)
        _store_dkdv(dk_desc, dv_desc, k, v, k_tile, v_tile, dk * sm_scale, dv, b, hk, start_n, HALF, KEYS)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "shift"])
    def attn_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_desc, delta_desc,
                                    qk_scale, sm_scale, n_q, n_k, n_heads_k, group, shift,
                                    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                                    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        """dK and dV of 2 x KEYS keys of one KV head, summed over its group's query heads, as
        `kernels.attn_bwd_dkdv_kernel` gives them (it reads the delta and base-2 lse the dQ kernel
        wrote, through `lse2_desc` and `delta_desc`); deterministic."""
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        b, hk, start_n, n_blocks, first_block = _key_program(n_q, n_k, n_heads_k, shift, CAUSAL, Q_ROWS, KEYS)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        lse2_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse2_desc.block_type.shape, lse2_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                              empty, qk_scale, sm_scale, shift, b, hk, start_n, group, first_block, n_blocks, 0,
                              CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_dkdv_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                              empty, qk_scale, sm_scale, shift, b, hk, start_n, group, first_block, n_blocks, 1,
                              CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_dkdv_producer, (q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                              delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                              n_blocks, Q_ROWS, KEYS, STAGES)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])



if gluon is not None:

    @gluon.jit
    def _bwd_consumer(dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, ds_smem,
                      dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, shift, b, hk, start_n,
                      group, first_block, n_blocks, HALF: gl.constexpr, CAUSAL: gl.constexpr, Q_ROWS: gl.constexpr,
                      KEYS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """`_dkdv_consumer`, plus dQ = dS K (FlashAttention-3's split): both warpgroups' dS^T meet in
        shared memory (two buffers by step parity, `ds_full` / `ds_free`), and each forms its half of
        the head dim over all 2 x KEYS keys, which one TMA reduce-add puts into the fp32 dQ sum."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, Q_ROWS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        DQ_COLS: gl.constexpr = HEAD_DIM // 2
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        # K's swizzle as its descriptor has it (`fused_kv_layout`: dQ reads half of each row)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=k_smem.layout.swizzle_byte_width,
                                                   element_bitwidth=k_smem.layout.element_bitwidth)
        dq_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, DQ_COLS], gl.float32)
        k_tile = k_smem.index(HALF)
        v_tile = v_smem.index(HALF)
        k = reinterpret(k_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        v = reinterpret(v_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        # this warpgroup's half of the head dim of both key halves: dQ's B operands
        k_lo = reinterpret(k_smem.index(0), dtype, [KEYS, HEAD_DIM], kv_2d).slice(HALF * DQ_COLS, DQ_COLS, dim=1)
        k_hi = reinterpret(k_smem.index(1), dtype, [KEYS, HEAD_DIM], kv_2d).slice(HALF * DQ_COLS, DQ_COLS, dim=1)
        dq_tile = dq_smem.index(HALF)
        dq_out = reinterpret(dq_tile, gl.float32, [Q_ROWS, DQ_COLS], dq_2d)
        keys = start_n + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
        dq_zero = gl.zeros([Q_ROWS, DQ_COLS], gl.float32, dq_layout)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        full_from = start_n + 2 * KEYS - shift
        per_head = n_blocks - first_block
        mbarrier.wait(kv_bar, 0)
        for step in range(group * per_head):
            stage = step % STAGES
            parity = step % 2
            h = hk * group + step // per_head
            m0 = (first_block + step % per_head) * Q_ROWS
            q, dv, pt_op, dst = _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys, m0 + cols, m0,
                                          full_from, shift, qk_scale, stage, step, s_zero, dv, op_layout, tile_2d,
                                          CAUSAL, Q_ROWS, HEAD_DIM, STAGES)
            ds16 = dst.to(dtype)
            # the dQ matmuls of two steps back (both warpgroups') have read this parity's buffers
            mbarrier.wait(ds_free.index(parity), ((step // 2) & 1) ^ 1, pred=step >= 2)
            ds_t = ds_smem.index(2 * parity + HALF)
            ds_t.store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_full.index(parity), count=1)
            dk = warpgroup_mma(ds_t, q, dk, is_async=True)  # dS^T read from shared memory: no registers held
            mbarrier.wait(ds_full.index(parity), (step // 2) & 1)
            dq = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)), k_lo, dq_zero, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)), k_hi, dq, is_async=True)
            dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op])
            mbarrier.arrive(ds_free.index(parity), count=1)
            mbarrier.arrive(empty.index(stage), count=1)
            store_wait(0)  # this warpgroup's add of the step before has read its tile
            dq_out.store(dq * sm_scale)
            fence_async_shared()
            tma_reduce_add(dq_desc, [b, h, m0, HALF * DQ_COLS], dq_tile)
        _store_dkdv(dk_desc, dv_desc, k, v, k_tile, v_tile, dk * sm_scale, dv, b, hk, start_n, HALF, KEYS)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "shift"])
    def attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_desc, delta_desc, dq_desc,
                               qk_scale, sm_scale, n_q, n_k, n_heads_k, group, shift,
                               CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                               CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        """The 5-matmul backward (Triton >= 3.8): `attn_bwd_dkdv_hopper_kernel` that also adds dQ
        (times the scale) into the fp32 dQ sum through `dq_desc` (TMA reduce-adds: not
        deterministic). Reads the row terms `kernels.attn_bwd_prep_kernel` wrote."""
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        b, hk, start_n, n_blocks, first_block = _key_program(n_q, n_k, n_heads_k, shift, CAUSAL, Q_ROWS, KEYS)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        lse2_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse2_desc.block_type.shape, lse2_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [4, KEYS, Q_ROWS], ds_layout)  # [parity, half]
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_bwd_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem,
                             ds_smem, dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, shift, b,
                             hk, start_n, group, first_block, n_blocks, 0, CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_bwd_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem,
                             ds_smem, dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, shift, b,
                             hk, start_n, group, first_block, n_blocks, 1, CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_dkdv_producer, (q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                              delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                              n_blocks, Q_ROWS, KEYS, STAGES)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# lse2 and delta rows in shared memory: fp32, unswizzled (a consumer reads them as one row vector)
STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3) if gl else None


def shared_layout(rows: int, cols: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], GL_DTYPES[dtype])


def fused_kv_layout(padded: int, dtype: torch.dtype):
    """K's, V's, dK's and dV's tiles in the 5-matmul backward: dQ's matmuls read half of each K row,
    which must start a swizzle atom (64-byte swizzle at d64, the default 128 from d128)."""
    width = min(128, padded * dtype.itemsize // 2)
    return gl.NVMMASharedLayout(swizzle_byte_width=width, element_bitwidth=8 * dtype.itemsize, rank=4)


def _descriptors(tensors, rows, padded: int, dtype: torch.dtype, layouts=None) -> list:
    """(shape, strides, block, layout) of each tensor's TMA descriptor, tiles of `rows` rows, in
    `layouts` where given (else the default for the tile)."""
    layouts = layouts or [None] * len(tensors)
    return [(list(t.shape), descriptor_strides(t), [1, 1, r, padded], layout or shared_layout(r, padded, dtype))
            for t, r, layout in zip(tensors, rows, layouts, strict=True)]


def bind(q, k, v, out, lse_strides: tuple[int, int], mask: Mask, sm_scale: float):
    """launch(q, k, v, out, lse) of the forward for tensors laid out like these (`takes` holds), out
    like q and lse (B, H, N) fp32 with strides (*lse_strides, 1); the caller checks
    `bases_aligned` per call. A program a multiprocessor where `persistent_grid` holds, else one tile a
    program."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = padded_head_dim(d)
    builds, (qk_scale, cap_scale, left, right) = forward_mask_args(mask, sm_scale)
    block_n, stages, consumers = forward_tiles(d, builds["SEEN"], n_q)
    layouts = _descriptors((q, k, v, out), (GLUON_ROWS, block_n, block_n, GLUON_ROWS), padded, q.dtype)
    n_blocks = sizing.cdiv(n_q, consumers * GLUON_ROWS)
    n_tiles = n_blocks * b * hq
    persistent = persistent_grid(builds["SEEN"], padded, n_q)
    units = b * hq * (sizing.cdiv(n_blocks, 2) if builds["SEEN"] == 1 else n_blocks)  # `_units`
    programs = min(units, backend.multiprocessor_count(q.device.index or 0)) if persistent else n_tiles
    launch = Launch(attn_fwd_hopper_kernel, (programs,),
                    (qk_scale, cap_scale, n_q, n_k, hq, hq // hk, int(mask.lower_right) * (n_k - n_q), left, right,
                     n_tiles, *lse_strides),
                    {**builds, "BLOCK_N": block_n, "HEAD_DIM": padded, "STAGES": stages, "CONSUMERS": consumers,
                     "PERSISTENT": persistent, "CONSUMER_REGISTERS": consumer_registers(consumers),
                     "PRODUCER_REGISTERS": GLUON_PRODUCER_REGISTERS, "num_warps": 4}, q.device)

    def run(q, k, v, out, lse):
        launch(*(Descriptor(t, shape, strides, block, layout=layout)
                 for t, (shape, strides, block, layout) in zip((q, k, v, out), layouts, strict=True)), lse)

    return run


def bind_dkdv(q, k, v, grad_out, dk, dv, scratch_strides: tuple[int, int], mask: Mask, sm_scale: float):
    """launch(q, k, v, grad_out, lse2, delta, dk, dv) of the dK/dV kernel for tensors laid out like
    these (`serves` holds for q, k, v; grad_out, dk and dv take descriptors too), lse2 and delta the
    dQ kernel's scratch rows, (B, H, N) with strides (*scratch_strides, 1); the caller checks
    `bases_aligned` per call."""
    launch, descriptors = _bwd_launch(attn_bwd_dkdv_hopper_kernel, (q, k, v, grad_out, dk, dv), scratch_strides,
                                      mask, sm_scale, None)

    def run(q, k, v, grad_out, lse2, delta, dk, dv):
        launch(*descriptors(q, k, v, grad_out, dk, dv, lse2, delta))

    return run


def _bwd_launch(kernel, tensors, scratch_strides: tuple[int, int], mask: Mask, sm_scale: float, kv_layout):
    """(launch, descriptors) of a backward kernel over keys (the dK/dV kernel, the 5-matmul one): its
    grid, arguments and tiles (K, V, dK, dV in `kv_layout` where given), and descriptors(q, k, v,
    grad_out, dk, dv, lse2, delta) giving their per-call TMA descriptors (the row terms: (B, H, padded
    rows), boxes of a Q block's rows)."""
    q, k = tensors[:2]
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = padded_head_dim(d)
    layouts = _descriptors(tensors, (GLUON_Q_ROWS, GLUON_KEYS, GLUON_KEYS, GLUON_Q_ROWS, GLUON_KEYS, GLUON_KEYS),
                           padded, q.dtype, (None, kv_layout, kv_layout, None, kv_layout, kv_layout))
    launch = Launch(kernel, (sizing.cdiv(n_k, 2 * GLUON_KEYS) * b * hk,),
                    (sm_scale * LOG2E, sm_scale, n_q, n_k, hk, hq // hk, int(mask.lower_right) * (n_k - n_q)),
                    {"CAUSAL": mask.right == 0, "HEAD_DIM": padded, "STAGES": GLUON_BWD_STAGES,
                     "CONSUMER_REGISTERS": GLUON_CONSUMER_REGISTERS, "PRODUCER_REGISTERS": GLUON_PRODUCER_REGISTERS,
                     "num_warps": 4}, q.device)
    layouts += [([b, hq, scratch_strides[1]], [*scratch_strides, 1], [1, 1, GLUON_Q_ROWS], STATS_LAYOUT)] * 2

    def descriptors(*tensors):
        return (Descriptor(t, shape, strides, block, layout=layout)
                for t, (shape, strides, block, layout) in zip(tensors, layouts, strict=True))

    return launch, descriptors


def bind_backward(q, k, v, out, grad_out, dlse, dq, dk, dv, lse_strides: tuple[int, int],
                  scratch_strides: tuple[int, int], mask: Mask, sm_scale: float):
    """launch(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, dk, dv) of the 5-matmul backward
    (`fused_serves`): the prep kernel's row terms and cleared fp32 dQ sum, the Gluon kernel, then dQ
    cast into `dq`. `dlse` None: no gradient reaches the lse (any tensor may stand in per call);
    delta and lse2 as `bind_dkdv` takes them; the caller checks `bases_aligned` per call."""
    b, hq, n_q, d = q.shape
    padded = padded_head_dim(d)
    has_dlse = dlse is not None
    prep = Launch(kernels.attn_bwd_prep_kernel, (sizing.cdiv(n_q, PREP_ROWS) * b * hq,),
                  (n_q, hq, *out.stride(), *grad_out.stride(), *lse_strides,
                   *(dlse.stride() if has_dlse else (0, 0, 0)), *scratch_strides),
                  {"HAS_DLSE": has_dlse, "HEAD_DIM": d, "HEAD_DIM_PADDED": padded, "BLOCK_M": PREP_ROWS,
                   "num_warps": 4}, q.device)
    launch, descriptors = _bwd_launch(attn_bwd_hopper_kernel, (q, k, v, grad_out, dk, dv), scratch_strides,
                                      mask, sm_scale, fused_kv_layout(padded, q.dtype))
    dq_shape = [b, hq, n_q, padded]
    # each consumer adds its half of the head dim
    dq_layout = (dq_shape, [hq * n_q * padded, n_q * padded, padded, 1], [1, 1, GLUON_Q_ROWS, padded // 2],
                 shared_layout(GLUON_Q_ROWS, padded // 2, torch.float32))
    fp32 = torch.empty(0, dtype=torch.float32, device=q.device)

    def run(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, dk, dv):
        dq_sum = alloc.new_empty(fp32, dq_shape)
        prep(out, grad_out, lse, dlse, delta, lse2, dq_sum)
        launch(*descriptors(q, k, v, grad_out, dk, dv, lse2, delta),
               Descriptor(dq_sum, *dq_layout[:3], layout=dq_layout[3]))
        dq.copy_(dq_sum[..., :d])

    return run

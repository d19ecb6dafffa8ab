"""fk-attention's Hopper backward in Gluon, top to bottom: when it is taken, the dK/dV kernel (beside
the tl dQ kernel: 7 matmuls a block pair), the 5-matmul kernel, their launches, each bound once per plan.

The dK/dV kernel has the forward's shape (`hopper`): two consumer warpgroups of 64 keys each keep
their K, V and dK, dV accumulators while a producer warp streams Q and dO blocks of every query head
of the group, each with its rows' lse2 and delta. dQ (and those row terms, delta and the base-2 lse)
stays with the tl kernel (`kernels.attn_bwd_dq_kernel`), which runs first; deterministic. Where a
warpgroup cannot hold dK and dV of 64 keys (d256), the role-split kernel takes 64 keys a program:
one warpgroup forms the scores and P, the other dP and dS, and each keeps half the head dim of dK and dV.
The 5-matmul backward (Triton >= 3.8, `config.GLUON_FUSED_DQ`) adds dQ = dS K to that kernel's
consumers, FlashAttention-3's way: both warpgroups' dS in shared memory, each forms half the head
dim over all the program's keys and adds it into an fp32 sum (at d128 in the accumulators' fragment
order, `dq_sum_fields`) with a TMA reduce-add (`kernels.attn_bwd_prep_kernel` writes the row terms
and clears the sum first; `kernels.attn_bwd_dq_cast_kernel` puts it in order and casts it). At the
head dims of `config.GLUON_BWD_AHEAD_HEAD_DIMS` a consumer issues the next block's scores before
this block's gradients (`_steps_ahead`).

Taken for what they were built and measured on (TUNING.md: Hopper backward): `hopper.on_hopper`'s
GPUs, Tritons, dtypes and tensors, head dims padded to `config.GLUON_HEAD_DIMS` (dK/dV; the role-split
kernel at `GLUON_ROLE_HEAD_DIMS`) and `GLUON_FUSED_HEAD_DIMS` (the 5-matmul backward), full or causal
masks (either alignment); the 5-matmul backward softcapped ones too (`fused_mask`).
"""

from __future__ import annotations

import torch

from fk_runtime import alloc, sizing
from fk_runtime.gluon import (fence_async_shared, gl, gluon, mbarrier, reinterpret, store_wait, tma_load,
                              tma_reduce_add, tma_store, warpgroup_mma, warpgroup_mma_wait)
from fk_runtime.launch import Descriptor, Launch

from . import config, hopper, kernels
from .config import (GLUON_BWD_STAGES, GLUON_CONSUMER_REGISTERS, GLUON_KEYS,
                     GLUON_PRODUCER_REGISTERS, GLUON_Q_ROWS, PREP_ROWS)
from .layout import padded_head_dim
from .mask import Mask


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> bool:
    """Whether the dK/dV of dense attention of these tensors runs here (bases are checked per call):
    full or causal masks, `config.GLUON_HEAD_DIMS` (read at bind time, so that a variant may set it)."""
    return mask.full_or_causal and hopper.on_hopper(q, k, v, config.GLUON_HEAD_DIMS)


def fused_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> bool:
    """Whether the backward binds the 5-matmul kernel (bases are checked per call): its masks
    (`fused_mask`), its own head dims, switched on in config (both read at bind
    time, so that a variant may set them), a Triton with TMA reduce-adds, no determinism asked for by the
    call. A call takes it only while torch's deterministic algorithms are off."""
    return (fused_mask(mask, q.dtype) and config.GLUON_FUSED_DQ and tma_reduce_add is not None
            and not mask.deterministic and hopper.on_hopper(q, k, v, config.GLUON_FUSED_HEAD_DIMS))


def fused_mask(mask: Mask, dtype: torch.dtype) -> bool:
    """Masks the 5-matmul backward takes: every key or causal (either alignment), other windows where
    `config.GLUON_BWD_WINDOWS` is on; softcapped too where the scores take `kernels.TANH_APPROX`
    (`Mask.softcap_build`) and `config.GLUON_BWD_SOFTCAP` is on."""
    capped = mask.softcap_build(dtype)
    return ((mask.left is None and mask.right in (None, 0) or config.GLUON_BWD_WINDOWS)
            and (not capped or (capped == kernels.TANH_APPROX and config.GLUON_BWD_SOFTCAP)))


def fused_builds(head_dim: int, seen: int) -> dict:
    """The 5-matmul backward's step order, ring depth and dQ split at this head dim and mask build (`seen`,
    `hopper.forward_mask_args`' SEEN): the next block's scores issued ahead at the head dims of
    `config.GLUON_BWD_AHEAD_HEAD_DIMS`, on `GLUON_BWD_AHEAD_STAGES`; else under full masks at
    `GLUON_BWD_DQ_TURNS_HEAD_DIMS` the consumers take turns at dQ; the dQ sum in fragment rows at
    `GLUON_BWD_DQ_FRAGMENT_HEAD_DIMS` (`dq_sum_fields`)."""
    padded = padded_head_dim(head_dim)
    ahead = padded in config.GLUON_BWD_AHEAD_HEAD_DIMS
    return {"AHEAD": ahead, "STAGES": config.GLUON_BWD_AHEAD_STAGES if ahead else GLUON_BWD_STAGES,
            "DQ_TURNS": not (ahead or seen) and padded in config.GLUON_BWD_DQ_TURNS_HEAD_DIMS,
            "DQ_FRAGMENTS": padded in config.GLUON_BWD_DQ_FRAGMENT_HEAD_DIMS}


if gluon is not None:

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                       delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                       end_block, Q_ROWS: gl.constexpr, KEYS: gl.constexpr, STAGES: gl.constexpr,
                       KV_TILES: gl.constexpr):
        """K and V of the program's KV_TILES x KEYS keys once, then (Q, dO) blocks with their rows' lse2 and
        delta into the ring as stages free up (as FlashAttention-3: the consumers then hold no global loads)."""
        mbarrier.expect(kv_bar, KV_TILES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for i in gl.static_range(KV_TILES):
            tma_load(k_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, k_smem.index(i))
            tma_load(v_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, v_smem.index(i))
        per_head = end_block - first_block
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
    def _key_program(n_q, n_k, n_heads_k, d_lo, d_hi, section, SEEN: gl.constexpr, Q_ROWS: gl.constexpr,
                     PROGRAM_KEYS: gl.constexpr):
        """A backward program over PROGRAM_KEYS keys: (batch, KV head, its first key, the end of the query blocks
        that see a key, the first of them). Row i sees key j when d_lo <= j - i <= d_hi (`_bwd_launch`): under
        SEEN 1 (causal) the right bound only, SEEN 2 (a window) both, SEEN 0 every key. Programs go head by head;
        causal ones in sections of `section` heads (`causal_section`), key block by key block: the longest
        programs (the first key blocks) first."""
        n_key_blocks = gl.cdiv(n_k, PROGRAM_KEYS)
        pid = gl.program_id(0)
        if SEEN == 1:
            span = section * n_key_blocks
            first = pid // span * section
            heads = gl.minimum(section, gl.num_programs(0) // n_key_blocks - first)  # fewer in the last section
            bhk = first + pid % span % heads
            key_block = pid % span // heads
        else:
            bhk = pid // n_key_blocks
            key_block = pid % n_key_blocks
        start_n = key_block * PROGRAM_KEYS
        b = bhk // n_heads_k
        hk = bhk % n_heads_k
        end_block = gl.cdiv(n_q, Q_ROWS)
        first_block = 0
        if SEEN != 0:
            first_block = gl.minimum(gl.maximum(start_n - d_hi, 0) // Q_ROWS, end_block)
        if SEEN == 2:  # the last row that sees the program's last key: start_n + PROGRAM_KEYS - 1 - d_lo
            last_end = gl.maximum(start_n + PROGRAM_KEYS - d_lo, 0)
            end_block = gl.maximum(gl.minimum(gl.cdiv(last_end, Q_ROWS), end_block), first_block)
        return b, hk, start_n, end_block, first_block

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
    def _issue_scores(k, v, q_smem, do_smem, ready, stage, step, s_zero, tile_2d: gl.constexpr, Q_ROWS: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """A (Q, dO) block's S^T = K Q^T and dP^T = V dO^T issued, once its ring stage has landed: (Q, dO,
        S^T, dP^T), the last two in flight."""
        dtype: gl.constexpr = q_smem.dtype
        # past n_q: Q = dO = 0 (TMA zero fill) and the row terms' padding (lse2 +inf, delta 0, to
        # kernels.STATS_ALIGN rows) weighs them 0
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        q = reinterpret(q_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        do = reinterpret(do_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return q, do, st, dpt

    @gluon.jit
    def _row_term(smem, stage, s_zero, Q_ROWS: gl.constexpr):
        """One of the block's row terms (base-2 log-sum-exp or delta), a row vector of S^T's layout."""
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        return reinterpret(smem.index(stage), gl.float32, [Q_ROWS], flat).load(gl.SliceLayout(0, s_zero.type.layout))

    @gluon.jit
    def _row_terms(lse2_smem, delta_smem, stage, s_zero, Q_ROWS: gl.constexpr):
        """The block's rows' base-2 log-sum-exp and delta, as row vectors of S^T's layout."""
        return _row_term(lse2_smem, stage, s_zero, Q_ROWS), _row_term(delta_smem, stage, s_zero, Q_ROWS)

    @gluon.jit
    def _full_rows(start_n, d_lo, d_hi, PROGRAM_KEYS: gl.constexpr, Q_ROWS: gl.constexpr):
        """(full_from, full_to): the Q blocks from m0 with full_from <= m0 <= full_to see every key of the program's
        (`_key_program`'s bounds); causal's full_from one row later than it need be."""
        return start_n + PROGRAM_KEYS - d_hi, start_n - Q_ROWS + 1 - d_lo

    @gluon.jit
    def _probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, SEEN: gl.constexpr):
        """P^T from a finished S^T of the query rows from m0 and the saved base-2 log-sum-exp, masked (`_key_program`'s
        SEEN) on blocks outside [full_from, full_to] (`_full_rows`)."""
        zt = st * qk_scale - gl.expand_dims(lse2, 0)
        if SEEN == 1:
            if m0 < full_from:  # the rows' indices made where masked, not held across the loop
                rows = m0 + gl.arange(0, st.shape[1], layout=gl.SliceLayout(0, st.type.layout))
                zt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + d_hi, zt, -float("inf"))
        if SEEN == 2:
            if (m0 < full_from) | (m0 > full_to):
                rows = m0 + d_lo + gl.arange(0, st.shape[1], layout=gl.SliceLayout(0, st.type.layout))
                # d_lo <= j - i <= d_hi as one unsigned compare a score (two and their AND took 9 LOP3 more)
                past_lo = (gl.expand_dims(keys, 1) - gl.expand_dims(rows, 0)).to(gl.uint32, bitcast=True)
                zt = gl.where(past_lo <= (d_hi - d_lo).to(gl.uint32, bitcast=True), zt, -float("inf"))
        return gl.exp2(zt)

    @gluon.jit
    def _capped_probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, cap_scale, SEEN: gl.constexpr):
        """`_probs` of softcapped scores (`kernels.TANH_APPROX` builds): t = tanh(S^T * cap_scale),
        P^T from t, and the cap's derivative 1 - t^2 that dS^T carries (as the tl kernels'); (P^T, 1 - t^2)."""
        t = hopper.tanh_approx(st * cap_scale)
        return _probs(t, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, SEEN), 1.0 - t * t

    @gluon.jit
    def _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys, m0, full_from, full_to, d_lo, d_hi,
                  qk_scale, cap_scale, stage, step, s_zero, dv, op_layout: gl.constexpr, tile_2d: gl.constexpr,
                  SEEN: gl.constexpr, SOFTCAP: gl.constexpr, Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr):
        """One (Q, dO) block of a backward consumer over keys (transposed, keys as rows): S^T = K Q^T
        and dP^T = V dO^T issued together, P^T from the saved base-2 log-sum-exp, dV += P^T dO issued;
        (Q, dV, P^T as the operand that matmul reads, dS^T = P^T (dP^T - delta) in fp32; SOFTCAP: capped
        scores, dS^T times 1 - t^2, applied to P^T once its operand is made: no register more held)."""
        dtype: gl.constexpr = q_smem.dtype
        q, do, st, dpt = _issue_scores(k, v, q_smem, do_smem, ready, stage, step, s_zero, tile_2d, Q_ROWS, HEAD_DIM,
                                       STAGES)
        # the row terms read under the matmuls where causal, after each one's wait where full, windowed or capped
        # (TUNING.md: When the backward reads its row terms)
        EARLY: gl.constexpr = SEEN == 1 and not SOFTCAP
        if EARLY:
            lse2, delta = _row_terms(lse2_smem, delta_smem, stage, s_zero, Q_ROWS)
        st = warpgroup_mma_wait(1, deps=[st])
        if not EARLY:
            lse2 = _row_term(lse2_smem, stage, s_zero, Q_ROWS)
        if SOFTCAP:
            pt, slope = _capped_probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, cap_scale, SEEN)
        else:
            pt = _probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, SEEN)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        if SOFTCAP:
            pt = pt * slope
        dv = warpgroup_mma(pt_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt])
        if not EARLY:
            delta = _row_term(delta_smem, stage, s_zero, Q_ROWS)
        return q, dv, pt_op, pt * (dpt - gl.expand_dims(delta, 0))

    @gluon.jit
    def _key_tiles(k_smem, v_smem, start_n, kv_2d: gl.constexpr, s_layout: gl.constexpr, acc_layout: gl.constexpr,
                   HALF: gl.constexpr, KEYS: gl.constexpr, Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """A consumer's KEYS keys (the program's HALF-th): K's and V's tiles and their views, the keys' and a
        Q block's indices, a zero score block, dK and dV accumulators at 0."""
        dtype: gl.constexpr = k_smem.dtype
        k_tile = k_smem.index(HALF)
        v_tile = v_smem.index(HALF)
        k = reinterpret(k_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        v = reinterpret(v_tile, dtype, [KEYS, HEAD_DIM], kv_2d)
        keys = start_n + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
        return k_tile, v_tile, k, v, keys, s_zero, dk, dv

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                       empty, qk_scale, sm_scale, d_lo, d_hi, b, hk, start_n, group, first_block, end_block,
                       HALF: gl.constexpr, SEEN: gl.constexpr, Q_ROWS: gl.constexpr, KEYS: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup's KEYS keys, transposed (keys as rows): S^T = K Q^T and dP^T = V dO^T issued
        together; P^T from the saved base-2 log-sum-exp, dV += P^T dO while dS^T = P^T (dP^T - delta)
        is formed, then dK += dS^T Q. dK (times the scale) and dV leave through K's and V's buffers."""
        s_layout: gl.constexpr = hopper.mma_layout(Q_ROWS)
        acc_layout: gl.constexpr = hopper.mma_layout(HEAD_DIM)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
        k_tile, v_tile, k, v, keys, s_zero, dk, dv = _key_tiles(k_smem, v_smem, start_n, kv_2d, s_layout,
                                                                acc_layout, HALF, KEYS, Q_ROWS, HEAD_DIM)
        # Row blocks from here on see every key of the program: no mask.
        full_from, full_to = _full_rows(start_n, d_lo, d_hi, 2 * KEYS, Q_ROWS)
        per_head = end_block - first_block
        mbarrier.wait(kv_bar, 0)
        for step in range(group * per_head):
            stage = step % STAGES
            m0 = (first_block + step % per_head) * Q_ROWS
            q, dv, pt_op, dst = _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys, m0,
                                          full_from, full_to, d_lo, d_hi, qk_scale, 1.0, stage, step, s_zero, dv,
                                          op_layout, tile_2d, SEEN, 0, Q_ROWS, HEAD_DIM, STAGES)
            ds_op = gl.convert_layout(dst.to(dtype), op_layout)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, pt_op, ds_op])
            mbarrier.arrive(empty.index(stage), count=1)
        _store_dkdv(dk_desc, dv_desc, k, v, k_tile, v_tile, dk * sm_scale, dv, b, hk, start_n, HALF, KEYS)

    @gluon.jit
    def _key_program_buffers(q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, STAGES: gl.constexpr,
                             KV_TILES: gl.constexpr):
        """A backward program's shared memory over keys: rings of STAGES (Q, dO) blocks with their row terms,
        and KV_TILES K and V tiles."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        lse2_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse2_desc.block_type.shape, lse2_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [KV_TILES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [KV_TILES] + v_desc.block_type.shape, v_desc.layout)
        return q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem

    @gluon.jit
    def _key_program_barriers(STAGES: gl.constexpr):
        """A backward program's ring barriers, initialized: K and V landed; each (Q, dO) stage landed, and
        released (by both consumers)."""
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        return kv_bar, ready, empty

    @gluon.jit(do_not_specialize=["n_q", "n_k", "d_lo", "d_hi", "section"])
    def attn_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_desc, delta_desc,
                                    qk_scale, sm_scale, n_q, n_k, n_heads_k, group, d_lo, d_hi, section,
                                    SEEN: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                                    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        """dK and dV of 2 x KEYS keys of one KV head, summed over its group's query heads, as
        `kernels.attn_bwd_dkdv_kernel` gives them (it reads the delta and base-2 lse the dQ kernel
        wrote, through `lse2_desc` and `delta_desc`); deterministic."""
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        b, hk, start_n, end_block, first_block = _key_program(n_q, n_k, n_heads_k, d_lo, d_hi, section, SEEN, Q_ROWS,
                                                              2 * KEYS)
        q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem = _key_program_buffers(q_desc, do_desc, lse2_desc,
                                                                                      delta_desc, k_desc, v_desc, STAGES, 2)
        kv_bar, ready, empty = _key_program_barriers(STAGES)
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                              empty, qk_scale, sm_scale, d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 0,
                              SEEN, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_dkdv_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, kv_bar, ready,
                              empty, qk_scale, sm_scale, d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 1,
                              SEEN, Q_ROWS, KEYS, HEAD_DIM, STAGES)),
            (_dkdv_producer, (q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                              delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                              end_block, Q_ROWS, KEYS, STAGES, 2)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])



    @gluon.jit
    def _role_consumer(dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, pt_smem, ds_smem,
                       kv_bar, ready, empty, pt_full, pt_free, ds_full, ds_free, qk_scale, sm_scale, d_lo, d_hi, b,
                       hk, start_n, group, first_block, end_block, ROLE: gl.constexpr, SEEN: gl.constexpr,
                       Q_ROWS: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup of the role-split dK/dV kernel (d256: a warpgroup cannot hold dK and dV of 64 keys
        over the whole head dim). ROLE 0 takes S^T = K Q^T and P^T, ROLE 1 dP^T = V dO^T and dS^T = P^T (dP^T -
        delta) from P^T in fp32 (rounded once, as the tl kernels round it); P^T passes through one fp32 buffer,
        dS^T through two 16-bit ones by step parity; each warpgroup adds its half of the head dim into
        dV += P^T dO and dK += dS^T Q. Both halves leave through the buffer of the operand only this
        warpgroup read (K or V)."""
        COLS: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = hopper.mma_layout(Q_ROWS)
        acc_layout: gl.constexpr = hopper.mma_layout(COLS)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
        out_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, COLS], dtype)
        if ROLE == 0:
            own = k_smem.index(0)
        else:
            own = v_smem.index(0)
        kv = reinterpret(own, dtype, [KEYS, HEAD_DIM], kv_2d)
        keys = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
        dk = gl.zeros([KEYS, COLS], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, COLS], gl.float32, acc_layout)
        full_from, full_to = _full_rows(start_n, d_lo, d_hi, KEYS, Q_ROWS)
        per_head = end_block - first_block
        mbarrier.wait(kv_bar, 0)
        for step in range(group * per_head):
            stage = step % STAGES
            parity = step % 2
            m0 = (first_block + step % per_head) * Q_ROWS
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            q = reinterpret(q_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
            do = reinterpret(do_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
            ds_t = ds_smem.index(parity)
            lse2, delta = _row_terms(lse2_smem, delta_smem, stage, s_zero, Q_ROWS)
            if ROLE == 0:
                st = warpgroup_mma(kv, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                st = warpgroup_mma_wait(0, deps=[st])
                pt = _probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, SEEN)
                mbarrier.wait(pt_free, (step & 1) ^ 1, pred=step >= 1)  # the other has read the last one
                pt_smem.store(pt)
                mbarrier.arrive(pt_full, count=1)
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do.slice(0, COLS, dim=1), dv,
                                   is_async=True)
                mbarrier.wait(ds_full.index(parity), (step // 2) & 1)
                dk = warpgroup_mma(ds_t, q.slice(0, COLS, dim=1), dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(ds_free.index(parity), count=1)
            else:
                dpt = warpgroup_mma(kv, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                mbarrier.wait(pt_full, step & 1)
                pt = pt_smem.load(s_layout)
                mbarrier.arrive(pt_free, count=1)
                ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
                # the other's dK matmul of two steps back has read this parity's buffer
                mbarrier.wait(ds_free.index(parity), ((step // 2) & 1) ^ 1, pred=step >= 2)
                ds_t.store(ds16)
                fence_async_shared()
                mbarrier.arrive(ds_full.index(parity), count=1)
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do.slice(COLS, COLS, dim=1), dv,
                                   is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q.slice(COLS, COLS, dim=1), dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
            mbarrier.arrive(empty.index(stage), count=1)
        out_4d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, KEYS, COLS], dtype)  # dK's, dV's tiles
        halves = reinterpret(own, dtype, [2, 1, 1, KEYS, COLS], out_4d)
        reinterpret(halves.index(0), dtype, [KEYS, COLS], out_2d).store((dk * sm_scale).to(dtype))
        reinterpret(halves.index(1), dtype, [KEYS, COLS], out_2d).store(dv.to(dtype))
        fence_async_shared()
        tma_store(dk_desc, [b, hk, start_n, ROLE * COLS], halves.index(0))
        tma_store(dv_desc, [b, hk, start_n, ROLE * COLS], halves.index(1))
        store_wait(0)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "d_lo", "d_hi", "section"])
    def attn_bwd_dkdv_roles_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_desc, delta_desc,
                                          qk_scale, sm_scale, n_q, n_k, n_heads_k, group, d_lo, d_hi, section,
                                          SEEN: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                                          CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        """`attn_bwd_dkdv_hopper_kernel` for head dims where one warpgroup cannot hold dK and dV of its keys
        (`config.GLUON_ROLE_HEAD_DIMS`): KEYS keys a program, its two warpgroups split by role
        (`_role_consumer`), dK and dV tiles (`dk_desc`, `dv_desc`) half the head dim wide; deterministic."""
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        b, hk, start_n, end_block, first_block = _key_program(n_q, n_k, n_heads_k, d_lo, d_hi, section, SEEN, Q_ROWS,
                                                              KEYS)
        q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem = _key_program_buffers(q_desc, do_desc, lse2_desc,
                                                                                      delta_desc, k_desc, v_desc, STAGES, 1)
        pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], gl.float32)
        pt_smem = gl.allocate_shared_memory(gl.float32, [KEYS, Q_ROWS], pt_layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, KEYS, Q_ROWS], ds_layout)  # [parity]
        kv_bar, ready, empty = _key_program_barriers(STAGES)
        pt_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pt_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(pt_full, count=1)
        mbarrier.init(pt_free, count=1)
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=1)
            mbarrier.init(ds_free.index(i), count=1)
        gl.warp_specialize([
            (_role_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, pt_smem,
                              ds_smem, kv_bar, ready, empty, pt_full, pt_free, ds_full, ds_free, qk_scale, sm_scale,
                              d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 0, SEEN, Q_ROWS, KEYS,
                              HEAD_DIM, STAGES)),
            (_role_consumer, (dk_desc, dv_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, pt_smem,
                              ds_smem, kv_bar, ready, empty, pt_full, pt_free, ds_full, ds_free, qk_scale, sm_scale,
                              d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 1, SEEN, Q_ROWS, KEYS,
                              HEAD_DIM, STAGES)),
            (_dkdv_producer, (q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                              delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                              end_block, Q_ROWS, KEYS, STAGES, 1)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])

    @gluon.jit
    def _store_ds(ds16, ds_smem, ds_full, ds_free, step, HALF: gl.constexpr):
        """This warpgroup's dS^T of `step` into its buffer of the step's parity, for dQ."""
        parity = step % 2
        # the dQ matmuls of two steps back have read this parity's buffers
        mbarrier.wait(ds_free.index(parity), ((step // 2) & 1) ^ 1, pred=step >= 2)
        ds_t = ds_smem.index(2 * parity + HALF)
        ds_t.store(ds16)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(parity), count=1)
        return ds_t

    @gluon.jit
    def _issue_dq(ds_smem, ds_full, k_lo, k_hi, dq_zero, step):
        """Once both warpgroups' dS^T of `step` are in, dQ = dS K issued over the head dim's columns of k_lo and
        k_hi (this warpgroup's half, or all of them where the warpgroups take turns)."""
        parity = step % 2
        mbarrier.wait(ds_full.index(parity), (step // 2) & 1)
        dq = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)), k_lo, dq_zero, use_acc=False, is_async=True)
        return warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)), k_hi, dq, is_async=True)

    @gluon.jit
    def _fragment_rows(dq, HEAD_DIM: gl.constexpr):
        """A warpgroup's dQ accumulator (64 rows, a half or all of the head dim) as the dQ sum's fragment rows
        (`dq_sum_fields`): thread t's registers of half h become row h x 128 + t, 4 floats of a (row, row + 8)
        pair of columns after another, so that a thread stores 16 bytes at a time with no bank conflict."""
        halves: gl.constexpr = dq.shape[1] // (HEAD_DIM // 2)
        # rows: warp, row + 8, lane // 4; columns: half, 8-column group, lane % 4, column pair
        parts = dq.reshape([4, 2, 8, halves, HEAD_DIM // 16, 4, 2])
        return gl.permute(parts, (3, 0, 2, 5, 4, 1, 6)).reshape([halves * 128, HEAD_DIM // 4])

    @gluon.jit
    def _add_dq(dq, dq_out, dq_tile, dq_desc, ds_free, empty, b, h, m0, step, sm_scale, HALF: gl.constexpr,
                HEAD_DIM: gl.constexpr, FRAGMENTS: gl.constexpr, STAGES: gl.constexpr):
        """After `step`'s matmuls: its dS^T buffers and ring stage released, its dQ (a half, or all where the
        warpgroups take turns; times the scale) added into the fp32 sum (in fragment rows with FRAGMENTS) by a
        TMA reduce-add."""
        mbarrier.arrive(ds_free.index(step % 2), count=1)
        mbarrier.arrive(empty.index(step % STAGES), count=1)
        store_wait(0)  # this warpgroup's add of the step before has read its tile
        if FRAGMENTS:
            dq_out.store(_fragment_rows(dq * sm_scale, HEAD_DIM))
            row, col = 4 * m0 + HALF * 128, 0  # a Q block: 256 fragment rows
        else:
            dq_out.store(dq * sm_scale)
            row, col = m0, HALF * dq.shape[1]
        fence_async_shared()
        tma_reduce_add(dq_desc, [b, h, row, col], dq_tile)

    @gluon.jit
    def _dq_by_turns(dv, dk, pt_op, ds_smem, dq_out, dq_tile, dq_desc, empty, ds_full, ds_free, k_lo, k_hi, dq_zero,
                     b, hk, group, per_head, m0, step, sm_scale, HALF: gl.constexpr, HEAD_DIM: gl.constexpr,
                     FRAGMENTS: gl.constexpr, STAGES: gl.constexpr):
        """The end of a step where the consumers take turns at dQ: once this warpgroup's dV and dK are done, on
        steps of its parity it forms dQ = dS K over both key halves and the whole head dim (N = 128: less shared
        memory read a product than two N = 64 halves) and adds it; on the others it goes on to the next block
        while the other one does. Returns (dV, dK)."""
        dv, dk, pt_op = warpgroup_mma_wait(0, deps=[dv, dk, pt_op])
        if step % 2 == HALF:
            dq = warpgroup_mma_wait(0, deps=[_issue_dq(ds_smem, ds_full, k_lo, k_hi, dq_zero, step)])
            _add_dq(dq, dq_out, dq_tile, dq_desc, ds_free, empty, b, hk * group + step // per_head, m0, step,
                    sm_scale, 0, HEAD_DIM, FRAGMENTS, STAGES)
        else:
            mbarrier.arrive(empty.index(step % STAGES), count=1)
        return dv, dk

    @gluon.jit
    def _steps_ahead(k, v, k_lo, k_hi, q_smem, do_smem, lse2_smem, delta_smem, ds_smem, dq_out, dq_tile, dq_desc,
                     ready, empty, ds_full, ds_free, keys, s_zero, dq_zero, dk, dv, qk_scale, sm_scale, cap_scale,
                     full_from, full_to, d_lo, d_hi, b, hk, group, first_block, per_head, op_layout: gl.constexpr,
                     tile_2d: gl.constexpr, HALF: gl.constexpr, SEEN: gl.constexpr, SOFTCAP: gl.constexpr,
                     Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, FRAGMENTS: gl.constexpr, STAGES: gl.constexpr):
        """A consumer's steps with the next block's S^T and dP^T issued ahead of this block's dV, dK and dQ,
        so that the next softmax runs while those are on the tensor cores (the other order leaves them idle
        while both warpgroups, which meet on dS every step, take their softmax together). Needs registers
        for both blocks' scores (d64) and a ring of 3 stages (two blocks held while the next loads). SOFTCAP:
        capped scores (`_capped_probs`), the cap's derivative held until dS^T. Returns (dK, dV)."""
        dtype: gl.constexpr = q_smem.dtype
        n = group * per_head
        if n > 0:
            m0 = first_block * Q_ROWS
            _, _, st, dpt = _issue_scores(k, v, q_smem, do_smem, ready, 0, 0, s_zero, tile_2d, Q_ROWS, HEAD_DIM,
                                          STAGES)
            lse2, delta = _row_terms(lse2_smem, delta_smem, 0, s_zero, Q_ROWS)
            st = warpgroup_mma_wait(1, deps=[st])
            if SOFTCAP:
                pt, slope = _capped_probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, cap_scale, SEEN)
            else:
                pt = _probs(st, lse2, keys, m0, full_from, full_to, d_lo, d_hi, qk_scale, SEEN)
            dpt = warpgroup_mma_wait(0, deps=[dpt])
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            if SOFTCAP:
                dst = dst * slope
            _store_ds(dst.to(dtype), ds_smem, ds_full, ds_free, 0, HALF)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            for step in range(n - 1):
                stage = step % STAGES
                ahead = step + 1
                m0 = (first_block + step % per_head) * Q_ROWS
                m_ahead = (first_block + ahead % per_head) * Q_ROWS
                _, _, st, dpt = _issue_scores(k, v, q_smem, do_smem, ready, ahead % STAGES, ahead, s_zero, tile_2d,
                                              Q_ROWS, HEAD_DIM, STAGES)
                q = reinterpret(q_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
                do = reinterpret(do_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
                dv = warpgroup_mma(pt_op, do, dv, is_async=True)
                dk = warpgroup_mma(ds_smem.index(2 * (step % 2) + HALF), q, dk, is_async=True)
                dq = _issue_dq(ds_smem, ds_full, k_lo, k_hi, dq_zero, step)
                if SOFTCAP:  # (delta read once dP^T is done: the cap's derivative is held instead)
                    lse2 = _row_term(lse2_smem, ahead % STAGES, s_zero, Q_ROWS)
                else:
                    lse2, delta = _row_terms(lse2_smem, delta_smem, ahead % STAGES, s_zero, Q_ROWS)
                st = warpgroup_mma_wait(5, deps=[st])  # S^T ahead done; dP^T ahead, dV, dK, dQ still run
                if SOFTCAP:
                    pt, slope = _capped_probs(st, lse2, keys, m_ahead, full_from, full_to, d_lo, d_hi, qk_scale,
                                              cap_scale, SEEN)
                else:
                    pt = _probs(st, lse2, keys, m_ahead, full_from, full_to, d_lo, d_hi, qk_scale, SEEN)
                dpt = warpgroup_mma_wait(4, deps=[dpt])
                if SOFTCAP:
                    delta = _row_term(delta_smem, ahead % STAGES, s_zero, Q_ROWS)
                ds = pt * (dpt - gl.expand_dims(delta, 0))
                if SOFTCAP:
                    ds = ds * slope
                ds16 = ds.to(dtype)
                dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op])
                _add_dq(dq, dq_out, dq_tile, dq_desc, ds_free, empty, b, hk * group + step // per_head, m0, step,
                        sm_scale, HALF, HEAD_DIM, FRAGMENTS, STAGES)
                _store_ds(ds16, ds_smem, ds_full, ds_free, ahead, HALF)
                pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            last = n - 1
            stage = last % STAGES
            q = reinterpret(q_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
            do = reinterpret(do_smem.index(stage), dtype, [Q_ROWS, HEAD_DIM], tile_2d)
            dv = warpgroup_mma(pt_op, do, dv, is_async=True)
            dk = warpgroup_mma(ds_smem.index(2 * (last % 2) + HALF), q, dk, is_async=True)
            dq = _issue_dq(ds_smem, ds_full, k_lo, k_hi, dq_zero, last)
            dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op])
            _add_dq(dq, dq_out, dq_tile, dq_desc, ds_free, empty, b, hk * group + last // per_head,
                    (first_block + last % per_head) * Q_ROWS, last, sm_scale, HALF, HEAD_DIM, FRAGMENTS, STAGES)
        return dk, dv

    @gluon.jit
    def _bwd_consumer(dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, ds_smem,
                      dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, cap_scale, d_lo, d_hi, b,
                      hk, start_n, group, first_block, end_block, HALF: gl.constexpr, SEEN: gl.constexpr,
                      SOFTCAP: gl.constexpr, Q_ROWS: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, AHEAD: gl.constexpr, DQ_TURNS: gl.constexpr, DQ_FRAGMENTS: gl.constexpr):
        """`_dkdv_consumer`, plus dQ = dS K (FlashAttention-3's split): both warpgroups' dS^T meet in
        shared memory (two buffers by step parity, `ds_full` / `ds_free`), and each forms its half of
        the head dim over all 2 x KEYS keys, which one TMA reduce-add puts into the fp32 dQ sum; with
        DQ_TURNS one of them forms all of it, each on steps of its parity (`_dq_by_turns`); DQ_FRAGMENTS: the sum
        in fragment rows (`dq_sum_fields`)."""
        s_layout: gl.constexpr = hopper.mma_layout(Q_ROWS)
        acc_layout: gl.constexpr = hopper.mma_layout(HEAD_DIM)
        DQ_COLS: gl.constexpr = HEAD_DIM if DQ_TURNS else HEAD_DIM // 2
        dq_layout: gl.constexpr = hopper.mma_layout(DQ_COLS)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        # K's swizzle as its descriptor has it (`fused_kv_layout`: dQ reads half of each row)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=k_smem.layout.swizzle_byte_width,
                                                   element_bitwidth=k_smem.layout.element_bitwidth)
        dq_box: gl.constexpr = dq_desc.block_type.shape[2:]  # what this warpgroup adds: rows in order or fragments
        dq_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for(dq_box, gl.float32)
        k_tile, v_tile, k, v, keys, s_zero, dk, dv = _key_tiles(k_smem, v_smem, start_n, kv_2d, s_layout,
                                                                acc_layout, HALF, KEYS, Q_ROWS, HEAD_DIM)
        # this warpgroup's half of the head dim (by turns: all of it) of both key halves: dQ's B operands
        k_lo = reinterpret(k_smem.index(0), dtype, [KEYS, HEAD_DIM], kv_2d)
        k_hi = reinterpret(k_smem.index(1), dtype, [KEYS, HEAD_DIM], kv_2d)
        if not DQ_TURNS:
            k_lo = k_lo.slice(HALF * DQ_COLS, DQ_COLS, dim=1)
            k_hi = k_hi.slice(HALF * DQ_COLS, DQ_COLS, dim=1)
        dq_tile = dq_smem.index(HALF)
        dq_out = reinterpret(dq_tile, gl.float32, dq_box, dq_2d)
        dq_zero = gl.zeros([Q_ROWS, DQ_COLS], gl.float32, dq_layout)
        full_from, full_to = _full_rows(start_n, d_lo, d_hi, 2 * KEYS, Q_ROWS)
        per_head = end_block - first_block
        mbarrier.wait(kv_bar, 0)
        if AHEAD:
            dk, dv = _steps_ahead(k, v, k_lo, k_hi, q_smem, do_smem, lse2_smem, delta_smem, ds_smem, dq_out, dq_tile,
                                  dq_desc, ready, empty, ds_full, ds_free, keys, s_zero, dq_zero, dk, dv, qk_scale,
                                  sm_scale, cap_scale, full_from, full_to, d_lo, d_hi, b, hk, group, first_block,
                                  per_head, op_layout, tile_2d, HALF, SEEN, SOFTCAP, Q_ROWS, HEAD_DIM, DQ_FRAGMENTS,
                                  STAGES)
        else:
            for step in range(group * per_head):
                stage = step % STAGES
                h = hk * group + step // per_head
                m0 = (first_block + step % per_head) * Q_ROWS
                q, dv, pt_op, dst = _bwd_step(k, v, q_smem, do_smem, lse2_smem, delta_smem, ready, keys,
                                              m0, full_from, full_to, d_lo, d_hi, qk_scale, cap_scale, stage, step,
                                              s_zero, dv, op_layout, tile_2d, SEEN, SOFTCAP, Q_ROWS, HEAD_DIM, STAGES)
                ds_t = _store_ds(dst.to(dtype), ds_smem, ds_full, ds_free, step, HALF)
                dk = warpgroup_mma(ds_t, q, dk, is_async=True)  # dS^T read from shared memory: no registers held
                if DQ_TURNS:
                    dv, dk = _dq_by_turns(dv, dk, pt_op, ds_smem, dq_out, dq_tile, dq_desc, empty, ds_full, ds_free,
                                          k_lo, k_hi, dq_zero, b, hk, group, per_head, m0, step, sm_scale, HALF,
                                          HEAD_DIM, DQ_FRAGMENTS, STAGES)
                else:
                    dq = _issue_dq(ds_smem, ds_full, k_lo, k_hi, dq_zero, step)
                    dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op])
                    _add_dq(dq, dq_out, dq_tile, dq_desc, ds_free, empty, b, h, m0, step, sm_scale, HALF, HEAD_DIM,
                            DQ_FRAGMENTS, STAGES)
        last = group * per_head - 1
        if last >= 0:  # dK leaves through this K tile: the other warpgroup's last dQ matmul has read it
            mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
        _store_dkdv(dk_desc, dv_desc, k, v, k_tile, v_tile, dk * sm_scale, dv, b, hk, start_n, HALF, KEYS)

    @gluon.jit(do_not_specialize=["n_q", "n_k", "d_lo", "d_hi", "section"])
    def attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_desc, delta_desc, dq_desc,
                               qk_scale, sm_scale, n_q, n_k, n_heads_k, group, d_lo, d_hi, section, cap_scale,
                               SEEN: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                               AHEAD: gl.constexpr, DQ_TURNS: gl.constexpr, DQ_FRAGMENTS: gl.constexpr,
                               SOFTCAP: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                               PRODUCER_REGISTERS: gl.constexpr):
        """The 5-matmul backward (Triton >= 3.8): `attn_bwd_dkdv_hopper_kernel` that also adds dQ
        (times the scale) into the fp32 dQ sum through `dq_desc` (TMA reduce-adds: not
        deterministic); AHEAD: each consumer issues the next block's scores first (`_steps_ahead`); DQ_TURNS:
        the consumers take turns at dQ by step (`_dq_by_turns`; `dq_desc`'s box then spans the head dim);
        DQ_FRAGMENTS: the sum in fragment rows (`dq_sum_fields`); SOFTCAP (`kernels.TANH_APPROX`): scores capped,
        tanh(S * cap_scale) scaled by qk_scale (`hopper.forward_mask_args`), as the forward took them.
        Reads the row terms `kernels.attn_bwd_prep_kernel` wrote."""
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        b, hk, start_n, end_block, first_block = _key_program(n_q, n_k, n_heads_k, d_lo, d_hi, section, SEEN, Q_ROWS,
                                                              2 * KEYS)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], dtype)
        q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem = _key_program_buffers(q_desc, do_desc, lse2_desc,
                                                                                      delta_desc, k_desc, v_desc, STAGES, 2)
        ds_smem = gl.allocate_shared_memory(dtype, [4, KEYS, Q_ROWS], ds_layout)  # [parity, half]
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        kv_bar, ready, empty = _key_program_barriers(STAGES)
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=1 if DQ_TURNS else 2)  # the warpgroups that read dS
        gl.warp_specialize([
            (_bwd_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem,
                             ds_smem, dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, cap_scale,
                             d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 0, SEEN, SOFTCAP, Q_ROWS,
                             KEYS, HEAD_DIM, STAGES, AHEAD, DQ_TURNS, DQ_FRAGMENTS)),
            (_bwd_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem,
                             ds_smem, dq_smem, kv_bar, ready, empty, ds_full, ds_free, qk_scale, sm_scale, cap_scale,
                             d_lo, d_hi, b, hk, start_n, group, first_block, end_block, 1, SEEN, SOFTCAP, Q_ROWS,
                             KEYS, HEAD_DIM, STAGES, AHEAD, DQ_TURNS, DQ_FRAGMENTS)),
            (_dkdv_producer, (q_desc, do_desc, lse2_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse2_smem,
                              delta_smem, k_smem, v_smem, kv_bar, ready, empty, b, hk, start_n, group, first_block,
                              end_block, Q_ROWS, KEYS, STAGES, 2)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# lse2 and delta rows in shared memory: fp32, unswizzled (a consumer reads them as one row vector)
STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3) if gl else None


def fused_kv_layout(padded: int, dtype: torch.dtype):
    """K's, V's, dK's and dV's tiles in the 5-matmul backward: dQ's matmuls read half of each K row,
    which must start a swizzle atom (64-byte swizzle at d64, the default 128 from d128)."""
    width = min(128, padded * dtype.itemsize // 2)
    return gl.NVMMASharedLayout(swizzle_byte_width=width, element_bitwidth=8 * dtype.itemsize, rank=4)


def bind_dkdv(q, k, v, grad_out, dk, dv, scratch_strides: tuple[int, int], mask: Mask, sm_scale: float):
    """launch(q, k, v, grad_out, lse2, delta, dk, dv) of the dK/dV kernel for tensors laid out like
    these (`serves` holds for q, k, v; grad_out, dk and dv take descriptors too), lse2 and delta the
    dQ kernel's scratch rows, (B, H, N) with strides (*scratch_strides, 1); the caller checks
    `bases_aligned` per call."""
    roles = padded_head_dim(q.shape[-1]) in config.GLUON_ROLE_HEAD_DIMS
    launch, descriptors = _bwd_launch(attn_bwd_dkdv_roles_hopper_kernel if roles else attn_bwd_dkdv_hopper_kernel,
                                      (q, k, v, grad_out, dk, dv), scratch_strides, mask, sm_scale, None, roles=roles)

    def run(q, k, v, grad_out, lse2, delta, dk, dv):
        launch(*descriptors(q, k, v, grad_out, dk, dv, lse2, delta))

    return run


def causal_section(heads: int, group: int, n_q: int, padded: int, itemsize: int, dq_sum: bool) -> int:
    """KV heads (of `heads`, batch x KV heads) whose causal backward programs go key block by key block
    (`_key_program`): as many as fit their query heads' Q and dO (and fp32 dQ sum) in
    `config.GLUON_BWD_CAUSAL_L2_BYTES`, at least one (one: head by head)."""
    return max(1, min(heads, config.GLUON_BWD_CAUSAL_L2_BYTES // (group * n_q * padded * (2 * itemsize + 4 * dq_sum))))


def _bwd_launch(kernel, tensors, scratch_strides: tuple[int, int], mask: Mask, sm_scale: float, kv_layout,
                builds: dict | None = None, roles: bool = False, dq_sum: bool = False):
    """(launch, descriptors) of a backward kernel over keys (the dK/dV kernels, the 5-matmul one): its
    grid, arguments and tiles (K, V, dK, dV in `kv_layout` where given; constexprs in `builds` over the
    defaults; `roles`: the role-split kernel's, GLUON_KEYS keys a program and dK, dV in halves of the
    head dim; `dq_sum`: it adds dQ into an fp32 sum), and descriptors(q, k, v, grad_out, dk, dv, lse2,
    delta) giving their per-call TMA descriptors (the row terms: (B, H, padded rows), boxes of a Q
    block's rows)."""
    q, k = tensors[:2]
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = padded_head_dim(d)
    rows = (GLUON_Q_ROWS, GLUON_KEYS, GLUON_KEYS, GLUON_Q_ROWS, GLUON_KEYS, GLUON_KEYS)
    layouts = hopper.tile_descriptors(tensors, rows, padded, q.dtype,
                                      (None, kv_layout, kv_layout, None, kv_layout, kv_layout))
    if roles:
        layouts[4:] = hopper.tile_descriptors(tensors[4:], rows[4:], padded // 2, q.dtype)
    program_keys = GLUON_KEYS if roles else 2 * GLUON_KEYS
    # the 5-matmul kernel takes softcaps and windows (`fused_mask`): the forward's scales and builds; row i
    # sees key j when d_lo <= j - i <= d_hi (`_key_program`)
    mask_builds, (qk_scale, cap_scale, left, right) = hopper.forward_mask_args(mask, sm_scale, q.dtype)
    shift = int(mask.lower_right) * (n_k - n_q)
    launch = Launch(kernel, (sizing.cdiv(n_k, program_keys) * b * hk,),
                    (qk_scale, sm_scale, n_q, n_k, hk, hq // hk, shift - left, shift + right,
                     causal_section(b * hk, hq // hk, n_q, padded, q.dtype.itemsize, dq_sum),
                     *((cap_scale,) if dq_sum else ())),
                    {"SEEN": mask_builds["SEEN"], "HEAD_DIM": padded, "STAGES": GLUON_BWD_STAGES,
                     **({"SOFTCAP": mask_builds["SOFTCAP"]} if dq_sum else {}),
                     "CONSUMER_REGISTERS": GLUON_CONSUMER_REGISTERS, "PRODUCER_REGISTERS": GLUON_PRODUCER_REGISTERS,
                     "num_warps": 4, **(builds or {})}, q.device)
    layouts += [([b, hq, scratch_strides[1]], [*scratch_strides, 1], [1, 1, GLUON_Q_ROWS], "zero", STATS_LAYOUT)] * 2

    def descriptors(*tensors):
        return (Descriptor(t, *fields) for t, fields in zip(tensors, layouts, strict=True))

    return launch, descriptors


def dq_sum_rows(n_q: int) -> int:
    """Rows of the fp32 dQ sum a head: whole Q blocks (its fragment rows mix a block's rows)."""
    return sizing.cdiv(n_q, GLUON_Q_ROWS) * GLUON_Q_ROWS


def dq_sum_fields(dq_shape: list[int], builds: dict) -> tuple:
    """The fp32 dQ sum's (contiguous, `dq_shape` = (B, H, `dq_sum_rows`, padded head dim)) TMA descriptor
    fields after its base, (shape, strides, box, padding, layout), for the 5-matmul kernel of `builds`
    (`fused_builds`). With DQ_FRAGMENTS the sum is kept in fragment rows, as a consumer's dQ accumulator
    holds it: a Q block's 64 x padded floats are 256 rows of padded / 4, row h x 128 + t the registers of
    thread t for half h of the head dim (`_fragment_rows`); else in order. The box: what one consumer
    adds, a Q block's half of the head dim, or all of it where the consumers take turns."""
    b, hq, rows, padded = dq_shape
    if builds["DQ_FRAGMENTS"]:
        shape, box = [b, hq, 4 * rows, padded // 4], [256 if builds["DQ_TURNS"] else 128, padded // 4]
    else:
        shape, box = dq_shape, [GLUON_Q_ROWS, padded if builds["DQ_TURNS"] else padded // 2]
    return (shape, [hq * rows * padded, rows * padded, shape[3], 1], [1, 1, *box], "zero",
            hopper.shared_layout(*box, torch.float32))


def bind_backward(q, k, v, out, grad_out, dlse, dq, dk, dv, lse_strides: tuple[int, int],
                  scratch_strides: tuple[int, int], mask: Mask, sm_scale: float):
    """launch(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, dk, dv) of the 5-matmul backward
    (`fused_serves`): the prep kernel's row terms and cleared fp32 dQ sum, the Gluon kernel, then dQ
    cast into `dq`. `dlse` None: no gradient reaches the lse (any tensor may stand in per call);
    delta and lse2 as `bind_dkdv` takes them; the caller checks `bases_aligned` per call."""
    b, hq, n_q, d = q.shape
    padded = padded_head_dim(d)
    has_dlse = dlse is not None
    rows = dq_sum_rows(n_q)
    prep = Launch(kernels.attn_bwd_prep_kernel, (sizing.cdiv(rows, PREP_ROWS) * b * hq,),
                  (n_q, hq, rows, *out.stride(), *grad_out.stride(), *lse_strides,
                   *(dlse.stride() if has_dlse else (0, 0, 0)), *scratch_strides),
                  {"HAS_DLSE": has_dlse, "HEAD_DIM": d, "HEAD_DIM_PADDED": padded, "BLOCK_M": PREP_ROWS,
                   "num_warps": 4}, q.device)
    builds = fused_builds(d, hopper.forward_mask_args(mask, sm_scale, q.dtype)[0]["SEEN"])
    launch, descriptors = _bwd_launch(attn_bwd_hopper_kernel, (q, k, v, grad_out, dk, dv), scratch_strides,
                                      mask, sm_scale, fused_kv_layout(padded, q.dtype), builds, dq_sum=True)
    dq_shape = [b, hq, rows, padded]
    dq_layout = dq_sum_fields(dq_shape, builds)
    cast = Launch(kernels.attn_bwd_dq_cast_kernel, (rows // GLUON_Q_ROWS * b * hq,), (n_q, hq, rows, *dq.stride()),
                  {"HEAD_DIM": d, "HEAD_DIM_PADDED": padded, "FRAGMENTS": builds["DQ_FRAGMENTS"], "num_warps": 4},
                  q.device)
    fp32 = torch.empty(0, dtype=torch.float32, device=q.device)

    def run(q, k, v, out, grad_out, lse, dlse, delta, lse2, dq, dk, dv):
        dq_sum = alloc.new_empty(fp32, dq_shape)
        prep(out, grad_out, lse, dlse, delta, lse2, dq_sum)
        launch(*descriptors(q, k, v, grad_out, dk, dv, lse2, delta),
               Descriptor(dq_sum, *dq_layout))
        cast(dq_sum, dq)

    return run

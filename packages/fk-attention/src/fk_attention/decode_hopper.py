"""fk-attention's split-KV decode kernel on Hopper, in Gluon: one warp a program, K and V through a
TMA ring.

The `tl` decode kernel (`decode_kernels.attn_decode_kernel`) spreads its 16 query rows over 4 warps,
so each step's row max and sum cross warps through shared memory, and it issues the next stage's
copies after the step's matmuls. Here a program is one warp: its 16 rows are one mma.sync tile (row
reductions stay in the warp), and K and V blocks arrive through TMA into a ring of STAGES stages,
each refilled as soon as its step has read it, so a block's copy is in flight for all the steps
before it. Same grid, key slices and outputs as the `tl` kernel (its merge combines the slices);
taken where `decode.gluon_block` and `decode.gluon_takes` say.
"""

from __future__ import annotations

import triton

from fk_runtime.gluon import gl, gluon, mbarrier, mma_v2, reinterpret, tma_load

from . import hopper

if gluon is not None and mma_v2 is not None:

    @triton.constexpr_function
    def acc_layout():
        """The warp's mma.sync accumulator layout: 16 rows, 8-column instructions."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])

    @gluon.jit
    def _edge_masked(s, pos, start, n_k, shift, left, right, full_lo, full_hi, BLOCK_N: gl.constexpr):
        """Scores of keys a row does not see at -inf (past n_k, or j - (i + shift) outside [-left,
        right]), in key blocks outside [full_lo, full_hi) only, which every row sees in full."""
        if (start < full_lo) | (start + BLOCK_N > full_hi):
            keys = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout())), 0)
            keep = keys < gl.expand_dims(gl.minimum(pos + shift + right + 1, n_k), 1)
            keep = keep & (keys >= gl.expand_dims(pos + shift - left, 1))
            s = gl.where(keep, s, -float("inf"))
        return s

    @gluon.jit
    def _values(v_tile, start, n_k, v_op: gl.constexpr, BLOCK_N: gl.constexpr):
        """V's block as the P V operand, rows at or past n_k zeroed (a cache's rows past its length
        hold anything, NaN too, and 0 x NaN is NaN)."""
        if start + BLOCK_N > n_k:
            rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
            v = v_tile.load(rows_layout)
            rows = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))
            v = gl.where(gl.expand_dims(rows < n_k, 1), v, gl.zeros_like(v))
            v = gl.convert_layout(v, v_op)
        else:
            v = v_tile.load(v_op)
        return v

    @gluon.jit(do_not_specialize=["n_k", "n_new", "n_splits", "n_part"])
    def attn_decode_tma_kernel(
        q_ptr, k_desc, v_desc, o_ptr, lse_ptr, part_ptr, seqlens_ptr, qk_scale, cap_scale,
        n_q, n_k, n_new, n_heads_k, group, lower_right, left, right, n_splits, n_part,
        sqb, sqh, sqn, sqd, sob, soh, son, sod, slb, slh, sln,
        SOFTCAP: gl.constexpr, SEQLENS: gl.constexpr, SLICED: gl.constexpr, STORE_LSE: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    ):
        """`decode_kernels.attn_decode_kernel` for a dense (B, Hk, N, D) cache through descriptors of
        [1, 1, BLOCK_N, D] blocks, 16 query rows a program, no ALiBi or left pads: one slice of the
        keys of a block of a GQA group's rows; with one slice the output and (STORE_LSE) lse, with
        several (SLICED) the fp32 partial output and log-sum-exp to part (the `tl` kernel's layout).
        Scores are scaled in base 2 by qk_scale > 0; SOFTCAP: tanh as `hopper.capped` takes it (cap_scale
        from `hopper.forward_mask_args`)."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        D: gl.constexpr = k_desc.block_type.shape[3]
        dtype: gl.constexpr = k_desc.dtype
        acc_l: gl.constexpr = acc_layout()
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=2)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)

        m_blocks = gl.cdiv(group * n_q, 16)
        pid = gl.program_id(0)
        block = pid % m_blocks  # row blocks fastest, then slices: programs on the same keys side by side
        split = (pid // m_blocks) % n_splits
        bhk = pid // (m_blocks * n_splits)
        b = bhk // n_heads_k
        hk = bhk % n_heads_k
        if SEQLENS:
            n_k_b = gl.minimum(gl.minimum(gl.maximum(gl.load(seqlens_ptr + b), 0), n_k) + n_new, n_k)
        else:
            n_k_b = n_k
        shift = lower_right * (n_k_b - n_q)
        rows = block * 16 + gl.arange(0, 16, layout=row_l)
        row_ok = rows < group * n_q
        pos = rows % n_q
        h = hk * group + rows // n_q
        # Keys some row sees, [lo, hi), and those every row sees, [full_lo, full_hi) (the `tl` kernel's).
        first = gl.min(gl.where(row_ok, pos, n_q), 0)
        last = gl.max(gl.where(row_ok, pos, 0), 0)
        lo = gl.maximum(first + shift - left, 0)
        hi = gl.maximum(gl.minimum(n_k_b, last + shift + right + 1), lo)
        full_lo = gl.cdiv(gl.maximum(last + shift - left, 0), BLOCK_N) * BLOCK_N
        full_hi = gl.minimum((gl.maximum(first + shift + right + 1, 0) // BLOCK_N) * BLOCK_N,
                             (n_k_b // BLOCK_N) * BLOCK_N)
        lo = (lo // BLOCK_N) * BLOCK_N
        chunk = gl.cdiv(gl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
        s_lo = gl.minimum(lo + split * chunk, hi)
        n_steps = gl.cdiv(gl.minimum(s_lo + chunk, hi) - s_lo, BLOCK_N)

        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
        for i in gl.static_range(STAGES):  # the ring's first lap, before anything else waits
            mbarrier.expect(k_ready.index(i), k_desc.block_type.nbytes, pred=i < n_steps)
            tma_load(k_desc, [b, hk, s_lo + i * BLOCK_N, 0], k_ready.index(i), k_smem.index(i), pred=i < n_steps)
            mbarrier.expect(v_ready.index(i), v_desc.block_type.nbytes, pred=i < n_steps)
            tma_load(v_desc, [b, hk, s_lo + i * BLOCK_N, 0], v_ready.index(i), v_smem.index(i), pred=i < n_steps)

        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        q_rows = gl.arange(0, 16, layout=gl.SliceLayout(1, q_layout)) + block * 16
        q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        q_h = hk * group + q_rows // n_q
        q_off = b.to(gl.int64) * sqb + q_h.to(gl.int64) * sqh + (q_rows % n_q).to(gl.int64) * sqn
        q_ok = gl.expand_dims(q_rows < group * n_q, 1) & gl.expand_dims(q_cols < HEAD_DIM, 0)
        q = gl.load(q_ptr + gl.expand_dims(q_off, 1) + gl.expand_dims(q_cols * sqd, 0), mask=q_ok, other=0.0)
        q = gl.convert_layout(q, a_op)

        m_i = gl.full([16], -float("inf"), gl.float32, row_l)
        l_i = gl.zeros([16], gl.float32, row_l)
        acc = gl.zeros([16, D], gl.float32, acc_l)
        s_zero = gl.zeros([16, BLOCK_N], gl.float32, acc_l)
        stage = 0
        phase = 0
        for i in range(n_steps):  # (stage and phase carried, not i % STAGES: no division a step)
            start = s_lo + i * BLOCK_N
            mbarrier.wait(k_ready.index(stage), phase)
            k_t = reinterpret(k_smem.index(stage), dtype, [BLOCK_N, D], kv_2d).permute((1, 0)).load(b_op)
            s = mma_v2(q, k_t, s_zero)
            s = hopper.capped(s, cap_scale, SOFTCAP)
            s = _edge_masked(s, pos, start, n_k_b, shift, left, right, full_lo, full_hi, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == -float("inf"), 0.0, m_new) * qk_scale
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
            alpha = gl.exp2(m_i * qk_scale - m_use)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            mbarrier.wait(v_ready.index(stage), phase)
            v = _values(reinterpret(v_smem.index(stage), dtype, [BLOCK_N, D], kv_2d), start, n_k_b, b_op, BLOCK_N)
            acc = mma_v2(gl.convert_layout(p.to(dtype), a_op), v, acc * gl.expand_dims(alpha, 1))
            # the stage is read: refill it with the block STAGES ahead
            ahead = i + STAGES < n_steps
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes, pred=ahead)
            tma_load(k_desc, [b, hk, start + STAGES * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage),
                     pred=ahead)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes, pred=ahead)
            tma_load(v_desc, [b, hk, start + STAGES * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage),
                     pred=ahead)
            stage += 1
            if stage == STAGES:
                stage = 0
                phase ^= 1
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))

        seen = l_i > 0.0  # rows that see no key: output 0, log-sum-exp -inf
        l_safe = gl.where(seen, l_i, 1.0)
        out = acc / gl.expand_dims(l_safe, 1)
        lse = gl.where(seen, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        cols = gl.arange(0, D, layout=col_l)
        out_ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
        if SLICED:
            slice0 = ((b.to(gl.int64) * n_heads_k * group + h) * n_q + pos) * n_splits + split
            gl.store(part_ptr + gl.expand_dims(slice0 * HEAD_DIM, 1) + gl.expand_dims(cols, 0), out, mask=out_ok)
            gl.store(part_ptr + n_part + slice0, lse, mask=row_ok)
        else:
            o_rows = b.to(gl.int64) * sob + h.to(gl.int64) * soh + pos.to(gl.int64) * son
            gl.store(o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(cols * sod, 0), out.to(o_ptr.dtype.element_ty),
                     mask=out_ok)
            if STORE_LSE:
                gl.store(lse_ptr + b.to(gl.int64) * slb + h.to(gl.int64) * slh + pos.to(gl.int64) * sln, lse,
                         mask=row_ok)

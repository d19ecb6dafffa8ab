"""fk-attention's Hopper forward in Gluon, top to bottom: when it is taken, its tiles, the kernel,
the launch bound once per plan.

FlashAttention-3's forward design, written with Triton's Gluon (`triton.experimental.gluon`):
each program takes 128 query rows of one (batch, head) as two 4-warp consumer warpgroups of 64
rows each, and one producer warp that moves Q and a ring of K/V blocks into shared memory through
TMA (mbarriers: `ready` when a stage has landed, `empty` when both consumers are done with it).
A consumer issues the next block's Q K^T on the tensor cores before the softmax of this one, so
that softmax runs under the P V matmul (asynchronous wgmma); the producer's registers go to the
consumers (`setmaxnreg`).

Taken for what it was built and measured on (TUNING.md: Hopper forward): an H100-class GPU
(compute capability 9.x), the Triton versions in GLUON_TRITON, fp16/bf16, head dims padded to
HEAD_DIMS, full or causal masks (either alignment), no softcap, dense (B, H, N, D) tensors whose
strides a TMA descriptor takes and whose bases are aligned (checked per call). Everything else,
and any Triton where Gluon or this API is missing, runs the `tl` kernels (`kernels.attn_fwd_kernel`),
which stay the reference the GPU tests compare with. The backward is the `tl` one either way.
"""

from __future__ import annotations

import torch
import triton

from fk_runtime import sizing
from fk_runtime.launch import Descriptor, Launch

from . import plan as table

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # a Triton without Gluon: the tl kernels serve
    gluon = None

# Triton versions (major, minor) this path was built, tested and measured with; on others (the
# Gluon API still moves between releases) the tl kernels run.
GLUON_TRITON = ((3, 6),)
DTYPES = (torch.float16, torch.bfloat16)
# Padded head dims taken: 128 beat the tl kernels by 7-33%; 64 and 256 lost to them (TUNING.md).
HEAD_DIMS = (128,)
# Query rows per consumer warpgroup (two per program), keys per step, K/V ring stages, the
# consumers' registers after the producer warp gives its own back (240: no spills at d128).
ROWS = 64
BLOCK_N = 128
STAGES = 3
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24
LOG2E = 1.4426950408889634


def triton_supported(version: str | None = None) -> bool:
    """Whether this Triton (or `version`) has the Gluon API this path was built for."""
    if gluon is None:
        return False
    major, minor = (int(part) for part in (version or triton.__version__).split(".")[:2])
    return (major, minor) in GLUON_TRITON


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: table.Mask, sm_scale: float) -> bool:
    """Whether the dense forward of these tensors runs here (bases are checked per call); the row
    max is taken on unscaled scores, so the scale must be positive."""
    return (sm_scale > 0 and q.dtype in DTYPES and table.padded_head_dim(q.shape[-1]) in HEAD_DIMS
            and mask.left is None and mask.right in (None, 0) and mask.softcap is None and triton_supported()
            and table.descriptors_may_serve(q.device, (q, k, v))
            and torch.cuda.get_device_capability(q.device)[0] == 9)


if gluon is not None:

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, ready, b, hk, step, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        stage = step % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, step * BLOCK_N, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [b, hk, step * BLOCK_N, 0], bar, v_smem.index(stage))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, b, h, hk, start_m,
                  n_steps, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Both consumers' Q tiles, then K/V blocks into the ring as its stages free up."""
        for i in gl.static_range(2):
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, start_m + i * ROWS, 0], q_bars.index(i), q_smem.index(i))
        for step in range(n_steps):
            # the first lap finds every stage free
            mbarrier.wait(empty.index(step % STAGES), ((step // STAGES) & 1) ^ 1, pred=step >= STAGES)
            _load_kv(k_desc, v_desc, k_smem, v_smem, ready, b, hk, step, BLOCK_N, STAGES)

    @gluon.jit
    def _masked(s, rows, cols, step, n_k, shift, full_steps, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """Scores with keys past n_k (and, causal, past a row's diagonal) at -inf; blocks every row
        sees in full pass unmasked."""
        if step >= full_steps:
            keys = gl.expand_dims(cols + step * BLOCK_N, 0)
            keep = keys < n_k
            if CAUSAL:
                keep = keep & (keys <= gl.expand_dims(rows, 1) + shift)
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
    def _consumer(o_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, lse_ptr, qk_scale, n_q, n_k, shift,
                  full_steps, n_steps, b, h, start_m, slb, slh, HALF: gl.constexpr, CAUSAL: gl.constexpr,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup's 64 rows: S_j = Q K_j^T issued, then P_{j-1} V_{j-1}; the softmax of S_j runs
        while the latter is on the tensor cores. Output through TMA from Q's own buffer."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        q_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        row0 = start_m + HALF * ROWS
        q_tile = q_smem.index(HALF)
        q = q_tile._reinterpret(dtype, [ROWS, HEAD_DIM], q_2d)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_bars.index(HALF), 0)
        if n_steps > 0:
            mbarrier.wait(ready.index(0), 0)
            k_0 = k_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_2d)
            s = warpgroup_mma(q, k_0.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            p, m_i, l_i, alpha = _softmax(_masked(s, rows, cols, 0, n_k, shift, full_steps, CAUSAL, BLOCK_N),
                                          m_i, l_i, qk_scale)
            for step in range(1, n_steps):
                stage = step % STAGES
                prev = (step - 1) % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                k_j = k_smem.index(stage)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_2d)
                v_prev = v_smem.index(prev)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_2d)
                s = warpgroup_mma(q, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])  # S_j is done; P V may still run
                p, m_i, l_i, alpha = _softmax(
                    _masked(s, rows, cols, step, n_k, shift, full_steps, CAUSAL, BLOCK_N), m_i, l_i, qk_scale)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            last = (n_steps - 1) % STAGES
            v_last = v_smem.index(last)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_2d)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(empty.index(last), count=1)
        seen = l_i > 0.0  # rows that see no key: output 0, log-sum-exp -inf
        l_safe = gl.where(seen, l_i, 1.0)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(seen, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        gl.store(lse_ptr + b.to(gl.int64) * slb + h.to(gl.int64) * slh + rows, lse, mask=rows < n_q)
        q.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_tile)
        tma.store_wait(0)

    @gluon.jit
    def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, n_q, n_k, n_heads, group, shift,
                               slb, slh, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                               PRODUCER_REGISTERS: gl.constexpr):
        """128 query rows of one (batch, head) against every key they see (causal: the blocks that
        see the most keys start first); out and the row log-sum-exp (natural log), as
        `kernels.attn_fwd_kernel` gives them."""
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        n_blocks = gl.cdiv(n_q, 2 * ROWS)
        pid = gl.program_id(0)
        bh = pid // n_blocks
        block = pid % n_blocks
        if CAUSAL:
            block = n_blocks - 1 - block
        b = bh // n_heads
        h = bh % n_heads
        hk = h // group
        start_m = block * 2 * ROWS
        end = n_k
        full_steps = n_k // BLOCK_N
        if CAUSAL:
            end = gl.minimum(n_k, gl.maximum(start_m + 2 * ROWS + shift, 0))
            full_steps = gl.minimum(full_steps, gl.maximum(start_m + shift + 1, 0) // BLOCK_N)
        n_steps = gl.cdiv(end, BLOCK_N)
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        # (literal 0 / 1: a constexpr name in these tuples reaches the partition as a plain int)
        gl.warp_specialize([
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, lse_ptr, qk_scale, n_q, n_k, shift,
                         full_steps, n_steps, b, h, start_m, slb, slh, 0, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES)),
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, lse_ptr, qk_scale, n_q, n_k, shift,
                         full_steps, n_steps, b, h, start_m, slb, slh, 1, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, b, h, hk, start_m,
                         n_steps, ROWS, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def _layout(rows: int, padded: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, padded], gl.float16 if dtype == torch.float16
                                                else gl.bfloat16)


def bind(q, k, v, out, lse_strides: tuple[int, int], mask: table.Mask, sm_scale: float):
    """launch(q, k, v, out, lse) of this path for tensors laid out like these (`takes` holds), out
    like q and lse (B, H, N) fp32 with strides (*lse_strides, 1); the caller checks
    `table.bases_aligned` per call."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = table.padded_head_dim(d)
    tiles = [(t, rows, _layout(rows, padded, q.dtype)) for t, rows in ((q, ROWS), (k, BLOCK_N), (v, BLOCK_N),
                                                                       (out, ROWS))]
    layouts = [(list(t.shape), table._descriptor_strides(t), [1, 1, rows, padded], layout)
               for t, rows, layout in tiles]
    launch = Launch(attn_fwd_hopper_kernel, (sizing.cdiv(n_q, 2 * ROWS) * b * hq,),
                    (sm_scale * LOG2E, n_q, n_k, hq, hq // hk, int(mask.lower_right) * (n_k - n_q),
                     *lse_strides),
                    {"CAUSAL": mask.right == 0, "BLOCK_N": BLOCK_N, "HEAD_DIM": padded, "STAGES": STAGES,
                     "CONSUMER_REGISTERS": CONSUMER_REGISTERS, "PRODUCER_REGISTERS": PRODUCER_REGISTERS,
                     "num_warps": 4}, q.device)

    def run(q, k, v, out, lse):
        launch(*(Descriptor(t, shape, strides, block, layout=layout)
                 for t, (shape, strides, block, layout) in zip((q, k, v, out), layouts, strict=True)), lse)

    return run


"""Draft, measured and not kept (TUNING.md: "The dQ adds: a reducer warp, red, no adds"): the Hopper
backward with 5 matmuls a block pair and every way triton 3.6's Gluon offers to add dQ.

Consumers (two warpgroups of 64 keys) as in hopper._dkdv_consumer, with FlashAttention-3's split:
both halves of dS^T meet in shared memory and each warpgroup forms dQ for its half of the head
dim over all 128 keys (two wgmmas). Then, by variant (VARIANTS):
- atomics / red: the consumers add it from registers (`gl.atomic_add`, which emits `atom`, or an
  inline-asm `red`, which returns nothing);
- reducer* / redr* / rotr*: they store it (fp32) to shared memory and a separate reducer warp adds
  it (one or two buffers), off the consumers' path;
- rot*: programs side by side start on different query blocks (no two add into one tile at once);
- noadd*: nothing is added (dQ wrong): the kernel's time if the adds were free.

    bash shared/from-source.sh python packages/fk-attention/tuning/drafts/hopper_dq_reducer.py all red redr1 noadd
    (check: every variant against float64 and the kept backward; bench: TFLOP/s, 5 matmuls counted,
    with torch's row terms, zeroing and cast / the kernel alone, beside the kept backward and cuDNN;
    BENCH_DTYPES=bfloat16 for one dtype; `offline V...` compiles for sm_90a without a GPU: spills,
    shared memory, the atomics emitted)
"""

import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from fk_runtime import sizing
from fk_runtime.launch import Descriptor

from fk_attention import hopper
from fk_attention import plan as table



@gluon.jit
def _producer_ref(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
                  b, hk, start_n, group, first_block, n_blocks, rot, Q_ROWS: gl.constexpr, KEYS: gl.constexpr,
                  STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, k_smem.index(i))
        tma.async_copy_global_to_shared(v_desc, [b, hk, start_n + i * KEYS, 0], kv_bar, v_smem.index(i))
    per_head = n_blocks - first_block
    for step in range(group * per_head):
        stage = step % STAGES
        h = hk * group + step // per_head
        m0 = (first_block + (step + rot) % per_head) * Q_ROWS
        mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1, pred=step >= STAGES)
        bar = ready.index(stage)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], bar, q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], bar, do_smem.index(stage))


@gluon.jit
def _red_v4(ptrs, values, mask):
    """Fire-and-forget fp32 adds of 4 consecutive elements (no result registers, unlike atom)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.b32 p, $12, 0;
        @p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};
        mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
        }""",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [ptrs.to(gl.int64), values, mask.to(gl.int32)], dtype=gl.int32, is_pure=False,
        pack=4)


@gluon.jit
def _red_v2(ptrs, values, mask):
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.b32 p, $6, 0;
        @p red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
        mov.b32 $0, 0; mov.b32 $1, 0;
        }""",
        "=r,=r,l,l,r,r,r,r", [ptrs.to(gl.int64), values, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _consumer(dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ready, empty, ds_full,
              ds_free, dq_full, dq_free, lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q, shift, b, hk,
              start_n, group, first_block, n_blocks, rot, ssb, ssh, sqb, sqh, HALF: gl.constexpr,
              CAUSAL: gl.constexpr, Q_ROWS: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, REDUCER: gl.constexpr, DQ_BUFFERS: gl.constexpr, RED: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, Q_ROWS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dtype: gl.constexpr = q_smem.dtype
    tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
    kv_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
    k_tile = k_smem.index(HALF)
    v_tile = v_smem.index(HALF)
    k = k_tile._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
    v = v_tile._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
    keys = start_n + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(0, s_layout))
    dq_rows = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = HALF * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
    dq_zero = gl.zeros([Q_ROWS, DQ_COLS], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
    full_from = start_n + 2 * KEYS - shift
    per_head = n_blocks - first_block
    k_0 = k_smem.index(0)._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
    k_1 = k_smem.index(1)._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
    mbarrier.wait(kv_bar, 0)
    for step in range(group * per_head):
        stage = step % STAGES
        h = hk * group + step // per_head
        m0 = (first_block + (step + rot) % per_head) * Q_ROWS
        rows = m0 + cols
        row_ok = rows < n_q
        stats = b.to(gl.int64) * ssb + h.to(gl.int64) * ssh + rows
        lse2 = gl.load(lse2_ptr + stats, mask=row_ok, other=0.0)
        delta = gl.load(delta_ptr + stats, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        q = q_smem.index(stage)._reinterpret(dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        do = do_smem.index(stage)._reinterpret(dtype, [Q_ROWS, HEAD_DIM], tile_2d)
        st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st])
        zt = st * qk_scale - gl.expand_dims(lse2, 0)
        if CAUSAL:
            if m0 < full_from:
                zt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + shift, zt, -float("inf"))
        pt = gl.exp2(zt)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt])
        ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        ds_op = gl.convert_layout(ds16, op_layout)
        parity = step % 2
        mbarrier.wait(ds_free.index(parity), ((step // 2) & 1) ^ 1, pred=step >= 2)
        ds_smem.index(2 * parity + HALF).store(ds16)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(parity), count=1)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        mbarrier.wait(ds_full.index(parity), (step // 2) & 1)
        dq = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)), k_0.slice(HALF * DQ_COLS, DQ_COLS, dim=1),
                           dq_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)), k_1.slice(HALF * DQ_COLS, DQ_COLS, dim=1),
                           dq, is_async=True)
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op, ds_op])
        mbarrier.arrive(ds_free.index(parity), count=1)
        mbarrier.arrive(empty.index(stage), count=1)
        if REDUCER:
            buf = step % DQ_BUFFERS
            mbarrier.wait(dq_free.index(buf), ((step // DQ_BUFFERS) & 1) ^ 1, pred=step >= DQ_BUFFERS)
            dq_smem.index(2 * buf + HALF).store(dq)
            mbarrier.arrive(dq_full.index(buf), count=1)
        else:
            dq_at = (dq_ptr + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh
                     + gl.expand_dims((m0 + dq_rows).to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(dq_cols, 0))
            dq_ok = gl.expand_dims(m0 + dq_rows < n_q, 1) & gl.expand_dims(dq_cols >= 0, 0)
            if RED:
                _red_v2(dq_at, dq, dq_ok)
            else:
                gl.atomic_add(dq_at, dq, mask=dq_ok, sem="relaxed")
    k.store((dk * sm_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, start_n + HALF * KEYS, 0], k_tile)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, start_n + HALF * KEYS, 0], v_tile)
    tma.store_wait(0)


@gluon.jit
def _reducer(dq_smem, dq_full, dq_free, dq_ptr, n_q, b, hk, group, first_block, n_blocks, rot, sqb, sqh,
             Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_BUFFERS: gl.constexpr, CHUNK: gl.constexpr,
             REDUCER: gl.constexpr, RED: gl.constexpr):
    """dQ halves from shared memory into the fp32 sum, a chunk of rows at a time (one warp)."""
    if REDUCER:
        DQ_COLS: gl.constexpr = HEAD_DIM // 2
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // DQ_COLS, DQ_COLS // 4], [1, 1], [1, 0])
        rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, layout))
        per_head = n_blocks - first_block
        for step in range(group * per_head):
            buf = step % DQ_BUFFERS
            h = hk * group + step // per_head
            m0 = (first_block + (step + rot) % per_head) * Q_ROWS
            base = dq_ptr + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh
            mbarrier.wait(dq_full.index(buf), (step // DQ_BUFFERS) & 1)
            for half in gl.static_range(2 if REDUCER == 1 else 0):
                tile = dq_smem.index(2 * buf + half)
                for c in gl.static_range(Q_ROWS // CHUNK):
                    part = tile.slice(c * CHUNK, CHUNK, dim=0).load(layout)
                    r = m0 + c * CHUNK + rows
                    at = base + gl.expand_dims(r.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(half * DQ_COLS + cols, 0)
                    ok = gl.expand_dims(r < n_q, 1) & gl.expand_dims(cols >= 0, 0)
                    if RED:
                        _red_v4(at, part, ok)
                    else:
                        gl.atomic_add(at, part, mask=ok, sem="relaxed")
            mbarrier.arrive(dq_free.index(buf), count=1)


@gluon.jit
def attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, dq_ptr,
                    qk_scale, sm_scale, n_q, n_k, n_heads_k, group, shift, ssb, ssh, sqb, sqh,
                    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
                    REDUCER: gl.constexpr, DQ_BUFFERS: gl.constexpr, CHUNK: gl.constexpr,
                    REDUCER_REGISTERS: gl.constexpr, RED: gl.constexpr, ROTATE: gl.constexpr):
    Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
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
    rot = 0
    if ROTATE:  # programs side by side start on different dQ rows: no two add into one tile at once
        rot = pid % n_key_blocks
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], dtype)
    dq_s_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM // 2], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, KEYS, Q_ROWS], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS if REDUCER else 2, Q_ROWS if REDUCER else 8,
                                                     HEAD_DIM // 2], dq_s_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_full.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_free.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                     ds_full, ds_free, dq_full, dq_free, lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q,
                     shift, b, hk, start_n, group, first_block, n_blocks, rot, ssb, ssh, sqb, sqh, 0, CAUSAL, Q_ROWS,
                     KEYS, HEAD_DIM, STAGES, REDUCER, DQ_BUFFERS, RED)),
        (_consumer, (dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                     ds_full, ds_free, dq_full, dq_free, lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q,
                     shift, b, hk, start_n, group, first_block, n_blocks, rot, ssb, ssh, sqb, sqh, 1, CAUSAL, Q_ROWS,
                     KEYS, HEAD_DIM, STAGES, REDUCER, DQ_BUFFERS, RED)),
        (_producer_ref, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
                         b, hk, start_n, group, first_block, n_blocks, rot, Q_ROWS, KEYS, STAGES)),
        (_reducer, (dq_smem, dq_full, dq_free, dq_ptr, n_q, b, hk, group, first_block, n_blocks, rot, sqb, sqh, Q_ROWS,
                    HEAD_DIM, DQ_BUFFERS, CHUNK, REDUCER, RED)),
    ], [4, 1, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS, REDUCER_REGISTERS])


VARIANTS = {"atomics": dict(REDUCER=False, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24),
            "red": dict(REDUCER=False, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24, RED=True),
            "rot": dict(REDUCER=False, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24, RED=True, ROTATE=True),
            "rotr1": dict(REDUCER=True, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24, RED=True, ROTATE=True),
            "rotr2": dict(REDUCER=True, DQ_BUFFERS=2, CHUNK=8, REDUCER_REGISTERS=24, RED=True, ROTATE=True),
            "noadd": dict(REDUCER=2, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24, RED=True),
            "noadd2": dict(REDUCER=2, DQ_BUFFERS=2, CHUNK=8, REDUCER_REGISTERS=24, RED=True),
            "redr1": dict(REDUCER=True, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24, RED=True),
            "redr2": dict(REDUCER=True, DQ_BUFFERS=2, CHUNK=8, REDUCER_REGISTERS=24, RED=True),
            "reducer1": dict(REDUCER=True, DQ_BUFFERS=1, CHUNK=8, REDUCER_REGISTERS=24),
            "reducer2": dict(REDUCER=True, DQ_BUFFERS=2, CHUNK=8, REDUCER_REGISTERS=24)}


def launch_args(q, k, v, grad_out, dk, dv, dq_sum, lse2, delta, mask, sm_scale, variant):
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = table.padded_head_dim(d)
    rows = (hopper.Q_ROWS, hopper.KEYS, hopper.KEYS, hopper.Q_ROWS, hopper.KEYS, hopper.KEYS)
    layouts = hopper._descriptors((q, k, v, grad_out, dk, dv), rows, padded, q.dtype)
    descs = [Descriptor(t, shape, strides, block, layout=layout)
             for t, (shape, strides, block, layout) in zip((q, k, v, grad_out, dk, dv), layouts, strict=True)]
    scalars = (sm_scale * hopper.LOG2E, sm_scale, n_q, n_k, hk, hq // hk, int(mask.lower_right) * (n_k - n_q),
               hq * n_q, n_q, hq * n_q * padded, n_q * padded)
    meta = {"CAUSAL": mask.right == 0, "HEAD_DIM": padded, "STAGES": hopper.BWD_STAGES,
            "CONSUMER_REGISTERS": hopper.CONSUMER_REGISTERS, "PRODUCER_REGISTERS": hopper.PRODUCER_REGISTERS,
            "RED": False, "ROTATE": False, **VARIANTS[variant.partition(":")[0]], "num_warps": 4}
    meta.update({kv.split("=")[0]: int(kv.split("=")[1]) for kv in variant.partition(":")[2].split(",") if kv})
    return (sizing.cdiv(n_k, 2 * hopper.KEYS) * b * hk,), descs, scalars, meta


def backward(grad_out, q, k, v, out, lse, mask, sm_scale, variant="reducer1"):
    b, hq, n_q, d = q.shape
    padded = table.padded_head_dim(d)
    delta = (out.float() * grad_out.float()).sum(-1)
    lse2 = torch.where(lse == -math.inf, math.inf, lse * hopper.LOG2E)
    dq_sum = torch.zeros(b, hq, n_q, padded, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, descs, scalars, meta = launch_args(q, k, v, grad_out, dk, dv, dq_sum, lse2, delta, mask, sm_scale, variant)
    attn_bwd_kernel[grid](*[x.real() for x in descs], lse2.contiguous(), delta.contiguous(), dq_sum, *scalars,
                          **meta)
    return (dq_sum[..., :d] * sm_scale).to(q.dtype), dk, dv


def offline():
    """Compile for sm_90a without a GPU; registers, spills, atomics."""
    import os
    import re
    import subprocess
    import tempfile
    from collections import Counter

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Off:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Off())
    B, H, N, D = 1, 2, 512, 128
    q = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    rows = torch.empty(B, H, N)
    dq_sum = torch.empty(B, H, N, D)
    for variant in sys.argv[2:] or VARIANTS:
        for causal in (False, True):
            mask = table.CAUSAL if causal else table.FULL
            name, _, extra = variant.partition(":")
            grid, descs, scalars, meta = launch_args(q, q, q, q, q, q, dq_sum, rows, rows, mask, 0.1, variant)
            c = attn_bwd_kernel.warmup(*[x.real() for x in descs], rows, rows, dq_sum, *scalars, grid=(1,), **meta)
            with tempfile.TemporaryDirectory() as folder:
                ptx = os.path.join(folder, "k.ptx")
                open(ptx, "w").write(c.asm["ptx"])
                tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
                log = subprocess.run([tool, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "k.o")],
                                     capture_output=True, text=True).stderr
            spills = [line.strip() for line in log.splitlines() if "spill" in line or "error" in line.lower()]
            atomics = Counter(re.findall(r"\b(?:red|atom)\.[\w.]+", c.asm["ptx"]))
            print(variant, "causal" if causal else "full", "shared", c.metadata.shared, spills, dict(atomics))
            if "ptx" in sys.argv[1]:
                open(f"/tmp/{name}{extra}_{int(causal)}.ptx", "w").write(c.asm["ptx"])


def _reference(q, k, v, grad_out, mask, scale):
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) * scale
    n_q, n_k = q.shape[2], k.shape[2]
    rows = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q if mask.lower_right else 0)
    if mask.right == 0:
        scores = scores.masked_fill(torch.arange(n_k, device=q.device) > rows, -math.inf)
    seen = torch.isfinite(scores).any(-1, keepdim=True)
    out = torch.softmax(scores.masked_fill(~seen, 0.0), -1) * seen @ v64.repeat_interleave(group, 1)
    return torch.autograd.grad(out, (q64, k64, v64), grad_out.double())


def check(variants) -> None:
    lower_right = table.Mask(right=0, lower_right=True)
    cases = [((2, 4, 2, 1000, 1000, 128), table.FULL), ((2, 4, 2, 1000, 1000, 128), table.CAUSAL),
             ((1, 4, 1, 333, 1025, 96), table.CAUSAL), ((1, 4, 1, 1025, 333, 96), lower_right),
             ((1, 2, 2, 300, 700, 72), lower_right), ((1, 2, 1, 4096, 4096, 128), table.CAUSAL)]
    bad = 0
    for (b, hq, hk, n_q, n_k, d), mask in cases:
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(b, hq, n_q, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, hk, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
            scale = d ** -0.5
            out, lse = table.forward(q, k, v, mask, scale)
            grad_out = torch.randn_like(out)
            kept = table.backward(grad_out, None, q, k, v, out, lse, mask, scale)
            wants = _reference(q, k, v, grad_out, mask, scale)
            for variant in variants:
                got = backward(grad_out, q, k, v, out, lse, mask, scale, variant)
                errors = []
                for name, g, kp, w in zip(("dq", "dk", "dv"), got, kept, wants, strict=True):
                    err, kept_err = ((t.double() - w).norm() / w.norm() for t in (g, kp))
                    errors.append(f"{name} {err:.1e} (kept {kept_err:.1e})")
                    if not err <= 1.2 * kept_err + 1e-6:
                        bad += 1
                        errors.append("BAD")
                print(f"{variant} {(b, hq, hk, n_q, n_k, d)} {mask} {str(dtype)[6:]}: " + ", ".join(errors),
                      flush=True)
    print("check:", "FAILED" if bad else "ok", bad, flush=True)


def _ms(fn) -> float:
    from triton.testing import do_bench
    fn()
    return do_bench(fn, warmup=50, rep=300)


def _variant_cell(q, k, v, out, lse, grad_out, mask, scale, work, variant):
    """TFLOP/s of the variant with torch's row terms, zeroing and cast / of its kernel alone."""
    full = work / _ms(lambda: backward(grad_out, q, k, v, out, lse, mask, scale, variant))
    delta = (out.float() * grad_out.float()).sum(-1)
    lse2 = torch.where(lse == -math.inf, math.inf, lse * hopper.LOG2E).contiguous()
    dq_sum = torch.zeros(*q.shape[:3], table.padded_head_dim(q.shape[-1]), device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, descs, scalars, meta = launch_args(q, k, v, grad_out, dk, dv, dq_sum, lse2, delta, mask, scale, variant)
    real = [x.real() for x in descs]
    kernel = work / _ms(lambda: attn_bwd_kernel[grid](*real, lse2, delta, dq_sum, *scalars, **meta))
    return f"{full:.0f} / {kernel:.0f}"


def _row(b, h, n, d, causal, dtype, variants):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    mask, scale = (table.CAUSAL if causal else table.FULL), d ** -0.5
    out, lse = table.forward(q, k, v, mask, scale)
    grad_out = torch.randn_like(out)
    work = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1) / 1e9
    cells = []
    for variant in variants:
        cells.append(_variant_cell(q, k, v, out, lse, grad_out, mask, scale, work, variant))
    kept = work / _ms(lambda: table.backward(grad_out, None, q, k, v, out, lse, mask, scale))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        cudnn = work / _ms(lambda: torch.autograd.grad(o, (qs, ks, vs), grad_out, retain_graph=True))
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | " + " | ".join(cells)
            + f" | {kept:.0f} | {cudnn:.0f} |")


SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (8, 16, 2048, 96, True), (16, 16, 1024, 128, False)]


def bench(variants, dtypes=(torch.bfloat16, torch.float16)) -> None:
    print("| shape | dtype | " + " | ".join(f"{v} full / kernel" for v in variants) + " | kept | cuDNN |")
    print("|" + " --- |" * (4 + len(variants)))
    for dtype in dtypes:
        for shape in SHAPES:
            print(_row(*shape, dtype, variants), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1].startswith("offline"):
        offline()
    else:
        variants = sys.argv[2:] or list(VARIANTS)
        print(torch.cuda.get_device_name(), flush=True)
        if sys.argv[1] in ("check", "all"):
            check(variants)
        if sys.argv[1] in ("bench", "all"):
            import os
            bench(variants, [getattr(torch, x) for x in os.environ.get("BENCH_DTYPES", "bfloat16,float16").split(",")])

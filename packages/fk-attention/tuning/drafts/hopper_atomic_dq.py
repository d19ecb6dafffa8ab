"""Draft, not wired into the plan and not yet run on a GPU: the Hopper backward with 5 matmuls a
block pair (TUNING.md: Hopper backward, what is left). The Gluon dK/dV kernel of `hopper.py`, whose
consumers also form dQ = dS K for their 64 keys and add it into an fp32 sum with relaxed atomics
(dS^T goes through shared memory once, read transposed as the wgmma's A). The row terms and the
final cast are torch ops here (a kept version would fuse them into a prep and a cast kernel).

    bash shared/from-source.sh python packages/fk-attention/tuning/drafts/hopper_atomic_dq.py

checks dq, dk, dv against float64 and the kept backward (fp16/bf16, masks, GQA, odd lengths), then
times the backward three ways: this, the kept one (Gluon dK/dV + tl dQ), SDPA cuDNN (TFLOP/s with
5 matmuls counted). Compiled offline for sm_90 with triton 3.6 only (registers and spills in
TUNING.md).
"""

import math

import torch
import torch.nn.functional as F
from fk_runtime import sizing
from fk_runtime.launch import Descriptor, Launch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.testing import do_bench

from fk_attention import hopper
from fk_attention import plan as table


@gluon.jit
def _consumer(dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, ready, empty, ds_full, ds_free,
              lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q, shift, b, hk, start_n, group, first_block,
              n_blocks, ssb, ssh, sqb, sqh, HALF: gl.constexpr, CAUSAL: gl.constexpr, Q_ROWS: gl.constexpr,
              KEYS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """`hopper._dkdv_consumer`, plus dQ += dS K: dS^T to shared memory, read back transposed by
    one more wgmma, the fp32 result added into dq_ptr (B, H, N, HEAD_DIM) with relaxed atomics.
    SPLIT false: each warpgroup adds dS K over its own 64 keys, (Q_ROWS, HEAD_DIM). SPLIT true
    (FlashAttention-3's split): both halves of dS^T meet in shared memory (double-buffered by step
    parity, `ds_full` / `ds_free`), and each warpgroup adds its half of the head dim over all 128
    keys: half the atomics."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, Q_ROWS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
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
    dq_cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    if SPLIT:
        dq_cols += HALF * DQ_COLS
    s_zero = gl.zeros([KEYS, Q_ROWS], gl.float32, s_layout)
    dq_zero = gl.zeros([Q_ROWS, DQ_COLS], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
    full_from = start_n + 2 * KEYS - shift
    per_head = n_blocks - first_block
    mbarrier.wait(kv_bar, 0)
    for step in range(group * per_head):
        stage = step % STAGES
        h = hk * group + step // per_head
        m0 = (first_block + step % per_head) * Q_ROWS
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
        if SPLIT:
            parity = step % 2
            # the other warpgroup's dQ of two steps back has read this buffer
            mbarrier.wait(ds_free.index(parity), ((step // 2) & 1) ^ 1, pred=step >= 2)
            ds_smem.index(2 * parity + HALF).store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_full.index(parity), count=1)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            mbarrier.wait(ds_full.index(parity), (step // 2) & 1)
            # dS (Q_ROWS, 2 KEYS) K (2 KEYS, this half of the head dim), one key half at a time
            k_0 = k_smem.index(0)._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
            k_1 = k_smem.index(1)._reinterpret(dtype, [KEYS, HEAD_DIM], kv_2d)
            dq = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)), k_0.slice(HALF * DQ_COLS, DQ_COLS, dim=1),
                               dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)),
                               k_1.slice(HALF * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
            dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op, ds_op])
            mbarrier.arrive(ds_free.index(parity), count=1)
        else:
            ds_t = ds_smem.index(HALF)  # dS^T (KEYS, Q_ROWS): read back as dS (Q_ROWS, KEYS)
            ds_t.store(ds16)
            fence_async_shared()
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            dq = warpgroup_mma(ds_t.permute((1, 0)), k, dq_zero, use_acc=False, is_async=True)
            dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op, ds_op])
        mbarrier.arrive(empty.index(stage), count=1)
        dq_at = (dq_ptr + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh
                 + gl.expand_dims((m0 + dq_rows).to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(dq_cols, 0))
        gl.atomic_add(dq_at, dq * sm_scale, mask=gl.expand_dims(m0 + dq_rows < n_q, 1), sem="relaxed")
    k.store((dk * sm_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, start_n + HALF * KEYS, 0], k_tile)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, start_n + HALF * KEYS, 0], v_tile)
    tma.store_wait(0)


@gluon.jit
def attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, dq_ptr,
                           qk_scale, sm_scale, n_q, n_k, n_heads_k, group, shift, ssb, ssh, sqb, sqh,
                           CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                           CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
                           SPLIT: gl.constexpr):
    """`hopper.attn_bwd_dkdv_hopper_kernel` that also adds dQ (times the scale) into dq_ptr."""
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
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, Q_ROWS], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4 if SPLIT else 2, KEYS, Q_ROWS], ds_layout)
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
        (_consumer, (dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, ready, empty, ds_full,
                     ds_free, lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q, shift, b, hk, start_n, group,
                     first_block, n_blocks, ssb, ssh, sqb, sqh, 0, CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES,
                     SPLIT)),
        (_consumer, (dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, ready, empty, ds_full,
                     ds_free, lse2_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, n_q, shift, b, hk, start_n, group,
                     first_block, n_blocks, ssb, ssh, sqb, sqh, 1, CAUSAL, Q_ROWS, KEYS, HEAD_DIM, STAGES,
                     SPLIT)),
        (hopper._dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar,
                                 ready, empty, b, hk, start_n, group, first_block, n_blocks, Q_ROWS, KEYS,
                                 STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def backward(grad_out, q, k, v, out, lse, mask: table.Mask, sm_scale: float, split: bool = True):
    """(dq, dk, dv) of dense (B, H, N, D) fp16/bf16 attention on Hopper (`hopper.serves` holds, bases
    aligned): torch row terms, the kernel (`split`: its SPLIT), torch's cast of the fp32 dQ sum."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    padded = table.padded_head_dim(d)
    delta = (out.float() * grad_out.float()).sum(-1)
    lse2 = torch.where(lse == -math.inf, math.inf, lse * hopper.LOG2E)
    dq_sum = torch.zeros(b, hq, n_q, padded, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    rows = (hopper.Q_ROWS, hopper.KEYS, hopper.KEYS, hopper.Q_ROWS, hopper.KEYS, hopper.KEYS)
    layouts = hopper._descriptors((q, k, v, grad_out, dk, dv), rows, padded, q.dtype)
    launch = Launch(attn_bwd_hopper_kernel, (sizing.cdiv(n_k, 2 * hopper.KEYS) * b * hk,),
                    (sm_scale * hopper.LOG2E, sm_scale, n_q, n_k, hk, hq // hk,
                     int(mask.lower_right) * (n_k - n_q), hq * n_q, n_q, hq * n_q * padded, n_q * padded),
                    {"CAUSAL": mask.right == 0, "HEAD_DIM": padded, "STAGES": hopper.BWD_STAGES,
                     "CONSUMER_REGISTERS": hopper.CONSUMER_REGISTERS,
                     "PRODUCER_REGISTERS": hopper.PRODUCER_REGISTERS, "SPLIT": split, "num_warps": 4},
                    q.device)
    tensors = (q, k, v, grad_out, dk, dv)
    launch(*(Descriptor(t, shape, strides, block, layout=layout)
             for t, (shape, strides, block, layout) in zip(tensors, layouts, strict=True)),
           lse2.contiguous(), delta.contiguous(), dq_sum)
    return dq_sum[..., :d].to(q.dtype), dk, dv


def _reference(q, k, v, grad_out, mask: table.Mask, scale: float):
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


def check() -> None:
    lower_right = table.Mask(right=0, lower_right=True)
    cases = [((2, 4, 2, 1000, 1000, 128), table.FULL), ((2, 4, 2, 1000, 1000, 128), table.CAUSAL),
             ((1, 4, 1, 333, 1025, 96), table.CAUSAL), ((1, 4, 1, 1025, 333, 96), lower_right),
             ((1, 2, 2, 300, 700, 72), lower_right), ((1, 2, 1, 4096, 4096, 128), table.CAUSAL)]
    for (b, hq, hk, n_q, n_k, d), mask in cases:
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(b, hq, n_q, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, hk, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
            scale = d ** -0.5
            out, lse = table.forward(q, k, v, mask, scale)
            grad_out = torch.randn_like(out)
            kept = table.backward(grad_out, None, q, k, v, out, lse, mask, scale)
            wants = _reference(q, k, v, grad_out, mask, scale)
            for split in (False, True):
                got = backward(grad_out, q, k, v, out, lse, mask, scale, split)
                errors = []
                for name, g, kp, w in zip(("dq", "dk", "dv"), got, kept, wants, strict=True):
                    err, kept_err = ((t.double() - w).norm() / w.norm() for t in (g, kp))
                    errors.append(f"{name} {err:.1e} (kept {kept_err:.1e})")
                    assert err <= 1.2 * kept_err + 1e-6, f"{name}: {err:.2e} against the kept one's {kept_err:.2e}"
                print(f"ok split={split} {(b, hq, hk, n_q, n_k, d)} {mask} {str(dtype)[6:]}: " + ", ".join(errors),
                      flush=True)


def _ms(fn) -> float:
    fn()
    return do_bench(fn, warmup=50, rep=300)


def _row(b: int, h: int, n: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    mask, scale = (table.CAUSAL if causal else table.FULL), d ** -0.5
    out, lse = table.forward(q, k, v, mask, scale)
    grad_out = torch.randn_like(out)
    work = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1) / 1e9
    atomic = work / _ms(lambda: backward(grad_out, q, k, v, out, lse, mask, scale, False))
    split = work / _ms(lambda: backward(grad_out, q, k, v, out, lse, mask, scale, True))
    kept = work / _ms(lambda: table.backward(grad_out, None, q, k, v, out, lse, mask, scale))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        cudnn = work / _ms(lambda: torch.autograd.grad(o, (qs, ks, vs), grad_out, retain_graph=True))
    best = max(atomic, split)
    return (f"| B{b} H{h} N{n} d{d}{' causal' if causal else ''} | {str(dtype)[6:]} | {atomic:.0f} | {split:.0f} | "
            f"{kept:.0f} | {cudnn:.0f} | {best / cudnn:.2f}x | {best / kept:.2f}x |")


SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (8, 16, 2048, 96, True), (16, 16, 1024, 128, False)]


def bench() -> None:
    print("| shape | dtype | per-warpgroup dQ TFLOP/s | split dQ TFLOP/s | kept TFLOP/s | cuDNN TFLOP/s | "
          "best / cuDNN | best / kept |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            print(_row(*shape, dtype), flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    check()
    bench()

"""Registers, spills and shared memory of the Gluon kernels (hopper.py, hopper_backward.py, decode_hopper.py), from a
compile for sm_90a on any machine: no GPU, Triton's bundled ptxas (TUNING.md: Hopper forward, Hopper
backward). Needs a Triton in fk_runtime.gluon.VERSIONS (3.6-3.9).

    TRITON_INTERPRET=0 PYTHONPATH=shared/src:packages/fk-attention/src \\
        python packages/fk-attention/tuning/gluon_registers.py

A consumer warpgroup's registers are set by `setmaxnreg` at run time; ptxas reports the launch's
count (168 with 12 warps, 128 with 16) and the spills it had to place at the registers the code asks for,
and "wgmma serialized (C7514)" where it serialized a kernel's wgmma (TUNING.md: Measured and not kept); for
each forward build, in how many step loops the P V wait lands below the exponentials (`hopper.late_pv_wait`).
"""

import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime.driver import driver



class OfflineHopper:
    """The active driver as Triton's JIT asks it, for a compile without a GPU."""

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


driver.set_active(OfflineHopper())

from fk_runtime import backend  # noqa: E402
from fk_runtime.launch import FP_FUSION, Descriptor  # noqa: E402

backend.is_interpreter = lambda: False  # the builds a GPU takes (`Mask.softcap_build`)

from fk_attention import decode_hopper, hopper, hopper_backward  # noqa: E402
from fk_attention import config as fk_config  # noqa: E402
from fk_attention.mask import CAUSAL, FULL, UNBOUNDED, Mask  # noqa: E402

B, H, N, D = 1, 2, 512, 128


def descriptor(t: torch.Tensor, rows: int, layout=None):
    d = t.shape[-1]
    return Descriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d],
                      layout=layout or hopper.shared_layout(rows, d, t.dtype)).real()


def row_terms(rows: torch.Tensor):
    """lse2's and delta's descriptor as the backward kernels take them (`hopper_backward.STATS_LAYOUT`)."""
    return Descriptor(rows, list(rows.shape), list(rows.stride()), [1, 1, fk_config.GLUON_Q_ROWS],
                      layout=hopper_backward.STATS_LAYOUT).real()


def mask_args(seen: int) -> tuple:
    """A backward kernel's (d_lo, d_hi) for mask build `seen` (`hopper_backward._key_program`; a window of 100 keys
    left and 37 right for 2)."""
    return ((-UNBOUNDED, UNBOUNDED), (-UNBOUNDED, 0), (-100, 37))[seen]


def fused_backward(d: int, seen: int, **builds):
    """The 5-matmul backward at padded head dim d and mask build `seen` (`hopper.forward_mask_args`' SEEN), its
    tiles as `hopper_backward.bind_backward` lays them out."""
    q = torch.empty(B, H, N, d, dtype=torch.bfloat16)
    rows = torch.empty(B, H, N)
    kv = hopper_backward.fused_kv_layout(d, q.dtype)
    tiles = [descriptor(q, r, layout) for r, layout in (
        (fk_config.GLUON_Q_ROWS, None), (fk_config.GLUON_KEYS, kv), (fk_config.GLUON_KEYS, kv),
        (fk_config.GLUON_Q_ROWS, None), (fk_config.GLUON_KEYS, kv), (fk_config.GLUON_KEYS, kv))]
    builds = {**hopper_backward.fused_builds(d, seen), "SOFTCAP": 0, **builds}
    dq_sum = torch.empty(B, H, hopper_backward.dq_sum_rows(N), d)
    dq = Descriptor(dq_sum, *hopper_backward.dq_sum_fields(list(dq_sum.shape), builds)).real()
    return hopper_backward.attn_bwd_hopper_kernel.warmup(
        *tiles, row_terms(rows), row_terms(rows), dq, 0.1, 0.1, N, N, H, 1, *mask_args(seen), 2, 0.01, SEEN=seen,
        HEAD_DIM=d,
        CONSUMER_REGISTERS=fk_config.GLUON_CONSUMER_REGISTERS, PRODUCER_REGISTERS=fk_config.GLUON_PRODUCER_REGISTERS,
        num_warps=4, grid=(1,), enable_fp_fusion=FP_FUSION, **builds)


def role_dkdv(d: int, causal: bool):
    """The role-split dK/dV kernel at padded head dim d, its tiles as `hopper_backward.bind_dkdv` lays them out."""
    q = torch.empty(B, H, N, d, dtype=torch.bfloat16)
    rows = torch.empty(B, H, N)
    tiles = [descriptor(q, r) for r in (fk_config.GLUON_Q_ROWS, fk_config.GLUON_KEYS, fk_config.GLUON_KEYS,
                                        fk_config.GLUON_Q_ROWS)]
    half = torch.empty(B, H, N, d // 2, dtype=torch.bfloat16)
    tiles += [descriptor(half, fk_config.GLUON_KEYS)] * 2
    return hopper_backward.attn_bwd_dkdv_roles_hopper_kernel.warmup(
        *tiles, row_terms(rows), row_terms(rows), 0.1, 0.1, N, N, H, 1, *mask_args(int(causal)), 2, SEEN=int(causal),
        HEAD_DIM=d,
        STAGES=fk_config.GLUON_BWD_STAGES, CONSUMER_REGISTERS=fk_config.GLUON_CONSUMER_REGISTERS,
        PRODUCER_REGISTERS=fk_config.GLUON_PRODUCER_REGISTERS, num_warps=4, grid=(1,), enable_fp_fusion=FP_FUSION)


def pv_waits_below(sass: str) -> str:
    """In how many of the forward's step loops (innermost predicated backward branches around wgmma and exp2)
    the last full wgmma wait comes after the last exp2: the P V that is meant to run under the softmax (ptxas
    moves a wgmma wait up to the top of its basic block; `hopper.late_pv_wait`)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    at = {int(a, 16): i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (_, text) in enumerate(ins):
        back = re.match(r"@!?U?P\d\s+BRA\s+(?:`\(\.L_x_\d+\)\s*)?.*?0x([0-9a-f]+)", text)
        start = at.get(int(back.group(1), 16), i) if back else i
        body = [t for _, t in ins[start:i + 1]]
        if start < i and any("MUFU.EX2" in t for t in body) and any("HGMMA" in t for t in body):
            loops.append((start, i, body))
    inner = [body for start, end, body in loops
             if not any(start <= s2 and e2 <= end and (s2, e2) != (start, end) for s2, e2, _ in loops)]
    below = sum(any("DEPBAR.LE gsb0, 0x0" in t for t in body[max(j for j, t in enumerate(body) if "MUFU.EX2" in t):])
                for body in inner)
    return f"; P V wait below the exponentials in {below} of {len(inner)} step loops"


def usage(compiled, pv_waits: bool = False) -> str:
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        tool = get_ptxas(90).path  # the ptxas this Triton compiles sm_90 with (3.9: its newer one)
        log = subprocess.run([tool, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "k.o")],
                             capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(tool), "cuobjdump"), "--dump-sass",
                               os.path.join(folder, "k.o")], capture_output=True, text=True).stdout if pv_waits else ""
    spills = next((line.strip() for line in log.splitlines() if "spill" in line), "")
    # ptxas serializes every wgmma of a kernel where other code reads an accumulator still in flight
    serialized = "; wgmma serialized (C7514)" if "C7514" in log else ""
    atomics = Counter(re.findall(r"\b(?:red|atom)\.[\w.]+", compiled.asm["ptx"]))
    found = f"shared {compiled.metadata.shared}; {spills}{serialized}" + (pv_waits_below(sass) if pv_waits else "")
    return found + (f"; {dict(atomics)}" if atomics else "")


def forward(d: int, mask, n: int = N, varlen: bool = False):
    """The forward at padded head dim d as `hopper.bind` launches it on a length-n query (varlen: B packed
    sequences of up to n rows)."""
    q = torch.empty(B, H, n, d, dtype=torch.bfloat16)
    builds, args = hopper.forward_mask_args(mask, 0.1, q.dtype)
    block_n, stages, consumers = hopper.forward_tiles(d, builds["SEEN"], n, varlen)
    tiles = [descriptor(q, r) for r in (fk_config.GLUON_ROWS, block_n, block_n, fk_config.GLUON_ROWS)]
    n_tiles = B * H * n // (consumers * fk_config.GLUON_ROWS)
    cu = torch.empty(B + 1, dtype=torch.int32)
    persistent = not varlen and hopper.persistent_grid(builds["SEEN"], d, n)
    return hopper.attn_fwd_hopper_kernel.warmup(
        *tiles, torch.empty(B, H, n), cu, cu, q, cu, *args[:2], B if varlen else n, n, H, 1, 0, *args[2:], n_tiles, H * n,
        n, B * n, B * n, H * d, d, d, **builds, VARLEN=varlen, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
        CONSUMERS=consumers, PERSISTENT=persistent, **hopper.consumer_builds(builds["SEEN"], d, consumers, persistent),
        num_warps=4, grid=(1,), enable_fp_fusion=FP_FUSION)


def decode(d: int, stages: int, sliced: bool):
    """The Gluon decode kernel at padded head dim d, as `decode._bind_gluon` launches it (H32:8, one query row)."""
    block_n = dict(fk_config.GLUON_DECODE_TILES)[d]
    k = torch.empty(2, 8, 1024, d, dtype=torch.bfloat16)
    q = torch.empty(2, 32, 1, d, dtype=torch.bfloat16)
    kv = descriptor(k, block_n)
    return decode_hopper.attn_decode_tma_kernel.warmup(
        q, kv, kv, q, torch.empty(1), torch.empty(1), torch.empty(2, dtype=torch.int32), 0.1, 0.1, 1, 1024, 0, 8, 4,
        1, 1 << 30, 0, 4 if sliced else 1, 100, *q.stride(), *q.stride(), 32, 1, 1, SOFTCAP=False, SEQLENS=True,
        SLICED=sliced, STORE_LSE=True, HEAD_DIM=d, STAGES=stages, num_warps=1, grid=(1,), enable_fp_fusion=FP_FUSION)


def main() -> None:
    q = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    rows = torch.empty(B, H, N)
    common = dict(HEAD_DIM=D, CONSUMER_REGISTERS=fk_config.GLUON_CONSUMER_REGISTERS,
                  PRODUCER_REGISTERS=fk_config.GLUON_PRODUCER_REGISTERS, num_warps=4, grid=(1,), enable_fp_fusion=FP_FUSION)
    print(f"triton {triton.__version__}, sm_90a, bf16")
    for d, *_ in fk_config.GLUON_FORWARD_TILES:  # the masks `hopper.takes` gives it (on a release that takes all)
        for name, mask in (("full", FULL), ("causal", CAUSAL), ("window", Mask(left=100, right=37)),
                           ("softcap", Mask(softcap=30.0)), ("window + softcap", Mask(left=255, right=0, softcap=5.0))):
            if d in fk_config.GLUON_FORWARD_FULL_OR_CAUSAL and name not in ("full", "causal"):
                continue
            two = hopper.two_consumer_rows(d, hopper.forward_mask_args(mask, 0.1, torch.bfloat16)[0]["SEEN"])
            for n in (two, two + 1) if two else (N,):  # two consumers up to `two` rows, then its count
                length = f" (N {n})" if two else ""
                print(f"forward d{d} {name}{length}: {usage(forward(d, mask, n), pv_waits=True)}")
    for causal in (False, True):
        bwd = [descriptor(q, r) for r in (fk_config.GLUON_Q_ROWS, fk_config.GLUON_KEYS, fk_config.GLUON_KEYS, fk_config.GLUON_Q_ROWS, fk_config.GLUON_KEYS,
                                          fk_config.GLUON_KEYS)]
        dkdv = hopper_backward.attn_bwd_dkdv_hopper_kernel.warmup(
            *bwd, row_terms(rows), row_terms(rows), 0.1, 0.1, N, N, H, 1, *mask_args(int(causal)), 2, SEEN=int(causal),
            STAGES=fk_config.GLUON_BWD_STAGES, **common)
        kernels = [(f"dK/dV d{D}", dkdv)] + [(f"dK/dV roles d{d}", role_dkdv(d, causal))
                                              for d in fk_config.GLUON_ROLE_HEAD_DIMS]
        if hopper_backward.tma_reduce_add is not None:  # the 5-matmul backward (Triton >= 3.8), its head dims
            kernels += [(f"5-matmul backward d{d}{' softcap' if cap else ''}",
                         fused_backward(d, int(causal), SOFTCAP=cap))
                        for d in fk_config.GLUON_FUSED_HEAD_DIMS for cap in (0, 2)]
        for name, compiled in kernels:
            print(f"{name}{' causal' if causal else ''}: {usage(compiled)}")
    if hopper_backward.tma_reduce_add is not None:  # and windows
        for d in fk_config.GLUON_FUSED_HEAD_DIMS:
            for cap in (0, 2):
                name = f"5-matmul backward d{d}{' softcap' if cap else ''} window"
                print(f"{name}: {usage(fused_backward(d, 2, SOFTCAP=cap))}")
    for d, _ in fk_config.GLUON_DECODE_TILES:
        for stages in fk_config.GLUON_DECODE_STAGES:
            for sliced in (False, True):
                print(f"decode d{d} {stages} stages{' sliced' if sliced else ''}: {usage(decode(d, stages, sliced))}")


if __name__ == "__main__":
    main()

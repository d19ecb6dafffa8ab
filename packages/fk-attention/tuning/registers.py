"""Registers, spills and shared memory of the dK/dV kernel, packed against dense (TUNING.md), from
a compile for sm_90a on any machine (no GPU: Triton's bundled ptxas and cuobjdump).

    TRITON_INTERPRET=0 python packages/fk-attention/tuning/registers.py [path/to/kernels.py]

Shapes: 8 x 2048 tokens, 32 heads of 64, causal, bf16, TMA inputs; the int arguments specialized
as Triton would (1 as a constant, multiples of 16 marked divisible). The causal build is this
Triton's (`config.window_build`); FK_WINDOW_BUILD=1 or 2 picks one (3.8: 198 and 199 registers
at the d64 default, 64 x 64, 4 warps, 3 stages). FK_DROPOUT=1 builds attention dropout in.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "src", "fk_attention", "kernels.py")
TILES = [(64, 64, 4, 2), (32, 64, 4, 4), (64, 64, 4, 3), (32, 128, 4, 3)]  # BLOCK_M, BLOCK_N, warps, stages
B, H, N, D = 8, 32, 2048, 64


def _kernels():
    spec = importlib.util.spec_from_file_location("fk_attention_kernels", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _values(varlen: bool, block_m: int, block_n: int) -> dict:
    desc = lambda rows: f"tensordesc<bf16[1, 1, {rows}, {D}]>"  # noqa: E731
    strides = [0, D, H * D, 1] if varlen else [N * H * D, D, H * D, 1]
    total = B * N if varlen else N
    align = int(_kernels().STATS_ALIGN)
    stats_rows = -(-(total + align * (B + 1)) // align) * align  # plan._bind_backward's scratch rows
    values = dict(q_ptr=desc(block_m), k_ptr=desc(block_n), v_ptr=desc(block_n), do_ptr=desc(block_m),
                  lse2_ptr="*fp32", delta_ptr="*fp32",
                  dk_ptr="*bf16" if varlen else desc(block_n), dv_ptr="*bf16" if varlen else desc(block_n),
                  cu_q_ptr="*i32" if varlen else "*fp32", cu_k_ptr="*i32" if varlen else "*fp32",
                  alibi_ptr="*fp32", sab=0, sah=0, seed_ptr="*i64", dropout_p=0.1,
                  sm_scale=0.125, softcap=1.0, n_q=N, n_k=N, n_heads_k=H,
                  group=1, lower_right=0, left=1 << 30, right=0, total_q=total, total_k=total,
                  ssb=0 if varlen else H * N, ssh=stats_rows if varlen else N,
                  n_q_key=N, n_k_key=N, bh_key=B * H, dtype_key=1)
    for name in ("q", "k", "v", "do", "dk", "dv"):
        values.update({f"s{name}{axis}": stride for axis, stride in zip("bhnd", strides, strict=True)})
    return values


def resources(kernel, varlen: bool, block_m: int, block_n: int, warps: int, stages: int) -> str:
    values = _values(varlen, block_m, block_n)
    from fk_attention import config, mask

    constexprs = dict(WINDOW=int(os.environ.get("FK_WINDOW_BUILD", config.window_build(mask.CAUSAL))), SOFTCAP=False, ALIBI=False, DROPOUT=os.environ.get("FK_DROPOUT") == "1", VARLEN=varlen, HEAD_DIM=D, HEAD_DIM_PADDED=D,
                      USE_DESC=2 if varlen else 1, PRECISION=None, BLOCK_M=block_m, BLOCK_N=block_n, REST=False)
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = constexprs.get(name, values.get(name))
        if name in constexprs or value == 1:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))  # as fk launches
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    regs = next((line.split()[0] for line in usage.splitlines() if "REG:" in line), "REG:?")
    return f"{regs} shared {compiled.metadata.shared}"


if __name__ == "__main__":
    kernel = _kernels().attn_bwd_dkdv_kernel
    print(f"triton {triton.__version__}, attn_bwd_dkdv_kernel, d{D}")
    for tiles in TILES:
        print(tiles, "dense", resources(kernel, False, *tiles), "| packed", resources(kernel, True, *tiles))

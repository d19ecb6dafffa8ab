"""Registers and SASS instruction counts of the tl forward kernel, causal, windowed and full, from a
compile for sm_90 on any machine (no GPU: the Triton's bundled ptxas and cuobjdump), to compare
Triton versions on the same tiles (TUNING.md: Triton versions).

    TRITON_INTERPRET=0 PYTHONPATH=shared/src:packages/fk-attention/src \\
        python packages/fk-attention/tuning/forward_sass.py [HEAD_DIM]

Tiles: the 16-bit default of the head dim (`config.DEFAULTS_16BIT`), TMA descriptors (Hopper). FK_DROPOUT=1 builds
attention dropout in.
"""

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fk_attention import config, kernels

HEAD_DIM = int(sys.argv[1]) if len(sys.argv) > 1 else 64
# SASS opcodes worth counting: tensor-core and warpgroup ops, barriers, exp2, the mask's compares
# and selects, TMA loads.
OPCODES = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "MUFU", "FSEL", "FMNMX", "ISETP", "UTMALDG")


def compile_forward(dtype: str, window: int, tile: config.Config):
    kernel = kernels.attn_fwd_kernel
    constexprs = dict(WINDOW=window, SOFTCAP=False, ALIBI=False, DROPOUT=os.environ.get("FK_DROPOUT") == "1", VARLEN=False, HEAD_DIM=HEAD_DIM, HEAD_DIM_PADDED=HEAD_DIM,
                      USE_DESC=1, PRECISION=None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n)
    signature, constants = {}, {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name], constants[name] = "constexpr", constexprs[name]
        elif name in ("q_ptr", "o_ptr", "k_ptr", "v_ptr"):
            rows = tile.block_m if name in ("q_ptr", "o_ptr") else tile.block_n
            signature[name] = f"tensordesc<{dtype}[1, 1, {rows}, {HEAD_DIM}]>"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name == "seed_ptr" else "*fp32"
        else:
            signature[name] = "fp32" if name in ("sm_scale", "softcap", "dropout_p") else "i32"
    options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages, enable_fp_fusion=True)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(ASTSource(kernel, signature, constants), target=target, options=options)


def usage(compiled) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        resources, sass = (subprocess.run([tool, flag, cubin.name], capture_output=True, text=True).stdout
                            for flag in ("--dump-resource-usage", "-sass"))
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    counts = " ".join(f"{op}={sum(n for name, n in ops.items() if name.startswith(op))}" for op in OPCODES)
    regs = re.search(r"REG:(\d+)", resources).group(1)
    return f"regs {regs}, {sum(ops.values())} instructions: {counts}"


def main() -> None:
    tile = dict(config.DEFAULTS_16BIT)[HEAD_DIM][config.Kind.FORWARD]
    print(f"triton {triton.__version__}, attn_fwd_kernel d{HEAD_DIM}, {tile}")
    for dtype in ("fp16", "bf16"):
        for window, build in ((1, "causal"), (2, "two-sided window"), (0, "full")):
            print(f"  {dtype} {build}: {usage(compile_forward(dtype, window, tile))}")


if __name__ == "__main__":
    main()

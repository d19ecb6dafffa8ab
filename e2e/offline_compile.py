"""Compile for sm_90 (Hopper), on a machine without a GPU, every kernel launch that a set of calls makes.

The interpreter runs fk's kernels in Python and never compiles them, so a kernel can pass every CPU
test and still fail Triton's compiler on a GPU. The 3.8 run of the ALiBi decode path did, with one
helper returning a float constant on one branch and a tensor on the other. This script:
1. runs the calls on the interpreter in a child process (`TRITON_INTERPRET=1`), recording each
   distinct launch: the kernel, its argument types and values, and its constexprs;
2. compiles each one with `triton.compile(..., GPUTarget("cuda", 90, 32))` here, specializing the int
   arguments as Triton's JIT would (1 as a constant, multiples of 16 marked divisible, except the
   kernel's `do_not_specialize`). The tiles are the interpreter's, not the GPU's defaults: this
   checks that each constexpr combination compiles, not what it costs.

    bash shared/from-source.sh python e2e/offline_compile.py [--ops attention attention-d256 norms softmax
        weightedsum] [--registers [KERNEL ...]] [--tiles]

It prints one line per launch and exits 1 if any fails to compile. `--tiles`: the prefill kernels'
launches compiled at each autotune candidate of their head dim (`fk_attention.config.candidates`,
pointer loads) instead, each with its registers and spills: what a tile costs in registers before a
GPU times it (`--ops attention-d256`: a causal fwd+bwd at head dim 256, fp16).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

OPS = ("attention", "attention-d256", "norms", "softmax", "weightedsum")
# The prefill kernels `--tiles` compiles at their candidates, by the config kind that sizes each.
TILED = {"attn_fwd_kernel": "fwd", "attn_bwd_dq_kernel": "dq", "attn_bwd_dkdv_kernel": "dkdv"}
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int32": "i32",
          "int64": "i64", "uint8": "u8"}


def _calls(ops) -> None:
    """The calls whose launches are compiled: every attention path (dense, windows, softcap, ALiBi,
    dropout, few rows, packed, KV cache dense and paged, paged varlen), the norms, softmax and
    weighted_sum."""
    import torch

    def g(*shape):
        return torch.randn(*shape, dtype=torch.float16, requires_grad=True)

    if "attention" in ops:
        import fk_attention as fa

        for n_q, n_k in ((70, 70), (3, 80)):  # the prefill kernels and the split-KV decode path
            for kw in ({}, {"causal": True}, {"window": (5, 3)}, {"softcap": 5.0},
                       {"alibi_slopes": torch.rand(4)}, {"dropout_p": 0.2}):
                fa.attention(g(1, 4, n_q, 64), g(1, 2, n_k, 64), g(1, 2, n_k, 64), **kw).sum().backward()
        cu = torch.tensor([0, 30, 75], dtype=torch.int32)
        fa.attention_varlen(g(75, 4, 64), g(75, 2, 64), g(75, 2, 64), cu, cu, 45, 45,
                            causal=True).sum().backward()
        lengths = torch.tensor([40, 90], dtype=torch.int32)
        new = [torch.randn(2, 2, 1, 64, dtype=torch.float16) for _ in range(2)]
        fa.attention_with_kvcache(torch.randn(2, 4, 1, 64, dtype=torch.float16),
                                  *(torch.randn(2, 2, 128, 64, dtype=torch.float16) for _ in range(2)), lengths,
                                  *new, causal=True, alibi_slopes=torch.rand(4))
        pages = [torch.randn(8, 2, 32, 64, dtype=torch.float16) for _ in range(2)]
        table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
        fa.attention_with_kvcache(torch.randn(2, 4, 2, 64, dtype=torch.float16), *pages, lengths,
                                  block_table=table, causal=True)
        # Paged varlen (serving): decode tokens split and merged, a prefill chunk's row tiles, new rows
        # written; pages of 32 rows (a block in one page) and of 5 (a page per row), softcap.
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 1, 41, 42], [0, 90, 120, 70]))
        new = [torch.randn(42, 2, 64, dtype=torch.float16) for _ in range(2)]
        with torch.no_grad():
            fa.attention_varlen(torch.randn(42, 4, 64, dtype=torch.float16), *pages, cu_q, cu_k, 40, 90, causal=True,
                                block_table=torch.arange(12, dtype=torch.int32).remainder(8).reshape(3, 4),
                                k_new=new[0], v_new=new[1])
            small = [torch.randn(60, 2, 5, 64, dtype=torch.float16) for _ in range(2)]
            fa.attention_varlen(torch.randn(42, 4, 64, dtype=torch.float16), *small, cu_q, cu_k, 40, 90,
                                block_table=torch.arange(60, dtype=torch.int32).reshape(3, 20), softcap=5.0)
    if "attention-d256" in ops:
        import fk_attention as fa

        fa.attention(g(1, 2, 80, 256), g(1, 2, 80, 256), g(1, 2, 80, 256), causal=True).sum().backward()
    x, w, b = g(8, 1000), g(1000), g(1000)
    if "norms" in ops:
        import fk_layernorm

        fk_layernorm.layer_norm(x, w, b).sum().backward()
        fk_layernorm.rms_norm(x, w).sum().backward()
    if "softmax" in ops:
        import fk_softmax

        fk_softmax.softmax(x, -1).sum().backward()
    if "weightedsum" in ops:
        import fk_weightedsum

        fk_weightedsum.weighted_sum(x, w).sum().backward()


def _argument(a):
    """A launch argument as the compile needs it: a pointer type, [scalar type, value], or None."""
    import torch

    if isinstance(a, torch.Tensor):
        return "*" + DTYPES[str(a.dtype).removeprefix("torch.")]
    if isinstance(a, bool):
        return ["i1", int(a)]
    if isinstance(a, float):
        return ["fp32", a]
    if isinstance(a, int):
        return ["i32" if -2**31 <= a < 2**31 else "i64", a]
    if a is None:
        return None
    raise TypeError(f"a launch argument of type {type(a).__name__}: not recorded")


def record(ops) -> list[str]:
    """The distinct launches of `_calls` (run here, on the interpreter), as JSON strings."""
    from fk_runtime import backend, launch

    backend.check_interpreter_numpy()  # a clear error, not one deep inside a kernel

    launches = {}
    call = launch.Launch.__call__

    def recorded(self, *head):
        fn = getattr(self.kernel, "fn", self.kernel)
        meta = {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in self.meta.items()}
        spec = [fn.__module__, fn.__name__, [_argument(a) for a in (*head, *self.tail)], meta]
        launches[json.dumps(spec, sort_keys=True)] = None
        return call(self, *head)

    launch.Launch.__call__ = recorded
    try:
        _calls(ops)
    finally:
        launch.Launch.__call__ = call
    return list(launches)


def compile_one(spec: str, registers: bool = False) -> str | None:
    """Compile one recorded launch for sm_90; None if it compiles, else the error's last lines.
    `registers`: print the compiled kernel's registers, stack (spills) and shared memory first."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fk_runtime.launch import FP_FUSION

    module, name, args, meta = json.loads(spec)
    fn = getattr(importlib.import_module(module), name)  # an unknown kernel raises: a recording gone stale
    names = fn.arg_names
    unspecialized = {names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") if k in meta}
    options.setdefault("enable_fp_fusion", FP_FUSION)  # as fk launches (Triton 3.10 turns the default off)
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(names):
        if param in meta:
            signature[param], constants[param] = "constexpr", meta[param]
        elif i >= len(args):  # a constexpr left to its default
            signature[param], constants[param] = "constexpr", fn.params[i].default
        elif args[i] is None:
            signature[param], constants[param] = "constexpr", None
        elif isinstance(args[i], str):  # a pointer: Triton's allocations are 16-byte aligned
            signature[param] = args[i]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            kind, value = args[i]
            integer = kind in ("i32", "i64") and param not in unspecialized
            if integer and value == 1:
                signature[param], constants[param] = "constexpr", 1
                continue
            signature[param] = kind
            if integer and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=options)
    except Exception as error:  # noqa: BLE001 (any compiler error is the finding)
        return " | ".join(str(error).strip().splitlines()[-3:])
    if registers:
        print(f"     {name}: {_resources(compiled)}")
    return None


def _resources(compiled) -> str:
    """The compiled kernel's registers, stack (spills land there) and shared memory: its cubin's
    resource usage as Triton's cuobjdump reads it."""
    from triton import knobs

    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        run = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
                             capture_output=True, text=True, check=False)
    usage = [line.strip() for line in run.stdout.splitlines() if "REG:" in line]
    return "; ".join(usage) or (run.stdout + run.stderr).strip()[-200:]


def _at_candidates(spec: str) -> list[str]:
    """A recorded prefill launch at each autotune candidate of its head dim, through pointers (other
    launches: none)."""
    from fk_attention import config

    module, name, args, meta = json.loads(spec)
    if name not in TILED:
        return []
    out = []
    for c in config.candidates(config.Kind(TILED[name]), meta["HEAD_DIM_PADDED"], False):
        tiled = dict(meta, **c.meta(), num_warps=c.num_warps, num_stages=c.num_stages)
        out.append(json.dumps([module, name, args, tiled], sort_keys=True))
    return out


def _child(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}  # fixed when the kernels are defined
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # the children's parts
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    parser.add_argument("--registers", nargs="*", metavar="KERNEL",
                        help="print registers, stack (spills) and shared memory of these kernels' launches (none named: all)")
    parser.add_argument("--tiles", action="store_true",
                        help="the prefill kernels at each autotune candidate of their head dim, with their registers")
    args = parser.parse_args(argv)
    if args.record:
        print(json.dumps(record(args.ops)))
        return 0
    if args.compile:
        import triton

        launches, failed = json.loads(open(args.compile).read()), 0
        if args.tiles:
            launches = [tiled for spec in launches for tiled in _at_candidates(spec)]
            args.registers = args.registers if args.registers is not None else []
        for spec in launches:
            _, name, _, meta = json.loads(spec)
            wanted = args.registers is not None and (not args.registers or name in args.registers)
            error = compile_one(spec, wanted)
            failed += error is not None
            flags = {k: v for k, v in meta.items() if k.isupper() or k.startswith("num_")}
            print(("ok  " if error is None else "FAIL") + f" {name} {flags}" + ("" if error is None else f": {error}"))
        print(f"triton {triton.__version__}, sm_90: {len(launches)} launches, {failed} failed to compile")
        return 1 if failed else 0
    recorded = _child(["--record", "--ops", *args.ops], interpret=True)
    if recorded.returncode != 0:
        print(recorded.stderr[-3000:])
        return recorded.returncode
    with tempfile.NamedTemporaryFile("w", suffix=".json") as launches:
        launches.write(recorded.stdout.strip().splitlines()[-1])
        launches.flush()
        extra = ([] if args.registers is None else ["--registers", *args.registers]) + ["--tiles"] * args.tiles
        compiled = _child(["--compile", launches.name, *extra], interpret=False)
    print(compiled.stdout + compiled.stderr[-3000:] * (compiled.returncode not in (0, 1)))
    return compiled.returncode


if __name__ == "__main__":
    raise SystemExit(main())

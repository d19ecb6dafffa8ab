"""First calls and shape changes: what a user waits for before a call runs, fk beside SDPA / torch.

Wall time of each call (synchronized), each case in fresh processes:
- cold: empty Triton and fk caches (TRITON_CACHE_DIR, FK_CACHE_DIR a new folder), the first call of each op, fwd+bwd:
  attention per dtype and head dim, one after the other in one process (the first pays the process's own start);
  rms_norm, layer_norm, softmax each in a process of its own (which pays it too); and Triton's own floor, a
  one-line kernel's first launch in a process of its own without fk;
- warm: the same first calls in a second process on the cache the cold one filled;
- new length: after the first call, calls at lengths the process has not seen (attention
  N = 1000..1100 forward, B1 H32 d128; SDPA beside);
- packed training loop: `attention_varlen` fwd+bwd, 16K tokens, H16 d128 bf16 causal, new random
  documents every batch (12 batches), SDPA's per-document calls beside;
- decode loop: `attention_with_kvcache` one token a step, H32:8 d128 bf16, the batch and the longest
  sequence changing every step as a server's do (batch 1..64, up to 32K keys): a dense cache of
  32K rows (SDPA beside on the same keys) and a paged one of 64-row pages whose table grows with
  the longest sequence; then in a process that first ran `fk_attention.warmup` for that range
  (`max_batch=64, cache_rows=32768`, dense and paged).

Triton's and fk's Python bytecode is compiled first, as `pip install` leaves a package: where none
was written (the GPU box sets PYTHONDONTWRITEBYTECODE=1), every process compiles the modules a first
call imports from source (Triton's Gluon modules, which its first specialization imports: 60-110 ms
on the H200's host). `--bytecode-as-found` measures the environment as it is.

    bash shared/from-source.sh python e2e/first_call.py --out benchmarks

writes `<out>/first-call.{json,md}` and rebuilds BENCHMARKS.md as the main job does. Acceptance of
the compile-once issue: cold attention at most 5 s, warm 0.5 s; norms and softmax 1 s / 0.2 s;
no call after the first over 50 ms in the N sweep; no packed batch after the first over 1.5x the
median.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTION = "first-call"
FK_PACKAGES = ("fk_runtime", "fk_attention", "fk_layernorm", "fk_softmax", "fk_weightedsum")
NORM_OPS = ("rms_norm", "layer_norm", "softmax")  # each one's first call in a process of its own
# The first-call cases, each a child process (cold, then warm on its cache): attention's, each norm's, Triton's floor.
FIRST_CASES = ("first", *(f"first-{op}" for op in NORM_OPS), "floor")
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
SWEEP = range(1000, 1101)
TOKENS, HEADS, BATCHES = 16384, 16, 12
# The decode loop: (batch, longest sequence) per step; heads, head dim, the dense cache's rows, page rows.
DECODE_STEPS = ((1, 300), (2, 700), (3, 1500), (5, 2500), (8, 4100), (12, 6000), (16, 9000), (24, 12000),
                (32, 16500), (48, 24000), (64, 32768), (40, 20000), (20, 10000), (6, 3000), (1, 800))
DECODE_HEADS, DECODE_DIM, DECODE_CAPACITY, DECODE_PAGE = (32, 8), 128, 32768, 64


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _grad(*shape, dtype):
    """A random CUDA tensor that requires grad."""
    import torch

    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def first_calls(op: str = "attention") -> list[dict]:
    """The first fwd+bwd in this process of attention (each dtype and head dim) or of one of NORM_OPS,
    ms; only the op's own package imported (as a user who needs only it)."""
    import torch
    import torch.nn.functional as F

    rows = []
    if op == "attention":
        import fk_attention

        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            for d in HEAD_DIMS:
                q, k, v = (_grad(2, 8, 1024, d, dtype=dtype) for _ in range(3))
                rows.append({"op": "attention", "case": f"B2 H8 N1024 d{d} causal", "dtype": dtype_name,
                             "fk_ms": _timed(lambda q=q, k=k, v=v: fk_attention.attention(
                                 q, k, v, causal=True).sum().backward())})
                rows[-1]["peer_ms"] = _timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True).sum().backward())
        return rows
    fk, peer = norm_calls(op)
    rows.append({"op": op, "case": "4096 x 4096", "dtype": "bfloat16", "fk_ms": _timed(lambda: fk().sum().backward()),
                 "peer_ms": _timed(lambda: peer().sum().backward())})
    return rows


def norm_calls(op: str) -> tuple:
    """(fk, torch): the forward of NORM_OPS' `op` on 4096 x 4096 bf16 inputs that require grad, fk's
    and torch's, each a callable returning the output; only fk's package for the op imported."""
    import importlib

    import torch
    import torch.nn.functional as F

    package = importlib.import_module("fk_softmax" if op == "softmax" else "fk_layernorm")
    x, w, b = (_grad(*shape, dtype=torch.bfloat16) for shape in ((4096, 4096), (4096,), (4096,)))
    return {
        "rms_norm": (lambda: package.rms_norm(x, w), lambda: F.rms_norm(x, (4096,), w)),
        "layer_norm": (lambda: package.layer_norm(x, w, b), lambda: F.layer_norm(x, (4096,), w, b)),
        "softmax": (lambda: package.softmax(x), lambda: torch.softmax(x, -1)),
    }[op]


def triton_floor() -> list[dict]:
    """What any Triton kernel's first call costs a fresh process: a one-line kernel's first launch
    (Triton's driver, cache key, compile and load), ms; no fk imported."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(1000, device="cuda")
    return [{"op": "triton (a one-line kernel, fwd only)", "case": "1000", "dtype": "float32",
             "fk_ms": _timed(lambda: add_one[(1,)](x, 1000, BLOCK=1024)), "peer_ms": _timed(lambda: x.add_(1))}]


def new_lengths() -> dict:
    """Dense forward over N = 1000..1100 in one process: every call's ms, fk and SDPA."""
    import torch
    import torch.nn.functional as F

    import fk_attention

    out = {"fk": [], "sdpa": []}
    for n in SWEEP:
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        out["fk"].append(_timed(lambda q=q: fk_attention.attention(q, q, q, causal=True)))
        out["sdpa"].append(_timed(lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=True)))
    return out


def _collector_pauses() -> list:
    """[(generation, ms)] of the Python collector's passes from now on (gc.callbacks), appended as they end."""
    import gc

    pauses, started = [], []

    def record(phase, info):
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    gc.callbacks.append(record)
    return pauses


def packed_loop(seed: int = 0) -> dict:
    """The packed training loop: each batch new random documents summing to TOKENS; ms per batch,
    and the Python collector's time inside each batch."""
    import torch

    import fk_attention

    gen = torch.Generator().manual_seed(seed)
    times, collected, pauses = [], [], _collector_pauses()
    for _ in range(BATCHES):
        cuts = torch.randperm(TOKENS - 1, generator=gen)[:15].add_(1).sort().values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([TOKENS])]).to(torch.int32)
        longest = int((bounds[1:] - bounds[:-1]).max())
        cu = bounds.cuda()
        q, k, v = (_grad(TOKENS, HEADS, 128, dtype=torch.bfloat16) for _ in range(3))
        pauses.clear()
        times.append(_timed(lambda q=q, k=k, v=v, cu=cu, n=longest: fk_attention.attention_varlen(
            q, k, v, cu, cu, n, n, causal=True).sum().backward()))
        collected.append(sum(ms for _, ms in pauses))
    return {"fk": times, "gc": collected}


def decode_loop(seed: int = 0, warm: bool = False) -> dict:
    """One token a step against a dense and a paged cache, batch and longest sequence per
    DECODE_STEPS (each sequence's length drawn up to the longest); ms per step, SDPA beside. warm:
    `fk_attention.warmup` for the loop's range first (its ms kept as "warmup")."""
    import torch
    import torch.nn.functional as F

    import fk_attention

    gen = torch.Generator().manual_seed(seed)
    (hq, hk), d = DECODE_HEADS, DECODE_DIM
    out = {"steps": [list(s) for s in DECODE_STEPS], "fk": [], "fk paged": [], "sdpa": []}
    if warm:
        longest = max(n for _, n in DECODE_STEPS)
        out["warmup"] = _timed(lambda: [fk_attention.warmup(
            hq, hk, d, torch.bfloat16, causal=True, backward=False, kvcache=True, page_size=page,
            max_batch=max(b for b, _ in DECODE_STEPS), cache_rows=DECODE_CAPACITY if page is None else longest)
            for page in (None, DECODE_PAGE)])
    for b, longest in DECODE_STEPS:
        lengths = torch.randint(1, longest + 1, (b,), generator=gen)
        lengths[0] = longest
        seqlens = lengths.to(torch.int32).cuda()
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, DECODE_CAPACITY, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pages = -(-longest // DECODE_PAGE)
        table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
        kp, vp = (t[:, :, :pages * DECODE_PAGE].unflatten(2, (pages, DECODE_PAGE)).transpose(1, 2).flatten(0, 1)
                  .contiguous() for t in (k, v))
        keys = torch.arange(longest, device="cuda")[None, None, None, :] < seqlens[:, None, None, None]
        calls = {"fk": lambda q=q, k=k, v=v, n=seqlens: fk_attention.attention_with_kvcache(q, k, v, n, causal=True),
                 "fk paged": lambda q=q, k=kp, v=vp, n=seqlens, t=table: fk_attention.attention_with_kvcache(
                     q, k, v, n, block_table=t, causal=True),
                 "sdpa": lambda q=q, k=k[:, :, :longest], v=v[:, :, :longest], m=keys: F.scaled_dot_product_attention(
                     q, k, v, attn_mask=m, enable_gqa=True)}
        for name, call in calls.items():
            out[name].append(_timed(call))
        del k, v, kp, vp, calls
    return out


def child(case: str) -> None:
    result = {"first": first_calls, **{f"first-{op}": functools.partial(first_calls, op) for op in NORM_OPS},
              "floor": triton_floor, "sweep": new_lengths, "packed": packed_loop, "decode": decode_loop,
              "decode-warm": lambda: decode_loop(warm=True)}[case]()
    print("RESULT " + json.dumps(result))


def compile_bytecode(packages=("triton", *FK_PACKAGES)) -> None:
    """Bytecode of `packages` (Triton's and fk's) in their own __pycache__ folders, as `pip install`
    writes it (where a folder is read-only, that package stays as it is)."""
    import compileall
    import importlib.util

    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            compileall.compile_dir(str(Path(spec.origin).parent), quiet=2)


def _spawn(case: str, cache: Path) -> object:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "FK_CACHE_DIR": str(cache / "fk")}  # fk's too (Triton's key)
    done = subprocess.run([sys.executable, __file__, "--child", case], env=env, capture_output=True, text=True,
                          check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{case} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def measure(out: Path, bytecode: bool = True) -> dict:
    import torch
    import triton

    if bytecode:
        compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="fk-first-call-") as tmp:
        cold, warm = [], []
        for i, case in enumerate(FIRST_CASES):
            cold += _spawn(case, Path(tmp) / f"a{i}")
            warm += _spawn(case, Path(tmp) / f"a{i}")
        sweep = _spawn("sweep", Path(tmp) / "b")
        packed = _spawn("packed", Path(tmp) / "c")
        decode = _spawn("decode", Path(tmp) / "d")
        decode_warm = _spawn("decode-warm", Path(tmp) / "e")
    command = "python e2e/first_call.py --out " + str(out) + ("" if bytecode else " --bytecode-as-found")
    return {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "date": time.strftime("%Y-%m-%d"), "command": command,
                     "bytecode": "compiled first" if bytecode else "as found"},
            "cold": cold, "warm": warm, "sweep": sweep, "packed": packed, "decode": decode,
            "decode_warm": decode_warm}


def _bytecode_note(bytecode: str | None) -> str:
    if bytecode == "compiled first":
        return "Triton's and fk's bytecode compiled first, as `pip install` leaves them."
    if bytecode == "as found":
        return "Python bytecode as the environment had it (`--bytecode-as-found`)."
    return ""


def report(run: dict) -> str:
    m = run["meta"]
    lines = ["## First calls and shape changes", "",
             f"{m['device']}, torch {m['torch']}, Triton {m['triton']} ({m['date']}). Wall time of each call, "
             "synchronized. Cold: empty Triton and fk caches; warm: a second process on the caches the cold one "
             "filled. Attention's four cases one after the other in one process (the first pays the process's start), "
             "each norm and softmax in a process of its own; the last row is Triton's floor, a one-line kernel's "
             "first launch in a process without fk (torch: `x.add_(1)`). SDPA / torch's op beside, in the same "
             "process after fk's call. " + _bytecode_note(m.get("bytecode")), "",
             f"Command: `{m['command']}`", "",
             "| op | case | dtype | fk cold (ms) | fk warm (ms) | torch cold (ms) | torch warm (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c, w in zip(run["cold"], run["warm"], strict=True):
        lines.append(f"| {c['op']} | {c['case']} | {c['dtype']} | {c['fk_ms']:.0f} | {w['fk_ms']:.0f} | "
                     f"{c['peer_ms']:.0f} | {w['peer_ms']:.0f} |")
    fk, sdpa = run["sweep"]["fk"], run["sweep"]["sdpa"]
    lines += ["", f"Dense causal forward, B1 H32 d128 bf16, N = {SWEEP.start}..{SWEEP.stop - 1} in one process: "
              f"first call fk {fk[0]:.0f} ms, SDPA {sdpa[0]:.0f} ms; after it the slowest call fk "
              f"{max(fk[1:]):.1f} ms, SDPA {max(sdpa[1:]):.1f} ms (median fk {statistics.median(fk[1:]):.2f}, "
              f"SDPA {statistics.median(sdpa[1:]):.2f})."]
    times = run["packed"]["fk"]
    rest = times[1:]
    lines += ["", f"Packed training loop, `attention_varlen` fwd+bwd, {TOKENS} tokens, H{HEADS} d128 bf16 causal, "
              f"16 new random documents each batch: first batch {times[0]:.0f} ms, then median "
              f"{statistics.median(rest):.1f} ms, slowest {max(rest):.1f} ms "
              f"({max(rest) / statistics.median(rest):.2f}x the median). Batches: "
              + ", ".join(f"{t:.0f}" for t in times) + " ms."]
    if "gc" in run["packed"]:
        lines[-1] += (" Python's collector inside them: " + ", ".join(f"{t:.1f}" for t in run["packed"]["gc"])
                      + " ms.")
    if "decode" in run:
        dec = run["decode"]
        (hq, hk), steps = DECODE_HEADS, dec["steps"]
        lines += ["", f"Decode loop, `attention_with_kvcache` one token a step, H{hq}:{hk} d{DECODE_DIM} bf16 causal, "
                  f"batch and longest sequence changing every step (batch, longest: "
                  + ", ".join(f"{b} {n}" for b, n in steps) + f"); a dense cache of {DECODE_CAPACITY} rows, a paged "
                  f"one of {DECODE_PAGE}-row pages (its table as wide as the longest sequence); SDPA on the dense "
                  "keys with a length mask; then fk in a fresh process that ran `fk_attention.warmup(..., kvcache=True, "
                  f"max_batch={max(b for b, _ in steps)}, cache_rows={DECODE_CAPACITY})` for both caches first"
                  + (f" ({run['decode_warm']['warmup']:.0f} ms)" if "decode_warm" in run else "") + ":", "",
                  "| path | first step (ms) | slowest after it (ms) | median after it (ms) | steps after it over 50 ms |",
                  "| --- | --- | --- | --- | --- |"]
        paths = [(name, dec[name]) for name in ("fk", "fk paged", "sdpa")]
        if "decode_warm" in run:
            paths += [(f"{name}, warmed", run["decode_warm"][name]) for name in ("fk", "fk paged")]
        for name, t in paths:
            lines.append(f"| {name} | {t[0]:.0f} | {max(t[1:]):.1f} | {statistics.median(t[1:]):.2f} | "
                         f"{sum(x > 50 for x in t[1:])} of {len(t) - 1} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    parser.add_argument("--child", choices=(*FIRST_CASES, "sweep", "packed", "decode", "decode-warm"))
    parser.add_argument("--bytecode-as-found", action="store_true",
                        help="no bytecode compiled first: the environment's own (or none)")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    run = measure(args.out, bytecode=not args.bytecode_as_found)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{SECTION}.json").write_text(json.dumps(run, indent=1))
    text = report(run)
    (args.out / f"{SECTION}.md").write_text(text)
    from fk_runtime.harness import cli

    cli.rebuild_benchmarks_md(args.out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""fp32 tiles (`fk_config.DEFAULTS_32BIT`): each kernel's time (torch.profiler, µs per call), registers
and spills per config, against the plan's and SDPA's fp32 forward + backward (TUNING.md:
DEFAULTS_32BIT).

    bash shared/from-source.sh python packages/fk-attention/tuning/fp32.py [HEAD_DIM ...]

fp32 runs exact fp32 products (`input_precision="ieee"`: FMA, no tensor cores), so its tiles are
bounded by registers: the candidates are the tiles an offline sm_90 compile (Triton 3.9) left with
the fewest spills. A config is forced by swapping it into DEFAULTS_32BIT for its kind (fp32 is not
autotuned), and its output or gradients are checked against the plan's. Last, the fastest config
of each kind together against the plan, unmasked and causal.
"""

import dataclasses
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fk_attention import attention, kernels
from fk_attention import plan as table
from fk_attention import config as fk_config, layout as fk_layout
from fk_runtime.harness import bench

B, H, N = 2, 16, 2048
FWD, DQ, DKDV = fk_config.Kind.FORWARD, fk_config.Kind.DQ, fk_config.Kind.DKDV
# (BLOCK_M, BLOCK_N, warps, stages); dK/dV: BLOCK_M query rows per step of a BLOCK_N-key program.
TILES = {
    64: {FWD: [(64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2), (32, 32, 8, 2)],
         DQ: [(64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2), (64, 16, 8, 2)],
         DKDV: [(16, 64, 8, 2), (16, 32, 4, 2), (16, 32, 8, 2), (32, 32, 8, 2)]},
    128: {FWD: [(32, 64, 8, 2), (32, 32, 8, 2), (64, 16, 8, 2), (16, 32, 4, 2)],
          DQ: [(64, 16, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (32, 16, 4, 2)],
          DKDV: [(16, 64, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)]},
}
KERNELS = {FWD: kernels.attn_fwd_kernel, DQ: kernels.attn_bwd_dq_kernel, DKDV: kernels.attn_bwd_dkdv_kernel}


def registers(kind: fk_config.Kind, config: fk_config.Config) -> str:
    """regs/spills of the newest compiled `kind` kernel with these tiles."""
    kernel = KERNELS[kind]
    found = "?"
    for caches in kernel.device_caches.values():
        for compiled in caches[0].values():
            constants = {kernel.arg_names[key[0]]: value for key, value in compiled.src.constants.items()}
            if (constants.get("BLOCK_M"), constants.get("BLOCK_N")) == (config.block_m, config.block_n) \
                    and compiled.metadata.num_warps == config.num_warps \
                    and compiled.metadata.num_stages == config.num_stages:
                found = f"{compiled.n_regs} regs, {compiled.n_spills} spills"
    return found


def with_configs(head_dim: int, configs: dict) -> tuple:
    """DEFAULTS_32BIT with `configs` ({kind: Config}) at this head dim."""
    padded = fk_layout.padded_head_dim(head_dim)
    return tuple((limit, {**entry, **configs} if limit == padded else entry)
                 for limit, entry in fk_config.DEFAULTS_32BIT)


def use(defaults: tuple) -> None:
    fk_config.DEFAULTS_32BIT = defaults
    fk_config.default_config.cache_clear()
    table.BOUND.clear()


def sweep(d: int) -> dict:
    """Each candidate of each kind at head dim d (unmasked); returns the fastest per kind."""
    q, k, v = (torch.randn(B, H, N, d, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def forward():
        return attention(q, k, v)

    def backward():
        return torch.autograd.grad(forward(), (q, k, v), grad)

    plan = fk_config.DEFAULTS_32BIT
    reference = {FWD: [forward().detach()], DQ: backward()[:1], DKDV: backward()[1:]}
    best = {}
    for kind, tiles in TILES[d].items():
        row = []
        for tile in tiles:
            config = fk_config.Config(*tile)
            use(with_configs(d, {kind: config}))
            try:
                call = forward if kind is FWD else backward
                us = round(bench.device_us_per_call(call, 5, KERNELS[kind].fn.__name__), 1)
                grads = None if kind is FWD else backward()
                got = [forward().detach()] if kind is FWD else (grads[:1] if kind is DQ else grads[1:])
                error = max(((g - r).abs().max() / r.abs().max()).item()
                            for g, r in zip(got, reference[kind], strict=True))
                notes = f"{registers(kind, config)}, err {error:.1e}"
                row.append((us if error < 1e-4 else float("inf"), tile, notes))
            finally:
                use(plan)
        plan_tile = dataclasses.astuple(fk_config.default_config(kind, d, torch.float32, False))[:4]
        print(f"  d{d} {kind.value} (plan {plan_tile}): "
              + ", ".join(f"{t}: {us} µs ({notes})" for us, t, notes in sorted(row)), flush=True)
        best[kind] = fk_config.Config(*sorted(row)[0][1])
    return best


def compare(d: int, best: dict) -> None:
    """fwd+bwd ms: SDPA, the plan, the fastest configs together; unmasked and causal."""
    q, k, v = (torch.randn(B, H, N, d, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    plan = fk_config.DEFAULTS_32BIT
    for causal in (False, True):
        def sdpa(causal=causal):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad)

        def fk(causal=causal):
            torch.autograd.grad(attention(q, k, v, causal=causal), (q, k, v), grad)

        times = {"sdpa": do_bench(sdpa), "plan": do_bench(fk)}
        use(with_configs(d, best))
        times["best"] = do_bench(fk)
        use(plan)
        print(f"B{B} H{H} N{N} d{d} fp32 {'causal' if causal else 'full'} fwd+bwd ms: "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    chosen = {}
    for d in [int(a) for a in sys.argv[1:]] or list(TILES):
        chosen[d] = sweep(d)
        compare(d, chosen[d])
        print(f"d{d} fastest: " + ", ".join(f"{kind.value} {dataclasses.astuple(c)[:4]}"
                                           for kind, c in chosen[d].items()), flush=True)

"""fk-layernorm's check and benchmark sweep, run by `python -m fk_runtime`.

LayerNorm with weight and bias, and RMSNorm with weight. Peers in the same run: torch
(F.layer_norm / F.rms_norm), torch.compile of them, Liger (when installed). Bytes counted:
forward reads x and writes y (2 tensors); backward reads x and grad_y and writes grad_x (3). Peak
memory is recorded for every variant on the bwd rows: the most the backward call allocates above
what the inputs and the forward's output and saved tensors already hold (`bench._peak_mib`).
Host time per call (`host_cases`): both ops on one tiny bf16 input against torch and Liger.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from fk_runtime.harness import bench, testing

from .ops import layer_norm, rms_norm

FULL_SHAPES = [(32768, 1024), (16384, 4096), (8192, 8192), (4096, 16384), (1024, 65536), (256, 262144)]
SMALL_SHAPES = [(64, 256), (3, 20000)]
DTYPES = [torch.bfloat16, torch.float32]
LN_EPS, RMS_EPS = 1e-5, 1e-6
HOST_SHAPE = (4, 4096)


def _torch_ln(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, LN_EPS)


def _torch_rms(x, w):
    return F.rms_norm(x, x.shape[-1:], w, RMS_EPS)


@functools.cache
def _peers(rms: bool) -> dict:
    torch_op = _torch_rms if rms else _torch_ln
    peers = {"torch": torch_op, **bench.compiled_peer(torch_op)}
    try:
        if rms:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            peers["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, RMS_EPS)
        else:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            peers["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, LN_EPS)
    except ImportError:
        pass
    return peers


def _inputs(rows, cols, dtype, rms):
    x = testing.randn((rows, cols), dtype, requires_grad=True)
    w = testing.randn((cols,), dtype, shift=1.0, requires_grad=True)
    if rms:
        return [x, w]
    return [x, w, testing.randn((cols,), dtype, requires_grad=True)]


def checks(full: bool):
    shapes = [(3, 1), (5, 17), (9, 4097), (3, 20000)] + ([(4, 262144), (4097, 1024)] if full else [])
    for shape in shapes:
        for dtype in DTYPES + [torch.float16]:
            for name, fn, ref, rms in [("layer_norm", layer_norm, _torch_ln, False),
                                       ("rms_norm", rms_norm, _torch_rms, True)]:
                if rms and shape[-1] == 1:
                    continue  # one-feature RMSNorm gradients are pure cancellation (see tests)

                def check(shape=shape, dtype=dtype, fn=fn, ref=ref, rms=rms):
                    inputs = _inputs(*shape, dtype, rms)
                    return testing.check_against_reference(fn, ref, inputs, dtype=dtype, baseline_fn=ref)

                yield f"{name} {shape} {str(dtype).removeprefix('torch.')}", check


def cases(full: bool) -> list[bench.Case]:
    out = []
    for rms in (False, True):
        op = "rmsnorm" if rms else "layernorm"
        variants = {"fk": rms_norm if rms else layer_norm, **_peers(rms)}
        for rows, cols in FULL_SHAPES if full else SMALL_SHAPES:
            for dtype in DTYPES:
                tensor_bytes = rows * cols * dtype.itemsize
                make = functools.partial(_inputs, rows, cols, dtype, rms)
                for direction, wrap, tensors in [("fwd", bench.forward, 2), ("bwd", bench.backward, 3)]:
                    out.append(bench.Case(
                        op=op, direction=direction, shape=f"{rows}×{cols}", dtype=dtype,
                        unit=bench.GBPS, work=tensors * tensor_bytes, make_inputs=make,
                        variants={name: wrap(fn) for name, fn in variants.items()},
                        input_bytes=tensor_bytes, memory=direction == "bwd",
                    ))
    return out


def host_cases() -> list[bench.HostCase]:
    """Both ops on a tiny input, where a call's cost is its host work, against torch's own op
    and Liger (when installed)."""
    rows, cols = HOST_SHAPE
    out = []
    for rms, name, fk in [(True, "rms_norm", rms_norm), (False, "layer_norm", layer_norm)]:
        peers = {k: v for k, v in _peers(rms).items() if k != bench.TORCH_COMPILE}
        out.append(bench.HostCase(
            op=name, shape=f"{rows}×{cols}", dtype=torch.bfloat16,
            make_inputs=functools.partial(_inputs, rows, cols, torch.bfloat16, rms),
            variants={"fk": fk, **peers},
        ))
    return out

"""Launch table for fk-attention: block shapes, warps and pipeline stages per head dim.

Forward blocks follow the Triton fused-attention tutorial's H100 choices (128 queries x 64 keys
up to head dim 128, smaller at 256 where shared memory runs out); the backward uses square 64
blocks (32 at head dim 256). The interpreter gets 16 x 16 blocks: it runs programs one by one
and a small block keeps CPU tests quick.
"""

from __future__ import annotations

import dataclasses
import functools

from .. import backend, sizing

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8
INTERPRETER_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Blocks:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (largest padded head dim, forward blocks, backward blocks); first match wins.
GPU_TABLE = (
    (64, Blocks(128, 64, 4, 3), Blocks(64, 64, 4, 2)),
    (128, Blocks(128, 64, 8, 3), Blocks(64, 64, 8, 2)),
    (256, Blocks(64, 32, 8, 2), Blocks(32, 32, 8, 1)),
)


def padded_head_dim(head_dim: int) -> int:
    return sizing.next_power_of_2(head_dim)


@functools.lru_cache(maxsize=64)
def blocks(head_dim: int, backward: bool) -> Blocks:
    if backend.is_interpreter():
        return Blocks(INTERPRETER_BLOCK, INTERPRETER_BLOCK, sizing.MIN_WARPS, 1)
    padded = padded_head_dim(head_dim)
    for limit, fwd, bwd in GPU_TABLE:
        if padded <= limit:
            return bwd if backward else fwd
    raise ValueError(f"head dim {head_dim} is above {MAX_HEAD_DIM}")

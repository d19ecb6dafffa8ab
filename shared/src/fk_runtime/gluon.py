"""Triton's Gluon API (`triton.experimental.gluon`) under one set of names, on every Triton that fk
supports: Gluon kernels import what they use from here, never from Triton.

Gluon is experimental and its names move between releases. Those fk's kernels meet:
- 3.8 renamed the Hopper TMA copies `tma.async_copy_global_to_shared` / `async_copy_shared_to_global`
  to `tma.async_load` / `tma.async_store` (the old names stay as aliases); 3.9 keeps the old names
  only to raise. Here they are `tma_load` and `tma_store`.
- 3.9 made a shared-memory descriptor's `_reinterpret` public as `reinterpret`: here a jitted
  `reinterpret(smem, dtype, shape, layout)`.
- 3.7 replaced `gl.thread_barrier` by `gl.barrier` (not used by fk's kernels yet).
- 3.8 added TMA reductions from shared memory (`tma.async_atomic_add`, ...): here `tma_reduce_add`,
  None before 3.8.
- Ampere's mma.sync (`nvidia.ampere.mma_v2`, one warp's 16-row tiles) has one name on every version: `mma_v2`.

`supported()` says whether this Triton is one whose Gluon kernels fk compiled for sm_90a and ran:
the Gluon paths are taken there only; elsewhere the `tl` kernels run.
"""

from __future__ import annotations

from . import backend

# (major, minor) Triton versions whose Gluon API fk's kernels were compiled and tested with.
VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon (or without its Hopper part): the tl kernels serve
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = mma_v2 = None
    TensorDescriptor = None

if tma is not None:
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    store_wait = tma.store_wait
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
else:
    tma_load = tma_store = store_wait = tma_reduce_add = None

if gluon is not None:
    # Which name this Triton gives a shared-memory view of another dtype, shape or layout.
    PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """`smem` seen as `dtype` of `shape` in `layout` (the same bytes)."""
        if PUBLIC_REINTERPRET:
            return smem.reinterpret(dtype, shape, layout)
        else:
            return smem._reinterpret(dtype, shape, layout)
else:
    reinterpret = None


def supported(version: str | None = None) -> bool:
    """Whether this Triton (or `version`) has the Gluon API fk's kernels were built for."""
    if gluon is None or tma_load is None:
        return False
    return backend.triton_release(version) in VERSIONS

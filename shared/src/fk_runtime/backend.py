"""Which backend the kernels run on: CUDA, HIP, or the Triton interpreter on a CPU.

Decided from torch alone. `triton.runtime.driver.active` raises ("0 active drivers") on a machine
with no GPU driver, so nothing here touches it. The answer is cached at first use, in eager code,
so that `torch.compile` never traces the detection itself.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import sys

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
NO_GPU_HINT = (
    f"fk's kernels need a CUDA or ROCm GPU, and torch sees none here. To run them on the CPU through "
    f"Triton's interpreter (slow; for tests), set {INTERPRET_ENV}=1 in the environment before "
    "importing triton or any fk op"
)


class Backend(str, enum.Enum):
    CUDA = "cuda"
    HIP = "hip"
    INTERPRETER = "interpreter"


def interpreter_requested() -> bool:
    """True when the user (or the test setup) asked Triton to interpret kernels on the CPU."""
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on", "yes")


def gpu_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def backend() -> Backend:
    """The backend kernels launch on in this process."""
    if interpreter_requested() or not gpu_available():
        return Backend.INTERPRETER
    return Backend.HIP if torch.version.hip else Backend.CUDA


def is_interpreter() -> bool:
    return backend() is Backend.INTERPRETER


def is_hip() -> bool:
    return backend() is Backend.HIP


def use_interpreter_without_gpu() -> bool:
    """Turn the Triton interpreter on when no GPU is present; return whether it is on.

    Must run before any `@triton.jit` kernel is defined (i.e. before an op package is imported):
    Triton picks interpreter or compiler when the decorator runs.
    """
    if not gpu_available() and not interpreter_requested():
        if "triton" in sys.modules:
            raise RuntimeError(
                "no GPU here and triton was imported before the interpreter could be turned on: "
                f"set {INTERPRET_ENV}=1 in the environment (or call this before importing triton)"
            )
        os.environ[INTERPRET_ENV] = "1"
    backend.cache_clear()
    return is_interpreter()


# Triton 3.6's interpreter turns one-element arrays into Python ints with int(), which numpy 2.4
# refuses ("only 0-dimensional arrays can be converted"); 3.7 fixed it.
INTERPRETER_NUMPY_LIMIT = {(3, 6): (2, 4)}


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string: "3.8.0", "3.9.0+git1a2b", "3.10.0rc1" -> (3, 10);
    None where it has no such numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


@functools.cache
def triton_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the Triton this process imports (or of `version`): the launcher layout,
    the Gluon gate and the per-version numbers of the ops' plans (a compiler release moves
    registers and schedules) key on it."""
    if version is None:
        import triton

        version = triton.__version__
    return release(version)


def triton_at_least(wanted: tuple[int, int]) -> bool:
    """Whether this process's Triton is release `wanted` or later (an unreadable version: no)."""
    return (triton_release() or (0, 0)) >= wanted


def interpreter_numpy_problem() -> str | None:
    """Why this Triton's interpreter cannot run kernels under the installed numpy, or None."""
    import numpy
    import triton

    limit = INTERPRETER_NUMPY_LIMIT.get(release(triton.__version__))
    if limit is not None and (release(numpy.__version__) or (0, 0)) >= limit:
        return (f"Triton {triton.__version__}'s interpreter needs numpy < {limit[0]}.{limit[1]} (numpy "
                f"{numpy.__version__} is installed): pip install 'numpy<{limit[0]}.{limit[1]}', or a newer triton")
    return None


def check_interpreter_numpy() -> None:
    """Raise that problem as a clear error (the test setup and the main job call this when they
    run on the interpreter, before any kernel fails deep inside it)."""
    problem = interpreter_numpy_problem()
    if problem is not None:
        raise RuntimeError(problem)


def default_device() -> torch.device:
    """Where tensors for fk kernels live by default: the GPU, else the CPU for the interpreter."""
    return torch.device("cpu") if is_interpreter() else torch.device("cuda")


def kernel_device_type() -> str:
    """The torch device type that kernels accept on this backend."""
    return "cpu" if is_interpreter() else "cuda"


@functools.cache
def multiprocessor_count(device_index: int = 0) -> int:
    """Streaming multiprocessors (CUDA) or compute units (HIP); a small stand-in on the CPU."""
    if is_interpreter():
        return INTERPRETER_PROCESSORS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def l2_cache_bytes(device_index: int = 0) -> int:
    if is_interpreter():
        return 0
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "L2_cache_size", 0))


def shared_memory_per_program(device_index: int = 0) -> int:
    """The most shared memory one program (CTA) may take on this device, in bytes (0 unknown)."""
    if is_interpreter():
        return 0
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def shared_memory_per_multiprocessor(device_index: int = 0) -> int:
    """Shared memory a multiprocessor holds for its resident programs, in bytes (0 unknown; the
    per-program limit where torch does not report it)."""
    if is_interpreter():
        return 0
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0)) or shared_memory_per_program(device_index)


def device_name(device_index: int = 0) -> str:
    if is_interpreter():
        return "CPU (Triton interpreter)"
    return torch.cuda.get_device_name(device_index)


def warp_size() -> int:
    """Threads per warp: 64-wide wavefronts on most AMD GPUs, 32 on NVIDIA."""
    if is_hip():
        return HIP_WAVEFRONT
    return CUDA_WARP


CUDA_WARP = 32
HIP_WAVEFRONT = 64
# The interpreter runs programs one by one; grids sized for a handful of "processors" keep it quick.
INTERPRETER_PROCESSORS = 4

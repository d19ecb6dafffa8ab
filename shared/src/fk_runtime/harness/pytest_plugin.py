"""pytest hooks every fk test directory loads from its conftest.py.

`from fk_runtime.harness.pytest_plugin import *` in a conftest sets the test device up before any test
module imports an op (and so before any kernel is defined), reports backend and seed, hands large
cached GPU memory back after each test, and runs the tests marked `heavy` first.
"""

from __future__ import annotations

import pytest
import torch

from .. import backend
from . import testing

testing.setup()

# What a test process may keep cached on the GPU after a test. PyTorch's caching allocator holds
# on to a test's peak; with several pytest-xdist workers on one GPU, the multi-GiB tests' leftovers
# starved the others (an H100 run of 2026-11-23 hit out-of-memory with three workers holding
# 16-22 GiB each).
KEEP_CACHED_GPU_BYTES = 1 << 30


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    yield
    if testing.on_gpu() and torch.cuda.memory_reserved() > KEEP_CACHED_GPU_BYTES:
        torch.cuda.empty_cache()


def pytest_configure(config):
    # Triton 3.6's interpreter turns one-element arrays into ints (numpy deprecated that in 1.25):
    # a warning per kernel step, tens of thousands a run, Triton's and harmless below numpy 2.4.
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
    config.addinivalue_line("markers", "heavy: tens of seconds on CI's 2 cores (ranks spawned, a main-job run, "
                            "a compile): collected first")


def pytest_collection_modifyitems(config, items):
    # Heavy tests first: pytest-xdist's workers then end on short tests, not one of them alone on a long one.
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_report_header(config):
    return f"fk: backend {backend.backend().value}, device {backend.device_name()}, " \
        f"{testing.SEED_ENV}={testing.seed()}"

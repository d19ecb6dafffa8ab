"""pytest hooks every fk test directory loads from its conftest.py.

`from fk_runtime.harness.pytest_plugin import *` in a conftest sets the test device up before any test
module imports an op (and so before any kernel is defined), reports backend and seed, hands large
cached GPU memory back after each test, and runs the tests marked `heavy` first. A run cut short (a
GPU box's time limit) can be taken up where it stopped: `FK_TESTS_LOG=FILE` appends the id of every
test that finished, `FK_TESTS_DONE=FILE` (a copy of such a log) leaves those tests out.
"""

from __future__ import annotations

import os

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
# A file each finished test's id is appended to; a file of ids a run leaves out (an earlier run's log).
LOG_ENV, DONE_ENV = "FK_TESTS_LOG", "FK_TESTS_DONE"
# Ids logged by this process (every conftest that imports these hooks calls them: once per id).
_logged: set[str] = set()


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
    if os.environ.get(DONE_ENV):
        with open(os.environ[DONE_ENV]) as f:
            done = {line.rstrip("\n") for line in f}
        left_out = [item for item in items if item.nodeid in done]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.nodeid not in done]


def pytest_runtest_logreport(report):
    # A test has finished once its call ran, or its setup skipped or failed; pytest-xdist's controller
    # logs every worker's tests, the workers nothing.
    finished = report.when == "call" or (report.when == "setup" and not report.passed)
    if finished and os.environ.get(LOG_ENV) and "PYTEST_XDIST_WORKER" not in os.environ \
            and report.nodeid not in _logged:
        _logged.add(report.nodeid)
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(report.nodeid + "\n")


def pytest_report_header(config):
    return f"fk: backend {backend.backend().value}, device {backend.device_name()}, " \
        f"{testing.SEED_ENV}={testing.seed()}"

"""pytest hooks every fk test directory loads from its conftest.py.

`from fk_runtime.pytest_plugin import *` in a conftest sets the test device up before any test
module imports an op (and so before any kernel is defined), and reports backend and seed.
"""

from __future__ import annotations

from . import backend, testing

testing.setup()


def pytest_report_header(config):
    return f"fk: backend {backend.backend().value}, device {backend.device_name()}, " \
        f"{testing.SEED_ENV}={testing.seed()}"

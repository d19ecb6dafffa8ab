import importlib.util
from pathlib import Path

import pytest
from fk_runtime.harness.pytest_plugin import *  # noqa: F403  (device setup before kernels are defined)


@pytest.fixture
def e2e_script():
    """load(name): a script of e2e/ as a module (they are files, not a package)."""
    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "e2e" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load

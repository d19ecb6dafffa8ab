import pytest

from fk_runtime.harness.pytest_plugin import *  # noqa: F403  (device setup before kernels are defined)


@pytest.fixture
def hopper_card(monkeypatch):
    """as_card(name): plans made as on that Hopper card (an H100 or H200): 132 multiprocessors, 228 KiB of shared
    memory each, 227 a program."""
    from fk_runtime import backend

    def as_card(name: str) -> None:
        monkeypatch.setattr(backend, "multiprocessor_count", lambda index=0: 132)
        monkeypatch.setattr(backend, "shared_memory_per_multiprocessor", lambda index=0: 233472)
        monkeypatch.setattr(backend, "shared_memory_per_program", lambda index=0: 232448)
        monkeypatch.setattr(backend, "device_name", lambda index=0: name)

    return as_card

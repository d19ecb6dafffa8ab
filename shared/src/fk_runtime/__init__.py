"""fk-runtime: what every fk op shares (backend, sizing, checks, allocation, tests, benchmarks)."""

from . import alloc, backend, checks, sizing
from .backend import Backend
from .version import package_version

__version__ = package_version(__name__, __file__)

__all__ = ["Backend", "alloc", "backend", "checks", "package_version", "sizing", "__version__"]

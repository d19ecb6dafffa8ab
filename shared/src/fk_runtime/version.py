"""`__version__` for every fk distribution, installed or run from source.

Installed (or built), setuptools-scm has written `_version.py` beside the package. From a source
checkout on PYTHONPATH there is none: ask setuptools-scm for the version from git, with the
package's own pyproject.toml (its own tag prefix). With neither, say so rather than guess.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

UNKNOWN = "0.0.0+unknown"


def package_version(module_name: str, module_file: str) -> str:
    try:
        return importlib.import_module(f"{module_name}._version").version
    except ImportError:
        pass
    # src/<module>/__init__.py -> the distribution root holding pyproject.toml
    pyproject = Path(module_file).resolve().parent.parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return UNKNOWN
    try:
        from setuptools_scm import Configuration, _get_version

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = Configuration.from_file(pyproject)
            return _get_version(config, force_write_version_files=False) or UNKNOWN
    except Exception:  # no setuptools-scm, no git, or no tag: the source has no version
        return UNKNOWN

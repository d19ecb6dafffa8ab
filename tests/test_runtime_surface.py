"""fk-runtime holds mechanisms only, and ops use only its declared public surface
(`fk_runtime.PUBLIC`), under an honest version range."""

import ast
import importlib
import re
from pathlib import Path

import fk_runtime
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p for p in (ROOT / "packages").glob("fk-*") if p.is_dir())
RUNTIME_SRC = ROOT / "shared" / "src" / "fk_runtime"
# Words that would mean a runtime module knows an op (its name, or its kernels' parameters).
OP_WORDS = re.compile(r"softmax|layer ?norm|rms ?norm|attention|weighted.?sum|HEAD_DIM|BLOCK_M\b|causal",
                      re.IGNORECASE)


def _runtime_uses(path: Path) -> set[tuple[str, str]]:
    """(module, name) pairs of fk_runtime that the file imports or reads as module attributes."""
    tree = ast.parse(path.read_text())
    used, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fk_runtime":
            module = node.module.removeprefix("fk_runtime").lstrip(".") or "fk_runtime"
            for alias in node.names:
                used.add((module, alias.name))
                if module == "fk_runtime":
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fk_runtime."):
                    used.add(("fk_runtime", alias.name.split(".")[1]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add((aliases[node.value.id], node.attr))
    return used


def _allowed(module: str, name: str) -> bool:
    names = fk_runtime.PUBLIC.get(module)
    if names == "*":
        return name == "*" or not name.startswith("_")
    return names is not None and name in names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_ops_use_only_the_public_surface(package):
    outside = sorted(f"{path.relative_to(ROOT)}: fk_runtime.{module}.{name}"
                     for path in package.rglob("*.py") for module, name in _runtime_uses(path)
                     if not _allowed(module, name))
    assert not outside, "not in fk_runtime.PUBLIC:\n" + "\n".join(outside)


def test_public_surface_exists():
    for module, names in fk_runtime.PUBLIC.items():
        if module in ("fk_runtime", "harness") or names == "*":  # harness: submodules, imported when used
            continue
        mod = importlib.import_module(f"fk_runtime.{module}")
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"fk_runtime.{module} lacks {missing}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_runtime_range_matches_the_surface_version(package):
    """Each op depends on fk-runtime >= the surface version it was written against, < the next
    minor: the range pip resolves is the one whose runtimes have every name the op uses."""
    text = (package / "pyproject.toml").read_text()
    match = re.search(r'"fk-runtime>=([0-9.]+)(?:\.dev0)?,<([0-9.]+)"', text)
    assert match, f"{package.name} must depend on fk-runtime by a >=,< range"
    major, minor = fk_runtime.SURFACE_VERSION.split(".")
    assert match.group(1) == fk_runtime.SURFACE_VERSION
    assert match.group(2) == f"{major}.{int(minor) + 1}"


def test_runtime_modules_name_no_op():
    """No per-op module, and no runtime module names an op or a kernel's parameters."""
    assert not list(RUNTIME_SRC.glob("tuning/*.py"))
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(RUNTIME_SRC.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if OP_WORDS.search(line)]
    assert not found, "\n".join(found)

"""How the packages are put together: no module of a package imports another that imports it back
(directly or through others), no module reaches another's private (underscore) names, and no
source file outgrows a reader. Read from the sources' syntax trees: nothing is imported."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "shared" / "src" / "fk_runtime"] + sorted(
    p for p in (ROOT / "packages").glob("fk-*/src/fk_*") if p.is_dir())
# A source file past this many lines is doing more than one job (the attention kernels are the largest).
MAX_LINES = 950


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name inside the package (e.g. "plan", "harness.bench") -> file."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _resolve(module: str, level: int, target: str | None, package_name: str, is_init: bool) -> str | None:
    """The package-relative module an import names, or None for other packages."""
    if level == 0:
        if target is None or target.split(".")[0] != package_name:
            return None
        return target.partition(".")[2]
    base = module.split(".") if module else []
    if not is_init:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + (target.split(".") if target else []))


def _imports(package: Path):
    """{module: {imported package module}} and [(module, line, private name it reaches)]."""
    modules = _modules(package)
    edges, private = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        is_init = path.name == "__init__.py"
        edges[name] = set()
        aliases = {}  # local name -> package module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(name, node.level, node.module, package.name, is_init)
                if source is None:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}".strip(".")
                    if sub in modules:  # `from . import plan`: a module
                        edges[name].add(sub)
                        aliases[alias.asname or alias.name] = sub
                    else:  # `from .plan import x`: a name of a module
                        edges[name].add(source)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append((name, node.lineno, f"{source}.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    sub = _resolve(name, 0, alias.name, package.name, is_init)
                    if sub is not None and sub in modules:
                        edges[name].add(sub)
                        if alias.asname:
                            aliases[alias.asname] = sub
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and aliases.get(node.value.id) not in (None, name) \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append((name, node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
        edges[name].discard(name)
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle through module imports (Tarjan's strongly connected components of size > 1)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycles(package):
    assert not _cycles(_imports(package)[0])


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_module_reaches_another_modules_private_names(package):
    private = [f"{m}:{line}: {name}" for m, line, name in _imports(package)[1]]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_source_files_stay_readable(package):
    long = {path.name: n for path in package.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checks_find_what_they_look_for(tmp_path):
    """A cycle and a private reach planted in a scratch package are found."""
    package = tmp_path / "fk_planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n\n\ndef f():\n    return b._hidden\n")
    (package / "b.py").write_text("from .a import f\n_hidden = 1\n")
    (package / "c.py").write_text("from fk_planted.b import _hidden\n")
    edges, private = _imports(package)
    assert _cycles(edges) == [["a", "b"]]
    assert sorted(name for _, _, name in private) == ["b._hidden", "b._hidden"]

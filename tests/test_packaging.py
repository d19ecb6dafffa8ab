"""Versions come from git tags, one prefix per distribution: a tag versions its package only."""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("setuptools_scm", reason="versioning checks need setuptools-scm (nox installs it)")
pytest.importorskip("build", reason="building distributions needs `build` (nox installs it)")


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def tagged_clone(tmp_path_factory):
    """A clone of this repository's HEAD with fk-weightedsum-v0.2.0 tagged."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path_factory.mktemp("clone") / "fk"
    _git(ROOT.parent, "clone", "-q", "--no-hardlinks", str(ROOT), str(clone))
    for tag in _git(clone, "tag", "--list").split():
        _git(clone, "tag", "-d", tag)
    _git(clone, "tag", "fk-weightedsum-v0.2.0")
    return clone


def _build(project: Path, out: Path, *kinds: str) -> list[str]:
    cmd = [sys.executable, "-m", "build", "--no-isolation", *kinds, "--outdir", str(out), str(project)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return sorted(p.name for p in out.iterdir())


def test_a_tag_versions_only_its_own_package(tagged_clone, tmp_path):
    ws = _build(tagged_clone / "packages" / "fk-weightedsum", tmp_path / "ws", "--sdist", "--wheel")
    assert ws == ["fk_weightedsum-0.2.0-py3-none-any.whl", "fk_weightedsum-0.2.0.tar.gz"]
    rt = _build(tagged_clone / "shared", tmp_path / "rt", "--wheel")
    assert len(rt) == 1 and rt[0].startswith("fk_runtime-0.1.dev"), rt


def test_runtime_tag_leaves_ops_alone(tagged_clone, tmp_path):
    _git(tagged_clone, "tag", "fk-runtime-v0.1.3")
    try:
        assert _build(tagged_clone / "shared", tmp_path / "rt", "--wheel") == [
            "fk_runtime-0.1.3-py3-none-any.whl"
        ]
        assert _build(tagged_clone / "packages" / "fk-weightedsum", tmp_path / "ws", "--wheel") == [
            "fk_weightedsum-0.2.0-py3-none-any.whl"
        ]
    finally:
        _git(tagged_clone, "tag", "-d", "fk-runtime-v0.1.3")


def test_sdist_builds_without_git(tagged_clone, tmp_path):
    """An sdist carries its version in PKG-INFO: a wheel built from it, far from any git
    repository, keeps 0.2.0."""
    (name,) = _build(tagged_clone / "packages" / "fk-weightedsum", tmp_path / "sd", "--sdist")
    sdist = tmp_path / "sd" / name
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    (unpacked,) = (tmp_path / "x").iterdir()
    assert _build(unpacked, tmp_path / "wheel", "--wheel") == ["fk_weightedsum-0.2.0-py3-none-any.whl"]


def test_version_attribute_from_source_checkout(tagged_clone):
    """`fk_weightedsum.__version__` from the source folders on PYTHONPATH, nothing installed."""
    paths = [tagged_clone / "shared" / "src", tagged_clone / "packages" / "fk-weightedsum" / "src"]
    for written_by_a_build in tagged_clone.rglob("_version.py"):
        written_by_a_build.unlink()
    code = "import fk_weightedsum, fk_runtime; print(fk_weightedsum.__version__, fk_runtime.__version__)"
    env = {"PYTHONPATH": ":".join(map(str, paths)), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tagged_clone)
    assert out.returncode == 0, out.stderr
    ws_version, rt_version = out.stdout.split()
    assert ws_version == "0.2.0" and rt_version.startswith("0.1.dev")


def test_installed_version_matches_metadata():
    from importlib.metadata import PackageNotFoundError, version

    import fk_weightedsum

    try:
        assert fk_weightedsum.__version__ == version("fk-weightedsum")
    except PackageNotFoundError:  # running from source: the version came from git
        assert fk_weightedsum.__version__

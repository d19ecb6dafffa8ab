"""Sessions for every fk package, generated from the folders under packages/.

    nox -s tests                 every package's tests and the cross-package tests (newest Triton)
    nox -s tests-oldest          the kernels' and launch path's tests on the oldest Triton (3.6)
    nox -s test-weightedsum      one op's tests (test-runtime for fk-runtime)
    nox -s lint                  ruff, and the GitHub workflows against their JSON schema
    nox -s build                 sdist + wheel of every distribution, metadata checked
    nox -s bench-weightedsum     one op's check and benchmark (the main job, one op)

torch is installed first in every session: $FK_TORCH (a pip requirement) from $FK_TORCH_INDEX when
set; else, on a machine with no GPU, a CPU build (a local `torch-*+cpu` wheel for this Python found
in pip's find-links folders, else PyTorch's CPU index) so that no session pulls the multi-GB CUDA
build; else PyPI's default torch. fk-runtime always comes from this working tree.
"""

from __future__ import annotations

import configparser
import os
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
RUNTIME = ROOT / "shared"
OPS = {p.name.removeprefix("fk-"): p for p in sorted((ROOT / "packages").glob("fk-*")) if p.is_dir()}
# numpy: the Triton interpreter needs it on a CPU-only machine (the range tested with it).
# pytest-xdist: the tests run on every core (up to PYTEST_WORKERS); CI has two.
NUMPY = "numpy>=2.3,<2.5"
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", NUMPY]
PYTEST_WORKERS = 4
BENCH_DEPS = ["matplotlib>=3.8", "tqdm>=4.66", NUMPY]
# The oldest Triton fk supports and the numpy its interpreter runs under (3.6's needs < 2.4);
# `tests` takes the newest that the packages' range admits.
OLDEST = ["triton==3.6.0", "numpy>=2.3,<2.4"]
# What the oldest Triton runs: the tests of what its version reaches, every op's kernels under its
# interpreter (dense, windowed, packed, decode builds) and fk-runtime's launch path. The layers above
# them (transformers, rings, the flash_attn layer, the main job, packaging, torch.compile) do not
# depend on the Triton version and run once, in `tests` (CI's two sessions fit about 20 minutes).
OLDEST_TARGETS = [
    RUNTIME / "tests",
    *(OPS["attention"] / "tests" / name for name in ("test_attention.py", "test_alibi.py", "test_dropout.py")),
    OPS["attention"] / "tests" / "test_masks_and_packing.py::test_masks_match_float64_reference",
    OPS["attention"] / "tests" / "test_masks_and_packing.py::test_packed_equals_dense_on_equal_lengths",
    OPS["layernorm"] / "tests" / "test_layernorm.py",
    OPS["softmax"] / "tests",
    OPS["weightedsum"] / "tests",
    *(ROOT / "tests" / name for name in ("test_host_path.py", "test_op_contract.py", "test_double_backward.py")),
]
# Nor do torch.compile's traces (the "compile" cases: aot_eager on a CPU), the determinism repeats,
# the opt-in autotuner's candidate sweep (FK_AUTOTUNE=1; 21 s), torch.library's opcheck of the
# registered ops and the stable LayerNorm's formula on 70001-wide rows (36 s): torch's side, or
# arithmetic the other LayerNorm tests already run through the same kernels there. Tests of
# Triton's own compiles (ahead in threads, the collector after them, a launch's compiled kernel)
# say "compile" too and stay: they read Triton's internals, which differ by version.
OLDEST_SKIPS = ["-k", "not (compile and not ahead and not collector and not pool_is_idle and not compiled_kernel)"
                " and not strided_bnhd and not determinis and not autotuned_launch and not opcheck and not stable_divides"]
# Each op's extras its tests need (optional integrations: fk_attention.hf, swap_norms on
# transformers models), so that no test of them skips in CI.
TEST_EXTRAS = {"attention": "transformers", "layernorm": "transformers"}
# pyflakes, pycodestyle errors, bugbear; set here so that every package lints alike.
RUFF_ARGS = ["--select", "E4,E7,E9,F,B,W", "--line-length", "110"]

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Device nodes of an NVIDIA or AMD GPU driver (no torch needed to look).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def gpu_present() -> bool:
    return any(Path(p).exists() for p in GPU_DEVICE_FILES)


def pip_wheel_dirs(environ) -> list[Path]:
    """pip's find-links folders: PIP_FIND_LINKS, then the [global] find-links of pip's config files."""
    links = environ.get("PIP_FIND_LINKS", "").split()
    for path in ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", Path.home() / ".config/pip/pip.conf",
                 Path.home() / ".pip/pip.conf", environ.get("PIP_CONFIG_FILE", "")):
        config = configparser.ConfigParser()
        if path and Path(path).is_file():
            config.read(path)
            links += config.get("global", "find-links", fallback="").split()
    return [Path(link.removeprefix("file://")) for link in links if not link.startswith(("http:", "https:"))]


def _wheel_version(wheel: Path) -> list[int]:
    return [int(part) for part in wheel.name.split("-")[1].split("+")[0].split(".") if part.isdigit()]


def torch_install_args(environ, gpu: bool, wheel_dirs, python_tag: str) -> list[str]:
    """What `pip install` gets for torch (see the module docstring)."""
    index = environ.get("FK_TORCH_INDEX")
    if "FK_TORCH" in environ or index or gpu:
        return [environ.get("FK_TORCH", "torch"), *(["--index-url", index] if index else [])]
    for folder in wheel_dirs:
        wheels = sorted(Path(folder).glob(f"torch-*+cpu-{python_tag}-*.whl"), key=_wheel_version) \
            if Path(folder).is_dir() else []
        if wheels:
            return [str(wheels[-1])]
    return ["torch", "--index-url", TORCH_CPU_INDEX]


# fk's build backend (its pyproject files' build requirements), installed before fk's packages: pip
# then builds them in the session's environment, not in a fresh one per package (20 s a session).
BUILD_BACKEND = ["setuptools>=77", "setuptools-scm>=10"]


def pip_install(session: nox.Session, *args: str) -> None:
    """`pip install`, leaving byte-compiling to Python (the modules a session imports, once): compiling
    all of torch's files as it installs took 30 of the 40 s of its install."""
    session.install("--no-compile", *args)


def install_torch(session: nox.Session) -> None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    pip_install(session, *torch_install_args(os.environ, gpu_present(), pip_wheel_dirs(os.environ), tag))


def install_packages(session: nox.Session, *paths: Path | str, extras: list[str] = ()) -> None:
    """fk-runtime and the given packages from this working tree (never from an index); a path may
    carry pip extras (`folder[extra]`), which come from the index."""
    install_torch(session)
    pip_install(session, *BUILD_BACKEND)
    pip_install(session, "--no-build-isolation", str(RUNTIME), *map(str, paths), *extras)


def tested(name: str) -> str:
    """An op's folder as a pip requirement with its test extras, e.g. `.../fk-attention[transformers]`."""
    return f"{OPS[name]}[{TEST_EXTRAS[name]}]" if name in TEST_EXTRAS else str(OPS[name])


def pytest(session: nox.Session, *targets: Path | str) -> None:
    # importlib mode: test modules of different packages may share a file name.
    # worksteal: an idle worker takes queued tests from a busy one (a few tests run minutes each).
    session.run("python", "-m", "pytest", "--import-mode=importlib", "--numprocesses=auto", "--dist=worksteal",
                "--durations=15", f"--maxprocesses={PYTEST_WORKERS}", *map(str, targets), *session.posargs)


# The packaging tests build distributions without isolation: they need the build backend here.
PACKAGING_DEPS = ["build>=1.2", *BUILD_BACKEND]


def all_tests(session: nox.Session, pins: list[str], targets: list, packages: list[str], extras: list[str]) -> None:
    # The pins in the packages' own install: pip resolves them at once (no newest Triton installed, then replaced).
    install_packages(session, *packages, extras=TEST_DEPS + BENCH_DEPS + extras + pins)
    pytest(session, *targets)


@nox.session(name="tests")
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-package tests, in one environment (the newest Triton)."""
    all_tests(session, [], [RUNTIME / "tests", *(p / "tests" for p in OPS.values()), ROOT / "tests"],
              [tested(name) for name in OPS], PACKAGING_DEPS)


@nox.session(name="tests-oldest")
def tests_oldest(session: nox.Session) -> None:
    """The kernels' and launch path's tests (OLDEST_TARGETS) on the oldest supported Triton and a
    numpy its interpreter runs under (no optional integrations: no test of them runs here)."""
    all_tests(session, OLDEST, [*OLDEST_TARGETS, *OLDEST_SKIPS], [str(path) for path in OPS.values()], [])


@nox.session(name="test-runtime")
def test_runtime(session: nox.Session) -> None:
    install_packages(session, extras=TEST_DEPS + BENCH_DEPS)
    pytest(session, RUNTIME / "tests")


def _op_sessions(name: str, path: Path) -> None:
    @nox.session(name=f"test-{name}")
    def test_op(session: nox.Session) -> None:
        install_packages(session, tested(name), extras=TEST_DEPS)
        pytest(session, path / "tests")

    @nox.session(name=f"bench-{name}")
    def bench_op(session: nox.Session) -> None:
        install_packages(session, path, extras=BENCH_DEPS)
        session.run("python", "-m", "fk_runtime", "--ops", name, *session.posargs)


for _name, _path in OPS.items():
    _op_sessions(_name, _path)


def _decoder_args(posargs: list[str]) -> list[str] | None:
    """The main job's arguments that e2e/decoder.py shares (--small, --out); None where the
    arguments narrow the run to some ops, to the checks or to the host-time section."""
    if any(a in ("--no-bench", "--host-only") or a.startswith("--ops") for a in posargs):
        return None
    args = []
    for i, a in enumerate(posargs):
        if a == "--small" or a.startswith("--out="):
            args.append(a)
        elif a == "--out" and i + 1 < len(posargs):
            args += [a, posargs[i + 1]]
    return args


@nox.session
def bench(session: nox.Session) -> None:
    """The main job for every op: check and benchmark on the default device; then the end-to-end
    decoder (e2e/decoder.py) into the same folder (without a GPU, one temporary folder for both
    unless --out is given)."""
    install_packages(session, *OPS.values(), extras=BENCH_DEPS)
    posargs = list(session.posargs)
    if not gpu_present() and not any(a == "--out" or a.startswith("--out=") for a in posargs):
        posargs += ["--out", str(Path(tempfile.mkdtemp(prefix="fk-bench-")) / "benchmarks")]
    session.run("python", "-m", "fk_runtime", *posargs)
    decoder_args = _decoder_args(posargs)
    if decoder_args is not None:
        session.run("python", str(ROOT / "e2e" / "decoder.py"), *decoder_args)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6", "check-jsonschema>=0.29")
    session.run("ruff", "check", *RUFF_ARGS, str(ROOT))
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)


@nox.session
def build(session: nox.Session) -> None:
    """sdist + wheel of every distribution into dist/, then their metadata checked by twine."""
    session.install("build>=1.2", "twine>=5")
    out = ROOT / "dist"
    for path in [RUNTIME, *OPS.values()]:
        session.run("python", "-m", "build", "--outdir", str(out), str(path))
    session.run("twine", "check", "--strict", *map(str, sorted(out.glob("*"))))

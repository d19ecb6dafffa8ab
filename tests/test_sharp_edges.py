"""Sharp edges a new user meets outside any one op: a machine without a GPU, and the sessions that
install torch (issue #19, points 3 and 9)."""

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NO_GPU_CALLS = {  # op: (import, first call)
    "softmax": ("from fk_softmax import softmax as f", "f(torch.randn(3, 5))"),
    "layer_norm": ("from fk_layernorm import layer_norm as f", "f(torch.randn(3, 5))"),
    "weighted_sum": ("from fk_weightedsum import weighted_sum as f", "f(torch.randn(3, 5), torch.randn(5))"),
    "attention": ("from fk_attention import attention as f", "f(*[torch.randn(1, 1, 4, 16)] * 3)"),
}


@pytest.mark.parametrize("op", NO_GPU_CALLS)
def test_no_gpu_and_no_interpreter_says_what_to_set(op):
    """No GPU visible and TRITON_INTERPRET unset: the first call raises fk's own RuntimeError with
    the variable to set, not Triton's "0 active drivers"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    imp, call = NO_GPU_CALLS[op]
    code = f"import torch\n{imp}\ntry:\n    {call}\nexcept RuntimeError as e:\n    print('raised:', e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "raised:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout
    assert "active drivers" not in out.stdout


def _noxfile():
    """The noxfile as a module, with `nox` stubbed where it is not installed (only its functions
    that pick torch are called)."""
    if importlib.util.find_spec("nox") is None:
        def session(*args, **kwargs):
            return args[0] if args and callable(args[0]) else (lambda f: f)
        stub = types.SimpleNamespace(session=session, options=types.SimpleNamespace(), Session=object,
                                     parametrize=lambda *a, **k: (lambda f: f))
        sys.modules.setdefault("nox", stub)
    spec = importlib.util.spec_from_file_location("fk_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nox_picks_a_cpu_torch_without_a_gpu(tmp_path):
    nox_file = _noxfile()
    wheel = tmp_path / "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    (tmp_path / "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    # No GPU, a local CPU wheel for this Python: that wheel.
    args = nox_file.torch_install_args({}, gpu=False, wheel_dirs=[tmp_path], python_tag="cp312")
    assert args == [str(wheel)]
    # No GPU and no local CPU wheel: PyTorch's CPU index.
    args = nox_file.torch_install_args({}, gpu=False, wheel_dirs=[], python_tag="cp312")
    assert args[0] == "torch" and "--index-url" in args and args[args.index("--index-url") + 1].endswith("/cpu")
    # A GPU: the default build.
    assert nox_file.torch_install_args({}, gpu=True, wheel_dirs=[tmp_path], python_tag="cp312") == ["torch"]
    # FK_TORCH (and FK_TORCH_INDEX) stay the override, GPU or not.
    env = {"FK_TORCH": "torch==2.12.0", "FK_TORCH_INDEX": "https://example.invalid/simple"}
    for gpu in (False, True):
        assert nox_file.torch_install_args(env, gpu=gpu, wheel_dirs=[tmp_path], python_tag="cp312") == [
            "torch==2.12.0", "--index-url", "https://example.invalid/simple"]
    assert nox_file.torch_install_args({"FK_TORCH": "torch==2.12.0"}, gpu=False, wheel_dirs=[tmp_path],
                                       python_tag="cp312") == ["torch==2.12.0"]

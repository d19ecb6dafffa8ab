import pytest
import torch

from fk_runtime import alloc, checks
from fk_runtime.harness import testing


def test_check_tensor_errors_name_the_argument():
    with pytest.raises(TypeError, match="^q must be a torch.Tensor"):
        checks.check_tensor("q", 3.0)
    with pytest.raises(TypeError, match="^q must have dtype"):
        checks.check_tensor("q", torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="^q must have at least 2 dims"):
        checks.check_tensor("q", torch.ones(2), min_dim=2)
    with pytest.raises(ValueError, match="^q must have at most 1 dims"):
        checks.check_tensor("q", torch.ones(2, 2), max_dim=1)
    assert checks.check_tensor("q", torch.ones(2)) is not None


def test_device_and_dtype_agreement():
    a = torch.ones(2)
    with pytest.raises(ValueError, match="one device: a on cpu, b on meta"):
        checks.check_same_device(a=a, b=torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match="one dtype"):
        checks.check_same_dtype(a=a, b=a.half())
    checks.check_same_device(a=a, b=None)
    checks.check_kernel_device("a", testing.randn((2,)))
    with pytest.raises(ValueError, match="^a must be on a"):
        checks.check_kernel_device("a", torch.ones(2, device="meta"))


def test_shape_dim_and_positive():
    with pytest.raises(ValueError, match=r"w must have shape \(3,\)"):
        checks.check_shape("w", torch.ones(4), (3,))
    assert checks.normalize_dim("dim", -1, 3) == 2
    with pytest.raises(ValueError, match="dim=3 is out of range"):
        checks.normalize_dim("dim", 3, 3)
    with pytest.raises(TypeError, match="dim must be an int"):
        checks.normalize_dim("dim", 1.0, 3)
    with pytest.raises(ValueError, match="eps must be a positive"):
        checks.check_positive("eps", -1)


def test_numpy_scalars_pass_and_bools_infinities_do_not():
    np = pytest.importorskip("numpy")
    assert checks.normalize_dim("dim", np.int64(-1), 3) == 2
    checks.check_positive("sm_scale", np.float32(0.5))
    assert checks.check_size("dim", np.int64(8)) == 8
    for bad in (True, float("inf"), float("nan"), 0.0, 10**400):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite number"):
            checks.check_positive("sm_scale", bad)
    with pytest.raises(TypeError, match="dim must be an int"):
        checks.normalize_dim("dim", True, 3)
    with pytest.raises(TypeError, match="dim must be an int, got bool"):
        checks.check_size("dim", True)
    with pytest.raises(TypeError, match="dim must be an int, got float"):
        checks.check_size("dim", 2.5)
    with pytest.raises(ValueError, match="dim must be positive, got 0"):
        checks.check_size("dim", 0)
    assert checks.check_size("length", 0, minimum=0) == 0
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        checks.check_size("length", -1, minimum=0)


def test_poisoned_outputs_are_nan_only_inside_the_context():
    with alloc.poisoned_outputs():
        assert torch.isnan(alloc.empty((5,), dtype=torch.float32, device=testing.device())).all()
    assert not alloc.poisoning()

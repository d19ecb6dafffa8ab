import math

import pytest
import torch

from fk_runtime import alloc
from fk_runtime.harness import testing


def test_inputs_are_fresh_random_and_laid_out_as_asked():
    a, b = testing.randn((8, 16)), testing.randn((8, 16))
    assert not torch.equal(a, b) and a.abs().sum() > 0
    padded = testing.randn((4, 5, 6), layout="padded_rows")
    assert padded.shape == (4, 5, 6) and not padded.is_contiguous() and padded.stride(-1) == 1
    strided = testing.randn((4, 6), torch.bfloat16, layout="strided_cols")
    assert strided.stride(-1) == 2 and strided.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="layout"):
        testing.randn((2,), layout="diagonal")


def test_rel_error_catches_nan_inf_and_shape():
    ref = torch.tensor([1.0, 2.0, -math.inf])
    assert testing.rel_error(ref.clone(), ref) == 0.0
    assert testing.rel_error(torch.tensor([1.0, math.nan, -math.inf]), ref) == math.inf
    assert testing.rel_error(torch.tensor([1.0, 2.0, 0.0]), ref) == math.inf
    assert testing.rel_error(torch.ones(2), torch.ones(3)) == math.inf


def test_harness_fails_a_wrong_kernel_and_an_unwritten_output():
    x = testing.randn((4, 8), requires_grad=True)

    def wrong(t):
        return t.sum(-1) * 1.01

    def unwritten(t):
        out = alloc.empty((4,), dtype=t.dtype, device=t.device)  # never written
        return out + 0 * t.sum(-1)

    for fn in (wrong, unwritten):
        with pytest.raises(AssertionError, match="mismatch"):
            testing.assert_matches_reference(fn, lambda t: t.sum(-1), [x], dtype=torch.float32)
    testing.assert_matches_reference(lambda t: t.sum(-1), lambda t: t.sum(-1), [x], dtype=torch.float32)


def test_wrong_gradient_is_caught():
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    x = testing.randn((5,), requires_grad=True)
    results = testing.check_against_reference(BadGrad.apply, lambda t: t * 2, [x], dtype=torch.float32)
    assert results[0].ok and not results[1].ok


def test_baseline_widens_the_bound():
    ref = torch.ones(100, dtype=torch.float64)
    noisy = ref.float() * 1.05
    c = testing.compare("y", noisy, ref, torch.float32, baseline=ref.float() * 1.04)
    expected = testing.TOLERANCE[torch.float32] + testing.BASELINE_FACTOR * 0.04
    assert c.ok and c.bound == pytest.approx(expected)
    worse = testing.compare("y", ref.float() * 1.09, ref, torch.float32, baseline=ref.float() * 1.04)
    assert not worse.ok


def test_a_cut_short_suite_goes_on_where_it_stopped(monkeypatch, tmp_path):
    """pytest_plugin: FK_TESTS_LOG gets each finished test once (a call ran, or a setup skipped or
    failed; never from an xdist worker), and FK_TESTS_DONE leaves the tests such a log names out."""
    from types import SimpleNamespace

    from fk_runtime.harness import pytest_plugin

    log = tmp_path / "finished.txt"
    monkeypatch.setenv(pytest_plugin.LOG_ENV, str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(pytest_plugin, "_logged", set())

    def report(nodeid, when, passed=True):
        return SimpleNamespace(nodeid=nodeid, when=when, passed=passed)

    for r in (report("a", "setup"), report("a", "call"), report("a", "teardown"), report("a", "call"),
              report("b", "setup", passed=False), report("c", "setup"), report("c", "teardown")):
        pytest_plugin.pytest_runtest_logreport(r)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytest_plugin.pytest_runtest_logreport(report("d", "call"))
    assert log.read_text().splitlines() == ["a", "b"]

    deselected = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    items = [SimpleNamespace(nodeid=n, get_closest_marker=lambda name: None) for n in "abcd"]
    monkeypatch.setenv(pytest_plugin.DONE_ENV, str(log))
    pytest_plugin.pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == ["c", "d"] and [i.nodeid for i in deselected] == ["a", "b"]


def test_compiled_variants_and_first_backward_gradients():
    """`compiled_variants` lists each `*_kernel`'s cached keys (none for a kernel never compiled);
    `upstream_grad` gives a model's dense gradient or `y.sum().backward()`'s broadcast one."""
    import types

    class Kernel:
        device_caches = {0: ({"a": 1, "b": 2}, None)}

    module = types.SimpleNamespace(add_kernel=Kernel(), idle_kernel=object(), helper=Kernel())
    assert testing.compiled_variants(module) == {"add_kernel": {"a", "b"}, "idle_kernel": set()}
    y = testing.randn((3, 5), torch.float16)
    dense, broadcast = testing.upstream_grad(y, "dense"), testing.upstream_grad(y, "sum")
    assert dense.shape == broadcast.shape == y.shape and dense.dtype == broadcast.dtype == y.dtype
    assert dense.is_contiguous() and broadcast.stride() == (0, 0) and bool((broadcast == 1).all())

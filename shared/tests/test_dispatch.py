import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fk_runtime import dispatch


def _recorder():
    calls = []
    run = dispatch.eager_or_op(lambda *a: calls.append("op"), lambda *a: calls.append("impl"))
    return run, calls


def test_plain_tensors_run_the_implementation():
    run, calls = _recorder()
    run(torch.ones(2), None, torch.nn.Parameter(torch.ones(1)), 3)
    assert calls == ["impl"]


def test_fake_tensors_go_through_the_registered_op():
    """A tracer that does not set `is_compiling` (AOTAutograd tracing a registered backward) hands
    over fake tensors: they must never reach the implementation's data pointers."""
    run, calls = _recorder()
    with FakeTensorMode() as mode:
        run(mode.from_tensor(torch.ones(2)), None)
    assert calls == ["op"]

import pytest
import torch
from fk_runtime import alloc, partials
from fk_runtime.harness import testing


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 17), (130, 1000), (7, 4097), (600, 33)])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float16), (torch.float32,) * 2])
def test_sum_rows_matches_a_float64_sum_in_each_dtype(rows, cols, dtypes):
    parts = testing.randn((len(dtypes), rows, cols), torch.float32, shift=0.25)
    with alloc.poisoned_outputs():  # a column the kernel does not write stays NaN
        sums = partials.sum_rows(parts, dtypes)
    assert len(sums) == len(dtypes)
    reference = parts.to(torch.float64).sum(1)
    for s, (out, dtype) in enumerate(zip(sums, dtypes, strict=True)):
        assert out.shape == (cols,) and out.dtype == dtype
        testing.assert_close(f"set {s}", out, reference[s], dtype)


def test_sum_rows_gives_the_same_bits_every_run():
    parts = testing.randn((2, 257, 300), torch.float32)
    first = partials.sum_rows(parts, (torch.float32, torch.float32))
    again = partials.sum_rows(parts.clone(), (torch.float32, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_sum_rows_outputs_are_separate_tensors():
    """Custom ops may not return aliases of one another: each set gets its own storage."""
    w, b = partials.sum_rows(testing.randn((2, 4, 8), torch.float32), (torch.float32, torch.float32))
    assert w.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_sum_rows_of_no_columns():
    (out,) = partials.sum_rows(torch.empty((1, 5, 0), device=testing.device()), (torch.float16,))
    assert out.shape == (0,) and out.dtype == torch.float16


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.empty((1, 3, 4), dtype=torch.float16), "fp32"),
    (lambda: torch.empty((3, 4)), "fp32"),
    (lambda: torch.empty((1, 4, 3)).transpose(1, 2), "contiguous"),
    (lambda: torch.empty((3, 2, 4)), "1 or 2 sets"),
    (lambda: torch.empty((1, 0, 4)), "at least one row"),
])
def test_sum_rows_rejects_what_it_cannot_sum(bad, match):
    with pytest.raises(ValueError, match=match):
        partials.sum_rows(bad().to(testing.device()), (torch.float32,) * 3 if match == "1 or 2 sets"
                          else (torch.float32,))

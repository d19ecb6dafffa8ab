import pytest
import torch
from fk_runtime import views
from fk_runtime.harness import testing


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_around_any_dim_is_a_view(dim):
    """The (outer, n, inner) view the softmax kernels read shares x's storage: no dim is copied."""
    x = testing.randn((2, 3, 4, 5))
    x3 = views.around(x, dim)
    assert x3.shape[1] == x.shape[dim] and x3.data_ptr() == x.data_ptr() and x3._base is not None
    assert torch.equal(x3, x.reshape(x3.shape))


def test_rows_views_when_strides_allow_and_copies_otherwise():
    x = testing.randn((4, 6, 8))
    assert views.rows(x).shape == (24, 8) and views.rows(x)._base is x
    padded = testing.randn((4, 6, 10))[..., :8]  # rows padded: still one stride per merged dim
    assert views.rows(padded).data_ptr() == padded.data_ptr()
    swapped = x.transpose(0, 1)  # leading dims cannot merge: a copy with the same values
    assert torch.equal(views.rows(swapped), swapped.reshape(-1, 8))


def test_empty_and_scalar_row_shapes():
    assert views.rows(torch.empty(0, 5)).shape == (0, 5)
    assert views.rows(torch.empty(3, 0)).shape == (3, 0)
    assert views.rows(torch.empty(7)).shape == (1, 7)
    assert views.around(torch.empty(2, 0, 3), 1).shape == (2, 0, 3)

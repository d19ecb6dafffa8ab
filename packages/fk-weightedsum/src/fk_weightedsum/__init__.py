"""fk-weightedsum: `x @ w` over the last dim, forward and backward in Triton."""

from fk_runtime import package_version

from .module import WeightedSum
from .ops import weighted_sum

__version__ = package_version(__name__, __file__)

__all__ = ["WeightedSum", "weighted_sum", "__version__"]

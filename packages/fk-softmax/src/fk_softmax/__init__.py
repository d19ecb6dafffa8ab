"""fk-softmax: softmax and log-softmax of any row length, with a causal mask, in Triton."""

from fk_runtime import package_version

from .module import LogSoftmax, Softmax
from .ops import log_softmax, softmax

__version__ = package_version(__name__, __file__)

__all__ = ["LogSoftmax", "Softmax", "__version__", "log_softmax", "softmax"]

"""fk-layernorm: LayerNorm and RMSNorm over the last dim, forward and backward in Triton."""

from fk_runtime import package_version

from .module import LayerNorm, RMSNorm
from .ops import layer_norm, rms_norm
from .swap import swap_norms

__version__ = package_version(__name__, __file__)

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm", "swap_norms", "__version__"]

"""fk-attention: FlashAttention-style attention, forward and backward in Triton, with GQA."""

from fk_runtime import package_version

from .module import SelfAttention
from .ops import attention, attention_varlen, attention_with_kvcache
from .ring import gather_sequence, ring_attention, ring_attention_varlen, shard_sequence
from .warm import warmup

__version__ = package_version(__name__, __file__)

__all__ = ["SelfAttention", "__version__", "attention", "attention_varlen", "attention_with_kvcache", "gather_sequence",
           "ring_attention", "ring_attention_varlen", "shard_sequence", "warmup"]

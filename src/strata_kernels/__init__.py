"""strata_kernels: pure functions on tensors for GGUF weights.

Importing this package does no work: no device probing, no compilation.
"""

from .dequant import SUPPORTED_TYPES, dequantize, dequantize_rows
from .formats import BlockFormat, block_format
from .quant_tensor import QuantTensor

__all__ = [
    "BlockFormat",
    "QuantTensor",
    "SUPPORTED_TYPES",
    "block_format",
    "dequantize",
    "dequantize_rows",
]

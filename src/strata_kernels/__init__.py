"""strata_kernels: pure functions on tensors for GGUF weights.

Importing this package does no work: no device probing, no compilation, and
no import of triton, which loads only when a Triton backend first runs (so the
interpreter can still be switched on, and the package imports where triton is
not installed).
"""

from .attention import attention, write_and_attend
from .dequant import SUPPORTED_TYPES, dequantize
from .experts import ExpertGroups, expert_matmul, expert_matrix, expert_planes, expert_planes_matmul
from .formats import BlockFormat, block_format
from .kv_quant import KV_FORMATS, KVStore, kv_read, kv_write, kv_write_consecutive
from .qmatmul import planes_matmul, prepare_rows, qmatmul
from .quant_tensor import QuantTensor
from .reference import embedding_rows
from .word_planes import WordPlanes, has_word_layout, planes_rows

__all__ = [
    "KV_FORMATS",
    "KVStore",
    "attention",
    "write_and_attend",
    "kv_read",
    "kv_write",
    "kv_write_consecutive",
    "BlockFormat",
    "ExpertGroups",
    "expert_matmul",
    "expert_matrix",
    "expert_planes",
    "expert_planes_matmul",
    "QuantTensor",
    "SUPPORTED_TYPES",
    "block_format",
    "dequantize",
    "embedding_rows",
    "qmatmul",
    "planes_matmul",
    "prepare_rows",
    "WordPlanes",
    "has_word_layout",
    "planes_rows",
]

"""``dequantize``: a QuantTensor to a dense tensor."""

from __future__ import annotations

import torch

from .formats import block_format
from .quant_tensor import QuantTensor
from .reference import DEQUANTIZE_BLOCKS, dequantize_blocks

SUPPORTED_TYPES = frozenset(DEQUANTIZE_BLOCKS)

# Rows per chunk: bounds the float32 temporaries of the byte unpacking to a few
# hundred MB even for a 262K-row embedding.
_CHUNK_BYTES = 16 << 20


def dequantize(qt: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights of ``qt`` as a dense ``dtype`` tensor of shape ``qt.shape``.

    The float32 values equal ``gguf.quants.dequantize`` exactly.
    """
    if qt.qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise NotImplementedError(
            f"dequantizing {qt.qtype.name} is not supported; supported types: {supported}"
        )
    fmt = block_format(qt.qtype)
    out = torch.empty((qt.rows, qt.cols), dtype=dtype, device=qt.device)
    chunk = max(1, _CHUNK_BYTES // max(1, qt.data.shape[1]))
    for start in range(0, qt.rows, chunk):
        rows = qt.data[start:start + chunk]
        blocks = rows.reshape(-1, fmt.type_size)
        values = dequantize_blocks(blocks, qt.qtype).reshape(rows.shape[0], qt.cols)
        out[start:start + chunk] = values.to(dtype)
    return out.reshape(qt.shape)


def dequantize_rows(qt: QuantTensor, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``index`` of a 2-D ``qt``, dequantized: an embedding lookup that
    never expands the whole table."""
    fmt = block_format(qt.qtype)
    rows = qt.data[index.reshape(-1)]
    values = dequantize_blocks(rows.reshape(-1, fmt.type_size), qt.qtype)
    return values.reshape(*index.shape, qt.cols).to(dtype)

"""``dequantize``: a QuantTensor to a dense tensor."""

from __future__ import annotations

import torch

from .backends import resolve_backend
from .formats import FLOAT_TYPES, block_format
from .quant_tensor import QuantTensor
from .reference import DEQUANTIZE_BLOCKS, dequantize_blocks

SUPPORTED_TYPES = frozenset(DEQUANTIZE_BLOCKS)

# Rows per chunk of the torch path: bounds the float32 temporaries of the byte
# unpacking to a few hundred MB even for a 262K-row embedding.
_CHUNK_BYTES = 16 << 20


def dequantize(qt: QuantTensor, dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """The weights of ``qt`` as a dense ``dtype`` tensor of shape ``qt.shape``.

    The float32 values equal ``gguf.quants.dequantize`` exactly (on a GPU,
    FMA contraction may move a value by an ulp). ``backend``: see
    ``backends.resolve_backend``.
    """
    if qt.qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise NotImplementedError(
            f"dequantizing {qt.qtype.name} is not supported; supported types: {supported}"
        )
    chosen = resolve_backend(qt.device, backend)
    if qt.qtype in FLOAT_TYPES:
        chosen = "torch"  # a plain view and a cast, on any device
    if chosen == "triton":
        from ._triton_dequant import dequantize_triton

        return dequantize_triton(qt, dtype)
    if chosen == "cpu":
        from .cpu_kernels import dequantize_cpu

        return dequantize_cpu(qt, dtype)
    fmt = block_format(qt.qtype)
    out = torch.empty((qt.rows, qt.cols), dtype=dtype, device=qt.device)
    chunk = max(1, _CHUNK_BYTES // max(1, qt.data.shape[1]))
    for start in range(0, qt.rows, chunk):
        rows = qt.data[start:start + chunk]
        values = dequantize_blocks(rows.reshape(-1, fmt.type_size), qt.qtype).reshape(rows.shape[0], qt.cols)
        out[start:start + chunk] = values.to(dtype)
    return out.reshape(qt.shape)

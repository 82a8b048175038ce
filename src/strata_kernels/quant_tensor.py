"""The quantized weight as Strata passes it around: GGUF blocks, untouched."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from .formats import block_format


@dataclass(frozen=True)
class QuantTensor:
    """A GGUF tensor as its raw blocks.

    Invariant: ``data`` is a ``uint8`` tensor ``[rows, row_bytes]`` holding the
    GGUF blocks exactly as stored in the file; ``shape`` is the logical shape
    (GGUF ``ne`` reversed, so the last dimension is the row length ``cols``);
    ``rows == prod(shape[:-1])`` and ``row_bytes == cols / block_size *
    type_size``. Nothing is dequantized or repacked here: kernels read these
    bytes as they are.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        fmt = block_format(self.qtype)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(
                f"QuantTensor data must be a 2-D uint8 tensor [rows, row_bytes], "
                f"got {self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1])
        if cols % fmt.block_size:
            raise ValueError(
                f"{fmt.name} rows must be a multiple of its block size {fmt.block_size}, got {cols}"
            )
        want = (rows, cols // fmt.block_size * fmt.type_size)
        if tuple(self.data.shape) != want:
            raise ValueError(
                f"{fmt.name} tensor of shape {self.shape} needs data of shape {want} "
                f"(rows, row_bytes), got {tuple(self.data.shape)}"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> "QuantTensor":
        return QuantTensor(self.data.to(device), self.qtype, self.shape)

    def row_slice(self, start: int, stop: int) -> "QuantTensor":
        """Rows ``[start, stop)`` of a 2-D tensor, sharing storage."""
        if len(self.shape) != 2:
            raise ValueError("row_slice needs a 2-D QuantTensor")
        return QuantTensor(self.data[start:stop], self.qtype, (stop - start, self.shape[1]))

"""A quantized weight laid out for a GPU's wide loads, built once at load
from its GGUF blocks (the file stays the source of truth; CPU paths read the
blocks as they are).

A GGUF block interleaves a 2-byte scale with its codes (Q8_0: 34 bytes per
32 weights), so a kernel reading blocks gathers bytes one at a time. Here
the codes of each row are one run of 32-bit words, 16-byte aligned, and the
scales a plane of their own, stored scale-column-major: the scales of one
block column for every row are contiguous, so a thread that handles
several rows reads their scales in one load.

- Q8_0: ``quants`` int32 ``[rows, cols / 4]``: word ``w`` holds the codes of
  weights ``4w..4w+3`` (byte ``j``: weight ``4w+j``, signed).
- Q4_0: ``quants`` int32 ``[rows, cols / 8]``: the 16 code bytes of each
  block as 4 words, as GGUF stores them (byte ``i`` of the block's bytes:
  weight ``i`` in its low nibble, weight ``16+i`` in its high one; a weight is
  its nibble minus 8).
- ``scales`` float16 ``[cols / 32, rows]``: block ``b``'s scale of row ``r``
  at ``[b, r]``.

Bytes: the same as the blocks' (codes and scales, nothing added).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from .quant_tensor import QuantTensor

BLOCK = 32  # weights per scale in every word layout
# type -> (code bits, bytes of codes per block)
WORD_TYPES = {T.Q8_0: (8, 32), T.Q4_0: (4, 16)}


@dataclass(frozen=True)
class WordPlanes:
    """A 2-D weight ``[rows, cols]`` as code words and a scale plane.

    Invariant: ``quants`` is contiguous int32 ``[rows, cols * bits / 32]``
    (``bits`` the type's code width) and ``scales`` contiguous float16
    ``[cols / 32, rows]``, both on one device; ``cols`` is a multiple of 32."""

    qtype: T
    rows: int
    cols: int
    quants: torch.Tensor
    scales: torch.Tensor

    @property
    def bits(self) -> int:
        return WORD_TYPES[self.qtype][0]

    @property
    def words_per_row(self) -> int:
        return self.quants.shape[1]

    @property
    def nbytes(self) -> int:
        return self.quants.numel() * 4 + self.scales.numel() * 2

    @property
    def device(self) -> torch.device:
        return self.quants.device

    @classmethod
    def of(cls, qt: QuantTensor) -> "WordPlanes":
        """``qt``'s blocks split into code words and scales, on ``qt``'s device."""
        if qt.qtype not in WORD_TYPES:
            raise ValueError(f"{qt.qtype.name} has no word layout; types with one: "
                             f"{', '.join(t.name for t in WORD_TYPES)}")
        if len(qt.shape) != 2:
            raise ValueError(f"word planes hold a 2-D weight, got shape {qt.shape}")
        _, code_bytes = WORD_TYPES[qt.qtype]
        blocks = qt.data.view(qt.rows, qt.cols // BLOCK, 2 + code_bytes)
        scales = blocks[:, :, :2].contiguous().view(torch.float16).view(qt.rows, -1).t().contiguous()
        quants = blocks[:, :, 2:].contiguous().view(qt.rows, -1).view(torch.int32)
        return cls(qt.qtype, qt.rows, qt.cols, quants, scales)


def dequantize_planes(planes: WordPlanes) -> torch.Tensor:
    """float32 ``[rows, cols]``: the torch reference of the layout (equal to
    the blocks' dequantization, bit for bit)."""
    codes = planes.quants.contiguous().view(torch.uint8).view(planes.rows, planes.cols // BLOCK, -1)
    if planes.qtype == T.Q8_0:
        q = codes.view(torch.int8).float()
    else:
        low, high = (codes & 0x0F).float() - 8, (codes >> 4).float() - 8
        q = torch.cat([low, high], dim=-1)
    d = planes.scales.t().float().unsqueeze(-1)
    return (d * q).reshape(planes.rows, planes.cols)

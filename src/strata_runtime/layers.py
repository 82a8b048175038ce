"""Building blocks shared by the model files: linear layers and embeddings
over GGUF weights, RMSNorm, rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata_kernels import QuantTensor, dequantize, embedding_rows, qmatmul


def keeps_blocks(weight: QuantTensor) -> bool:
    """Weights on a GPU stay as GGUF blocks and run through the Triton kernels;
    on the CPU they are dequantized once, at load time."""
    return weight.device.type == "cuda"


class Linear(nn.Module):
    """``y = x @ W.T`` for a GGUF weight of logical shape ``[out, in]``.

    Invariant: exactly one of ``qweight`` (the GGUF blocks, on a GPU, read by
    ``qmatmul`` without a dense copy) and ``weight`` (the exact dequantization
    in ``dtype``, on the CPU) is set.
    """

    def __init__(self, weight: QuantTensor, dtype: torch.dtype):
        super().__init__()
        if keeps_blocks(weight):
            self.qweight: QuantTensor | None = weight
            self.weight = None
        else:
            self.qweight = None
            self.weight = nn.Parameter(dequantize(weight, dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.linear(x, self.weight)
        flat = x.reshape(-1, x.shape[-1])
        return qmatmul(flat, self.qweight).reshape(*x.shape[:-1], self.qweight.rows)


class TiedEmbedding(nn.Module):
    """The token table, used both to embed tokens and, transposed, to score
    them. Same storage rule as ``Linear``: GGUF blocks on a GPU (rows are
    dequantized as they are looked up), the exact dense table on the CPU."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype):
        super().__init__()
        self.out = Linear(weight, dtype)
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.out.qweight is None:
            return self.out.weight[tokens]
        return embedding_rows(self.out.qweight, tokens, self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class RMSNorm(nn.Module):
    """RMSNorm whose GGUF weight is the full multiplier (converters fold in
    the ``1 +`` that Gemma's checkpoints keep separately)."""

    def __init__(self, weight: QuantTensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(dequantize(weight).reshape(-1), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


def rope_inverse_frequencies(head_dim: int, base: float, linear_scale: float = 1.0) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents) / linear_scale


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NEOX-style rotary embedding (halves rotated) of ``x`` ``[T, heads, dim]``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    cos = angles.cos()[:, None, :].to(x.dtype)
    sin = angles.sin()[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")

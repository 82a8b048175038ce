"""Building blocks shared by the model files: linear layers and embeddings
over GGUF weights, RMSNorm, rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata_kernels import QuantTensor, dequantize, embedding_rows, qmatmul


def keeps_blocks(weight: QuantTensor) -> bool:
    """Weights on a GPU stay as GGUF blocks and run through the Triton kernels;
    on the CPU they are dequantized once, at load time. On the meta device
    (a weight another process of a split holds) they stay a shape: no bytes."""
    return weight.device.type in ("cuda", "meta")


def cpu_fast_path(weight: QuantTensor, dtype: torch.dtype) -> bool:
    """bfloat16 on the CPU is the fast path: dense bfloat16 weights, and the
    output head (most of a decode step's bytes) as grouped int8."""
    return weight.device.type == "cpu" and dtype == torch.bfloat16


# Up to this many rows of x, grouped int8 weights are multiplied as they are
# (torch's int8-weight kernel, once per group); above it, a bf16 copy of a
# slab of weight rows is made and fed to the bf16 GEMM. On the head, 2 cores:
# 84 ms against 138 at M=16, 287 against 110 at M=64 (bench/cpu_matmul.py).
INT8_MATVEC_MAX_ROWS = 24
# Weight rows dequantized at a time on the GEMM side (bounds the temporary).
DEQUANT_SLAB_ROWS = 16384
# Columns sharing one int8 scale. Per-row scales (one group) cost Gemma 3
# 270M KL 0.029 on the head alone; groups of 128 cost 0.011 with the rest in
# bf16, and five int8 kernel calls still read the head in 13 ms against
# 22 ms for bf16 on 2 cores (issue 8's note has the figures).
INT8_GROUP = 128


class Int8Groups(nn.Module):
    """A weight ``[out, in]`` as int8 codes in column groups of ``INT8_GROUP``,
    each group with one bfloat16 scale per row.

    Invariant: ``codes[g][r] * scales[g][r]`` is row ``r`` of columns
    ``g*group .. (g+1)*group-1`` to within half a step (``scale = max |x| /
    127`` over those values; all-zero groups have scale 1). Each group's codes
    are contiguous, as torch's int8 kernel wants.
    """

    def __init__(self, rows: int, cols: int, group: int = INT8_GROUP):
        super().__init__()
        self.group = group
        self.rows = rows
        widths = [min(group, cols - g0) for g0 in range(0, cols, group)]
        self.codes = [torch.zeros(rows, w, dtype=torch.int8) for w in widths]
        self.scales = [torch.ones(rows, dtype=torch.bfloat16) for _ in widths]

    @classmethod
    def from_dense(cls, dense: torch.Tensor, group: int = INT8_GROUP) -> "Int8Groups":
        out = cls(dense.shape[0], dense.shape[1], group)
        out._fill(0, dense.float())
        return out

    @classmethod
    def from_blocks(cls, weight: QuantTensor, group: int = INT8_GROUP) -> "Int8Groups":
        """Repack GGUF blocks a slab of rows at a time, so loading never holds
        the whole table in float32 (671 MB for Gemma 3's head)."""
        out = cls(weight.rows, weight.cols, group)
        for r0 in range(0, weight.rows, DEQUANT_SLAB_ROWS):
            part = QuantTensor(weight.data[r0:r0 + DEQUANT_SLAB_ROWS], weight.qtype,
                               (min(DEQUANT_SLAB_ROWS, weight.rows - r0), weight.cols))
            out._fill(r0, dequantize(part, torch.float32))
        return out

    def _fill(self, first_row: int, dense: torch.Tensor) -> None:
        rows = slice(first_row, first_row + dense.shape[0])
        for g, (codes, scales) in enumerate(zip(self.codes, self.scales)):
            part = dense[:, g * self.group:(g + 1) * self.group]
            scale = part.abs().amax(dim=1) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
            codes[rows] = torch.round(part / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            scales[rows] = scale

    def dense(self, rows: slice | torch.Tensor = slice(None), dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The selected rows, dequantized."""
        return torch.cat([c[rows].to(dtype) * s[rows, None].to(dtype) for c, s in zip(self.codes, self.scales)],
                         dim=-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for bfloat16 ``x`` ``[M, in]``, by the faster side for M."""
        return self.int8_kernel_matmul(x) if x.shape[0] <= INT8_MATVEC_MAX_ROWS else self.slab_matmul(x)

    def int8_kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Torch's int8-weight kernel, once per column group, summed."""
        out = None
        for g, (c, s) in enumerate(zip(self.codes, self.scales)):
            part = torch._weight_int8pack_mm(x[:, g * self.group:(g + 1) * self.group].contiguous(), c, s)
            out = part if out is None else out.add_(part)
        return out

    def slab_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 GEMM over slabs of rows dequantized on the fly."""
        slabs = [F.linear(x, self.dense(slice(r, r + DEQUANT_SLAB_ROWS)))
                 for r in range(0, self.rows, DEQUANT_SLAB_ROWS)]
        return torch.cat(slabs, dim=-1)


class Linear(nn.Module):
    """``y = x @ W.T`` for a GGUF weight of logical shape ``[out, in]``.

    Invariant: exactly one of ``qweight`` (the GGUF blocks, on a GPU, read by
    ``qmatmul`` without a dense copy), ``int8`` (grouped int8, asked for by
    the caller on the fast CPU path) and ``weight`` (the dequantization in
    ``dtype`` on the CPU, exact for float32) is set.
    """

    def __init__(self, weight: QuantTensor, dtype: torch.dtype, int8: bool = False):
        super().__init__()
        self.qweight: QuantTensor | None = None
        self.int8: Int8Groups | None = None
        self.weight = None
        if keeps_blocks(weight):
            self.qweight = weight
        elif int8:
            self.int8 = Int8Groups.from_blocks(weight)
        else:
            self.weight = nn.Parameter(dequantize(weight, dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        flat = x.reshape(-1, x.shape[-1])
        if self.int8 is not None:
            return self.int8.matmul(flat).reshape(*x.shape[:-1], self.int8.rows)
        return qmatmul(flat, self.qweight).reshape(*x.shape[:-1], self.qweight.rows)


class TiedEmbedding(nn.Module):
    """The token table, used both to embed tokens and, transposed, to score
    them. Same storage rule as ``Linear``: GGUF blocks on a GPU (rows are
    dequantized as they are looked up), grouped int8 on the fast CPU path,
    the exact dense table otherwise."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype):
        super().__init__()
        self.out = Linear(weight, dtype, int8=cpu_fast_path(weight, dtype))
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.out.weight is not None:
            return self.out.weight[tokens]
        if self.out.int8 is not None:
            return self.out.int8.dense(tokens, self.dtype)
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


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, 1, dim]`` for ``apply_rope`` (made once per layer call,
    shared by its queries and keys)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos()[:, None, :].to(dtype), angles.sin()[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX-style rotary embedding (halves rotated) of ``x`` ``[T, heads, dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")

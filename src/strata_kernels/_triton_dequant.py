"""Triton dequantization of GGUF blocks (imported only when the Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_unpack import TRITON_TABLES, weight_tile
from .formats import lookup_table
from .launch_plans import dequantize_launch
from .quant_tensor import QuantTensor


@triton.jit
def _dequantize_kernel(
    blocks, out, N, K, row_bytes, stride_out,
    grid_ptr, signs_ptr, values_ptr,
    QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # blocks: uint8 [N, row_bytes], rows contiguous at stride row_bytes
    # out:    [N, K] (float32/16, bf16), row stride stride_out, unit column stride
    # grid:   (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); program (pn, pk) writes
    #         rows pn*BLOCK_N.. and columns pk*BLOCK_K.. of out
    pn = tl.program_id(0).to(tl.int64)
    pk = tl.program_id(1).to(tl.int64)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)[:, None]
    k = pk * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)[None, :]
    inside = (n < N) & (k < K)
    w = weight_tile(blocks, row_bytes, tl.minimum(n, N - 1), tl.minimum(k, K - 1),
                    grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS, OFFSET)
    tl.store(out + n * stride_out + k, w.to(out.dtype.element_ty), mask=inside)


def table_args(qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookup tables a type reads, on the weight's device (a 1-byte
    placeholder where a type reads none)."""
    names = TRITON_TABLES.get(int(qt.qtype))
    if names is None:
        raise NotImplementedError(f"no Triton kernel reads {qt.qtype.name}")
    placeholder = torch.zeros(1, dtype=torch.uint8, device=qt.device)
    return tuple(lookup_table(name, qt.device) if name else placeholder for name in names)


def dequantize_triton(qt: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = qt.rows, qt.cols
    out = torch.empty((n, k), dtype=dtype, device=qt.device)
    launch = dequantize_launch(qt.qtype, n, k)
    c = launch.constexprs
    grid = (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(k, c["BLOCK_K"]))
    _dequantize_kernel[grid](qt.data, out, n, k, qt.data.stride(0), out.stride(0), *table_args(qt), **c,
                             num_warps=launch.num_warps)
    return out.reshape(qt.shape)

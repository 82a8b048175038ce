"""Triton dequantization of ``word_planes.WordPlanes`` into a dense matrix of
the activations' dtype: a prompt's matmuls read the planes once into a
reused scratch and run on the tensor cores as a dense ``torch.matmul``
(imported only when the Triton backend runs).

Each program writes ``BLOCK_N`` rows by ``BLOCK_B`` blocks of 32 weights;
the codes are read as bytes (16 of a block's nibbles or 32 of Q8_0's), the
weights computed as ``torch`` computes them in ``dequantize_planes`` (the
same products in the same order), and each block's two halves stored
(weights 0..15 from the low nibbles, 16..31 from the high ones).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from .formats import lookup_table
from .launch_plans import planes_dequant_launch
from .word_planes import BLOCK, WordPlanes


@triton.jit
def _half(codes, high_words, levels, n, b, i, KB, HALF: tl.constexpr, KIND: tl.constexpr):
    """The integer (or codebook value) of weights ``16 * HALF + i`` of blocks
    ``b`` of rows ``n``, from their nibbles ``codes`` ``[N, B, 16]``."""
    if KIND == 3 or KIND >= 7:  # Q5_K, Q5_0, Q5_1: bit i // 4 (+ 4 for the low half) of byte i % 4 of the
        # block's high word
        h = tl.load(high_words + n[:, None, None] * KB + b[None, :, None])
        codes |= ((h >> (8 * (i % 4) + i // 4 + 4 - 4 * HALF)) & 1) << 4
    if KIND == 4:  # Q6_K: bits 2 (i // 4) of byte i % 4 of the half's word, top bit flipped
        h = tl.load(high_words + n[:, None, None] * (2 * KB) + b[None, :, None] * 2 + HALF)
        two = ((h >> (8 * (i % 4) + 2 * (i // 4))) & 3) ^ 2
        codes = (codes | (two << 4)) - 32
    if KIND == 5:
        return tl.load(levels + codes)
    if KIND == 1:
        codes -= 8
    return codes.to(tl.float32)


@triton.jit
def _dequantize_planes_kernel(
    quants, scales, high_words, sub, supers, levels, out, N, K, KB,
    KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # quants: the planes' codes as bytes [N, K] (Q8_0) or [N, K / 2]; out: [N, K] (row-major)
    # scales: float16 [KB, N] (Q8_0, Q4_0); high_words, sub, supers as in _gemv_superblock_kernel (Q4_1, Q5_0,
    #         Q5_1: supers [KB, N], no sub)
    # levels: IQ4's 16 codebook values (float32)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_in = n < N
    b_in = b < KB
    n_safe = tl.where(n_in, n, 0)
    b_safe = tl.where(b_in, b, 0)
    i = tl.arange(0, 16)
    ok = n_in[:, None, None] & b_in[None, :, None]
    row = n_safe.to(tl.int64)[:, None, None]
    at = row * K + b_safe[None, :, None] * 32 + i[None, None, :]  # weight 16 * half + i of each block
    if KIND == 0:  # Q8_0: the bytes are the codes, in order
        low = tl.load(quants + row * K + b_safe[None, :, None] * 32 + i[None, None, :]).to(tl.float32)
        high = tl.load(quants + row * K + b_safe[None, :, None] * 32 + 16 + i[None, None, :]).to(tl.float32)
    else:
        byte = tl.load(quants + row * (K // 2) + b_safe[None, :, None] * 16 + i[None, None, :]).to(tl.int32) & 0xFF
        low = _half(byte & 0x0F, high_words, levels, n_safe, b_safe, i[None, None, :], KB, 0, KIND)
        high = _half(byte >> 4, high_words, levels, n_safe, b_safe, i[None, None, :], KB, 1, KIND)
    if KIND <= 1:
        d = tl.load(scales + b_safe[None, :] * N + n_safe[:, None]).to(tl.float32)[:, :, None]
        low = d * low
        high = d * high
    elif KIND >= 6:  # Q4_1, Q5_0, Q5_1: d x code - dmin x the type's min, d and dmin per block
        sup = tl.load(supers + b_safe[None, :] * N + n_safe[:, None])
        d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        ml = dmin * (16.0 if KIND == 7 else 1.0)
        low = d * low - ml
        high = d * high - ml
    else:
        s = tl.load(sub + b_safe[None, :] * N + n_safe[:, None]).to(tl.int32)
        sup = tl.load(supers + (b_safe // 8)[None, :] * N + n_safe[:, None])
        d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if KIND == 4:  # Q6_K: a signed scale per half
            low = (d * ((s << 24) >> 24).to(tl.float32))[:, :, None] * low
            high = (d * (s >> 8).to(tl.float32))[:, :, None] * high
        elif KIND == 5:  # IQ4_XS: the scale less 32, signed
            low = (d * s.to(tl.float32))[:, :, None] * low
            high = (d * s.to(tl.float32))[:, :, None] * high
        else:  # Q4_K, Q5_K: d x scale x code - dmin x min
            dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dl = (d * (s & 0xFF).to(tl.float32))[:, :, None]
            ml = (dmin * ((s >> 8) & 0xFF).to(tl.float32))[:, :, None]
            low = dl * low - ml
            high = dl * high - ml
    tl.store(out + at, low.to(out.dtype.element_ty), mask=ok)
    tl.store(out + at + 16, high.to(out.dtype.element_ty), mask=ok)


def dequantize_planes_into(planes: WordPlanes, out: torch.Tensor) -> torch.Tensor:
    """``planes``' weights written into ``out`` (``[rows, cols]``, any float
    dtype, on the planes' device), which is returned."""
    if out.shape != (planes.rows, planes.cols) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{planes.rows}, {planes.cols}], got {tuple(out.shape)}")
    if planes.kind.grid:
        from ._triton_gemv_grid import dequantize_grid_into

        return dequantize_grid_into(planes, out)
    launch = planes_dequant_launch(int(planes.qtype))
    c = launch.constexprs
    kb = planes.cols // BLOCK
    codes = planes.quants.view(torch.int8 if planes.qtype == T.Q8_0 else torch.uint8)
    empty = planes.quants  # a placeholder (int32) for the planes a type has not
    _dequantize_planes_kernel[(triton.cdiv(planes.rows, c["BLOCK_N"]), triton.cdiv(kb, c["BLOCK_B"]))](
        codes, planes.scales if planes.scales is not None else empty,
        planes.high if planes.high is not None else empty,
        planes.sub if planes.sub is not None else empty,
        planes.supers if planes.supers is not None else empty,
        lookup_table("iq4nl_values", planes.device), out, planes.rows, planes.cols, kb,
        **c, num_warps=launch.num_warps,
    )
    return out

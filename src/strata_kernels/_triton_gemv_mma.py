"""Triton GEMV for a decode step of 2 to 8 rows over ``word_planes.WordPlanes``
on the tensor cores (imported only when the Triton backend runs).

At one row the word GEMV's ``dp2a`` products cost about as much as the
weights' loads; at eight they cost eight times as much (300-600 instructions
a KiB of weights on sm_90, where the memory allows about 128). Here the
weights become float16 in registers instead, a word of codes at a time (the
1024-offset trick: a code as a float16 mantissa under a fixed exponent, the
offset subtracted exactly), are scaled per block, and multiply x on the
tensor cores, x padded to 16 rows: the products cost one ``mma`` a 16 x 16
tile, and the weights' conversion about 1.5 instructions a weight.

x is prepared once per call: each row scaled by its largest magnitude into
[-1, 1] and rounded to float16 (11 bits: the tensor cores' operand), laid out
``[K, 16]`` (column ``m`` is row ``m``), the scales kept to multiply the
output. Types: Q8_0 (KIND 0), Q4_0 (1), Q4_K (2); the others stay on the word
GEMV (their high bits and codebooks are not converted here yet).

``USE_ASM`` picks the conversions through inline PTX, or plain Triton
conversions of the same values, which the interpreter runs: equal, as the
conversions are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ._triton_convert import bytes_to_f16, nibbles_to_f16
from .launch import split_k
from .launch_plans import MMA_KINDS, gemv_mma_launch
from .word_planes import BLOCK, WordPlanes

X_ROWS = 16  # x padded to the tensor cores' smallest tile


@triton.jit
def _gemv_mma_kernel(
    xt, xscale, quants, scales, sub, supers, out, M, N, KB, blocks_per_split,
    KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, USE_ASM: tl.constexpr,
):
    # xt:      float16 [K, 16]: x's rows scaled into [-1, 1], column m row m (zeros past M); xscale
    #          float32 [16] their scales
    # quants:  the planes' codes as bytes, [N, K] (Q8_0: int8) or [N, K / 2] (uint8, Q4_0 order)
    # scales:  float16 [KB, N] (Q8_0, Q4_0); sub int16 [KB, N] and supers int32 [KB / 8, N] (Q4_K)
    # out:     float32 [splits, M, N]; grid (cdiv(N, BLOCK_N), splits): rows pn*BLOCK_N.. over blocks
    #          ps*blocks_per_split.. of 32 weights, BLOCK_B at a time: each block's weights 0..15 (the
    #          low nibbles) and 16..31 (the high) as two [BLOCK_N, BLOCK_B * 16] float16 tiles, each
    #          times the matching 16-row slices of x
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    n_safe = tl.where(n_in, n, 0)
    i = tl.arange(0, 16)
    bb = tl.arange(0, BLOCK_B)
    k = tl.arange(0, BLOCK_B * 16)
    m = tl.arange(0, 16)
    b_start = ps * blocks_per_split
    b_stop = tl.minimum(b_start + blocks_per_split, KB)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for b0 in range(b_start, b_stop, BLOCK_B):
        b = b0 + bb
        if KIND == 0:
            at = n_safe[:, None, None].to(tl.int64) * (KB * 32) + b[None, :, None] * 32 + i[None, None, :]
            low = bytes_to_f16(tl.load(quants + at), USE_ASM)
            high = bytes_to_f16(tl.load(quants + at + 16), USE_ASM)
        else:
            at = n_safe[:, None, None].to(tl.int64) * (KB * 16) + b[None, :, None] * 16 + i[None, None, :]
            low, high = nibbles_to_f16(tl.load(quants + at), 8 if KIND == 1 else 0, USE_ASM)
        if KIND <= 1:
            d = tl.load(scales + b[None, :] * N + n_safe[:, None])[:, :, None]
            low = low * d
            high = high * d
        else:  # Q4_K: d x scale x code - dmin x min, the block's scale and min made once in float32
            s = tl.load(sub + b[None, :] * N + n_safe[:, None]).to(tl.int32)
            sup = tl.load(supers + (b // 8)[None, :] * N + n_safe[:, None])
            d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            scale = (d * (s & 0xFF).to(tl.float32)).to(tl.float16)[:, :, None]
            offset = (dmin * ((s >> 8) & 0xFF).to(tl.float32)).to(tl.float16)[:, :, None]
            low = low * scale - offset
            high = high * scale - offset
        row = (b0 + k // 16) * 32 + k % 16  # x's rows for the low halves; the high ones are 16 further
        x_low = tl.load(xt + row[:, None] * 16 + m[None, :])
        x_high = tl.load(xt + (row + 16)[:, None] * 16 + m[None, :])
        acc = tl.dot(low.reshape(BLOCK_N, BLOCK_B * 16), x_low, acc)
        acc = tl.dot(high.reshape(BLOCK_N, BLOCK_B * 16), x_high, acc)
    sx = tl.load(xscale + m)
    tl.store(out + (ps * M + m[None, :]) * N + n[:, None], acc * sx[None, :], mask=n_in[:, None] & (m < M)[None, :])


def prepare_mma(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (M <= 16) as the kernel reads it: ``[K, 16]`` float16 of
    each row over its largest magnitude, and those magnitudes ``[16]``."""
    m, k = x.shape
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    xt = torch.zeros((k, X_ROWS), dtype=torch.float16, device=x.device)
    xt[:, :m] = (xf / scale[:, None]).T.to(torch.float16)
    scales = torch.zeros(X_ROWS, dtype=torch.float32, device=x.device)
    scales[:m] = scale
    return xt, scales


def gemv_mma(x: torch.Tensor, planes: WordPlanes, prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
             splits: int | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (2 <= M <= 8 the intended rows; any
    M <= 16 works), in ``x``'s dtype."""
    m, k = x.shape
    if planes.qtype not in MMA_KINDS:
        raise ValueError(f"{planes.qtype.name} has no tensor-core GEMV; types with one: "
                         f"{', '.join(t.name for t in MMA_KINDS)}")
    if k != planes.cols or m > X_ROWS:
        raise ValueError(f"x must be [M <= {X_ROWS}, {planes.cols}], got {tuple(x.shape)}")
    launch = gemv_mma_launch(int(planes.qtype))
    block_n, block_b = launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_B"]
    kb = k // BLOCK
    xt, xscale = prepared if prepared is not None else prepare_mma(x)
    n_tiles = triton.cdiv(planes.rows, block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        splits = split_k(n_tiles, kb, block_b, sms)
    per_split = triton.cdiv(triton.cdiv(kb, splits), block_b) * block_b
    splits = triton.cdiv(kb, per_split)
    if kb % block_b:
        raise ValueError(f"{kb} blocks of 32 a row are not whole tiles of {block_b}")
    out = torch.empty((splits, m, planes.rows), dtype=torch.float32, device=x.device)
    codes = planes.quants.view(torch.int8 if planes.qtype == T.Q8_0 else torch.uint8)
    empty = planes.quants
    _gemv_mma_kernel[(n_tiles, splits)](
        xt, xscale, codes, planes.scales if planes.scales is not None else empty,
        planes.sub if planes.sub is not None else empty, planes.supers if planes.supers is not None else empty,
        out, m, planes.rows, kb, per_split,
        **{**launch.constexprs, "USE_ASM": x.is_cuda if use_asm is None else use_asm}, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out.sum(dim=0).to(x.dtype)

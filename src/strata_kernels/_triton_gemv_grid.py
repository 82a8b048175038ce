"""Triton kernels over the planes of the grid types (IQ3_S, IQ2_XXS;
``word_planes``): the word GEMV of a decode step and the dequantization of
a prompt's dense matmul (imported only when the Triton backend runs).

A grid type's weights are codebook indices: each index names 4 (IQ3_S) or
8 (IQ2_XXS) unsigned levels in a small table (2 KiB), and a sign bit per
weight negates its level. A thread reads its rows' index and sign words 16
bytes at a time, looks each index's level word up in the table (a load the
L1 cache serves, marked ``evict_last``: the table stays there while the
planes stream past, and ``sass.loop_figures`` counts such loads as lookups,
not as streamed bytes), turns the 4 sign bits of a level word into byte
masks and the levels into signed bytes. The products are then those of a
Q8_0 word: x's 16-bit codes in pairs (``_triton_gemv_words.prepare``'s "8"
pairing) times the signed bytes by ``dp2a``, partial sums in registers, one
reduction after the loop, split K. llama.cpp's CUDA kernels read the grid
the same way (``iq3s_grid``, ``iq2xxs_grid`` in global memory, ``dp4a``).

A tile is ``[M, N, C, 2, 4]``: rows of x, rows of the weight, chunks of 32
weights, and each chunk's 8 level words as 2 x 4 (word ``w = 4h + j``
holds weights ``4w..4w+3``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_gemv_common import _dp2a, _dp2a_first, _group, _new_out
from .launch_plans import grid_dequant_launch
from .word_planes import BLOCK, WordPlanes, grid_words


@triton.jit
def _signed(levels, ones):
    """A word of 4 unsigned levels (each at least 1) with byte ``e`` negated
    where bit 0 of byte ``e`` of ``ones`` is set (its other bits clear):
    ``(levels ^ 0xFF) + 1`` per byte, which never carries out of its byte."""
    return (levels ^ (ones * 255)) + ones


@triton.jit
def _parity7(s, USE_ASM: tl.constexpr):
    """Bit 0: the parity of ``s``'s low 7 bits (IQ2_XXS's implied eighth sign)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [s], dtype=tl.int32, is_pure=True, pack=1)
    p = s ^ (s >> 4)
    p ^= p >> 2
    return p ^ (p >> 1)


@triton.jit
def _lookup(table, index, USE_ASM: tl.constexpr):
    """``table[index]`` (int32), a load the L1 cache keeps (evict-last). In
    PTX where ``USE_ASM``: a ``tl.load`` of a gather gets a layout of its own
    (one word a thread) and a conversion through shared memory to meet the
    products' layout; an elementwise instruction stays in that layout."""
    if USE_ASM:
        return tl.inline_asm_elementwise("ld.global.nc.L1::evict_last.b32 $0, [$1];", "=r,l", [table + index],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return tl.load(table + index, eviction_policy="evict_last")


@triton.jit
def _level_words(quants, grid, q_row, c, h, j, s, w, KIND: tl.constexpr, USE_ASM: tl.constexpr):
    """The signed-byte level words ``[N, C, 2, 4]`` of chunks ``c`` ``[1, C,
    1, 1]`` of the rows whose offset in chunks is ``q_row`` ``[N, 1, 1, 1]``,
    from each chunk's high word ``w`` ``[N, C, 1, 1]`` (IQ3_S's sign word,
    IQ2_XXS's sign and scale word) and IQ3_S's sub word ``s`` (the same shape)."""
    if KIND == 0:  # IQ3_S: 2 index words a chunk; level word k draws on index k, its ninth bit in sub
        k = 4 * h + j
        q = tl.load(quants + q_row * 2 + c * 2 + h)  # [N, C, 2, 1]
        index = ((q >> (8 * j)) & 0xFF) | ((s >> k) & 0x100)  # the ninth bit: bit 8 + k of sub
        levels = _lookup(grid, index, USE_ASM)
        return _signed(levels, (w >> k) & 0x01010101)  # the sign word's bit 8e + k: weight 4k + e
    k = 2 * h + j // 2  # IQ2_XXS: one index word a chunk; index k covers words 2k, 2k + 1
    q = tl.load(quants + q_row + c)  # [N, C, 1, 1]
    index = (q >> (8 * k)) & 0xFF
    levels = _lookup(grid, index * 2 + (j % 2), USE_ASM)
    seven = (w >> (7 * k)) & 0x7F
    eight = seven | ((_parity7(seven, USE_ASM) & 1) << 7)
    nibble = (eight >> (4 * (j % 2))) & 0xF
    return _signed(levels, (nibble * 0x00204081) & 0x01010101)  # bit e of the nibble to bit 0 of byte e


@triton.jit
def _odd_scale(s, w, KIND: tl.constexpr):
    """Each chunk's scale as the odd integer ``1 + 2 scale`` (IQ3_S from its
    sub word ``s``, IQ2_XXS from its high word ``w``: GGUF's ``0.5 + scale``
    doubled)."""
    if KIND == 0:
        return 2 * (s & 0xF) + 1
    return 2 * ((w >> 28) & 0xF) + 1


@triton.jit
def _gemv_grid_kernel(
    xw, xmeta, quants, high_words, sub, supers, grid, out, groups, M, N, STRIDE, WPR, KB, chunks_per_split,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # KIND 0 IQ3_S, 1 IQ2_XXS. x as _gemv_words_kernel reads Q8_0's (xw [rows, K / 16, 2, 4]), xmeta
    # [rows, KB, 2]; quants int32 [N, WPR] (WPR = KB * 2 or KB), high_words int32 [N, KB], sub int16 [KB, N]
    # (IQ3_S), supers int32 [KB / 8, N] (d); grid int32 (grid_words); groups, out and the grid of programs as
    # _gemv_words_kernel's, a chunk here being 32 weights. BLOCK_C divides 8: an iteration's chunks share
    # a superblock's d.
    ps = tl.program_id(1)
    n, n_in, n_safe, row0, first, m, m_in = _group(groups, N, BLOCK_N, BLOCK_M)
    c = tl.arange(0, BLOCK_C)
    h = tl.arange(0, 2)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    c_start = ps * chunks_per_split
    c_stop = tl.minimum(c_start + chunks_per_split, KB)
    quants += row0.to(tl.int64) * WPR
    high_words += row0.to(tl.int64) * KB
    q_row = n_safe[:, None, None, None] * KB
    w_off = n_safe[:, None] * KB + c[None, :]
    # x's words for word 4h + j of chunk c: pair plane p of Q8_0's 16-weight chunk 2c + h, lane j
    x_off = ((((first + m)[:, None, None, None, None] * (2 * KB) + 2 * c[None, None, :, None, None]
               + h[None]) * 8 + j[None]) + tl.zeros([BLOCK_N], tl.int32)[None, :, None, None, None])
    meta_off = ((first + m)[:, None] * KB + c[None, :]) * 2
    sub_off = c[None, :] * STRIDE + row0 + n_safe[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_C), dtype=tl.float32)
    for c0 in range(c_start, c_stop, BLOCK_C):
        w = tl.load(high_words + w_off + c0)  # [N, C]
        s = tl.load(sub + sub_off + c0 * STRIDE).to(tl.int32) if KIND == 0 else w  # (IQ2_XXS: unused)
        value = _level_words(quants, grid, q_row, c[None, :, None, None] + c0, h, j, s[:, :, None, None],
                             w[:, :, None, None], KIND, USE_ASM)
        scale = _odd_scale(s, w, KIND)
        x_at = xw + x_off + c0 * 16
        dot = _dp2a_first(tl.load(x_at), value[None], False, USE_ASM)
        dot = _dp2a(tl.load(x_at + 4), value[None], dot, True, USE_ASM)
        total = tl.sum(tl.sum(dot, axis=4), axis=3).to(tl.float32)  # [M, N, C]
        sup = tl.load(supers + (c0 // 8) * STRIDE + row0 + n_safe)
        d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if KIND == 1:
            d = d * 0.125
        sx = tl.load(xmeta + meta_off + c0 * 2)[:, None, :]
        acc += total * (d[:, None] * scale.to(tl.float32))[None, :, :] * sx
    result = tl.sum(acc, axis=2)
    tl.store(out + (ps * M + first + m[:, None]) * N + n[None, :], result, mask=m_in[:, None] & n_in[None, :])


@triton.jit
def _dequantize_grid_kernel(quants, high_words, sub, supers, grid, out, N, K, KB,
                            KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    # The planes of a grid type (as _gemv_grid_kernel reads them) into out [N, K], BLOCK_N rows by BLOCK_B
    # chunks of 32 weights a program; the products reference forms, in its order: (d x scale) x level x sign.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_safe = tl.where(n < N, n, 0)
    b_safe = tl.where(b < KB, b, 0)
    h = tl.arange(0, 2)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    w = tl.load(high_words + n_safe[:, None] * KB + b_safe[None, :])  # [N, B]
    s = tl.load(sub + b_safe[None, :] * N + n_safe[:, None]).to(tl.int32) if KIND == 0 else w
    value = _level_words(quants, grid, n_safe[:, None, None, None] * KB, b_safe[None, :, None, None], h, j,
                         s[:, :, None, None], w[:, :, None, None], KIND, False)
    scale = _odd_scale(s, w, KIND)
    sup = tl.load(supers + (b_safe // 8)[None, :] * N + n_safe[:, None])
    d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if KIND == 0:
        db = d * scale.to(tl.float32)
    else:  # GGUF's d x (0.5 + scale) x 0.25, rounded as it rounds
        db = d * (scale.to(tl.float32) * 0.5) * 0.25
    e = tl.arange(0, 4)[None, None, None, None, :]
    weights = db[:, :, None, None, None] * ((value[:, :, :, :, None] << (24 - 8 * e)) >> 24).to(tl.float32)
    at = (n_safe.to(tl.int64)[:, None, None, None, None] * K + b_safe[None, :, None, None, None] * 32
          + (4 * h + j)[:, :, :, :, None] * 4 + e)
    ok = (n < N)[:, None, None, None, None] & (b < KB)[None, :, None, None, None]
    tl.store(out + at, weights.to(out.dtype.element_ty), mask=ok)


def _sub(planes: WordPlanes) -> torch.Tensor:
    return planes.sub if planes.sub is not None else planes.quants  # IQ2_XXS: a placeholder it never reads


def gemv_grid_launch(x, planes: WordPlanes, prepared, groups, n, grid, splits, constexprs, num_warps) -> torch.Tensor:
    """``_gemv_grid_kernel`` over ``grid`` programs (``_triton_gemv_words._launch`` made the rest): the
    splits' partial sums ``[splits, M, n]``."""
    xw, xmeta = prepared
    m = x.shape[0]
    out = _new_out(splits[0], m, n, grid[2], x.device)
    _gemv_grid_kernel[grid](xw, xmeta, planes.quants, planes.high, _sub(planes), planes.supers,
                            grid_words(planes.qtype, planes.device), out, groups, m, n, planes.rows,
                            planes.words_per_row, planes.cols // BLOCK, splits[1],
                            **constexprs, num_warps=num_warps)
    return out


def dequantize_grid_into(planes: WordPlanes, out: torch.Tensor) -> torch.Tensor:
    """A grid type's weights written into ``out`` (``[rows, cols]``, contiguous)."""
    launch = grid_dequant_launch(int(planes.qtype))
    c = launch.constexprs
    kb = planes.cols // BLOCK
    _dequantize_grid_kernel[(triton.cdiv(planes.rows, c["BLOCK_N"]), triton.cdiv(kb, c["BLOCK_B"]))](
        planes.quants, planes.high, _sub(planes), planes.supers, grid_words(planes.qtype, planes.device), out,
        planes.rows, planes.cols, kb, **c, num_warps=launch.num_warps)
    return out

"""Triton device functions that read one GGUF weight tile straight from its blocks.

Every weight is ``scale * code (+ offset)``, the scale (and offset) shared
by its sub-block (``SUB_BLOCK`` weights). ``weight_codes`` and
``sub_block_scales`` read the two halves at rows ``n`` and columns ``k`` (int64
tensors of any broadcastable shapes, already clamped into range by the
caller) of a tensor whose row ``r`` starts at byte ``r * row_bytes`` of
``blocks``: the GEMV reads codes per weight and scales once per sub-block.
``weight_tile`` multiplies them out per weight (the dequantize kernel, the
GEMM's tiles). Each weight is located by its block (``k // block_size``) and
its place in it. The arithmetic follows ``gguf.quants`` operation by
operation (same products in the same order; a sign of +-1 moved between
factors is exact), so without FMA contraction the values are bit-exact.

The ``QTYPE`` switch is a ``tl.constexpr``: each kernel specialisation compiles
only its own format.
"""

from __future__ import annotations

import triton
import triton.language as tl

# GGMLQuantizationType values (tl.constexpr comparisons need plain ints).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29

# Types these kernels read, and the lookup tables each one needs
# (grid, signs, values), by the names ``formats.lookup_table`` knows.
TRITON_TABLES: dict[int, tuple[str | None, str | None, str | None]] = {
    Q4_0: (None, None, None), Q4_1: (None, None, None), Q5_0: (None, None, None),
    Q5_1: (None, None, None), Q8_0: (None, None, None),
    Q2_K: (None, None, None), Q3_K: (None, None, None), Q4_K: (None, None, None),
    Q5_K: (None, None, None), Q6_K: (None, None, None),
    IQ2_XXS: ("iq2xxs_grid", "ksigns", None), IQ2_XS: ("iq2xs_grid", "ksigns", None),
    IQ2_S: ("iq2s_grid", None, None), IQ3_XXS: ("iq3xxs_grid", "ksigns", None),
    IQ3_S: ("iq3s_grid", None, None), IQ1_S: ("iq1s_grid", None, None), IQ1_M: ("iq1s_grid", None, None),
    IQ4_NL: (None, None, "iq4nl_values"), IQ4_XS: (None, None, "iq4nl_values"),
}


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u16(ptr):
    return _byte(ptr) | (_byte(ptr + 1) << 8)


@triton.jit
def _u32(ptr):
    b0 = tl.load(ptr).to(tl.uint32)
    b1 = tl.load(ptr + 1).to(tl.uint32)
    b2 = tl.load(ptr + 2).to(tl.uint32)
    b3 = tl.load(ptr + 3).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _signed8(v):
    return tl.where(v > 127, v - 256, v)


@triton.jit
def _sign(bit):
    return tl.where(bit == 0, 1.0, -1.0)


@triton.jit
def _k_scale_min(blk, s):
    """The 6-bit scale and min of sub-block ``s`` (0..7) of Q4_K/Q5_K, packed at ``blk + 4``."""
    lo = s < 4
    s4 = tl.where(lo, s, s - 4)
    a = _byte(blk + 4 + s4)  # scales[0..3]
    b = _byte(blk + 8 + s4)  # scales[4..7]
    c = _byte(blk + 12 + s4)  # scales[8..11]
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
    return sc, mn


# Weights per scale (the sub-block) of each type: the GEMV sums x * code over
# a sub-block and applies its scale (and offset) once.
SUB_BLOCK: dict[int, int] = {
    Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q2_K: 16, Q3_K: 16, Q4_K: 32, Q5_K: 32, Q6_K: 16,
    IQ2_XXS: 32, IQ2_XS: 16, IQ2_S: 16, IQ3_XXS: 32, IQ3_S: 32, IQ1_S: 32, IQ1_M: 16, IQ4_NL: 32, IQ4_XS: 32,
}
# Types whose weight is scale * code + offset (a per-sub-block minimum); the rest are scale * code.
HAS_OFFSET = (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)


@triton.jit
def weight_tile(blocks, row_bytes, n, k, grid_ptr, signs_ptr, values_ptr,
                QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr):
    """Weights ``[BLOCK_N, BLOCK_K]`` (float32) of a ``QTYPE`` tensor whose
    blocks hold ``BS`` weights in ``TS`` bytes: ``scale * code``, plus the
    offset where the type has one (``OFFSET``: ``QTYPE in HAS_OFFSET``; adding
    a 0 would turn a -0.0 into 0.0), the products gguf.quants forms, in its order."""
    code = weight_codes(blocks, row_bytes, n, k, grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS)
    scale, offset = sub_block_scales(blocks, row_bytes, n, k, QTYPE, BS, TS)
    if OFFSET:
        return scale * code + offset
    return scale * code


@triton.jit
def sub_block_scales(blocks, row_bytes, n, k, QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr):
    """(scale, offset), float32, of the sub-block holding weight ``(n, k)``
    (any broadcastable shapes): the weight is ``scale * code + offset``;
    ``offset`` is 0 for types without a minimum."""
    blk = blocks + n * row_bytes + (k // BS) * TS
    j = k % BS
    offset = tl.zeros(j.shape, tl.float32)  # a tensor either way (a float would be a constexpr)
    if QTYPE == 2 or QTYPE == 6 or QTYPE == 8 or QTYPE == 20:  # Q4_0, Q5_0, Q8_0, IQ4_NL: d
        scale = _f16(blk)
    elif QTYPE == 3 or QTYPE == 7:  # Q4_1, Q5_1: d, m
        scale = _f16(blk)
        offset = _f16(blk + 2)
    elif QTYPE == 10:  # Q2_K: scales[16] qs[64] d dmin
        sc = _byte(blk + j // 16)
        scale = _f16(blk + 80) * (sc & 15).to(tl.float32)
        offset = -(_f16(blk + 82) * (sc >> 4).to(tl.float32))
    elif QTYPE == 11:  # Q3_K: hmask[32] qs[64] scales[12] d
        s = j // 16
        low = (_byte(blk + 96 + s % 8) >> ((s // 8) * 4)) & 15
        high = (_byte(blk + 104 + s % 4) >> ((s // 4) * 2)) & 3
        scale = _f16(blk + 108) * ((low | (high << 4)) - 32).to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: d dmin scales[12] ...
        sc, mn = _k_scale_min(blk, j // 32)
        scale = _f16(blk) * sc.to(tl.float32)
        offset = -(_f16(blk + 2) * mn.to(tl.float32))
    elif QTYPE == 14:  # Q6_K: ql[128] qh[64] scales[16] d
        scale = _f16(blk + 208) * _signed8(_byte(blk + 192 + j // 16)).to(tl.float32)
    elif QTYPE == 23:  # IQ4_XS: d scales_h scales_l[4] qs[128]
        s = j // 32
        sl = (_byte(blk + 4 + s // 2) >> ((s % 2) * 4)) & 15
        sh = (_u16(blk + 2) >> (2 * s)) & 3
        scale = _f16(blk) * ((sl | (sh << 4)) - 32).to(tl.float32)
    elif QTYPE == 16:  # IQ2_XXS: d, 8 groups of (4 grid bytes, u32 signs+scale)
        aux = _u32(blk + 2 + (j // 32) * 8 + 4)
        scale = _f16(blk) * (0.5 + (aux >> 28).to(tl.int32).to(tl.float32)) * 0.25
    elif QTYPE == 17:  # IQ2_XS: d qs[32 x u16] scales[8]
        s = j // 16
        sc = (_byte(blk + 66 + s // 2) >> ((s % 2) * 4)) & 15
        scale = _f16(blk) * (0.5 + sc.to(tl.float32)) * 0.25
    elif QTYPE == 22:  # IQ2_S: d qs[32] signs[32] qh[8] scales[8]
        s = j // 16
        sc = (_byte(blk + 74 + s // 2) >> ((s % 2) * 4)) & 15
        scale = _f16(blk) * (0.5 + sc.to(tl.float32)) * 0.25
    elif QTYPE == 18:  # IQ3_XXS: d qs[64] scales[8 x u32]
        aux = _u32(blk + 66 + 4 * (j // 32))
        scale = _f16(blk) * (0.5 + (aux >> 28).to(tl.int32).to(tl.float32)) * 0.5
    elif QTYPE == 21:  # IQ3_S: d qs[64] qh[8] signs[32] scales[4]
        s = j // 32
        sc = (_byte(blk + 106 + s // 2) >> ((s % 2) * 4)) & 15
        scale = _f16(blk) * (1 + 2 * sc).to(tl.float32)
    elif QTYPE == 19:  # IQ1_S: d qs[32] qh[8 x u16]
        qh = _u16(blk + 34 + 2 * (j // 32))
        scale = _f16(blk) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    else:  # IQ1_M: qs[32] qh[16] scales[4 x u16]
        s0 = _u16(blk + 48)
        s1 = _u16(blk + 50)
        s2 = _u16(blk + 52)
        s3 = _u16(blk + 54)
        d_bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
        d = d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        h = j // 16  # 16 scales of 3 bits, 4 per word
        word = _u16(blk + 48 + 2 * (h // 4))
        scale = d * (2 * ((word >> (3 * (h % 4))) & 7) + 1).to(tl.float32)
    return scale, offset


@triton.jit
def weight_codes(blocks, row_bytes, n, k, grid_ptr, signs_ptr, values_ptr,
                 QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr):
    """The code of weight ``(n, k)`` (float32, any broadcastable shapes):
    what its sub-block's scale multiplies (grid value with its sign, IQ1's
    delta included)."""
    blk = blocks + n * row_bytes + (k // BS) * TS
    j = k % BS
    if QTYPE == 2:  # Q4_0
        code = (((_byte(blk + 2 + j % 16) >> ((j // 16) * 4)) & 15) - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        code = ((_byte(blk + 4 + j % 16) >> ((j // 16) * 4)) & 15).to(tl.float32)
    elif QTYPE == 6:  # Q5_0
        low = (_byte(blk + 6 + j % 16) >> ((j // 16) * 4)) & 15
        high = (_byte(blk + 2 + j // 8) >> (j % 8)) & 1
        code = ((low | (high << 4)) - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1
        low = (_byte(blk + 8 + j % 16) >> ((j // 16) * 4)) & 15
        high = (_byte(blk + 4 + j // 8) >> (j % 8)) & 1
        code = (low | (high << 4)).to(tl.float32)
    elif QTYPE == 8:  # Q8_0
        code = _signed8(_byte(blk + 2 + j)).to(tl.float32)
    elif QTYPE == 10:  # Q2_K
        r = j % 128
        code = ((_byte(blk + 16 + (j // 128) * 32 + r % 32) >> ((r // 32) * 2)) & 3).to(tl.float32)
    elif QTYPE == 11:  # Q3_K
        r = j % 128
        ql = (_byte(blk + 32 + (j // 128) * 32 + r % 32) >> ((r // 32) * 2)) & 3
        qh = (_byte(blk + j % 32) >> (j // 32)) & 1
        code = (ql - ((qh ^ 1) << 2)).to(tl.float32)
    elif QTYPE == 12:  # Q4_K
        code = ((_byte(blk + 16 + (j // 64) * 32 + j % 32) >> (((j % 64) // 32) * 4)) & 15).to(tl.float32)
    elif QTYPE == 13:  # Q5_K
        low = (_byte(blk + 48 + (j // 64) * 32 + j % 32) >> (((j % 64) // 32) * 4)) & 15
        high = (_byte(blk + 16 + j % 32) >> (j // 32)) & 1
        code = (low | (high << 4)).to(tl.float32)
    elif QTYPE == 14:  # Q6_K
        r = j % 128
        low = (_byte(blk + (j // 128) * 64 + r % 64) >> ((r // 64) * 4)) & 15
        high = (_byte(blk + 128 + (j // 128) * 32 + r % 32) >> ((r // 32) * 2)) & 3
        code = ((low | (high << 4)) - 32).to(tl.float32)
    elif QTYPE == 20:  # IQ4_NL
        code = tl.load(values_ptr + ((_byte(blk + 2 + j % 16) >> ((j // 16) * 4)) & 15))
    elif QTYPE == 23:  # IQ4_XS
        r = j % 32
        code = tl.load(values_ptr + ((_byte(blk + 8 + (j // 32) * 16 + r % 16) >> ((r // 16) * 4)) & 15))
    elif QTYPE == 16:  # IQ2_XXS
        g = j // 32
        sub = (j % 32) // 8
        e = j % 8
        aux = _u32(blk + 2 + g * 8 + 4)
        signs = _byte(signs_ptr + ((aux >> (7 * sub)) & 127).to(tl.int32))
        code = tl.load(grid_ptr + _byte(blk + 2 + g * 8 + sub) * 8 + e) * _sign((signs >> e) & 1)
    elif QTYPE == 17:  # IQ2_XS
        e = j % 8
        q = _u16(blk + 2 + 2 * (j // 8))
        signs = _byte(signs_ptr + (q >> 9))
        code = tl.load(grid_ptr + (q & 511) * 8 + e) * _sign((signs >> e) & 1)
    elif QTYPE == 22:  # IQ2_S
        i = j // 8
        e = j % 8
        idx = _byte(blk + 2 + i) | (((_byte(blk + 66 + i // 4) >> (2 * (i % 4))) & 3) << 8)
        code = tl.load(grid_ptr + idx * 8 + e) * _sign((_byte(blk + 34 + i) >> e) & 1)
    elif QTYPE == 18:  # IQ3_XXS
        g = j // 32
        sub = (j % 32) // 8
        e = j % 8
        aux = _u32(blk + 66 + 4 * g)
        signs = _byte(signs_ptr + ((aux >> (7 * sub)) & 127).to(tl.int32))
        code = tl.load(grid_ptr + _byte(blk + 2 + j // 4) * 4 + j % 4) * _sign((signs >> e) & 1)
    elif QTYPE == 21:  # IQ3_S
        i = j // 4
        idx = _byte(blk + 2 + i) | (((_byte(blk + 66 + i // 8) >> (i % 8)) & 1) << 8)
        code = tl.load(grid_ptr + idx * 4 + j % 4) * _sign((_byte(blk + 74 + j // 8) >> (j % 8)) & 1)
    elif QTYPE == 19:  # IQ1_S
        qh = _u16(blk + 34 + 2 * (j // 32))
        delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
        i = j // 8
        idx = _byte(blk + 2 + i) | (((qh >> (3 * (i % 4))) & 7) << 8)
        code = tl.load(grid_ptr + idx * 8 + j % 8) + delta
    else:  # IQ1_M
        i = j // 8
        qh = (_byte(blk + 32 + i // 2) >> (4 * (i % 2))) & 15
        idx = _byte(blk + i) | ((qh & 7) << 8)
        delta = tl.where((qh & 8) == 0, 0.125, -0.125)
        code = tl.load(grid_ptr + idx * 8 + j % 8) + delta
    return code

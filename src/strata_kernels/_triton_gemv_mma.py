"""Triton GEMV for a decode step of 2 to 8 rows over ``word_planes.WordPlanes``
on the tensor cores (imported only when the Triton backend runs).

At one row the word GEMV's ``dp2a`` products cost about as much as the
weights' loads; at eight they cost eight times as much (300-600 instructions
a KiB of weights on sm_90, where the memory allows about 128). Here the
weights become float16 in registers instead and multiply x on the tensor
cores, x padded to 8 rows: the products cost one ``mma`` a 16 x 16 tile of
weights.

The conversion is what remains, so it is cut to the bone. The words of a
tile's codes are loaded as int32 and made words of whole code bytes in
registers (the four low nibbles by a mask; the four high ones masked where
they are, each byte 16 x its code, those products divided by 16 once at the
end), and each byte a float16 1024 + code by ``prmt`` with 0x64 bytes, one
instruction a pair, the tile joined from the words in registers. Bits above
a nibble go where they cost least (``_code_words``): a Q5 type's fifth bit
of a low nibble into its byte, of a high one into the float16's top byte
(0x64 + bit: 256 = 16 x 16), which ``prmt`` takes from a word beside the
codes; Q6_K's two bits into the top bytes of both tiles, each 16 x the code.
(Masking each pair into the mantissa inside one PTX
block, 1024 + code and 64 + code, took a register constant per ``lop3``
that ptxas re-made at every use, and a block taking the high words beside
the code bytes cost a register copy per operand: 187 against 160
instructions per KiB of Q4_0 on sm_90, 262 against 173 of Q5_K. Offered as
an operand, a constant keeps Triton from making the tiles in the tensor
cores' layout, a dearer trip through shared memory.) A single ``fma`` per
pair then scales it and takes the exponent's offset away exactly (``code x
s`` rounded once: ``1024 s`` is exact). Every other offset of a type (Q4_0's
8, Q4_K's min, Q6_K's 32, IQ4's +128 that makes its codebook unsigned) is
not applied per weight: it is one more column of the weight tile per 16
weights, ``-offset``, against a row of x's sums over those 16 (``xsums``), a
sixteenth more tensor-core work. IQ4_XS looks its codebook up by ``prmt``.
Q8_0 converts each signed byte exactly and multiplies by its scale.

A word's bytes are put where the tensor cores' operand layout has the lane
that loaded it hold them (``_weight_order``: byte 2h + o of word w at
position 8h + 2w + o of its 16), so the tile is made in registers as it is
multiplied; in byte order Triton sent each tile through shared memory and
back (160 against 150 instructions per KiB of Q4_0 on sm_90). x's rows are
read in the same order, so the products meet the right weights (IQ4 keeps
a byte's two nibbles together: its lookup gives them as a pair).

x is prepared once per call: each row scaled by its largest magnitude into
[-1, 1] and rounded to float16 (the tensor cores' operand, 11 bits where the
CPU's default path keeps 8), laid out ``[K, 8]`` (column ``m`` is row ``m``),
with each column's sums over each 16 values, and the scales kept for the
output. (Rounding's residual in 8 more columns carried x to 22 bits, but
cost a second ``mma`` a tile: 150 against 130 instructions per KiB of Q4_0.)

``USE_ASM`` picks the conversions through inline PTX, or plain Triton
computing the same float16 values, which the interpreter runs: equal (the
masks that make code bytes are plain Triton either way).
Exactness needs ``1024 s`` within float16 (``WordPlanes.fits_mma``: every
block scale below 64); ``qmatmul.gemv_path`` takes the word GEMV otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ._triton_convert import IQ4_BANK_WORDS, IQ4_LOOKUP, WORD_PLUS_1024, bytes_to_f16, operand_order
from .formats import lookup_table
from .launch import split_k
from .launch_plans import MMA_KINDS, gemv_mma_launch
from .word_planes import BLOCK, WordPlanes

MAX_ROWS = 8
X_ROWS = tl.constexpr(MAX_ROWS)  # x's columns: its rows, zeros past M

# IQ4_XS: a word of 8 nibble indices in $8 -> their codebook values + 128 (unsigned bytes) by prmt
# (_triton_convert.IQ4_LOOKUP), as float16 1024 + value in $0..$7: byte 0's low and high nibble, byte 1's
# (tile 0), bytes 2 and 3's (tile 1). The banks' words and the bank bit's mask come in $9..$13
# (_triton_convert.IQ4_BANK_WORDS, loaded from the kernel's word table): as immediates ptxas kept them in
# uniform registers and copied each out at every use (1056 against 839 instructions a step on sm_90).
IQ4_BANKS_AT = tl.constexpr(16)  # where the word table (_tables) holds the bank words, four copies each
IQ4_WORD = tl.constexpr("""{
    .reg .b32 index, bank, a, b, first, second, p0, p1, p2, p3;""" + IQ4_LOOKUP + """
    prmt.b32 p0, first, 0x64646464, 0x5140;
    prmt.b32 p1, first, 0x64646464, 0x7362;
    prmt.b32 p2, second, 0x64646464, 0x5140;
    prmt.b32 p3, second, 0x64646464, 0x7362;
    mov.b32 {$0, $1}, p0;
    mov.b32 {$2, $3}, p1;
    mov.b32 {$4, $5}, p2;
    mov.b32 {$6, $7}, p3;
    }""")


@triton.jit
def _weight_order(i, TILE: tl.constexpr, KIND: tl.constexpr):
    """The weight of its chunk (0..31) that position ``i`` (0..15) of tile
    ``TILE`` holds: the order the conversion's pairs come out in."""
    if KIND == 0:  # Q8_0: the chunk's first and second 16 bytes as they are
        return i + 16 * TILE
    if KIND == 5:  # IQ4: value 2h + o of word w (IQ4_WORD: bytes 2 TILE and 2 TILE + 1, a byte's two nibbles
        # together) at 8h + 2w + o, as _word_tile puts a word's bytes
        return 4 * ((i % 8) // 2) + 2 * TILE + i // 8 + 16 * (i % 2)
    return operand_order(i) + 16 * TILE  # tile 1 the high nibbles


@triton.jit
def _plain_tile(quants, q_at, codebook, i, TILE: tl.constexpr, KIND: tl.constexpr):
    """Q8_0's and IQ4_XS's tile ``TILE`` in plain Triton (the interpreter's
    form; IQ4 what its PTX makes): each position's signed code (Q8_0) or
    float16 1024 + its codebook value + 128 (IQ4_XS)."""
    wi = _weight_order(i, TILE, KIND)
    if KIND == 0:
        return tl.load(quants + q_at + wi[None, None, :]).to(tl.float16)
    code = (tl.load(quants + q_at + (wi % 16)[None, None, :]).to(tl.int32) >> (4 * (wi // 16))) & 15
    return (tl.load(codebook + code) + 1024).to(tl.float16)


@triton.jit
def _iq4_tiles(words, word_table):
    """IQ4_XS's two tiles ``[N, B, 16]`` from its code words ``words`` ``[N,
    B, 4]`` (int32): ``IQ4_WORD``, each word's values put as ``_word_tile``
    puts bytes. The bank words are loaded as ``_code_words`` loads its masks
    (made from a per-lane zero instead, or offered as kernel arguments, they
    kept Triton from making the tiles in the tensor cores' layout: a trip
    through shared memory)."""
    w = tl.arange(0, 4)[None, None, :]
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        IQ4_WORD, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r",
        [words, tl.load(word_table + IQ4_BANKS_AT + w), tl.load(word_table + IQ4_BANKS_AT + 4 + w),
         tl.load(word_table + IQ4_BANKS_AT + 8 + w), tl.load(word_table + IQ4_BANKS_AT + 12 + w),
         tl.load(word_table + IQ4_BANKS_AT + 16 + w)], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    t0 = tl.join(tl.join(v0, v1), tl.join(v2, v3)).permute(0, 1, 4, 2, 3)
    t1 = tl.join(tl.join(v4, v5), tl.join(v6, v7)).permute(0, 1, 4, 2, 3)
    return t0.reshape(words.shape[0], words.shape[1], 16), t1.reshape(words.shape[0], words.shape[1], 16)


@triton.jit
def _word_tile(words, USE_ASM: tl.constexpr):
    """Words of four code bytes ``[N, B, 4]`` (int32) as the float16 tile
    ``[N, B, 16]`` of 1024 + each byte, in ``_weight_order``."""
    if USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(WORD_PLUS_1024, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    else:
        b0 = ((words & 0xFF) + 1024).to(tl.float16)
        b1 = (((words >> 8) & 0xFF) + 1024).to(tl.float16)
        b2 = (((words >> 16) & 0xFF) + 1024).to(tl.float16)
        b3 = (((words >> 24) & 0xFF) + 1024).to(tl.float16)
    # [.., w, o, h] holds byte 2h + o of word w, put at position 8h + 2w + o (_weight_order)
    tile = tl.join(tl.join(b0, b1), tl.join(b2, b3)).permute(0, 1, 4, 2, 3)
    return tile.reshape(words.shape[0], words.shape[1], 16)


# An int32 word of four code bytes in $4 and of the four float16s' top bytes in $5 -> the float16s in $0..$3
# (byte k of each: bits 0-7 and 8-15 of the k-th), by one prmt a pair.
WORD_TOP_PAIRS = tl.constexpr("""{
    .reg .b32 lo, hi;
    prmt.b32 lo, $4, $5, 0x5140;
    prmt.b32 hi, $4, $5, 0x7362;
    mov.b32 {$0, $1}, lo;
    mov.b32 {$2, $3}, hi;
    }""")


@triton.jit
def _word_top_tile(words, top, USE_ASM: tl.constexpr):
    """``_word_tile`` with each float16's top byte from ``top`` (0x64 plus
    the code's bits above its byte, 256 each) instead of 0x64."""
    if USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(WORD_TOP_PAIRS, "=h,=h,=h,=h,r,r", [words, top],
                                                   dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:  # what prmt does: byte k of words the low byte, byte k of top the high one
        b0 = ((words & 0xFF) | ((top & 0xFF) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        b1 = (((words >> 8) & 0xFF) | (top & 0xFF00)).to(tl.int16).to(tl.float16, bitcast=True)
        b2 = (((words >> 16) & 0xFF) | ((top >> 8) & 0xFF00)).to(tl.int16).to(tl.float16, bitcast=True)
        b3 = (((words >> 24) & 0xFF) | ((top >> 16) & 0xFF00)).to(tl.int16).to(tl.float16, bitcast=True)
    tile = tl.join(tl.join(b0, b1), tl.join(b2, b3)).permute(0, 1, 4, 2, 3)
    return tile.reshape(words.shape[0], words.shape[1], 16)


@triton.jit
def _code_words(quants, at, high_words, h_now, word_table, KIND: tl.constexpr):
    """A nibble type's codes of the blocks at word offsets ``at`` ``[N, B,
    1]`` as words of whole bytes, ``[N, B, 4]`` int32 each: ``low`` (weights
    4w..4w+3 of the block), ``low_top``, ``high`` (16 + 4w..), ``high_top``.
    A high nibble is masked where it is, each byte 16 x its code (no shift;
    those products are kept apart and divided by 16 at the end). Where a code
    has bits above its nibble, a ``top`` word holds each float16's top byte,
    0x64 + those bits (256 each: 16 x 16) for ``_word_top_tile``: Q5_K, Q5_0
    and Q5_1 put their high nibbles' fifth bits there and or the low ones'
    into the byte (their high word shifted right by the word's index: the
    low nibble's at bit 4 of byte j, the high one's at bit 0), Q6_K both
    halves' two bits (its low nibbles shifted up to 16 x too; the bits'
    stored top bit flipped back by the xor). Otherwise the tops are unused.
    The shifts and the masks come from ``word_table`` (0..3, 0x01010101 and
    0x03030303 four times each, 0, 2, 4, 6) as loaded values: a made range
    there sent the tiles through shared memory (158 against 173 instructions
    per KiB of Q5_K on sm_90), and a mask beside the 0x64 immediate was made
    again by ptxas at every use (772 against 741 instructions an iteration
    of Q5_K). Q6_K's two high words a block load as one run of the row's
    (``h_now`` ``[N, 2 B]``): loaded as pairs they took 8-byte loads from
    shared memory (867 against 829 an iteration)."""
    w = tl.arange(0, 4)[None, None, :]
    words = tl.load(quants.to(tl.pointer_type(tl.int32), bitcast=True) + at + w)
    high = words & -0x0F0F0F10  # 0xF0F0F0F0
    if KIND == 4:  # h_now [N, 2 B]: the blocks' high words, two a block
        h_low, h_high = tl.split(tl.load(high_words + h_now).reshape(h_now.shape[0], h_now.shape[1] // 2, 2))
        twos = tl.load(word_table + 8 + w)
        shift = tl.load(word_table + 12 + w)
        low = (words << 4) & -0x0F0F0F10
        low_top = ((h_low[:, :, None] >> shift) & twos) ^ 0x66666666
        high_top = ((h_high[:, :, None] >> shift) & twos) ^ 0x66666666
        return low, low_top, high, high_top
    low = words & 0x0F0F0F0F
    if KIND == 3 or KIND >= 7:
        h = tl.load(high_words + h_now)[:, :, None] >> tl.load(word_table + w)
        low |= h & 0x10101010
        return low, low, high, (h & tl.load(word_table + 4 + w)) | 0x64646464
    return low, low, high, high


@triton.jit
def _block_scales(scales, sub, supers, b0, bb, n_safe, N, KIND: tl.constexpr):
    """Each (row, block)'s float16 scale of its first and second 16 weights
    and the offset of each half (``weight = s * code - offset``; IQ4's codes
    carry +128), for blocks ``b0 + bb``. A step's blocks share one
    superblock (``b0 % 8 == 0``, ``BLOCK_B <= 8``): its scales load once."""
    b = b0 + bb
    if KIND <= 1:
        d = tl.load(scales + b[None, :] * N + n_safe[:, None])
        off = d * 8.0 if KIND == 1 else d * 0.0
        return d, d, off, off
    if KIND >= 6:  # Q4_1, Q5_0, Q5_1: d and dmin per block, scale 1, min 1 (16 for Q5_0): exact in float16
        sup = tl.load(supers + b[None, :] * N + n_safe[:, None])
        d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        off = dmin * 16.0 if KIND == 7 else dmin
        return d, d, off, off
    s = tl.load(sub + b[None, :] * N + n_safe[:, None]).to(tl.int32)
    sup = tl.load(supers + (b0 // 8) * N + n_safe)[:, None]
    d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if KIND == 4:  # Q6_K: a signed scale per 16 weights; codes carry +32
        s0 = (d * ((s << 24) >> 24).to(tl.float32)).to(tl.float16)
        s1 = (d * (s >> 8).to(tl.float32)).to(tl.float16)
        return s0, s1, s0 * 32.0, s1 * 32.0
    if KIND == 5:  # IQ4_XS: a signed scale per 32; the codebook's values carry +128
        s0 = (d * s.to(tl.float32)).to(tl.float16)
        return s0, s0, s0 * 128.0, s0 * 128.0
    dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s0 = (d * (s & 0xFF).to(tl.float32)).to(tl.float16)
    off = (dmin * ((s >> 8) & 0xFF).to(tl.float32)).to(tl.float16)
    return s0, s0, off, off


@triton.jit
def _gemv_mma_kernel(
    xt, xscale, xsums, quants, high_words, scales, sub, supers, codebook, word_table, out, M, N, KB,
    blocks_per_split,
    KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, USE_ASM: tl.constexpr,
):
    # xt:      float16 [K, 8]: x's rows scaled into [-1, 1], column m row m (zeros past M); xscale
    #          float32 [8] the scales; xsums float16 [K / 16, 8]: xt's sums over each 16 rows
    # quants:  the planes' codes as bytes, [N, K] (Q8_0: int8) or [N, K / 2] (uint8, Q4_0 order)
    # high_words: int32 Q5_K [N, KB], Q6_K [N, 2 KB]; codebook int32 [16] IQ4's values + 128 (plain form);
    #          word_table int32 [36] (_code_words, _iq4_tiles)
    # scales:  float16 [KB, N] (Q8_0, Q4_0); sub int16 [KB, N] and supers int32 [KB / 8, N] (others)
    # out:     float32 [splits, M, N]; grid (cdiv(N, BLOCK_N), splits): rows pn*BLOCK_N.. over blocks
    #          ps*blocks_per_split.. of 32 weights, BLOCK_B at a time: two [BLOCK_N, BLOCK_B * 16] float16
    #          tiles (each block's 32 weights in two sixteens, in _weight_order), each times its rows of x,
    #          and (but Q8_0) the offsets' tile [BLOCK_N, 2 * BLOCK_B] times x's sums
    # Offsets within a program are int32 from its first row's, computed once; an iteration adds its start.
    tl.static_assert(8 % BLOCK_B == 0)  # a step's blocks in one superblock (_block_scales)
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    BYTES: tl.constexpr = 32 if KIND == 0 else 16  # code bytes a block
    HIGH: tl.constexpr = 1 if (KIND == 3 or KIND >= 7) else 2 if KIND == 4 else 0  # high words a block
    # Tiles of 16 x the code (_code_words): every nibble type's high nibbles, Q6_K's low ones too; and those
    # with the bits above in the float16's top byte
    HIGH_TIMES_16: tl.constexpr = KIND != 0 and KIND != 5
    LOW_TIMES_16: tl.constexpr = KIND == 4
    HIGH_TOP: tl.constexpr = HIGH > 0
    local = tl.arange(0, BLOCK_N)
    n = pn * BLOCK_N + local
    n_in = n < N
    local = tl.where(n_in, local, 0)
    n_safe = pn * BLOCK_N + local
    quants += (pn * BLOCK_N).to(tl.int64) * (KB * BYTES)
    high_words += (pn * BLOCK_N).to(tl.int64) * (KB * HIGH)
    i = tl.arange(0, 16)
    bb = tl.arange(0, BLOCK_B)
    k = tl.arange(0, BLOCK_B * 16)
    m = tl.arange(0, X_ROWS)
    q_at = local[:, None, None] * (KB * BYTES) + bb[None, :, None] * BYTES
    w_at = q_at // 4  # in words
    HIGH_RUN: tl.constexpr = (HIGH if HIGH > 0 else 1) * BLOCK_B  # a step's high words a row
    h_at = local[:, None] * (KB * HIGH) + tl.arange(0, HIGH_RUN)[None, :]
    x0_at = ((k // 16) * 32 + _weight_order(k % 16, 0, KIND))[:, None] * X_ROWS + m[None, :]
    x1_at = ((k // 16) * 32 + _weight_order(k % 16, 1, KIND))[:, None] * X_ROWS + m[None, :]
    sums_at = tl.arange(0, 2 * BLOCK_B)[:, None] * X_ROWS + m[None, :]
    # blocks_per_split is a multiple of BLOCK_B; written so, the compiler sees BLOCK_B divide b_start and
    # copies a row's high words 16 bytes at a time (Q5_K 742 -> 693 instructions a step on sm_90)
    b_start = ps * (blocks_per_split // BLOCK_B) * BLOCK_B
    b_stop = tl.minimum(b_start + blocks_per_split, KB)
    acc = tl.zeros((BLOCK_N, X_ROWS), tl.float32)
    acc16 = tl.zeros((BLOCK_N, X_ROWS), tl.float32)  # the products of tiles of 16 x the code
    for b0 in range(b_start, b_stop, BLOCK_B):
        s0, s1, off0, off1 = _block_scales(scales, sub, supers, b0, bb, n_safe, N, KIND)
        at = q_at + b0 * BYTES
        if KIND == 0:
            if USE_ASM:
                t0 = bytes_to_f16(tl.load(quants + at + i[None, None, :]), True)
                t1 = bytes_to_f16(tl.load(quants + at + 16 + i[None, None, :]), True)
            else:
                t0 = _plain_tile(quants, at, codebook, i, 0, KIND)
                t1 = _plain_tile(quants, at, codebook, i, 1, KIND)
            t0 = t0 * s0[:, :, None]
            t1 = t1 * s1[:, :, None]
        else:
            h_now = h_at + b0 * HIGH
            if KIND == 5:
                if USE_ASM:
                    t0, t1 = _iq4_tiles(tl.load(quants.to(tl.pointer_type(tl.int32), bitcast=True) + w_at + b0 * 4
                                                + tl.arange(0, 4)[None, None, :]), word_table)
                else:
                    t0 = _plain_tile(quants, at, codebook, i, 0, KIND)
                    t1 = _plain_tile(quants, at, codebook, i, 1, KIND)
            else:  # the same masks either way; the bytes become float16 by prmt (USE_ASM) or by shifts
                low, low_top, high, high_top = _code_words(quants, w_at + b0 * (BYTES // 4), high_words, h_now,
                                                           word_table, KIND)
                if LOW_TIMES_16:
                    t0 = _word_top_tile(low, low_top, USE_ASM)
                else:
                    t0 = _word_tile(low, USE_ASM)
                if HIGH_TOP:
                    t1 = _word_top_tile(high, high_top, USE_ASM)
                else:
                    t1 = _word_tile(high, USE_ASM)
            # code x s exactly (one rounding): the exponent's 1024 times s is exact
            t0 = tl.fma(t0, s0[:, :, None], (s0 * -1024.0)[:, :, None])
            t1 = tl.fma(t1, s1[:, :, None], (s1 * -1024.0)[:, :, None])
        x0 = tl.load(xt + x0_at + b0 * (32 * X_ROWS))
        x1 = tl.load(xt + x1_at + b0 * (32 * X_ROWS))
        if LOW_TIMES_16:
            acc16 = tl.dot(t0.reshape(BLOCK_N, BLOCK_B * 16), x0, acc16)
        else:
            acc = tl.dot(t0.reshape(BLOCK_N, BLOCK_B * 16), x0, acc)
        if HIGH_TIMES_16:
            acc16 = tl.dot(t1.reshape(BLOCK_N, BLOCK_B * 16), x1, acc16)
        else:
            acc = tl.dot(t1.reshape(BLOCK_N, BLOCK_B * 16), x1, acc)
        if KIND != 0:  # the offsets: -offset of each 16 weights against x's sum over them
            offsets = tl.join(-off0, -off1).reshape(BLOCK_N, 2 * BLOCK_B)
            acc = tl.dot(offsets, tl.load(xsums + sums_at + b0 * (2 * X_ROWS)), acc)
    acc += acc16 * 0.0625
    sx = tl.load(xscale + m)
    tl.store(out + (ps * M + m[None, :]) * N + n[:, None], acc * sx[None, :], mask=n_in[:, None] & (m < M)[None, :])


def prepare_mma(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (M <= 8) as the kernel reads it: ``[K, 8]`` float16,
    column ``m`` row ``m`` over its largest magnitude rounded to float16
    (zeros past M), the sums of each column over each 16 values ``[K / 16,
    8]`` (float16 of their float32 sums), and the magnitudes ``[8]``."""
    m, k = x.shape
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    xt = torch.zeros((k, MAX_ROWS), dtype=torch.float16, device=x.device)
    xt[:, :m] = (xf / scale[:, None]).T.to(torch.float16)
    sums = xt.float().view(k // 16, 16, MAX_ROWS).sum(dim=1).to(torch.float16)
    scales = torch.zeros(MAX_ROWS, dtype=torch.float32, device=x.device)
    scales[:m] = scale
    return xt, scales, sums


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4's codebook + 128 as int32 (what the plain form looks up) and
    ``_code_words``' table: the word indices 0..3, 0x01010101 and 0x03030303
    four times each, twice the indices, then IQ4's bank words four times each
    (``_iq4_tiles``; int32)."""
    if device not in _TABLES:
        words = [0, 1, 2, 3] + [0x01010101] * 4 + [0x03030303] * 4 + [0, 2, 4, 6]
        assert len(words) == IQ4_BANKS_AT.value
        words += [word for word in IQ4_BANK_WORDS for _ in range(4)]
        _TABLES[device] = ((lookup_table("iq4nl_values", device).round().to(torch.int32) + 128).contiguous(),
                           torch.tensor(words, dtype=torch.int32, device=device))
    return _TABLES[device]


def gemv_mma(x: torch.Tensor, planes: WordPlanes, prepared: tuple | None = None,
             splits: int | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (2 <= M <= 8 the intended rows; one
    works), in ``x``'s dtype."""
    m, k = x.shape
    if planes.qtype not in MMA_KINDS:
        raise ValueError(f"{planes.qtype.name} has no tensor-core GEMV; types with one: "
                         f"{', '.join(t.name for t in MMA_KINDS)}")
    if k != planes.cols or m > MAX_ROWS:
        raise ValueError(f"x must be [M <= {MAX_ROWS}, {planes.cols}], got {tuple(x.shape)}")
    launch = gemv_mma_launch(int(planes.qtype))
    block_n, block_b = launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_B"]
    kb = k // BLOCK
    if kb % block_b:
        raise ValueError(f"{kb} blocks of 32 a row are not whole tiles of {block_b}")
    xt, xscale, xsums = prepared if prepared is not None else prepare_mma(x)
    n_tiles = triton.cdiv(planes.rows, block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        splits = split_k(n_tiles, kb, block_b, sms)
    per_split = triton.cdiv(triton.cdiv(kb, splits), block_b) * block_b
    splits = triton.cdiv(kb, per_split)
    out = torch.empty((splits, m, planes.rows), dtype=torch.float32, device=x.device)
    codes = planes.quants.view(torch.int8 if planes.qtype == T.Q8_0 else torch.uint8)
    empty = planes.quants
    _gemv_mma_kernel[(n_tiles, splits)](
        xt, xscale, xsums, codes, planes.high if planes.high is not None else empty,
        planes.scales if planes.scales is not None else empty,
        planes.sub if planes.sub is not None else empty, planes.supers if planes.supers is not None else empty,
        *_tables(x.device), out, m, planes.rows, kb, per_split,
        **{**launch.constexprs, "USE_ASM": x.is_cuda if use_asm is None else use_asm}, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out.sum(dim=0).to(x.dtype)

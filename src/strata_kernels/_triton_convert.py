"""Exact conversions of packed codes to float16 in registers, for the Triton
kernels that feed weights or KV to the tensor cores (imported only when the
Triton backend runs).

Each works four bytes a register through inline PTX: a code, made
unsigned, becomes the low mantissa bits of a float16 whose exponent puts it
at 1024 + code (``prmt`` with 0x64 bytes), and the offset is subtracted
exactly (``sub.f16x2``; k8v4's values fold it into one fused multiply-add
with their scale). The byte forms take a tensor of bytes (``pack=4``);
the word forms an int32 word of codes and give one tensor per code (a tile
loaded as words keeps 16-byte loads and its values in registers in the
order the tensor cores read them). ``USE_ASM`` False: the plain Triton
conversions of the same values (what the interpreter runs): equal; the PTX
strings run on a CPU in ``kernels_test/test_mma_ptx.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Four bytes of nibbles in $4 -> the low nibbles' float16 in $0, $1 and the high ones' in $2, $3, less
# the offset that %s (a float16 pair: 1024 + offset twice) takes away.
_NIBBLES = """{
    .reg .b32 l, h, a, b, c, e, bias;
    and.b32 l, $4, 0x0F0F0F0F;
    shr.u32 h, $4, 4;
    and.b32 h, h, 0x0F0F0F0F;
    mov.b32 bias, %s;
    prmt.b32 a, l, 0x64646464, 0x5140;
    prmt.b32 b, l, 0x64646464, 0x7362;
    prmt.b32 c, h, 0x64646464, 0x5140;
    prmt.b32 e, h, 0x64646464, 0x7362;
    sub.f16x2 $0, a, bias;
    sub.f16x2 $1, b, bias;
    sub.f16x2 $2, c, bias;
    sub.f16x2 $3, e, bias;
    }"""
NIBBLES_LESS_8 = tl.constexpr(_NIBBLES % "0x64086408")
NIBBLES = tl.constexpr(_NIBBLES % "0x64006400")


# A word of four unsigned bytes in register SRC -> each as float16 (1024 + byte - 1152, exact) in $A..$D,
# byte 0 first (``bias`` holds 1152 twice).
_WORD_TO_F16 = """
    prmt.b32 lo, {src}, 0x64646464, 0x5140;
    prmt.b32 hi, {src}, 0x64646464, 0x7362;
    {finish_lo}
    {finish_hi}
    mov.b32 {{${0}, ${1}}}, lo;
    mov.b32 {{${2}, ${3}}}, hi;"""


def _to_f16(src: str, first: int, finish: str = "sub.f16x2 {half}, {half}, bias;") -> str:
    """``finish``: what makes each pair its values from 1024 + byte (``{half}``: lo, then hi)."""
    return _WORD_TO_F16.format(first, first + 1, first + 2, first + 3, src=src,
                               finish_lo=finish.format(half="lo"), finish_hi=finish.format(half="hi"))


# An int32 word of four signed bytes in $4 -> each byte as float16 in $0..$3 (byte 0 first): as bytes_to_f16,
# unpacked from the two float16 pairs (a tile loaded as words keeps its loads 16 bytes wide and its
# registers in the order the dot reads them).
WORD_BYTES = tl.constexpr("""{
    .reg .b32 u, lo, hi, bias;
    xor.b32 u, $4, 0x80808080;
    mov.b32 bias, 0x64806480;""" + _to_f16("u", 0) + """
    }""")

# Attention's keys: an int32 word of four signed bytes in $4 -> 1024 + 128 + each byte as float16 in $0..$3,
# byte 0 first (bytes_to_f16 less its subtraction: the attention kernel takes a key's offset from its score once).
WORD_BYTES_BIASED = tl.constexpr("""{
    .reg .b32 u, lo, hi;
    xor.b32 u, $4, 0x80808080;
    prmt.b32 lo, u, 0x64646464, 0x5140;
    prmt.b32 hi, u, 0x64646464, 0x7362;
    mov.b32 {$0, $1}, lo;
    mov.b32 {$2, $3}, hi;
    }""")
KEY_BIAS = tl.constexpr(1152.0)  # what WORD_BYTES_BIASED adds to a code

# The tensor-core GEMV's: a word of four code bytes in $4 -> each byte as float16 1024 + byte in $0..$3, byte 0
# first (prmt with 0x64 bytes: one instruction a pair, the constant 0x64646464 the only one).
WORD_PLUS_1024 = tl.constexpr("""{
    .reg .b32 lo, hi, m;
    mov.b32 m, 0x64646464;
    prmt.b32 lo, $4, m, 0x5140;
    prmt.b32 hi, $4, m, 0x7362;
    mov.b32 {$0, $1}, lo;
    mov.b32 {$2, $3}, hi;
    }""")

# IQ4_NL's lookup by prmt, shared with the tensor-core GEMV's IQ4_XS tiles: $8 an int32 word of eight 4-bit
# codes (byte j: code 2j low, 2j + 1 high) -> the levels + 128 (unsigned bytes) of codes 0..3 in first, of
# 4..7 in second, from two 8-value banks (the low 3 bits of a code pick a byte, its top bit the bank). The
# banks' words and the bank bit's mask come in $9..$13 (IQ4_BANK_WORDS): as immediates, ptxas kept them in
# uniform registers and copied each out at every use (k8v4 decode attention: 663 against 608 instructions
# a step at D=128 on sm_90).
IQ4_LOOKUP = """
    and.b32 index, $8, 0x77777777;
    shr.u32 bank, $8, 1;
    and.b32 bank, bank, $13;
    or.b32 bank, bank, 0x32103210;
    prmt.b32 a, $9, $10, index;
    prmt.b32 b, $11, $12, index;
    prmt.b32 first, a, b, bank;
    shr.u32 index, index, 16;
    shr.u32 bank, bank, 16;
    prmt.b32 a, $9, $10, index;
    prmt.b32 b, $11, $12, index;
    prmt.b32 second, a, b, bank;"""
# The lookup's bytes as each code's IQ4_NL level times a scale, float16 in $0..$7, code 0 first: 1024 + byte
# as above, then one fused multiply-add a pair, (1024 + byte) * scale + offset, with the scale in $14 and
# offset = -1152 * scale in $15 (float16). Exactly the level times the scale rounded once, when the offset is
# exact: a scale of 7 significant bits or fewer (reference_kv.round_scale_bits); otherwise within half a unit
# of the offset's last place (k8v4 decode attention: 578 against 608 instructions a step at D = 128 on sm_90
# with a subtraction and a multiply a pair).
WORD_IQ4_SCALED = tl.constexpr("""{
    .reg .b32 index, bank, a, b, first, second, lo, hi, scale, offset;""" + IQ4_LOOKUP + """
    mov.b32 scale, {$14, $14};
    mov.b32 offset, {$15, $15};""" + _to_f16("first", 0, "fma.rn.f16x2 {half}, {half}, scale, offset;")
    + _to_f16("second", 4, "fma.rn.f16x2 {half}, {half}, scale, offset;") + """
    }""")
# IQ4_NL's levels + 128 as bytes: values 0..3, 4..7 (the low bank), 8..11, 12..15 (the high one); then the
# mask of each code's top bit moved to the bank bit of its selector nibble
IQ4_BANK_WORDS = (0x3F2D1801, 0x766A5D4F, -0x5966727F, -0x0E263A4B, 0x44444444)  # 0xA6998D81, 0xF1D9C5B5
_BANK0, _BANK1, _BANK2, _BANK3, _BANK_BITS = (tl.constexpr(word) for word in IQ4_BANK_WORDS)


@triton.jit
def operand_order(i):
    """The byte at position ``i`` (mod 16) of a 16 whose four int32 words are
    laid out where the tensor cores' operand has the lane that loaded each
    word hold its bytes: byte 2h + o of word w sits at 8h + 2w + o (an
    ``mma`` operand holds positions 2L, 2L + 1, 2L + 8, 2L + 9 in lane L % 4).
    A tile converted from words in this order stays in registers; the
    other operand is read in it (x's rows, the queries)."""
    return 4 * ((i // 2) % 4) + 2 * ((i // 8) % 2) + i % 2


@triton.jit
def _iq4_level(code):
    """IQ4_NL's level of a 4-bit code (plain Triton: the 16 bytes of the
    table as four words, the code's byte shifted out)."""
    word = tl.where(code < 4, -1079142271, tl.where(code < 8, -152379953,
                                                    tl.where(code < 12, 639175937, 1901675829)))
    return ((word << (24 - 8 * (code % 4))) >> 24).to(tl.int8)


@triton.jit
def word_iq4_levels_scaled(words, zero, scale, USE_ASM: tl.constexpr):
    """The IQ4_NL levels of the eight 4-bit codes of each int32 of ``words``
    (code ``k`` in bits ``4k..4k+3``) times ``scale`` (float16, broadcast to
    ``words``), each product rounded once to float16: eight tensors of
    ``words``' shape, code 0's first. ``zero`` (int32, broadcast to
    ``words``) is 0 where the compiler cannot see it, computed once outside
    the caller's loop: the bank words are made from it so that they stay in
    registers (``WORD_IQ4_SCALED``; exact for scales of 7 significant bits)."""
    if USE_ASM:
        kept = zero + tl.zeros(words.shape, tl.int32)
        scale = scale + tl.zeros(words.shape, tl.float16)
        return tl.inline_asm_elementwise(
            WORD_IQ4_SCALED, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,h,h",
            [words, kept + _BANK0, kept + _BANK1, kept + _BANK2, kept + _BANK3, kept + _BANK_BITS,
             scale, scale * -1152.0],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    return (_iq4_level(words & 15).to(tl.float16) * scale, _iq4_level((words >> 4) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 8) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 12) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 16) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 20) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 24) & 15).to(tl.float16) * scale,
            _iq4_level((words >> 28) & 15).to(tl.float16) * scale)


@triton.jit
def word_bytes_to_f16(words, USE_ASM: tl.constexpr):
    """The four signed bytes of each int32 of ``words`` as float16, exactly:
    four tensors of ``words``' shape, byte 0's first."""
    if USE_ASM:
        return tl.inline_asm_elementwise(WORD_BYTES, "=h,=h,=h,=h,r", [words],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                         pack=1)
    return (((words << 24) >> 24).to(tl.float16), ((words << 16) >> 24).to(tl.float16),
            ((words << 8) >> 24).to(tl.float16), (words >> 24).to(tl.float16))


@triton.jit
def bytes_to_f16(codes, USE_ASM: tl.constexpr):
    """Signed bytes as float16, exactly (each offset by 128 as the mantissa
    of 1024 + it, less 1152)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 u, lo, hi, bias;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 lo, u, 0x64646464, 0x5140;
            prmt.b32 hi, u, 0x64646464, 0x7362;
            mov.b32 bias, 0x64806480;
            sub.f16x2 $0, lo, bias;
            sub.f16x2 $1, hi, bias;
            }""",
            "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    return codes.to(tl.float16)


@triton.jit
def nibbles_to_f16(byte, OFFSET: tl.constexpr, USE_ASM: tl.constexpr):
    """The low and the high nibbles of ``byte`` (uint8) less ``OFFSET`` (8 or
    0), as float16, exactly."""
    if USE_ASM:
        if OFFSET == 8:
            return tl.inline_asm_elementwise(NIBBLES_LESS_8, "=r,=r,=r,=r,r", [byte],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        return tl.inline_asm_elementwise(NIBBLES, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    code = byte.to(tl.int32)
    return ((code & 15) - OFFSET).to(tl.float16), ((code >> 4) - OFFSET).to(tl.float16)

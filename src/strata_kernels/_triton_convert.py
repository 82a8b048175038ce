"""Exact conversions of packed codes to float16 in registers, for the Triton
kernels that feed weights or KV to the tensor cores (imported only when the
Triton backend runs).

Each works four bytes a register through inline PTX (``pack=4``): a code,
made unsigned, becomes the low mantissa bits of a float16 whose exponent
puts it at 1024 + code (``prmt`` with 0x64 bytes), and the offset is
subtracted exactly (``sub.f16x2``). ``USE_ASM`` False: the plain Triton
conversions of the same values (what the interpreter runs): equal.
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

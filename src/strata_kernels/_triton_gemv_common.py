"""The word GEMVs' shared pieces (``_triton_gemv_words``, ``_triton_gemv_grid``):
``dp2a`` in PTX or plain Triton, a program's group of rows, the splits'
partial sums (imported only when the Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr, USE_ASM: tl.constexpr):
    """``c`` plus the products of ``a``'s two signed 16-bit halves with ``b``'s
    signed bytes 0 and 1 (``HI``: bytes 2 and 3), in int32."""
    if USE_ASM:
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    a0 = (a << 16) >> 16
    a1 = a >> 16
    if HI:
        b0 = (b << 8) >> 24
        b1 = b >> 24
    else:
        b0 = (b << 24) >> 24
        b1 = (b << 16) >> 24
    return c + a0 * b0 + a1 * b1


@triton.jit
def _dp2a_first(a, b, HI: tl.constexpr, USE_ASM: tl.constexpr):
    """``_dp2a`` onto zero (an immediate: no register zeroed for it)."""
    if USE_ASM:
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return _dp2a(a, b, 0, HI, False)


@triton.jit
def _group(groups, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's rows of its group's expert ``n`` (in range: ``n_in``;
    clamped: ``n_safe``), the expert's first plane row ``row0``, and its rows
    of x: ``first + m``, of which ``m_in`` are the group's (x holds BLOCK_M
    rows past the last group's, zeros: loads need no mask)."""
    g = tl.program_id(2)
    row0 = tl.load(groups + 3 * g) * N
    first = tl.load(groups + 3 * g + 1)
    count = tl.load(groups + 3 * g + 2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    m = tl.arange(0, BLOCK_M)
    return n, n_in, tl.where(n_in, n, 0), row0, first, m, m < count



def _new_out(splits: int, m: int, n: int, n_groups: int, device: torch.device) -> torch.Tensor:
    """The splits' partial sums ``[splits, m, n]`` (zeros for groups: rows of x in no group stay zero)."""
    return (torch.empty if n_groups == 1 else torch.zeros)((splits, m, n), dtype=torch.float32, device=device)

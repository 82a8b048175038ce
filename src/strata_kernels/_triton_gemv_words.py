"""Triton GEMV (a decode step's few rows) over ``word_planes.WordPlanes``:
bandwidth-bound by construction (imported only when the Triton backend runs).

Each thread loads 16 bytes of one row's code words at a time; the rows of x
are prepared once per call as 16-bit codes (one float scale per 32 values)
paired into words laid out to meet the weight words lane by lane, so a
word's products are two ``dp2a`` (16-bit x 8-bit, four products summed in
int32) per word of 8-bit codes, four per word of 4-bit codes. Partial sums
stay in registers, one per row and chunk, and are reduced once after the
loop. The K range is split over programs (``split_k``) so that a launch has
enough programs for every SM; the splits' partial outputs are summed after.

``USE_ASM`` (a constexpr) picks ``dp2a`` through inline PTX, or the same
integer arithmetic in plain Triton, which the interpreter runs: the two are
equal bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import split_k
from .launch_plans import gemv_words_launch
from .word_planes import BLOCK, WordPlanes

WORDS_PER_THREAD = 4  # 16 bytes: one load per thread


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
def _gemv_words_kernel(
    xw, xs, xsum, quants, scales, out, M, N, WPR, plane, KB, chunks_per_split,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # xw:      int32 [PLANES, BLOCK_M, WPR]: x's 16-bit codes in pairs, plane p meeting lane p of each weight
    #          word; plane: BLOCK_M * WPR, the planes' stride
    # xs:      float32 [BLOCK_M, KB]: x's scale per 32 values; xsum: int32 [BLOCK_M, KB], the codes' sum
    #          per 32 (4-bit codes); rows past M are zeros
    # quants:  int32 [N, WPR] code words; scales: float16 [KB, N] (block-column-major)
    # out:     float32 [splits, M, N]: each split's partial sums
    # grid:    (cdiv(N, BLOCK_N), splits); program (pn, ps) reads rows pn*BLOCK_N.. over chunks
    #          ps*chunks_per_split.. (a chunk: 4 words of a row, 16 bytes)
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    WPB: tl.constexpr = BITS  # words per 32-weight block (32 * BITS / 32)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    n_safe = tl.where(n_in, n, 0)
    m = tl.arange(0, BLOCK_M)  # x's planes hold BLOCK_M rows (zeros past M): loads need no mask
    m_in = m < M
    c = tl.arange(0, BLOCK_C)
    j = tl.arange(0, 4)
    chunks = WPR // 4
    c_start = ps * chunks_per_split
    c_stop = tl.minimum(c_start + chunks_per_split, chunks)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_C), dtype=tl.float32)
    for c0 in range(c_start, c_stop, BLOCK_C):  # a split's chunks are whole BLOCK_Cs: no mask in the loop
        cc = c0 + c
        w = cc[:, None] * 4 + j[None, :]  # [C, 4] word of the row
        q = tl.load(quants + n_safe[:, None, None] * WPR + w[None, :, :])
        # x in the products' own shape [M, N, C, 4] (each thread loads the words its row meets: no
        # layout conversion through shared memory; they come from L1, shared by every row)
        # (n >> 30) * 4 is 0, but not to the compiler: x loads in the products' own shape, 16 bytes
        # a thread, instead of a tiny tile spread a word a thread and converted through shared memory
        x_at = m[:, None, None, None] * WPR + w[None, None, :, :] + ((n_safe >> 30) * 4)[None, :, None, None]
        if BITS == 8:
            x0 = tl.load(xw + x_at)
            x1 = tl.load(xw + plane + x_at)
            dot = _dp2a_first(x0, q[None, :, :, :], False, USE_ASM)
            dot = _dp2a(x1, q[None, :, :, :], dot, True, USE_ASM)
        else:
            low = q & 0x0F0F0F0F
            high = (q >> 4) & 0x0F0F0F0F
            x0 = tl.load(xw + x_at)
            x1 = tl.load(xw + plane + x_at)
            x2 = tl.load(xw + 2 * plane + x_at)
            x3 = tl.load(xw + 3 * plane + x_at)
            dot = _dp2a_first(x0, low[None, :, :, :], False, USE_ASM)
            dot = _dp2a(x1, low[None, :, :, :], dot, True, USE_ASM)
            dot = _dp2a(x2, high[None, :, :, :], dot, False, USE_ASM)
            dot = _dp2a(x3, high[None, :, :, :], dot, True, USE_ASM)
        total = tl.sum(dot, axis=3)  # [M, N, C]: one chunk's 4 words, all in one thread
        b = cc * 4 // WPB  # the chunk's block
        if BITS == 4:  # a weight is its nibble minus 8
            sums = tl.load(xsum + m[:, None] * KB + b[None, :])
            total -= 8 * sums[:, None, :]
        d = tl.load(scales + b[None, :] * N + n_safe[:, None]).to(tl.float32)
        sx = tl.load(xs + m[:, None] * KB + b[None, :])
        acc += total.to(tl.float32) * d[None, :, :] * sx[:, None, :]
    result = tl.sum(acc, axis=2)
    tl.store(out + (ps * M + m[:, None]) * N + n[None, :], result, mask=m_in[:, None] & n_in[None, :])


# x's 16-bit code pairs, per plane, for the weight word lanes of each layout:
# (element of the block) pairs that meet dp2a's lo / hi bytes of word i of a block.
def _pairs(bits: int) -> list[list[tuple[int, int]]]:
    if bits == 8:  # word i of a block: weights 4i..4i+3
        return [[(4 * i, 4 * i + 1) for i in range(8)], [(4 * i + 2, 4 * i + 3) for i in range(8)]]
    # word i of a block: low nibbles weights 4i..4i+3, high nibbles 16+4i..16+4i+3
    return [[(4 * i + o, 4 * i + o + 1) for i in range(4)] for o in (0, 2)] + \
           [[(16 + 4 * i + o, 16 + 4 * i + o + 1) for i in range(4)] for o in (0, 2)]


@functools.lru_cache(maxsize=None)
def _pair_index(bits: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``_pairs`` as index tensors on ``device``, made once (a call inside a
    CUDA graph capture must not copy from the host)."""
    return [(torch.tensor([p[0] for p in pairs], device=device), torch.tensor([p[1] for p in pairs], device=device))
            for pairs in _pairs(bits)]


def prepare_activations(x: torch.Tensor, bits: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` as the kernel reads it, padded with zeros to ``rows``
    rows: 16-bit codes per 32 values (scale max|x| / 32767) paired into
    int32 words per plane ``[PLANES, rows, K * bits / 32]``, the scales
    ``[rows, K / 32]`` and the codes' sums per 32 ``[rows, K / 32]``."""
    m, k = x.shape
    if rows > m:
        x = torch.cat([x, x.new_zeros(rows - m, k)])
        m = rows
    xf = x.float().view(m, k // BLOCK, BLOCK)
    scale = xf.abs().amax(dim=2) / 32767.0
    codes = torch.round(xf / torch.where(scale > 0, scale, 1.0)[..., None]).to(torch.int32)
    planes = []
    for lo, hi in _pair_index(bits, x.device):
        word = (codes[:, :, lo] & 0xFFFF) | (codes[:, :, hi] << 16)  # [M, KB, words per block]
        planes.append(word.reshape(m, -1))
    return torch.stack(planes).contiguous(), scale.contiguous(), codes.sum(dim=2, dtype=torch.int32).contiguous()


def gemv_words(x: torch.Tensor, planes: WordPlanes, splits: int | None = None, use_asm: bool | None = None,
               **tiles) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (M <= 8), in ``x``'s dtype; ``splits``
    of K (default: enough for 4 programs per SM), ``tiles`` overriding the
    launch plan's (``block_n``, ``block_c``, ``num_warps``)."""
    m, k = x.shape
    launch = gemv_words_launch(int(planes.qtype), m, **tiles)
    block_n, block_c = launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_C"]
    if k != planes.cols:
        raise ValueError(f"x has {k} columns, the weight {planes.cols}")
    block_m = triton.next_power_of_2(m)
    xw, xs, xsum = prepare_activations(x, planes.bits, block_m)
    chunks = planes.words_per_row // 4
    if chunks % block_c:
        raise ValueError(f"{chunks} chunks of 4 words a row are not whole tiles of {block_c}")
    n_tiles = triton.cdiv(planes.rows, block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        splits = split_k(n_tiles, chunks, block_c, sms)
    per_split = triton.cdiv(triton.cdiv(chunks, splits), block_c) * block_c
    splits = triton.cdiv(chunks, per_split)
    out = torch.empty((splits, m, planes.rows), dtype=torch.float32, device=x.device)
    if use_asm is None:
        use_asm = x.is_cuda
    _gemv_words_kernel[(n_tiles, splits)](
        xw, xs, xsum, planes.quants, planes.scales, out, m, planes.rows, planes.words_per_row,
        block_m * planes.words_per_row, k // BLOCK,
        per_split, **{**launch.constexprs, "USE_ASM": use_asm}, num_warps=launch.num_warps)
    return out.sum(dim=0).to(x.dtype)

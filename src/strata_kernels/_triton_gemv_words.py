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

Two kernels: ``_gemv_words_kernel`` for Q8_0 and Q4_0 (a float16 scale per
32), ``_gemv_superblock_kernel`` for Q4_K, Q5_K, Q6_K and IQ4_XS (integer
sub-block scales and a superblock's d, their high-bit words, IQ4's codebook
by ``prmt``) and for Q4_1, Q5_0, Q5_1 (superblocks of one chunk). Both
take groups (expert, rows of x) so that a mixture's routed rows run in one
launch (``gemv_words_grouped``); a plain weight is one group. At 2-8 rows the tensor-core GEMV (``_triton_gemv_mma``) takes
the types it converts. The grid types (IQ3_S, IQ2_XXS) run ``_triton_gemv_grid``'s
kernel through the same launch (``_launch``), their chunks of 32 weights.

``USE_ASM`` (a constexpr) picks ``dp2a`` and ``prmt`` through inline PTX, or
the same integer arithmetic in plain Triton, which the interpreter runs: the
two are equal bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_gemv_common import _dp2a, _dp2a_first, _group, _new_out
from .launch import GEMV_MAX_M, split_k
from .launch_plans import gemv_words_launch
from .word_planes import BLOCK, WordPlanes, pairing_of

WORDS_PER_THREAD = 4  # 16 bytes: one load per thread


@triton.jit
def _gemv_words_kernel(
    xw, xmeta, quants, scales, out, groups, M, N, STRIDE, WPR, KB, chunks_per_split,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # xw:      int32 [BLOCK_M, WPR / 4, PLANES, 4]: x's 16-bit codes in pairs, per chunk of 4 weight words
    #          the PLANES words that meet each (plane p meeting lane pair p of a weight word)
    # xmeta:   float32 [BLOCK_M, KB, 2]: x's scale per 32 values and its codes' sum; rows past M are zeros
    # quants:  int32 [N, WPR] code words; scales: float16 [KB, N] (block-column-major)
    # out:     float32 [splits, M, N]: each split's partial sums
    # groups:  int32 [G, 3]: (expert, first row of x, rows of x) of each group; a weight of E experts is
    #          E x N rows (STRIDE in all), expert e's rows e*N..; one group (0, 0, M) for a plain weight
    # grid:    (cdiv(N, BLOCK_N), splits, G); program (pn, ps, g) reads rows pn*BLOCK_N.. of group g's expert
    #          over chunks ps*chunks_per_split.. (a chunk: 4 words of a row, 16 bytes)
    # Offsets are int32 and computed once; an iteration adds its start to them.
    ps = tl.program_id(1)
    WPB: tl.constexpr = BITS  # words per 32-weight block (32 * BITS / 32)
    PLANES: tl.constexpr = 2 if BITS == 8 else 4
    n, n_in, n_safe, row0, first, m, m_in = _group(groups, N, BLOCK_N, BLOCK_M)
    quants += row0.to(tl.int64) * WPR
    c = tl.arange(0, BLOCK_C)
    j = tl.arange(0, 4)
    chunks = WPR // 4
    c_start = ps * chunks_per_split
    c_stop = tl.minimum(c_start + chunks_per_split, chunks)
    q_off = n_safe[:, None, None] * WPR + (c * 4)[None, :, None] + j[None, None, :]
    # x in the products' own shape [M, N, C, 4], the same words for every row: a thread loads them once
    # for the rows it holds, 16 bytes a load, with no layout conversion through shared memory
    x_off = (((first + m)[:, None, None, None] * chunks + c[None, None, :, None]) * (PLANES * 4)
             + j[None, None, None, :] + tl.zeros([BLOCK_N], tl.int32)[None, :, None, None])
    b = c * 4 // WPB  # each chunk's block, from the iteration's first
    d_off = b[None, :] * STRIDE + row0 + n_safe[:, None]
    meta_off = ((first + m)[:, None] * KB + b[None, :]) * 2
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_C), dtype=tl.float32)
    for c0 in range(c_start, c_stop, BLOCK_C):  # a split's chunks are whole BLOCK_Cs: no mask in the loop
        q = tl.load(quants + q_off + c0 * 4)
        x_at = xw + x_off + c0 * (PLANES * 4)
        if BITS == 8:
            dot = _dp2a_first(tl.load(x_at), q[None, :, :, :], False, USE_ASM)
            dot = _dp2a(tl.load(x_at + 4), q[None, :, :, :], dot, True, USE_ASM)
        else:
            low = q & 0x0F0F0F0F
            high = (q >> 4) & 0x0F0F0F0F
            dot = _dp2a_first(tl.load(x_at), low[None, :, :, :], False, USE_ASM)
            dot = _dp2a(tl.load(x_at + 4), low[None, :, :, :], dot, True, USE_ASM)
            dot = _dp2a(tl.load(x_at + 8), high[None, :, :, :], dot, False, USE_ASM)
            dot = _dp2a(tl.load(x_at + 12), high[None, :, :, :], dot, True, USE_ASM)
        total = tl.sum(dot, axis=3).to(tl.float32)  # [M, N, C]: one chunk's 4 words, all in one thread
        b0 = c0 * 4 // WPB
        sx = tl.load(xmeta + meta_off + b0 * 2)
        if BITS == 4:  # a weight is its nibble minus 8
            total -= 8 * tl.load(xmeta + meta_off + b0 * 2 + 1)[:, None, :]
        d = tl.load(scales + d_off + b0 * STRIDE).to(tl.float32)
        acc += total * d[None, :, :] * sx[:, None, :]
    result = tl.sum(acc, axis=2)
    tl.store(out + (ps * M + first + m[:, None]) * N + n[None, :], result, mask=m_in[:, None] & n_in[None, :])


@triton.jit
def _prmt(a, b, sel, USE_ASM: tl.constexpr):
    """PTX ``prmt.b32`` (default mode, selectors below 8): byte ``k`` of the
    result is byte ``sel`` nibble ``k`` of the 8 bytes ``b:a``."""
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.int32, is_pure=True, pack=1)
    both = (a.to(tl.int64) & 0xFFFFFFFF) | (b.to(tl.int64) << 32)
    out = tl.zeros_like(sel)
    for k in tl.static_range(4):
        index = (sel >> (4 * k)) & 7
        out |= (((both >> (8 * index)) & 0xFF) << (8 * k)).to(tl.int32)
    return out


@triton.jit
def _iq4_lookup(index, bank0, bank1, BANK: tl.constexpr, USE_ASM: tl.constexpr):
    """The codebook values of 4 nibble selectors (``index`` below 8 each) in
    one 8-value bank: ``BANK`` 0 holds IQ4's values 0..7, 1 values 8..15.
    ``bank0`` and ``bank1`` hold each bank's first 4 bytes (values 0..3 and
    8..11) in registers kept over the loop; the other 4 are the instruction's
    immediate."""
    if USE_ASM:
        if BANK == 0:  # -127, -104, -83, -65 | -49, -35, -22, -10
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0xF6EADDCF, $2;", "=r,r,r", [bank0, index],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x71594535, $2;", "=r,r,r", [bank1, index],
                                         dtype=tl.int32, is_pure=True, pack=1)
    if BANK == 0:
        return _prmt(bank0, tl.full(index.shape, -152379953, tl.int32), index, False)
    return _prmt(bank1, tl.full(index.shape, 1901675829, tl.int32), index, False)


@triton.jit
def _iq4_values(q, bank0, bank1, fours, USE_ASM: tl.constexpr):
    """IQ4's codebook values of a word of 8 nibble indices, as two words of
    signed bytes in the nibbles' order: nibbles 0..3 (the low and high
    nibble of bytes 0 and 1), then 4..7 (x's IQ4 planes pair to match)."""
    index = q & 0x77777777
    bank = 0x32103210 | ((q >> 1) & fours)  # nibble k: k, or k + 4 (the high bank) where its index >= 8
    first = _prmt(_iq4_lookup(index, bank0, bank1, 0, USE_ASM), _iq4_lookup(index, bank0, bank1, 1, USE_ASM),
                  bank, USE_ASM)
    index = index >> 16
    second = _prmt(_iq4_lookup(index, bank0, bank1, 0, USE_ASM), _iq4_lookup(index, bank0, bank1, 1, USE_ASM),
                   bank >> 16, USE_ASM)
    return first, second


@triton.jit
def _superblock_words(q, high_words, h_off, j, KIND: tl.constexpr):
    """A chunk's code words as signed bytes, from its nibble words ``q``
    ``[N, C, 4]`` and, for Q5_K and Q6_K, its high words at ``h_off`` ``[N, C]``:
    the low nibbles' words (weights 4i..4i+3) and the high nibbles'
    (16+4i..). Q6_K's bytes are 4 x (code - 32)."""
    if KIND == 3 or KIND >= 7:  # Q5_K, Q5_0, Q5_1: one high word a chunk, bit 4 + i (i) of byte j above
        # weight 4i+j (16+4i+j)
        h = tl.load(high_words + h_off)[:, :, None]
        low = (q & 0x0F0F0F0F) | ((h >> j) & 0x10101010)
        high = ((q >> 4) & 0x0F0F0F0F) | ((h << (4 - j)) & 0x10101010)
    elif KIND == 4:  # Q6_K: two high words a chunk, bits 2i..2i+1 of byte j above weight 4i+j of each half
        # (-0x3F3F3F40 is 0xC0C0C0C0, the top two bits of each byte, as an int32)
        h_low = tl.load(high_words + h_off)[:, :, None]
        h_high = tl.load(high_words + h_off + 1)[:, :, None]
        low = ((q << 2) & 0x3C3C3C3C) | ((h_low << (6 - 2 * j)) & -0x3F3F3F40)
        high = ((q >> 2) & 0x3C3C3C3C) | ((h_high << (6 - 2 * j)) & -0x3F3F3F40)
    else:  # Q4_K
        low = q & 0x0F0F0F0F
        high = (q >> 4) & 0x0F0F0F0F
    return low, high


@triton.jit
def _gemv_superblock_kernel(
    xw, xmeta, quants, high_words, sub, supers, out, groups, M, N, STRIDE, WPR, KB, chunks_per_split,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # The superblock types (KIND 2 Q4_K, 3 Q5_K, 4 Q6_K, 5 IQ4_XS; 6 Q4_1, 7 Q5_0, 8 Q5_1 superblocks of one
    # chunk), as _gemv_words_kernel reads Q4_0 (x in the same layout), plus: high_words int32 Q5_K, Q5_0,
    # Q5_1 [N, KB], Q6_K [N, 2 * KB] (else unused); sub int16 [KB, N], a chunk's integer scales (none for
    # 6-8: scale 1, min 1 or 16); supers int32 [KB / 8, N] (6-8: [KB, N]), float16 d | dmin << 16.
    # BLOCK_C and chunks_per_split are multiples of 8 for 2-5: an iteration covers whole superblocks.
    ps = tl.program_id(1)
    n, n_in, n_safe, row0, first, m, m_in = _group(groups, N, BLOCK_N, BLOCK_M)
    c = tl.arange(0, BLOCK_C)
    j = tl.arange(0, 4)
    chunks = WPR // 4
    HIGH: tl.constexpr = 1 if (KIND == 3 or KIND >= 7) else 2 if KIND == 4 else 0  # high words a chunk
    PER: tl.constexpr = 1 if KIND >= 6 else 8  # chunks a superblock
    c_start = ps * chunks_per_split
    c_stop = tl.minimum(c_start + chunks_per_split, chunks)
    quants += row0.to(tl.int64) * WPR
    high_words += row0.to(tl.int64) * (HIGH * KB)
    q_off = n_safe[:, None, None] * WPR + (c * 4)[None, :, None] + j[None, None, :]
    x_off = (((first + m)[:, None, None, None] * chunks + c[None, None, :, None]) * 16 + j[None, None, None, :]
             + tl.zeros([BLOCK_N], tl.int32)[None, :, None, None])
    meta_off = ((first + m)[:, None] * KB + c[None, :]) * 2
    sub_off = c[None, :] * STRIDE + row0 + n_safe[:, None]
    sup_off = (c // PER)[None, :] * STRIDE + row0 + n_safe[:, None]
    h_off = n_safe[:, None] * (HIGH * KB) + c[None, :] * HIGH
    # IQ4's codebook words (values 0..3 and 8..11), in registers: (n >> 30) is 0, not to the compiler,
    # which would keep a constant in a uniform register and copy it out at every use
    bank0 = (-1079142271 + (n_safe >> 30))[:, None, None]
    bank1 = (639175937 + (n_safe >> 30))[:, None, None]
    fours = (0x44444444 + (n_safe >> 30))[:, None, None]  # the banks' bit of each nibble (a second constant)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_C), dtype=tl.float32)
    for c0 in range(c_start, c_stop, BLOCK_C):
        q = tl.load(quants + q_off + c0 * 4)
        if KIND == 5:
            low, high = _iq4_values(q, bank0, bank1, fours, USE_ASM)
        else:
            low, high = _superblock_words(q, high_words, h_off + c0 * HIGH, j, KIND)
        x_at = xw + x_off + c0 * 16
        dot_low = _dp2a_first(tl.load(x_at), low[None, :, :, :], False, USE_ASM)
        dot_low = _dp2a(tl.load(x_at + 4), low[None, :, :, :], dot_low, True, USE_ASM)
        sx = tl.load(xmeta + meta_off + c0 * 2)[:, None, :]
        sup = tl.load(supers + sup_off + (c0 // PER) * STRIDE)
        d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if KIND < 6:
            s = tl.load(sub + sub_off + c0 * STRIDE).to(tl.int32)  # [N, C]
        if KIND == 4:  # Q6_K: a scale per 16 weights, bytes 4 x (code - 32)
            dot_high = _dp2a_first(tl.load(x_at + 8), high[None, :, :, :], False, USE_ASM)
            dot_high = _dp2a(tl.load(x_at + 12), high[None, :, :, :], dot_high, True, USE_ASM)
            scaled = (tl.sum(dot_low, axis=3).to(tl.float32) * ((s << 24) >> 24).to(tl.float32)[None, :, :]
                      + tl.sum(dot_high, axis=3).to(tl.float32) * (s >> 8).to(tl.float32)[None, :, :])
            acc += scaled * (d * 0.25)[None, :, :] * sx
        else:
            dot = _dp2a(tl.load(x_at + 8), high[None, :, :, :], dot_low, False, USE_ASM)
            dot = _dp2a(tl.load(x_at + 12), high[None, :, :, :], dot, True, USE_ASM)
            total = tl.sum(dot, axis=3).to(tl.float32)
            if KIND == 5:  # IQ4_XS: d x scale x codebook value
                acc += total * (d * s.to(tl.float32))[None, :, :] * sx
            elif KIND >= 6:  # Q4_1, Q5_0, Q5_1: d x code - dmin x (1 or 16)
                dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                sums = tl.load(xmeta + meta_off + c0 * 2 + 1)[:, None, :]
                acc += (total * d[None, :, :] - sums * (dmin * (16.0 if KIND == 7 else 1.0))[None, :, :]) * sx
            else:  # Q4_K, Q5_K: d x scale x code - dmin x min
                dmin = ((sup >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                sums = tl.load(xmeta + meta_off + c0 * 2 + 1)[:, None, :]
                acc += (total * (d * (s & 0xFF).to(tl.float32))[None, :, :]
                        - sums * (dmin * ((s >> 8) & 0xFF).to(tl.float32))[None, :, :]) * sx
    result = tl.sum(acc, axis=2)
    tl.store(out + (ps * M + first + m[:, None]) * N + n[None, :], result, mask=m_in[:, None] & n_in[None, :])


# x's 16-bit code pairs, per plane, for the weight word lanes of each layout:
# (element of the block) pairs that meet dp2a's lo / hi bytes of word i of a block.
def _pairs(pairing: str) -> list[list[tuple[int, int]]]:
    if pairing == "8":  # word i of a block: weights 4i..4i+3
        return [[(4 * i, 4 * i + 1) for i in range(8)], [(4 * i + 2, 4 * i + 3) for i in range(8)]]
    if pairing == "iq4":  # IQ4's value words in nibble order: 4i+o then 16+4i+o, o = 0..3 a plane
        return [[(4 * i + o, 16 + 4 * i + o) for i in range(4)] for o in range(4)]
    # word i of a block: low nibbles weights 4i..4i+3, high nibbles 16+4i..16+4i+3
    return [[(4 * i + o, 4 * i + o + 1) for i in range(4)] for o in (0, 2)] + \
           [[(16 + 4 * i + o, 16 + 4 * i + o + 1) for i in range(4)] for o in (0, 2)]


@functools.cache
def _pair_index(pairing: str, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``_pairs`` as index tensors on ``device``, made once (a call inside a
    CUDA graph capture must not copy from the host)."""
    return [(torch.tensor([p[0] for p in pairs], device=device), torch.tensor([p[1] for p in pairs], device=device))
            for pairs in _pairs(pairing)]


def prepare_activations(x: torch.Tensor, pairing: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` as the kernels read it, padded with zeros to ``rows``
    rows: 16-bit codes per 32 values (scale max|x| / 32767) paired into
    int32 words, the planes of each chunk of 4 weight words together
    ``[rows, K * bits / 128, planes, 4]``; and per 32 values the scale and the
    codes' sum ``[rows, K / 32, 2]`` (float32; a sum of 32 codes is exact)."""
    m, k = x.shape
    if rows > m:
        x = torch.cat([x, x.new_zeros(rows - m, k)])
        m = rows
    xf = x.float().view(m, k // BLOCK, BLOCK)
    scale = xf.abs().amax(dim=2) / 32767.0
    codes = torch.round(xf / torch.where(scale > 0, scale, 1.0)[..., None]).to(torch.int32)
    planes = []
    for lo, hi in _pair_index(pairing, x.device):
        word = (codes[:, :, lo] & 0xFFFF) | (codes[:, :, hi] << 16)  # [M, KB, words per block]
        planes.append(word.reshape(m, -1, 4))  # [M, chunks, 4]
    words = torch.stack(planes, dim=2).contiguous()  # [M, chunks, planes, 4]
    meta = torch.stack([scale, codes.sum(dim=2).float()], dim=-1).contiguous()
    return words, meta


def prepare(x: torch.Tensor, planes: WordPlanes) -> tuple[torch.Tensor, torch.Tensor]:
    """x as ``gemv_words`` reads it for ``planes`` (and for every weight of
    the same pairing: q/k/v or gate/up share one preparation)."""
    return prepare_activations(x, pairing_of(planes), triton.next_power_of_2(x.shape[0]))


def _block_c(chunks: int, block_c: int, superblocks: bool, grid_type: bool = False) -> int:
    """The launch plan's chunk tile, or the largest power of two below it
    that divides a row's chunks (K = 640 in Q4_0 is 20 chunks: tiles of 4);
    a superblock type's tiles are whole superblocks of 8 chunks (a grid
    type's tiles of 32-weight chunks divide a superblock's 8)."""
    if grid_type:
        if 8 % block_c:
            raise ValueError(f"a grid type's tile divides a superblock's 8 chunks, got {block_c}")
        return block_c
    if superblocks:
        if block_c % 8:
            raise ValueError(f"a superblock type's tile is whole superblocks of 8 chunks, got {block_c}")
        while chunks % block_c:  # rows are whole superblocks: 8 divides them
            block_c //= 2
        return block_c
    while chunks % block_c:
        block_c //= 2
    return block_c


def gemv_words(x: torch.Tensor, planes: WordPlanes, splits: int | None = None, use_asm: bool | None = None,
               prepared: tuple[torch.Tensor, torch.Tensor] | None = None, **tiles) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (M <= 8), in ``x``'s dtype; ``splits``
    of K (default: enough for 4 programs per SM), ``prepared`` x from
    ``prepare`` (made here if None), ``tiles`` overriding the launch plan's
    (``block_n``, ``block_c``, ``num_warps``)."""
    m = x.shape[0]
    groups = _one_group(m, x.device)
    return _launch(x, planes, planes.rows, groups, 1, m, splits, use_asm, prepared, tiles)


def gemv_words_grouped(x: torch.Tensor, planes: WordPlanes, n_experts: int, runs: list[tuple[int, int, int]],
                       splits: int | None = None, use_asm: bool | None = None, **tiles) -> torch.Tensor:
    """Mixture-of-experts GEMVs in one launch: ``planes`` hold ``n_experts``
    matrices of ``N = rows / n_experts`` rows each, ``x`` ``[P, K]`` the
    routed rows grouped by expert, ``runs`` (expert, first row, rows) with at
    most 8 rows each. ``[P, N]`` in ``x``'s dtype: row ``j`` of a run times
    its expert's matrix (rows of ``x`` in no run are left as zeros)."""
    if planes.rows % n_experts:
        raise ValueError(f"{planes.rows} rows are not {n_experts} experts' matrices")
    if any(not 1 <= count <= GEMV_MAX_M for _, _, count in runs):
        raise ValueError(f"a grouped GEMV run holds 1 to {GEMV_MAX_M} rows, got {[r[2] for r in runs]}")
    rows = max(count for _, _, count in runs)
    groups = torch.tensor(runs, dtype=torch.int32).to(x.device, non_blocking=True)
    return _launch(x, planes, planes.rows // n_experts, groups, len(runs), rows, splits, use_asm, None, tiles)


@functools.cache
def _one_group(m: int, device: torch.device) -> torch.Tensor:
    """The group table of a plain weight, made once (a call inside a CUDA
    graph capture must not copy from the host)."""
    return torch.tensor([[0, 0, m]], dtype=torch.int32, device=device)


def _launch(x, planes, n, groups, n_groups, rows, splits, use_asm, prepared, tiles) -> torch.Tensor:
    """The GEMV over ``n_groups`` groups of at most ``rows`` rows of x, each
    times ``n`` rows of the planes (``_group`` in the kernels)."""
    m, k = x.shape
    launch = gemv_words_launch(int(planes.qtype), rows, **tiles)
    if k != planes.cols:
        raise ValueError(f"x has {k} columns, the weight {planes.cols}")
    grid_type = planes.kind.grid is not None
    chunks = k // BLOCK if grid_type else planes.words_per_row // 4  # a grid type's chunks are of 32 weights
    if tiles.get("block_c") and chunks % tiles["block_c"]:
        what = "32 weights" if grid_type else "4 words"
        raise ValueError(f"{chunks} chunks of {what} a row are not whole tiles of {tiles['block_c']}")
    block_n, block_m = launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_M"]
    block_c = _block_c(chunks, launch.constexprs["BLOCK_C"], planes.kind.chunks_per_super > 1, grid_type)
    if prepared is None:  # x's rows, and BLOCK_M of zeros after them for the last group's tile to read
        prepared = prepare_activations(x, pairing_of(planes), m + block_m if n_groups > 1 else block_m)
    xw, xmeta = prepared
    n_tiles = triton.cdiv(n, block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        splits = split_k(n_tiles * n_groups, chunks, block_c, sms)
    per_split = triton.cdiv(triton.cdiv(chunks, splits), block_c) * block_c
    splits = triton.cdiv(chunks, per_split)
    if use_asm is None:
        use_asm = x.is_cuda
    constexprs = {**launch.constexprs, "BLOCK_C": block_c, "USE_ASM": use_asm}
    common = (groups, m, n, planes.rows, planes.words_per_row, k // BLOCK, per_split)
    grid = (n_tiles, splits, n_groups)
    if grid_type:
        from ._triton_gemv_grid import gemv_grid_launch

        out = gemv_grid_launch(x, planes, prepared, groups, n, grid, (splits, per_split), constexprs,
                               launch.num_warps)
    elif planes.scales is not None:
        out = _new_out(splits, m, n, n_groups, x.device)
        _gemv_words_kernel[grid](xw, xmeta, planes.quants, planes.scales, out, *common,
                                 **constexprs, num_warps=launch.num_warps)
    else:
        high = planes.high if planes.high is not None else planes.quants
        sub = planes.sub if planes.sub is not None else planes.quants
        out = _new_out(splits, m, n, n_groups, x.device)
        _gemv_superblock_kernel[grid](xw, xmeta, planes.quants, high, sub, planes.supers, out, *common,
                                      **constexprs, num_warps=launch.num_warps)
    return out.sum(dim=0).to(x.dtype)

"""A quantized weight laid out for a GPU's wide loads, built once at load
from its GGUF blocks (the file stays the source of truth; CPU paths read the
blocks as they are).

A GGUF block interleaves scales with its codes (Q8_0: 34 bytes per 32
weights, Q4_K: 144 per 256), so a kernel reading blocks gathers bytes one at
a time. Here the codes of each row are one run of 32-bit words, 16-byte
aligned, and everything else sits in planes of its own. A kernel takes a
row 32 weights (a *chunk*) at a time: 4 or 8 code words, its high-bit words
and its sub-block scales.

- ``quants`` int32 ``[rows, cols * bits / 32]``. Q8_0 (8 bits): word ``w``
  holds the codes of weights ``4w..4w+3`` (byte ``j``: weight ``4w+j``,
  signed). Every other type (4 bits): each chunk's 16 code bytes as 4 words,
  byte ``i`` holding weight ``i`` of the chunk in its low nibble and weight
  ``16+i`` in its high one (GGUF's Q4_0 order; Q4_K and Q5_K reordered to
  it). Word ``i`` of a chunk thus carries weights ``4i..4i+3`` (low nibbles)
  and ``16+4i..16+4i+3`` (high nibbles).
- ``high`` int32, the code bits above the nibble (None for 4-bit types).
  Q5_K ``[rows, cols / 32]``: one word a chunk, byte ``j`` bit ``4+i`` (``i``)
  the fifth bit of weight ``4i+j`` (``16+4i+j``): shifted right by ``i``, the
  low nibble's bit is where its byte wants it (bit 4) and the high nibble's
  at bit 0, where the tensor-core GEMV sets the top byte of 16 x its code.
  Q6_K ``[rows, cols / 16]``: two words a chunk, the first for weights
  0..15, the second for 16..31; byte ``j`` bits ``2i, 2i+1`` the two high
  bits of weight ``4i+j`` of the half, with their top bit flipped: nibble
  and high bits together are the 6-bit two's complement of ``code - 32``.
- ``scales`` float16 ``[cols / 32, rows]`` (Q8_0, Q4_0: a weight is scale
  times its code, Q4_0's less 8), stored scale-column-major: one block
  column's scales for every row are contiguous, so a thread that handles
  several rows reads them in one load.
- ``sub`` int16 ``[cols / 32, rows]`` (superblock types): each chunk's
  integer sub-block scales. Q4_K, Q5_K: scale in the low byte, min in the
  high one (6 bits each). Q6_K: the scale of weights 0..15 in the low byte,
  of 16..31 in the high one (signed). IQ4_XS: the scale (less 32, signed).
- ``supers`` int32 ``[cols / 256, rows]`` (superblock types): the float16
  ``d`` in the low half, ``dmin`` (Q4_K, Q5_K; else 0) in the high one.

IQ3_S and IQ2_XXS (the *grid types*) keep their codebook indices as
words; a kernel looks each index up in the type's grid (``grid_words``: 4
unsigned byte levels per word) and applies its sign bits:

- IQ3_S: ``quants`` ``[rows, cols / 16]``, a chunk's 8 index bytes in 2
  words (index ``k``: weights ``4k..4k+3``); ``high`` ``[rows, cols / 32]``,
  the chunk's sign word, bit ``8e + k`` the sign of weight ``4k + e`` (so
  that ``(word >> k) & 0x01010101`` puts a level word's 4 signs at bit 0 of
  its bytes; GGUF's bit ``b`` is weight ``b``'s); ``sub`` the
  index's ninth bits in the high byte (index ``k``'s at bit ``8 + k``: where
  ``sub >> k`` meets the index) and the 4-bit scale in the low one; a
  weight is ``d * (1 + 2 scale) * level * sign``.
- IQ2_XXS: ``quants`` ``[rows, cols / 32]``, a chunk's 4 index bytes
  (index ``k``: weights ``8k..8k+7``); ``high`` the chunk's GGUF sign word
  as it is (four 7-bit sign indices, bit 7 of each the parity of the
  seven, and the 4-bit scale in bits 28..31); no ``sub``; a weight is
  ``d * (0.5 + scale) / 4 * level * sign``.

Q4_1, Q5_0 and Q5_1 (a float16 d, and m, per 32) are superblock types of
one chunk without ``sub``: ``supers`` ``[cols / 32, rows]``, an implied
scale of 1 and min of ``WordType.unit_min``: Q4_1 and Q5_1 hold ``-m`` as
dmin (min 1), Q5_0 ``d`` (min 16); Q5_0 and Q5_1 have Q5_K's high word.

A weight is then ``d * scale * code - dmin * min`` (Q4_K, Q5_K; Q4_1, Q5_0,
Q5_1: ``d * code + m``, ``d * code - 16 d``), ``d * scale * (code - 32)``
(Q6_K), ``d * scale * kvalues[code]`` (IQ4_XS). Bytes: Q8_0, Q4_0, Q4_1 and
Q5_1 as their blocks; Q4_K, Q5_K, Q6_K, IQ2_XXS at most 3% more, IQ3_S 5.5%
(a 16-bit sub word where the blocks pack 12 bits), IQ4_XS 9% (16 bits where
they pack 8), Q5_0 9% (its d twice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch
from gguf import GGMLQuantizationType as T

from .formats import block_format, lookup_table
from .quant_tensor import QuantTensor
from .reference import superblock_parts

BLOCK = 32  # weights per chunk (and per scale, in Q8_0 and Q4_0)
SUPER = 256  # weights per superblock


@dataclass(frozen=True)
class WordType:
    """How a type's planes are made: ``quants`` bits per weight (8 or 4;
    a grid type's index bits, 2 or 1), high words per chunk, whether scales
    come as ``sub`` x ``supers``, for a superblock of one chunk (no ``sub``)
    the min its dmin multiplies, and a grid type's codebook (the
    ``formats.lookup_table`` name)."""

    bits: int
    high_words: int = 0
    superblocks: bool = False
    unit_min: int | None = None
    grid: str | None = None

    @property
    def has_sub(self) -> bool:
        """Whether the planes hold ``sub`` (IQ2_XXS keeps its scale in its sign word)."""
        return self.superblocks and self.unit_min is None and self.grid != "iq2xxs_grid"

    @property
    def chunks_per_super(self) -> int:
        """Chunks that share a superblock's d (1: a scale per chunk)."""
        return SUPER // BLOCK if self.superblocks and self.unit_min is None else 1

    @property
    def block_weights(self) -> int:
        """Weights in one of the type's GGUF blocks."""
        return BLOCK * self.chunks_per_super


WORD_TYPES = {
    T.Q8_0: WordType(8), T.Q4_0: WordType(4),
    T.Q4_K: WordType(4, 0, True), T.Q5_K: WordType(4, 1, True), T.Q6_K: WordType(4, 2, True),
    T.IQ4_XS: WordType(4, 0, True),
    T.Q4_1: WordType(4, 0, True, unit_min=1), T.Q5_0: WordType(4, 1, True, unit_min=16),
    T.Q5_1: WordType(4, 1, True, unit_min=1),
    T.IQ3_S: WordType(2, 1, True, grid="iq3s_grid"), T.IQ2_XXS: WordType(1, 1, True, grid="iq2xxs_grid"),
}
GRID_TYPES = tuple(t for t, kind in WORD_TYPES.items() if kind.grid)


def has_word_layout(qt: QuantTensor) -> bool:
    """Whether ``qt`` can be laid out as ``WordPlanes`` (a 2-D weight of a type with a word layout)."""
    return qt.qtype in WORD_TYPES and len(qt.shape) == 2


def pairing_of(planes: "WordPlanes") -> str:
    """How x's 16-bit codes pair to meet ``planes``' words (the GEMV's
    ``_pairs``): by 8-bit codes (a grid type's looked-up levels are those),
    by nibbles, or by IQ4's value words."""
    if planes.kind.grid:
        return "8"
    return "iq4" if planes.qtype == T.IQ4_XS else str(planes.bits)


def bytes_per_weight(qtype: T) -> float:
    """Bytes of every plane per weight (what a GEMV streams)."""
    kind = WORD_TYPES[qtype]
    if kind.unit_min is not None:  # codes, high words, d and dmin
        return (BLOCK * kind.bits / 8 + 4 * kind.high_words + 4) / BLOCK
    scale = 2 if kind.has_sub or not kind.superblocks else 0  # a float16 scale or a sub word
    chunk = BLOCK * kind.bits / 8 + 4 * kind.high_words + scale  # codes, high words, a scale
    return chunk / BLOCK + (4 / SUPER if kind.superblocks else 0)


@dataclass(frozen=True)
class WordPlanes:
    """A 2-D weight ``[rows, cols]`` as code words and scale planes (the
    module's docstring gives each plane's layout per type).

    Invariant: every plane present is contiguous and on one device;
    ``quants`` is int32 ``[rows, cols * bits / 32]``; ``scales`` is present
    exactly for the types without superblocks, ``supers`` exactly for those
    with, ``sub`` for those with but those of one chunk (``unit_min``) and
    IQ2_XXS (``WordType.has_sub``); ``high`` exactly for Q5_K, Q6_K, Q5_0,
    Q5_1 and the grid types; ``cols`` is a multiple of 32 (of 256 with
    superblocks of 8 chunks)."""

    qtype: T
    rows: int
    cols: int
    quants: torch.Tensor
    scales: torch.Tensor | None = None
    high: torch.Tensor | None = None
    sub: torch.Tensor | None = None
    supers: torch.Tensor | None = None

    @property
    def kind(self) -> WordType:
        return WORD_TYPES[self.qtype]

    @property
    def bits(self) -> int:
        return self.kind.bits

    @property
    def words_per_row(self) -> int:
        return self.quants.shape[1]

    @property
    def planes(self) -> list[torch.Tensor]:
        return [p for p in (self.quants, self.scales, self.high, self.sub, self.supers) if p is not None]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)

    @property
    def device(self) -> torch.device:
        return self.quants.device

    @cached_property
    def fits_mma(self) -> bool:
        """Whether every block scale is below 64, so that 1024 times it is a
        float16 (what the tensor-core GEMV's exact conversion needs; real
        weights' scales are far smaller). Computed once, on first use."""
        if self.kind.grid:
            return False
        return bool(block_scales(self).abs().max() < 64) if self.cols else True

    def select_rows(self, index: torch.Tensor) -> WordPlanes:
        """The planes of rows ``index`` alone (a copy: one expert's matrix of
        a mixture's, the rows a lookup asks for)."""
        index = index.reshape(-1).to(self.device)
        picked = [None if p is None else p.index_select(dim, index).contiguous()
                  for p, dim in ((self.scales, 1), (self.high, 0), (self.sub, 1), (self.supers, 1))]
        return WordPlanes(self.qtype, int(index.numel()), self.cols, self.quants.index_select(0, index).contiguous(),
                          *picked)

    @classmethod
    def of(cls, qt: QuantTensor) -> WordPlanes:
        """``qt``'s blocks split into code words and scale planes, on ``qt``'s device."""
        if qt.qtype not in WORD_TYPES:
            raise ValueError(f"{qt.qtype.name} has no word layout; types with one: "
                             f"{', '.join(t.name for t in WORD_TYPES)}")
        if len(qt.shape) != 2:
            raise ValueError(f"word planes hold a 2-D weight, got shape {qt.shape}")
        if WORD_TYPES[qt.qtype].unit_min is not None:
            return _chunk_planes(qt)
        if WORD_TYPES[qt.qtype].grid:
            return _grid_planes(qt)
        if qt.qtype in (T.Q8_0, T.Q4_0):
            code_bytes = 32 if qt.qtype == T.Q8_0 else 16
            blocks = qt.data.view(qt.rows, qt.cols // BLOCK, 2 + code_bytes)
            scales = blocks[:, :, :2].contiguous().view(torch.float16).view(qt.rows, -1).t().contiguous()
            quants = blocks[:, :, 2:].contiguous().view(qt.rows, -1).view(torch.int32)
            return cls(qt.qtype, qt.rows, qt.cols, quants, scales=scales)
        return _superblock_planes(qt)


def _fifth_bit_shifts(device: torch.device) -> torch.Tensor:
    """``[1, 1, half, word i, 1]``: the bit of a Q5 high word's byte that holds
    the fifth bit of weight ``16 half + 4i + j`` (``4 + i``, or ``i`` for the
    high nibbles)."""
    return (torch.arange(4, device=device).view(1, 1, 1, 4, 1)
            + 4 * (1 - torch.arange(2, device=device)).view(1, 1, 2, 1, 1))


def _superblock_planes(qt: QuantTensor) -> WordPlanes:
    rows, chunks = qt.rows, qt.cols // BLOCK
    parts = superblock_parts(qt.data.reshape(-1, block_format(qt.qtype).type_size), qt.qtype)
    codes = parts.codes.view(rows, chunks, 2, 16)  # [row, chunk, half, i]: weight 16 * half + i of the chunk
    nibbles = (codes[:, :, 0] & 0x0F) | ((codes[:, :, 1] & 0x0F) << 4)
    quants = nibbles.to(torch.uint8).contiguous().view(torch.int32).view(rows, -1)
    high = None
    by_word = codes.view(rows, chunks, 2, 4, 4)  # [row, chunk, half, word i, byte j]
    if qt.qtype == T.Q5_K:
        bit = (by_word >> 4) & 1
        high = (bit << _fifth_bit_shifts(codes.device)).sum(dim=(2, 3)).to(torch.uint8)  # [row, chunk, byte j]
    elif qt.qtype == T.Q6_K:
        two = ((by_word >> 4) ^ 2) & 3
        shifts = 2 * torch.arange(4, device=codes.device).view(1, 1, 1, 4, 1)
        high = (two << shifts).sum(dim=3).to(torch.uint8)  # [row, chunk, half, byte j]
    if high is not None:
        high = high.contiguous().view(torch.int32).view(rows, -1)
    if qt.qtype == T.Q6_K:
        pairs = parts.sub.view(rows, chunks, 2)
        sub = (pairs[..., 0] & 0xFF) | (pairs[..., 1] << 8)
    elif parts.mins is not None:
        sub = parts.sub.view(rows, chunks) | (parts.mins.view(rows, chunks) << 8)
    else:
        sub = parts.sub.view(rows, chunks)
    d = parts.d.view(torch.int16).int() & 0xFFFF
    dmin = parts.dmin.view(torch.int16).int() & 0xFFFF if parts.dmin is not None else torch.zeros_like(d)
    supers = (d | (dmin << 16)).view(rows, -1)
    return WordPlanes(qt.qtype, rows, qt.cols, quants, high=high,
                      sub=sub.to(torch.int16).t().contiguous(), supers=supers.t().contiguous())


def _chunk_planes(qt: QuantTensor) -> WordPlanes:
    """Q4_1, Q5_0, Q5_1: superblocks of one chunk (the module's docstring)."""
    rows, chunks = qt.rows, qt.cols // BLOCK
    blocks = qt.data.reshape(rows, chunks, block_format(qt.qtype).type_size)
    d = blocks[..., 0:2].contiguous().view(torch.int16).int().squeeze(-1) & 0xFFFF
    if qt.qtype == T.Q5_0:
        dmin = d
    else:  # -m: the float16's sign bit flipped
        dmin = (blocks[..., 2:4].contiguous().view(torch.int16).int().squeeze(-1) & 0xFFFF) ^ 0x8000
    quants = blocks[..., -16:].contiguous().view(rows, -1).view(torch.int32)
    high = None
    if qt.qtype != T.Q4_1:  # qh bit w: the fifth bit of weight w; to Q5_K's word
        qh = blocks[..., -20:-16].contiguous().view(torch.int32).squeeze(-1)
        w = torch.arange(32, device=qh.device)
        bits = (qh[..., None] >> w) & 1  # [row, chunk, weight]
        shifts = 8 * (w % 4) + _fifth_bit_shifts(qh.device).view(2, 4)[w // 16, (w % 16) // 4]
        high = (bits << shifts).sum(dim=-1).to(torch.int32).contiguous()  # distinct bits: the sum is their or
    supers = (d | (dmin << 16)).t().contiguous()
    return WordPlanes(qt.qtype, rows, qt.cols, quants, high=high, supers=supers)


def _grid_planes(qt: QuantTensor) -> WordPlanes:
    """IQ3_S, IQ2_XXS: index words, sign words, scales (the module's docstring)."""
    rows, supers_per_row = qt.rows, qt.cols // SUPER
    blocks = qt.data.reshape(rows, supers_per_row, block_format(qt.qtype).type_size)
    d = blocks[..., 0:2].contiguous().view(torch.int16).int().squeeze(-1) & 0xFFFF
    supers = d.t().contiguous()
    if qt.qtype == T.IQ2_XXS:  # per chunk: 4 index bytes, then the sign and scale word
        chunks = blocks[..., 2:].reshape(rows, -1, 2, 4)
        quants = chunks[:, :, 0].contiguous().view(torch.int32).view(rows, -1)
        high = chunks[:, :, 1].contiguous().view(torch.int32).view(rows, -1)
        return WordPlanes(qt.qtype, rows, qt.cols, quants, high=high, supers=supers)
    qs, qh, signs, scales = (blocks[..., a:b] for a, b in ((2, 66), (66, 74), (74, 106), (106, 110)))
    quants = qs.contiguous().view(rows, -1).view(torch.int32)
    weight_bits = (signs.reshape(rows, -1, 4, 1).int() >> torch.arange(8, device=signs.device)) & 1
    weight_bits = weight_bits.reshape(rows, -1, 8, 4).long()  # [row, chunk, level word k, byte e]
    at = 8 * torch.arange(4, device=signs.device) + torch.arange(8, device=signs.device)[:, None]  # bit 8e + k
    high = (weight_bits << at).sum(dim=(2, 3)).to(torch.int32)  # distinct bits: the sum is their or
    nibbles = torch.stack([scales & 0x0F, scales >> 4], dim=-1).reshape(rows, -1).to(torch.int16)
    sub = (qh.reshape(rows, -1).to(torch.int16) << 8) | nibbles  # (bit 15 set: a negative int16)
    return WordPlanes(qt.qtype, rows, qt.cols, quants, high=high, sub=sub.t().contiguous(), supers=supers)


@functools.cache
def grid_words(qtype: T, device: torch.device) -> torch.Tensor:
    """int32: a grid type's codebook as words of 4 unsigned byte levels (IQ3_S: one word an index; IQ2_XXS:
    two, weights 0..3 then 4..7), on ``device`` (made once)."""
    levels = lookup_table(WORD_TYPES[qtype].grid, torch.device("cpu")).to(torch.uint8)
    return levels.contiguous().view(torch.int32).reshape(-1).to(device)


def _grid_weights(planes: WordPlanes) -> torch.Tensor:
    """float32 ``[rows, cols]`` of a grid type: the products ``reference``
    forms for the blocks, in its order (``db * level * sign``)."""
    rows, chunks = planes.rows, planes.cols // BLOCK
    index = planes.quants.contiguous().view(torch.uint8).view(rows, chunks, -1).long()
    d = (planes.supers.t() & 0xFFFF).to(torch.int16).view(torch.float16).float().repeat_interleave(8, dim=1)
    word = planes.high.int()  # [rows, chunks]
    if planes.qtype == T.IQ3_S:
        sub = planes.sub.t().int()
        index = index | ((sub[..., None] >> torch.arange(8, device=sub.device)) & 0x100).long()
        db = d * (1 + 2 * (sub & 0xF)).float()
        i = torch.arange(32, device=word.device)
        sign_bits = (word[..., None] >> (8 * (i % 4) + i // 4)) & 1  # [rows, chunks, 32]: weight 4k + e at 8e + k
    else:
        db = d * (0.5 + ((word >> 28) & 0xF).float()) * 0.25
        shifts = torch.arange(8, device=word.device)
        pattern = lookup_table("ksigns", word.device).int()[((word[..., None] >> (7 * shifts[:4])) & 0x7F).long()]
        sign_bits = ((pattern[..., None] >> shifts) & 1).reshape(rows, chunks, 32)
    levels = lookup_table(planes.kind.grid, word.device)[index].reshape(rows, chunks, 32)
    signs = 1.0 - 2.0 * sign_bits.float()
    return (db[..., None] * levels * signs).reshape(rows, planes.cols)


def _codes(planes: WordPlanes) -> torch.Tensor:
    """int32 ``[rows, cols / 32, 32]``: each weight's code (Q6_K's less 32)."""
    rows, chunks = planes.rows, planes.cols // BLOCK
    codes = planes.quants.contiguous().view(torch.uint8).view(rows, chunks, -1).int()
    if planes.qtype == T.Q8_0:
        return (codes << 24) >> 24  # signed bytes
    nib = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # [row, chunk, 32]
    if planes.high is not None and planes.kind.high_words == 1:  # Q5_K, Q5_0, Q5_1
        byte = planes.high.contiguous().view(torch.uint8).view(rows, chunks, 1, 1, 4).int()
        nib = nib | (((byte >> _fifth_bit_shifts(byte.device)) & 1) << 4).reshape(rows, chunks, 32)
    elif planes.qtype == T.Q6_K:
        byte = planes.high.contiguous().view(torch.uint8).view(rows, chunks, 2, 1, 4).int()
        shifts = 2 * torch.arange(4, device=byte.device).view(1, 1, 1, 4, 1)
        six = nib | ((((byte >> shifts) & 3) << 4).reshape(rows, chunks, 32))  # two's complement of code - 32
        nib = six - ((six & 0x20) << 1)
    return nib


def block_scales(planes: WordPlanes) -> torch.Tensor:
    """float32 ``[rows, cols / 16]``: the scale of each 16 weights, as the
    tensor-core GEMV rounds it to float16 (``d x`` the integer scale)."""
    if planes.kind.grid:
        raise ValueError(f"{planes.qtype.name} has no tensor-core GEMV (its weights are looked up in a grid)")
    if planes.scales is not None:
        return planes.scales.t().float().repeat_interleave(2, dim=1)
    if planes.kind.unit_min is not None:
        return (planes.supers.t() & 0xFFFF).to(torch.int16).view(torch.float16).float().repeat_interleave(2, dim=1)
    sub = planes.sub.t().int()
    d = (planes.supers.t() & 0xFFFF).to(torch.int16).view(torch.float16).float().repeat_interleave(
        SUPER // BLOCK, dim=1)
    if planes.qtype == T.Q6_K:
        scale = torch.stack([(sub << 24) >> 24, sub >> 8], dim=-1).flatten(1)
        return (d.repeat_interleave(2, dim=1) * scale.float()).half().float()
    integer = sub if planes.qtype == T.IQ4_XS else sub & 0xFF
    return (d * integer.float()).half().float().repeat_interleave(2, dim=1)


def dequantize_planes(planes: WordPlanes) -> torch.Tensor:
    """float32 ``[rows, cols]``: the torch reference of the layout (equal to
    the blocks' dequantization, bit for bit: the same products in the same
    order as ``gguf.quants``)."""
    if planes.kind.grid:
        return _grid_weights(planes)
    rows, chunks = planes.rows, planes.cols // BLOCK
    codes = _codes(planes)
    if planes.scales is not None:
        q = codes.float() - (8 if planes.qtype == T.Q4_0 else 0)
        return (planes.scales.t().float().unsqueeze(-1) * q).reshape(rows, planes.cols)
    supers = planes.supers.t().contiguous()
    per = planes.kind.chunks_per_super
    d = (supers & 0xFFFF).to(torch.int16).view(torch.float16).float().repeat_interleave(per, dim=1)
    if planes.kind.unit_min is not None:  # d x code - dmin x unit_min
        dmin = ((supers >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
        ml = (dmin * float(planes.kind.unit_min)).unsqueeze(-1)
        return (d.unsqueeze(-1) * codes.float() - ml).reshape(rows, planes.cols)
    sub = planes.sub.t().int()  # [rows, chunks]
    if planes.qtype == T.Q6_K:
        scale = torch.stack([(sub << 24) >> 24, sub >> 8], dim=-1)  # [rows, chunks, 2] signed
        dl = (d.unsqueeze(-1) * scale.float()).unsqueeze(-1)  # [rows, chunks, 2, 1]
        return (dl * codes.view(rows, chunks, 2, 16).float()).reshape(rows, planes.cols)
    if planes.qtype == T.IQ4_XS:
        dl = (d * sub.float()).unsqueeze(-1)
        q = lookup_table("iq4nl_values", codes.device)[codes.long()]
        return (dl * q).reshape(rows, planes.cols)
    dmin = ((supers >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float().repeat_interleave(
        SUPER // BLOCK, dim=1)
    dl = (d * (sub & 0xFF).float()).unsqueeze(-1)
    ml = (dmin * ((sub >> 8) & 0xFF).float()).unsqueeze(-1)
    return (dl * codes.float() - ml).reshape(rows, planes.cols)


def planes_rows(planes: WordPlanes, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``index`` of the weight, dequantized to ``dtype`` ``[len(index),
    cols]`` (a token table's lookup: only those rows are read)."""
    return dequantize_planes(planes.select_rows(index)).to(dtype)

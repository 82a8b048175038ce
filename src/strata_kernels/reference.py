"""Torch implementations of the kernel ops: the test oracle and the CPU path.

``dequantize_blocks(blocks, qtype)`` turns ``[n_blocks, type_size]`` bytes into
``[n_blocks, block_size]`` float32. Every type follows the arithmetic of
``gguf.quants`` operation by operation (same products, same order, no fused
multiply-add), so the result equals ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from .formats import QK_K, iq1_delta, lookup_table

Blocks = torch.Tensor


# --- byte-field helpers -----------------------------------------------------

def _split(blocks: Blocks, *sizes: int) -> list[Blocks]:
    """Split each block's bytes into fields of the given sizes (the rest last)."""
    out, start = [], 0
    for size in sizes:
        out.append(blocks[:, start:start + size])
        start += size
    out.append(blocks[:, start:])
    return out


def _view(field: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret little-endian byte fields as ``dtype`` (copying when a
    column slice leaves them unaligned)."""
    size = dtype.itemsize
    if field.storage_offset() % size or field.stride(0) % size or not field.is_contiguous():
        field = field.clone(memory_format=torch.contiguous_format)
    return field.view(dtype)


def _f16(field: Blocks) -> torch.Tensor:
    """Float16 fields -> float32 ``[n, k]``."""
    return _view(field, torch.float16).float()


def _u16(field: Blocks) -> torch.Tensor:
    return _view(field, torch.int16).to(torch.int32) & 0xFFFF


def _u32(field: Blocks) -> torch.Tensor:
    return _view(field, torch.int32).to(torch.int64) & 0xFFFFFFFF


def _shifts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(shape)


def _nibbles(field: Blocks, n: int, group: int) -> torch.Tensor:
    """Low nibbles of each ``group`` bytes, then their high nibbles."""
    x = field.reshape(n, -1, 1, group) >> _shifts([0, 4], (1, 1, 2, 1), field)
    return (x & 0x0F).reshape(n, -1)


def _bits(field: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Each value's low ``n_bits`` bits, least significant first: ``[..., n_bits]``."""
    return (field.unsqueeze(-1) >> _shifts(list(range(n_bits)), (n_bits,), field)) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


# --- float and legacy formats ------------------------------------------------

def _f32(b: Blocks) -> torch.Tensor:
    return _view(b, torch.float32)


def _f16_blocks(b: Blocks) -> torch.Tensor:
    return _f16(b)


def _bf16(b: Blocks) -> torch.Tensor:
    return (_view(b, torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(b: Blocks) -> torch.Tensor:
    d, qs = _split(b, 2)
    q = _nibbles(qs, b.shape[0], 16).to(torch.int8) - 8
    return _f16(d) * q.float()


def _q4_1(b: Blocks) -> torch.Tensor:
    d, m, qs = _split(b, 2, 2)
    q = _nibbles(qs, b.shape[0], 16).float()
    return _f16(d) * q + _f16(m)


def _q5_bits(qh: Blocks, qs: Blocks) -> torch.Tensor:
    n = qs.shape[0]
    high = _bits(_u32(qh).reshape(n), 32).to(torch.uint8)
    return _nibbles(qs, n, 16) | (high << 4)


def _q5_0(b: Blocks) -> torch.Tensor:
    d, qh, qs = _split(b, 2, 4)
    q = _q5_bits(qh, qs).to(torch.int8) - 16
    return _f16(d) * q.float()


def _q5_1(b: Blocks) -> torch.Tensor:
    d, m, qh, qs = _split(b, 2, 2, 4)
    return _f16(d) * _q5_bits(qh, qs).float() + _f16(m)


def _q8_0(b: Blocks) -> torch.Tensor:
    d, x = _split(b, 2)
    return _view(x, torch.int8).float() * _f16(d)


# --- k-quants ----------------------------------------------------------------

def _q2_k(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = _split(b, QK_K // 16, QK_K // 4, 2)
    dl = (_f16(d) * (scales & 0xF).float()).reshape(n, QK_K // 16, 1)
    ml = (_f16(dmin) * (scales >> 4).float()).reshape(n, QK_K // 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)) & 3
    q = q.reshape(n, QK_K // 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales, d = _split(b, QK_K // 8, QK_K // 4, 12)
    low, high = scales[:, :8], scales[:, 8:]
    low = (low.reshape(n, 1, 8) >> _shifts([0, 4], (1, 2, 1), low)).reshape(n, 16)
    high = (high.reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), high)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (_f16(d) * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), hmask)).reshape(n, 16, 16) & 1
    # The offset 4 applies where the high bit is clear.
    q = (ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4_k_parts(b: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks ``[n, 144]`` -> codes ``[n, 256]`` (0..15, uint8), and the
    scale and min of each group of 32 ``[n, 8]`` (float32): w = scale * q - min."""
    n = b.shape[0]
    d, dmin, scales, qs = _split(b, 2, 2, 12)
    sc, mn = _k_scale_min(scales)
    return _nibbles(qs, n, 32), _f16(d) * sc.float(), _f16(dmin) * mn.float()


def _q4_k(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    q, scale, minv = q4_k_parts(b)
    return (scale.reshape(n, -1, 1) * q.reshape(n, -1, 32).float() - minv.reshape(n, -1, 1)).reshape(n, QK_K)


def _q5_k(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, dmin, scales, qh, qs = _split(b, 2, 2, 12, QK_K // 8)
    sc, mn = _k_scale_min(scales)
    dl = (_f16(d) * sc.float()).reshape(n, -1, 1)
    ml = (_f16(dmin) * mn.float()).reshape(n, -1, 1)
    ql = _nibbles(qs, n, 32).reshape(n, -1, 32)
    high = (qh.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), qh)).reshape(n, -1, 32) & 1
    q = (ql | (high << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = _split(b, QK_K // 2, QK_K // 4, QK_K // 16)
    dl = (_f16(d) * _view(scales, torch.int8).float()).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, n, 64).reshape(n, -1, 32)
    high = (qh.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qh)).reshape(n, -1, 32) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (dl * q).reshape(n, QK_K)


# --- ternary and microscaling ------------------------------------------------

def _tq1_0(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    qs, qh, d = _split(b, (QK_K - 4 * QK_K // 64) // 5, QK_K // 64)
    pow3 = [1, 3, 9, 27, 81]
    q0 = (qs[:, :32].reshape(n, 1, 1, 32) * _shifts(pow3, (1, 1, 5, 1), qs)).reshape(n, -1)
    q1 = (qs[:, 32:].reshape(n, 1, 1, 16) * _shifts(pow3, (1, 1, 5, 1), qs)).reshape(n, -1)
    q2 = (qh.reshape(n, 1, 1, 4) * _shifts(pow3[:4], (1, 1, 4, 1), qh)).reshape(n, -1)
    q = torch.cat([q0, q1, q2], dim=-1)
    q = ((q.to(torch.int32) * 3) >> 8).to(torch.int8) - 1
    return _f16(d) * q.float()


def _tq2_0(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    qs, d = _split(b, QK_K // 4)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)) & 3
    return _f16(d) * (q.reshape(n, -1).to(torch.int8) - 1).float()


def _mxfp4(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    e, qs = _split(b, 1)
    e = e.to(torch.int32)
    # e8m0 exponent to float32, halved (the table holds doubled e2m1 values).
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    q = lookup_table("mxfp4_values", b.device)[_nibbles(qs, n, 16).long()]
    return d * q


# --- the IQ family -----------------------------------------------------------

def _ksign_bits(index: torch.Tensor) -> torch.Tensor:
    """Sign patterns: ``ksigns[index]`` unpacked to ``[..., 8]`` of +-1."""
    ksigns = lookup_table("ksigns", index.device)
    return _signs(_bits(ksigns[index.long()], 8))


def _iq2_xxs(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs = _split(b, 2)
    groups = qs.reshape(n, QK_K // 32, 8)
    aux = _u32(groups[:, :, 4:]).reshape(n, -1)
    db = (_f16(d) * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, -1, 1, 1)
    sign_idx = (aux.unsqueeze(-1) >> _shifts([0, 7, 14, 21], (1, 1, 4), aux)) & 0x7F
    signs = _ksign_bits(sign_idx)
    grid = lookup_table("iq2xxs_grid", b.device)[groups[:, :, :4].long()]
    return (db * grid * signs).reshape(n, -1)


def _iq2_xs(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs, scales = _split(b, 2, 2 * QK_K // 8)
    qs = _u16(qs)
    sc = _nibbles_pairs(scales, n)
    db = (_f16(d) * (0.5 + sc.float()) * 0.25).reshape(n, -1, 1, 1)
    signs = _ksign_bits(qs >> 9).reshape(n, -1, 2, 8)
    grid = lookup_table("iq2xs_grid", b.device)[(qs & 511).long()].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, -1)


def _nibbles_pairs(field: Blocks, n: int) -> torch.Tensor:
    """Each byte's low nibble then its high nibble: ``[n, 2 * bytes]``."""
    x = field.reshape(n, -1, 1) >> _shifts([0, 4], (1, 1, 2), field)
    return (x & 0x0F).reshape(n, -1)


def _iq2_s(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs, sign_bytes, qh, scales = _split(b, 2, QK_K // 8, QK_K // 8, QK_K // 32)
    sc = _nibbles_pairs(scales, n)
    db = (_f16(d) * (0.5 + sc.float()) * 0.25).reshape(n, -1, 1, 1)
    signs = _signs(_bits(sign_bytes, 8)).reshape(n, -1, 2, 8)
    high = ((qh.reshape(n, -1, 1) >> _shifts([0, 2, 4, 6], (1, 1, 4), qh)) & 3).reshape(n, -1)
    idx = qs.long() | (high.long() << 8)
    grid = lookup_table("iq2s_grid", b.device)[idx].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq3_xxs(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs, scales = _split(b, 2, QK_K // 4)
    aux = _u32(scales).reshape(n, -1)
    db = (_f16(d) * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, -1, 1, 1)
    sign_idx = (aux.unsqueeze(-1) >> _shifts([0, 7, 14, 21], (1, 1, 4), aux)) & 0x7F
    signs = _ksign_bits(sign_idx)
    grid = lookup_table("iq3xxs_grid", b.device)[qs.long()].reshape(n, -1, 4, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq3_s(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs, qh, sign_bytes, scales = _split(b, 2, QK_K // 4, QK_K // 32, QK_K // 8)
    sc = _nibbles_pairs(scales, n)
    db = (_f16(d) * (1 + 2 * sc).float()).reshape(n, -1, 1, 1)
    signs = _signs(_bits(sign_bytes, 8)).reshape(n, -1, 4, 8)
    idx = qs.long() | (_bits(qh, 8).reshape(n, -1).long() << 8)
    grid = lookup_table("iq3s_grid", b.device)[idx].reshape(n, -1, 4, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq1_s(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs, qh = _split(b, 2, QK_K // 8)
    qh = _u16(qh)
    dl = (_f16(d) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, -1, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, iq1_delta(), -iq1_delta()).float().reshape(n, -1, 1, 1)
    high = ((qh.unsqueeze(-1) >> _shifts([0, 3, 6, 9], (1, 1, 4), qh)) & 7).reshape(n, -1)
    idx = qs.long() | (high.long() << 8)
    grid = lookup_table("iq1s_grid", b.device)[idx].reshape(n, -1, 4, 8)
    return (dl * (grid + delta)).reshape(n, -1)


def _iq1_m(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    qs, qh, scales = _split(b, QK_K // 8, QK_K // 16)
    scales = _u16(scales).reshape(n, 4)
    # The float16 super-block scale is spread over the top nibbles of the four scale words.
    top = (scales & 0xF000) >> _shifts([12, 8, 4, 0], (1, 4), scales)
    d_bits = top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]
    d = d_bits.to(torch.int16).view(torch.float16).float().reshape(n, 1)
    sc = ((scales.unsqueeze(-1) >> _shifts([0, 3, 6, 9], (1, 1, 4), scales)) & 7).reshape(n, -1)
    dl = (d * (2 * sc + 1).float()).reshape(n, -1, 2, 1, 1)
    qh_n = (qh.reshape(n, -1, 1) >> _shifts([0, 4], (1, 1, 2), qh)).reshape(n, -1)
    idx = qs.long() | ((qh_n & 7).long() << 8)
    delta = torch.where((qh_n & 8) == 0, iq1_delta(), -iq1_delta()).float().reshape(n, -1, 2, 2, 1)
    grid = lookup_table("iq1s_grid", b.device)[idx].reshape(n, -1, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, -1)


def _iq4_nl(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, qs = _split(b, 2)
    q = lookup_table("iq4nl_values", b.device)[_nibbles(qs, n, 16).long()]
    return _f16(d) * q


def _iq4_xs(b: Blocks) -> torch.Tensor:
    n = b.shape[0]
    d, scales_h, scales_l, qs = _split(b, 2, 2, QK_K // 64)
    sh = _u16(scales_h).reshape(n, 1)
    sh = ((sh >> _shifts(list(range(0, 16, 2)), (1, 8), sh)) & 3).to(torch.uint8)
    sl = _nibbles_pairs(scales_l, n)
    sc = (sl | (sh << 4)).to(torch.int8) - 32
    dl = (_f16(d) * sc.float()).reshape(n, -1, 1)
    q = _nibbles(qs, n, 16).reshape(n, -1, 32)
    q = lookup_table("iq4nl_values", b.device)[q.long()]
    return (dl * q).reshape(n, -1)


@dataclass(frozen=True)
class SuperblockParts:
    """The integers a 256-weight superblock type's blocks hold, unpacked:
    ``codes`` int32 ``[n, 256]`` (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 before its
    offset of 32, IQ4_XS the 4-bit index into its codebook), ``sub`` int32 the
    sub-block scales (``[n, 8]`` of 32 weights; Q6_K ``[n, 16]`` of 16,
    signed; IQ4_XS already less its 32), ``mins`` int32 ``[n, 8]`` or None,
    ``d`` and ``dmin`` the float16 superblock scales ``[n]`` (``dmin`` None
    where the type has none)."""

    codes: torch.Tensor
    sub: torch.Tensor
    mins: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None


def superblock_parts(b: Blocks, qtype: T) -> SuperblockParts:
    """``[n, type_size]`` blocks of Q4_K, Q5_K, Q6_K or IQ4_XS as integers."""
    n = b.shape[0]
    f16 = lambda field: _view(field, torch.float16).reshape(n)
    if qtype in (T.Q4_K, T.Q5_K):
        if qtype == T.Q4_K:
            d, dmin, scales, qs = _split(b, 2, 2, 12)
            codes = _nibbles(qs, n, 32)
        else:
            d, dmin, scales, qh, qs = _split(b, 2, 2, 12, QK_K // 8)
            high = (qh.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), qh)).reshape(n, -1) & 1
            codes = _nibbles(qs, n, 32) | (high << 4)
        sc, mn = _k_scale_min(scales)
        return SuperblockParts(codes.int(), sc.int(), mn.int(), f16(d), f16(dmin))
    if qtype == T.Q6_K:
        ql, qh, scales, d = _split(b, QK_K // 2, QK_K // 4, QK_K // 16)
        low = _nibbles(ql, n, 64).reshape(n, -1, 32)
        high = (qh.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qh)).reshape(n, -1, 32) & 3
        return SuperblockParts((low | (high << 4)).reshape(n, -1).int(), _view(scales, torch.int8).int(), None,
                               f16(d), None)
    if qtype == T.IQ4_XS:
        d, scales_h, scales_l, qs = _split(b, 2, 2, QK_K // 64)
        sh = _u16(scales_h).reshape(n, 1)
        sh = ((sh >> _shifts(list(range(0, 16, 2)), (1, 8), sh)) & 3).to(torch.uint8)
        sc = (_nibbles_pairs(scales_l, n) | (sh << 4)).to(torch.int8).int() - 32
        return SuperblockParts(_nibbles(qs, n, 16).int(), sc, None, f16(d), None)
    raise ValueError(f"{qtype.name} is not a superblock type with parts (Q4_K, Q5_K, Q6_K, IQ4_XS)")


DEQUANTIZE_BLOCKS: dict[T, Callable[[Blocks], torch.Tensor]] = {
    T.F32: _f32, T.F16: _f16_blocks, T.BF16: _bf16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0, T.MXFP4: _mxfp4,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}


def dequantize_blocks(blocks: Blocks, qtype: T) -> torch.Tensor:
    """``[n_blocks, type_size]`` uint8 -> ``[n_blocks, block_size]`` float32."""
    return DEQUANTIZE_BLOCKS[qtype](blocks)


def embedding_rows(qt, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``index`` of a 2-D QuantTensor, dequantized: an embedding lookup
    that never expands the whole table."""
    from .formats import block_format

    fmt = block_format(qt.qtype)
    rows = qt.data[index.reshape(-1)]
    values = dequantize_blocks(rows.reshape(-1, fmt.type_size), qt.qtype)
    return values.reshape(*index.shape, qt.cols).to(dtype)

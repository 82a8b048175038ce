"""Torch implementations of the kernel ops: the test oracle and the CPU path.

``dequantize_blocks(blocks, qtype)`` turns ``[n_blocks, type_size]`` bytes into
``[n_blocks, block_size]`` float32. Every type follows the arithmetic of
``gguf.quants`` operation by operation (same products, same order, no fused
multiply-add), so the result equals ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

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


# --- KV cache formats ----------------------------------------------------------

def kv_quantize(x: torch.Tensor, fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[T, Hkv, D]`` -> (codes, float16 scales) in ``fmt``: "f16" (the
    values in ``dtype``), "int8" (groups of 64, scale max|x|/127, round half
    away from zero) or "nf4" (blocks of 32 on the 16 non-uniform IQ4_NL
    levels, two codes a byte, low nibble first; each block's scale is the
    ``nf4_scale_candidates`` one with the least squared error, so it may be
    negative)."""
    if fmt == "f16":
        return x.to(dtype), None
    t, h, d = x.shape
    if fmt == "int8":
        g = x.float().reshape(t, h, d // 64, 64)
        scales = (g.abs().amax(-1) / 127.0).to(torch.float16)
        # Divide by the stored (float16) scale so codes and scale agree exactly.
        s = scales.float().unsqueeze(-1)
        codes = round_half_away(torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0)).clamp(-127, 127)
        return codes.to(torch.int8).reshape(t, h, d), scales
    blocks = x.float().reshape(-1, 32)
    codes = torch.empty(blocks.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks.shape[0], dtype=torch.float16, device=x.device)
    for i in range(0, blocks.shape[0], NF4_BLOCKS_AT_ONCE):
        codes[i:i + NF4_BLOCKS_AT_ONCE], scales[i:i + NF4_BLOCKS_AT_ONCE] = _nf4_blocks(blocks[i:i + NF4_BLOCKS_AT_ONCE])
    codes = codes.reshape(t, h, d // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scales.reshape(t, h, d // 32)


# Blocks searched together: bounds the [blocks, candidates, 32] temporaries to ~10 MB.
NF4_BLOCKS_AT_ONCE = 2048


@lru_cache(maxsize=None)  # one copy per device: a decode step's writes must not copy it each time
def nf4_scale_candidates(device: torch.device | str = "cpu") -> torch.Tensor:
    """Multipliers ``m`` of a block's signed extreme value ``e`` (the one of
    largest magnitude): each block is tried at the float16 scales ``e * m``
    and keeps the first with the least squared error. First ``-1/127``: the
    extreme lands exactly on the lowest (-127) level; then the extreme at
    0.8-1.2 times the -127 and the +113 levels, 16 steps each. Against the
    first alone the search cuts a Gaussian block's squared error by 15% and
    the KL divergence to the f16 cache on the default model by about 0.01."""
    factors = torch.linspace(0.8, 1.2, 16, dtype=torch.float64)
    m = torch.cat([torch.tensor([1.0]), factors, factors]) / torch.cat(
        [torch.tensor([-127.0]), torch.full((16,), -127.0), torch.full((16,), 113.0)])
    return m.to(device=device, dtype=torch.float32)


def _nf4_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` ``[n, 32]`` float32 -> (level indices ``[n, 32]`` uint8,
    float16 scales ``[n]``), searching ``nf4_scale_candidates``."""
    levels = lookup_table("iq4nl_values", blocks.device).float()
    top, bottom = blocks.amax(-1), blocks.amin(-1)
    extreme = torch.where(top >= -bottom, top, bottom)
    scales = (extreme.unsqueeze(-1) * nf4_scale_candidates(blocks.device)).to(torch.float16)  # [n, C]
    s = scales.float().unsqueeze(-1)  # [n, C, 1]
    y = torch.where(s != 0, blocks.unsqueeze(1) / torch.where(s != 0, s, 1.0), 0.0)
    # The nearest level, the lower one on a tie: how many midpoints lie below.
    codes = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)
    error = (levels[codes] * s - blocks.unsqueeze(1)).square().sum(-1)  # [n, C]
    best = error.argmin(-1)  # the first of equal errors (an all-zero block: scale 0)
    rows = torch.arange(blocks.shape[0], device=blocks.device)
    return codes[rows, best].to(torch.uint8), scales[rows, best]


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (what the Triton kernel does too)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def kv_dequantize(store, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 keys and values ``[n, Hkv, D]`` of ``store`` at ``slots`` (an
    index tensor, or a slice: then f16-format float32 storage is read in
    place, without a copy), as stored (a rotated store's rows stay rotated)."""
    d = store.head_dim
    k, v = store.k[slots], store.v[slots]
    if store.fmt == "f16":
        return k.float(), v.float()
    n, h = k.shape[0], k.shape[1]
    k = (k.float().reshape(n, h, d // 64, 64) * store.k_scales[slots].float().unsqueeze(-1)).reshape(n, h, d)
    if store.fmt == "int8":
        v = (v.float().reshape(n, h, d // 64, 64) * store.v_scales[slots].float().unsqueeze(-1)).reshape(n, h, d)
        return k, v
    nib = torch.stack([v & 15, v >> 4], dim=-1).reshape(n, h, d).long()
    levels = lookup_table("iq4nl_values", v.device)[nib]
    v = (levels.reshape(n, h, d // 32, 32) * store.v_scales[slots].float().unsqueeze(-1)).reshape(n, h, d)
    return k, v


def attention(q: torch.Tensor, store, start: int, window: int | None, scale: float,
              chunk: int = 1024, tables=None) -> torch.Tensor:
    """Causal grouped-query attention of queries ``q`` ``[T, H, D]`` at
    positions ``start..start+T-1`` over the cache ``store`` holding positions
    up to ``start+T-1`` (in the slots of one sequence's block table
    ``tables``, or of a ring without one); keys further back than ``window``
    are masked (and not read). Keys are dequantized ``chunk`` positions at a
    time, each chunk a contiguous run of slots, with an online softmax, never
    the whole cache at once. Works in the store's basis: a rotated store needs
    ``q`` rotated and gives its output rotated (``strata_kernels.attention``
    turns both). Returns ``[T, H, D]`` float32."""
    from .paging import BlockTables

    t, h, d = q.shape
    hkv = store.kv_heads
    g = h // hkv
    end = start + t
    qf = q.float().reshape(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
    # Only positions some query can see: the window of the first query on.
    first = 0 if window is None else max(0, start - window + 1)
    tables = tables if tables is not None else BlockTables.contiguous(store.capacity)
    runs = tables.runs(0, first, end, chunk)
    # One query sees every position from ``first`` on: no mask. Float32
    # storage is read in place, so any number of runs is safe then; other
    # formats are dequantized run by run, so only up to one chunk in all.
    in_place = store.fmt == "f16" and store.k.dtype == torch.float32
    if t == 1 and (in_place or sum(n for _, _, n in runs) <= chunk):
        return _one_query(qf, store, runs, scale).reshape(t, h, d)
    q_pos = torch.arange(start, end, device=q.device).repeat(g)  # [G*T], matching qf's rows
    m = torch.full((hkv, g * t, 1), float("-inf"), device=q.device)
    l = torch.zeros((hkv, g * t, 1), device=q.device)
    acc = torch.zeros((hkv, g * t, d), device=q.device)
    for p0, slot, n in runs:
        k, v = kv_dequantize(store, slice(slot, slot + n))
        k_pos = torch.arange(p0, p0 + n, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= q_pos[:, None] - k_pos[None, :] < window
        scores = torch.matmul(qf, k.permute(1, 2, 0)) * scale  # [Hkv, G*T, n]
        scores = scores.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        p = torch.exp(scores - safe)
        correction = torch.exp(torch.where(torch.isinf(m), float("-inf"), m - safe))
        l = l * correction + p.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(p, v.permute(1, 0, 2))
        m = m_new
    return (acc / l).reshape(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, h, d)


def _one_query(qf: torch.Tensor, store, runs, scale: float) -> torch.Tensor:
    """Decode's common case: one query, whose visible positions are every one
    from the window's start on (no mask), in a few ring runs that are read in
    place or fit one chunk together. One softmax over the runs' scores, no
    online rescaling: a decode step's attention in a third of the operations."""
    parts = [kv_dequantize(store, slice(slot, slot + n)) for _, slot, n in runs]
    scores = torch.cat([torch.matmul(qf, k.permute(1, 2, 0)) for k, _ in parts], -1) * scale  # [Hkv, G, n]
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    acc, at = None, 0
    for (_, _, n), (_, v) in zip(runs, parts):
        part = torch.matmul(p[..., at:at + n], v.permute(1, 0, 2))
        acc = part if acc is None else acc + part
        at += n
    return acc / p.sum(-1, keepdim=True)

"""Torch implementations of the KV cache's ops: quantize-on-write, reading
back, and attention over a store (the test oracle and the CPU path of
``kv_quant`` and ``attention``). The formats are ``kv_quant``'s."""

from __future__ import annotations

from functools import lru_cache

import torch

from .formats import lookup_table


def kv_quantize(x: torch.Tensor, fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[T, Hkv, D]`` -> (codes, float16 scales) in ``fmt``: "f16" (the
    values in ``dtype``), "int8" (groups of 64, scale max|x|/127, round half
    away from zero) or "nf4" (blocks of 32 on the 16 non-uniform IQ4_NL
    levels, two codes a byte, low nibble first; each block's scale is the
    ``nf4_scale_candidates`` one with the least squared error, so it may be
    negative, rounded to ``NF4_SCALE_BITS`` significant bits)."""
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


# A k8v4 value scale's significant bits: with 7 or fewer, -1152 * scale is exact in float16, so the GPU's
# decode takes a level times its scale in one fused multiply-add from 1024 + level + 128 (_triton_convert.
# WORD_IQ4_SCALED), rounded once as level * scale is. Against 11 bits: a scale 0.4% off at most, next to
# the 4-bit levels' steps of 8-19%.
NF4_SCALE_BITS = 7


def round_scale_bits(scales: torch.Tensor) -> torch.Tensor:
    """Float16 ``scales`` rounded to ``NF4_SCALE_BITS`` significant bits,
    halves away from zero (on the bit pattern: the exponent takes the carry)."""
    drop = 11 - NF4_SCALE_BITS
    bits = scales.view(torch.int16).to(torch.int32)
    return ((bits + (1 << (drop - 1))) & -(1 << drop)).to(torch.int16).view(torch.float16)


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
    scales = round_scale_bits((extreme.unsqueeze(-1) * nf4_scale_candidates(blocks.device)).to(torch.float16))
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

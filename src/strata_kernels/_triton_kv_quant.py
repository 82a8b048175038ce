"""Triton quantize-on-write of K/V rows into an int8 / k8v4 cache (imported
only when the Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import lookup_table
from .kv_store import INT4_BLOCK, INT8_GROUP, KVStore
from .launch_plans import kv_quantize_launch
from .reference_kv import NF4_SCALE_BITS, nf4_scale_candidates


@triton.jit
def _round_half_away(x):
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))


# A float16 scale's low mantissa bits that the writers clear: half their weight (to round) and the mask
_SCALE_HALF = tl.constexpr(1 << (10 - NF4_SCALE_BITS))
_SCALE_MASK = tl.constexpr(-(1 << (11 - NF4_SCALE_BITS)))


@triton.jit
def _round_scale_bits(scales):
    """Float16 ``scales`` to NF4_SCALE_BITS significant bits (reference_kv.round_scale_bits)."""
    bits = scales.to(tl.int16, bitcast=True).to(tl.int32)
    return ((bits + _SCALE_HALF) & _SCALE_MASK).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _nearest_level(y, levels):
    """Index of the IQ4_NL level nearest ``y`` (the lower one on a tie)."""
    idx = tl.zeros(y.shape, tl.int32)
    for i in tl.static_range(15):
        mid = (tl.load(levels + i) + tl.load(levels + i + 1)) / 2
        idx += (y > mid).to(tl.int32)
    return idx


@triton.jit
def _quantize_kernel(x, slots, codes, scales, levels, candidates, HKV, D: tl.constexpr, GROUP: tl.constexpr,
                     BITS: tl.constexpr, N_CANDIDATES: tl.constexpr, CANDIDATES: tl.constexpr):
    # x:      [T, HKV, D] float rows to write (contiguous)
    # slots:  [T] int64 ring slot of each row
    # codes:  [C, HKV, D] int8 (BITS=8) or [C, HKV, D // 2] uint8 (BITS=4, IQ4_NL level indices,
    #         value 2i in the low nibble)
    # scales: [C, HKV, D // GROUP] float16
    # levels: [16] float32 IQ4_NL levels (BITS=4)
    # candidates: [N_CANDIDATES] float32 multipliers of the block's extreme value, tried as
    #         scales, the first best kept (BITS=4; reference_kv.nf4_scale_candidates);
    #         CANDIDATES is N_CANDIDATES rounded up to a power of two
    # grid:   (T * HKV, D // GROUP); program (r, g) quantizes group g of row r = t * HKV + h
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    t = r // HKV
    h = r % HKV
    slot = tl.load(slots + t)
    src = x + r * D + g * GROUP
    dst_row = slot * HKV + h
    if BITS == 8:
        i = tl.arange(0, GROUP)
        vals = tl.load(src + i).to(tl.float32)
        scale = (tl.max(tl.abs(vals), axis=0) / 127.0).to(tl.float16)
        s = scale.to(tl.float32)
        q = tl.where(s > 0, _round_half_away(vals / tl.where(s > 0, s, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(codes + dst_row * D + g * GROUP + i, q.to(tl.int8))
    else:
        i = tl.arange(0, GROUP // 2)
        even = tl.load(src + 2 * i).to(tl.float32)
        odd = tl.load(src + 2 * i + 1).to(tl.float32)
        top = tl.maximum(tl.max(even, axis=0), tl.max(odd, axis=0))
        bottom = tl.minimum(tl.min(even, axis=0), tl.min(odd, axis=0))
        extreme = tl.where(top >= -bottom, top, bottom)
        # All candidate scales at once, one per row of a [CANDIDATES, GROUP // 2] tile;
        # keep the first with the least squared error, as the reference does.
        c = tl.arange(0, CANDIDATES)
        tried = _round_scale_bits((extreme * tl.load(candidates + c, mask=c < N_CANDIDATES, other=0.0)).to(tl.float16))
        s = tried.to(tl.float32)[:, None]
        safe = tl.where(s != 0, s, 1.0)
        qe = _nearest_level(tl.where(s != 0, even[None, :] / safe, 0.0), levels)
        qo = _nearest_level(tl.where(s != 0, odd[None, :] / safe, 0.0), levels)
        de = tl.load(levels + qe) * s - even[None, :]
        do = tl.load(levels + qo) * s - odd[None, :]
        error = tl.sum(de * de, axis=1) + tl.sum(do * do, axis=1)
        best = tl.argmin(tl.where(c < N_CANDIDATES, error, float("inf")), axis=0, tie_break_left=True)
        scale = _round_scale_bits((extreme * tl.load(candidates + best)).to(tl.float16))
        s = scale.to(tl.float32)
        safe = tl.where(s != 0, s, 1.0)
        qe = _nearest_level(tl.where(s != 0, even / safe, 0.0), levels)
        qo = _nearest_level(tl.where(s != 0, odd / safe, 0.0), levels)
        tl.store(codes + dst_row * (D // 2) + g * (GROUP // 2) + i, (qe | (qo << 4)).to(tl.uint8))
    tl.store(scales + dst_row * (D // GROUP) + g, scale)


def kv_write_triton(store: KVStore, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    t, hkv, d = keys.shape
    if t == 0:
        return
    halves = [(store.k, store.k_scales, keys, INT8_GROUP, 8)]
    if store.fmt == "int8":
        halves.append((store.v, store.v_scales, values, INT8_GROUP, 8))
    else:
        halves.append((store.v, store.v_scales, values, INT4_BLOCK, 4))
    levels = lookup_table("iq4nl_values", keys.device)
    candidates = nf4_scale_candidates(keys.device)
    for codes, scales, x, group, bits in halves:
        x = x.contiguous()
        launch = kv_quantize_launch(d, group, bits, candidates.numel())
        _quantize_kernel[(t * hkv, d // group)](x, slots, codes, scales, levels, candidates, hkv, **launch.constexprs,
                                                num_warps=launch.num_warps)

"""Triton attention over a KV cache in any format, dequantizing each K/V tile
in registers right after it is loaded (imported only when the Triton backend
runs)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_convert import word_bytes_to_f16, word_iq4_levels_to_f16
from .kv_quant import KVStore
from .launch_plans import KernelLaunch, attention_launch, merge_launch
from .paging import BlockTables


@triton.jit
def _kv_tile(data, scales, slots, kvh, HKV, D: tl.constexpr, FMT: tl.constexpr, IS_V: tl.constexpr,
             BLOCK_N: tl.constexpr, operand: tl.constexpr, USE_ASM: tl.constexpr):
    """``[BLOCK_N, D]`` of one KV head at ``slots`` ``[BLOCK_N]``, in the
    products' ``operand`` dtype. Quantized formats are read as whole rows of
    codes as int32 words (16 bytes a load), each word converted into the
    float16 values it holds, in order, and scaled in a tile ``[BLOCK_N,
    groups, group]`` that meets each group's scale."""
    row = (slots * HKV + kvh).to(tl.int64)
    # One branch each (compile-time): a head dim under 64 never meets the quantized formats' groups.
    if FMT == 0:
        d = tl.arange(0, D)
        tile = tl.load(data + row[:, None] * D + d[None, :]).to(operand)
    elif FMT == 2 and IS_V:  # k8v4 values: two 4-bit codes a byte (value 2i low, 2i + 1 high), a scale per 32
        BLOCKS: tl.constexpr = D // 32
        b = tl.arange(0, BLOCKS)
        w = tl.arange(0, 4)
        # Whole words, eight float16 levels out of each, joined in registers in code order (the joins' new
        # dimensions come out bit-reversed: value 4i + 2j + k at [.., i, j, k] takes leaf 4k + 2j + i)
        words = tl.load(data.to(tl.pointer_type(tl.int32)) + row[:, None, None] * (D // 8) + b[None, :, None] * 4
                        + w[None, None, :])
        v0, v1, v2, v3, v4, v5, v6, v7 = word_iq4_levels_to_f16(words, USE_ASM)
        levels = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                         tl.join(tl.join(v1, v5), tl.join(v3, v7))).reshape(BLOCK_N, BLOCKS, 32)
        scale = tl.load(scales + row[:, None] * BLOCKS + b[None, :])
        tile = (levels * scale[:, :, None]).reshape(BLOCK_N, D).to(operand)
    else:
        G: tl.constexpr = D // 64  # int8 keys (and values): a scale per 64
        g = tl.arange(0, G)
        w = tl.arange(0, 16)
        # Whole words (16 bytes a load), four float16 out of each, joined in registers in byte order
        words = tl.load(data.to(tl.pointer_type(tl.int32)) + row[:, None, None] * (D // 4) + g[None, :, None] * 16
                        + w[None, None, :])
        b0, b1, b2, b3 = word_bytes_to_f16(words, USE_ASM)
        values = tl.join(tl.join(b0, b2), tl.join(b1, b3)).reshape(BLOCK_N, G, 64)  # [.., j, a]: byte 2j + a
        scale = tl.load(scales + row[:, None] * G + g[None, :])
        tile = (values * scale[:, :, None]).reshape(BLOCK_N, D).to(operand)
    return tile


@triton.jit
def _attention_kernel(
    q, k, v, k_scales, v_scales, table, table_lengths, starts, part_acc, part_ml,
    T, HKV, G, table_stride, block_size, block_magic, block_shift, splits, slots_per_split, window, scale,
    D: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
):
    # q:        [B, T, HKV * G, D] float queries; sequence b's at positions starts[b]..starts[b]+T-1
    # k, v:     cache of one layer, [slots, HKV, D] (f16/int8) or [slots, HKV, D // 2] (k8v4 values)
    # table:    [B, table_stride] int32, each sequence's blocks (table_lengths[b] of them): its
    #           position p lives in its ring's logical slot p % capacity (capacity = table_lengths[b]
    #           * block_size), which is store slot table[b, ls // block_size] * block_size
    #           + ls % block_size; n_slots = min(capacity, start + T) logical slots are filled
    # part_acc: [B, splits, HKV, T * G, D] float32 unnormalised outputs of each split
    # part_ml:  [B, splits, HKV, T * G, 2] float32 running max and sum of each split
    # grid:     (cdiv(T * G, BLOCK_M), HKV, B * splits); rows r = t * G + g are (query token, head in
    #           group) pairs of one KV head; split s scans logical slots [s * slots_per_split,
    #           (s+1) * slots_per_split) of its sequence (none, past a shorter sequence's end)
    # Positions, slots and rows are int32 (a context is < 2^31 positions); an element's offset is int64
    # from its slot's row on (a store may hold more than 2^31 elements). A slot's block is a multiply by
    # block_magic and a shift by block_shift (paging.divide_by_multiplying), not a division.
    pr = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2) // splits
    sp = tl.program_id(2) % splits
    start = tl.load(starts + seq).to(tl.int32)
    capacity = tl.load(table_lengths + seq) * block_size
    blocks = table + seq.to(tl.int64) * table_stride
    r = pr * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T * G
    t = r // G
    head = kvh * G + r % G
    d = tl.arange(0, D)
    # Products on the tensor cores, 16-bit operands and float32 sums, in the
    # cache's own type: a float16 (or bfloat16) cache is read as stored, with
    # no conversion per element; quantized ones dequantize to float16 (3 more
    # bits than bfloat16). The queries follow, their scale folded in first
    # (q / sqrt(D) stays well inside float16's range). (The interpreter's
    # bfloat16 dot is wrong: there a bfloat16 cache converts to float16.)
    if k.dtype.element_ty == tl.bfloat16 and USE_ASM:
        operand = tl.bfloat16
    else:
        operand = tl.float16
    qs = tl.load(q + ((seq * T + t) * HKV * G + head).to(tl.int64)[:, None] * D + d[None, :], mask=row_ok[:, None],
                 other=0.0).to(tl.float32)
    qs = (qs * scale).to(operand)
    q_pos = start + t
    end = start + T
    n_slots = tl.minimum(capacity, end)
    # The newest position's slot: a slot past it holds a position one lap older (no division per slot)
    newest = (end - 1) % capacity
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo = sp * slots_per_split
    hi = tl.minimum(lo + slots_per_split, n_slots)
    for n0 in range(lo, hi, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        slot_ok = slots < hi
        safe = tl.where(slot_ok, slots, 0)
        k_pos = (end - 1) - (newest - safe) - tl.where(safe > newest, capacity, 0)
        # safe // block_size by a high multiply and a shift (paging.divide_by_multiplying)
        block = (tl.umulhi((safe * 2).to(tl.uint32, bitcast=True), block_magic.to(tl.uint32, bitcast=True))
                 >> block_shift).to(tl.int32, bitcast=True)
        physical = tl.load(blocks + block) * block_size + (safe - block * block_size)
        keys = _kv_tile(k, k_scales, physical, kvh, HKV, D, FMT, False, BLOCK_N, operand, USE_ASM)
        s = tl.dot(qs, tl.trans(keys))
        allowed = slot_ok[None, :] & (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
        allowed &= (window <= 0) | (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        corr = tl.exp(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe))
        l_i = l_i * corr + tl.sum(p, axis=1)
        values = _kv_tile(v, v_scales, physical, kvh, HKV, D, FMT, True, BLOCK_N, operand, USE_ASM)
        acc = acc * corr[:, None] + tl.dot(p.to(operand), values)
        m_i = m_new
    out_row = (((seq * splits + sp) * HKV + kvh) * T * G + r).to(tl.int64)
    tl.store(part_acc + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml + out_row * 2, m_i, mask=row_ok)
    tl.store(part_ml + out_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_acc, part_ml, out, splits, HKV, TG, G, D: tl.constexpr, BLOCK_S: tl.constexpr):
    # The splits' log-sum-exp merge, one program per (sequence, KV head, row r = t * G + g): weights
    # exp(m_s - max m) (a split past a sequence's end holds m = -inf, l = 0: weight 0), the output
    # sum_s w_s acc_s / sum_s w_s l_s written in place at [seq, t, KV head * G + g, :] of out [B, T, H, D].
    row = tl.program_id(0)
    seq = row // (HKV * TG)
    kvh = (row // TG) % HKV
    r = row % TG
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    at = ((seq * splits + sp) * HKV + kvh).to(tl.int64) * TG + r  # [BLOCK_S] rows of the parts, the first splits
    stride = HKV * TG * BLOCK_S  # from one tile of splits to the next
    top = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        top = tl.maximum(top, tl.load(part_ml + (at + s0 // BLOCK_S * stride) * 2, mask=sp + s0 < splits,
                                      other=float("-inf")))
    m_max = tl.max(top, axis=0)
    acc = tl.zeros((D,), tl.float32)
    total = tl.zeros((BLOCK_S,), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        rows = at + s0 // BLOCK_S * stride
        ok = sp + s0 < splits
        m = tl.load(part_ml + rows * 2, mask=ok, other=float("-inf"))
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        total += weight * tl.load(part_ml + rows * 2 + 1, mask=ok, other=0.0)
        parts = tl.load(part_acc + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(parts * weight[:, None], axis=0)
    t = r // G
    head = kvh * G + r % G
    tl.store(out + ((seq * (TG // G) + t) * (HKV * G) + head).to(tl.int64) * D + d, acc / tl.sum(total, axis=0))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs (0 for the interpreter's CPU tensors: splits by length alone)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def attention_triton(q: torch.Tensor, store: KVStore, starts: list[int], window: int | None, scale: float,
                     tables: BlockTables, launch: tuple[KernelLaunch, int] | None = None,
                     starts_on_device: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[B, T, H, D]``: sequence ``b``'s queries at positions
    ``starts[b]..``, over its blocks (row ``b`` of ``tables``), all in one
    launch. Float32 ``[B, T, H, D]``. ``launch``: the constants and split count
    to use instead of ``attention_launch``'s (tests split short contexts);
    ``starts_on_device``: ``starts`` already as an int64 tensor on ``q``'s
    device (a call captured in a CUDA graph copies nothing from the host)."""
    b, t, h, d = q.shape
    hkv = store.kv_heads
    g = h // hkv
    n_slots = max(min(tables.capacity(i), s + t) for i, s in enumerate(starts))
    launch, splits = launch or attention_launch(t, g, n_slots, d, store.fmt, b * hkv, _sm_count(q.device))
    c = launch.constexprs
    block_n = c["BLOCK_N"]
    per_split = triton.cdiv(triton.cdiv(n_slots, splits), block_n) * block_n
    splits = triton.cdiv(n_slots, per_split)
    part_acc = torch.empty((b, splits, hkv, t * g, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, splits, hkv, t * g, 2), dtype=torch.float32, device=q.device)
    dummy = torch.zeros(1, dtype=torch.float16, device=q.device)
    table = tables.tables.to(q.device)
    _attention_kernel[(triton.cdiv(t * g, c["BLOCK_M"]), hkv, b * splits)](
        q.contiguous(), store.k, store.v,
        store.k_scales if store.k_scales is not None else dummy,
        store.v_scales if store.v_scales is not None else dummy,
        table, tables.lengths.to(q.device),
        starts_on_device if starts_on_device is not None else torch.tensor(starts, dtype=torch.int64, device=q.device),
        part_acc, part_ml,
        t, hkv, g, table.shape[1], tables.block_size, *tables.division, splits, per_split, window or 0, scale,
        **{**c, "USE_ASM": q.is_cuda}, num_warps=launch.num_warps,
    )
    out = torch.empty((b, t, h, d), dtype=torch.float32, device=q.device)
    merge = merge_launch(d)
    _merge_splits_kernel[(b * hkv * t * g,)](part_acc, part_ml, out, splits, hkv, t * g, g, **merge.constexprs,
                                             num_warps=merge.num_warps)
    return out

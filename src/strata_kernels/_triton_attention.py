"""Triton attention over a KV cache in any format, reading the codes of a
quantized one as stored and making them float16 in registers right after
they are loaded, each int8 key group's scale applied to its scores and each
int8 value group's to the probabilities (imported only when the Triton
backend runs)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_convert import KEY_BIAS, WORD_BYTES_BIASED, operand_order, word_bytes_to_f16, word_iq4_levels_scaled
from .kv_quant import KVStore
from .launch_plans import KernelLaunch, attention_launch, merge_launch
from .paging import BlockTables




@triton.jit
def _exp2(x, USE_ASM: tl.constexpr):
    """2^x, flushing results below 2^-126 to zero (``ex2.approx.ftz``: no
    range fix-up around the instruction, as ``tl.exp2`` has)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp2(x)


@triton.jit
def _columns(tile, N: tl.constexpr, C: tl.constexpr):
    """The ``C`` columns of ``tile`` ``[N, C]`` (a power of two) as a tuple
    of ``[N]`` vectors, by halving it in registers."""
    if C == 1:
        return (tile.reshape(N),)
    else:
        even, odd = tl.split(tile.reshape(N, C // 2, 2))
        a = _columns(even, N, C // 2)
        b = _columns(odd, N, C // 2)
        out = ()
        for i in tl.static_range(C // 2):
            out = out + (a[i], b[i])
        return out


@triton.jit
def _group_tile(data, rows, g, D: tl.constexpr, KEYS: tl.constexpr, USE_ASM: tl.constexpr):
    """Group ``g`` (64 values) of the int8 KV rows ``rows`` ``[BLOCK_N]``
    (int64) as float16 ``[BLOCK_N, 64]``, read as whole int32 words (16
    bytes a load): values exact and in order; ``KEYS`` each code + KEY_BIAS,
    byte 2h + o of word w of each 16 put at 8h + 2w + o, where the tensor
    cores' operand layout has the lane that loaded the word hold it (the
    queries are read in that order; in order, each key tile went through
    shared memory: 190 against 180 instructions per KiB of k8v4 at D=128,
    128 against 117 of int8, on sm_90)."""
    w = tl.arange(0, 16)
    words = tl.load(data.to(tl.pointer_type(tl.int32)) + rows[:, None] * (D // 4) + g * 16 + w[None, :])
    if KEYS and USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(WORD_BYTES_BIASED, "=h,=h,=h,=h,r", [words],
                                                   dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        b0, b1, b2, b3 = word_bytes_to_f16(words, USE_ASM)
        if KEYS:
            b0, b1, b2, b3 = b0 + KEY_BIAS, b1 + KEY_BIAS, b2 + KEY_BIAS, b3 + KEY_BIAS
    if KEYS:  # [.., sixteen, w, o, h] -> [.., sixteen, h, w, o]
        tile = tl.join(tl.join(b0, b1), tl.join(b2, b3)).reshape(rows.shape[0], 4, 4, 2, 2)
        return tile.permute(0, 1, 4, 2, 3).reshape(rows.shape[0], 64)
    return tl.join(tl.join(b0, b2), tl.join(b1, b3)).reshape(rows.shape[0], 64)  # [.., j, a]: byte 2j + a


V_SHRINK = tl.constexpr(16.0)  # k8v4 value tiles are this many times smaller than the values (_k8v4_values)


@triton.jit
def _k8v4_values(v, v_scales, rows, zero, D: tl.constexpr, USE_ASM: tl.constexpr):
    """k8v4 values of the rows ``rows`` ``[BLOCK_N]`` (int64) as float16
    ``[BLOCK_N, D]``: whole words (16 bytes a load), eight IQ4_NL levels out
    of each, times their block's scale (one per 32) / V_SHRINK. ``zero`` ``[BLOCK_N]``:
    ``word_iq4_levels_scaled``'s."""
    B: tl.constexpr = D // 32
    b = tl.arange(0, B)
    w = tl.arange(0, 4)
    words = tl.load(v.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (D // 8) + b[None, :, None] * 4
                    + w[None, None, :])
    # a sixteenth of the scale: the decode's offset, -1152 times it, stays inside float16's range for every
    # scale up to 910 (values up to 115000); the kernel multiplies its sums by 16 (V_SHRINK) at the end
    scale = tl.load(v_scales + rows[:, None] * B + b[None, :]) * (1.0 / V_SHRINK)
    # joined in registers in code order (the joins' new dimensions come out bit-reversed: value 4i + 2j + k
    # at [.., i, j, k] takes leaf 4k + 2j + i)
    v0, v1, v2, v3, v4, v5, v6, v7 = word_iq4_levels_scaled(words, zero[:, None, None], scale[:, :, None], USE_ASM)
    levels = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                     tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return levels.reshape(rows.shape[0], D)


@triton.jit
def _step_rows(n0, lo, hi, slot_lo, capacity, blocks, block_size, block_magic, block_shift, HKV, kvh,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr = True):
    """A step's ``BLOCK_N`` scan indices ``i`` from ``n0``, whether each is
    before the split's end ``hi``, and the store row (int64) of each (past
    the end: the split's first slot's, a valid address whose scores are
    masked). Not ``MASKED``: the caller knows the step ends by ``hi``."""
    i = n0 + tl.arange(0, BLOCK_N)
    slot_ok = i < hi
    ls = slot_lo + (tl.where(slot_ok, i - lo, 0) if MASKED else i - lo)
    ls = tl.where(ls >= capacity, ls - capacity, ls)
    # ls // block_size by a high multiply and a shift (paging.divide_by_multiplying)
    block = (tl.umulhi((ls * 2).to(tl.uint32, bitcast=True), block_magic.to(tl.uint32, bitcast=True))
             >> block_shift).to(tl.int32, bitcast=True)
    physical = tl.load(blocks + block) * block_size + (ls - block * block_size)
    return i, slot_ok, (physical * HKV + kvh).to(tl.int64)


@triton.jit
def _step_scores(s, queries, starts_at, k, k_scales, rows, D: tl.constexpr, FMT: tl.constexpr,
                 KG: tl.constexpr, operand: tl.constexpr, USE_ASM: tl.constexpr):
    """``s`` ``[BLOCK_M, BLOCK_N]`` plus the scores of the keys at ``rows``
    (log2 units): one dot for a float cache, one per key group for a
    quantized one, each scaled by its group's scale after."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    if FMT == 0:
        d = tl.arange(0, D)
        keys = tl.load(k + rows[:, None] * D + d[None, :]).to(operand)
        s = tl.dot(queries[0], tl.trans(keys), s)
    else:
        k_scale = _columns(tl.load(k_scales + rows[:, None] * KG + tl.arange(0, KG)[None, :]).to(tl.float32),
                           BLOCK_N, KG)
        for g in tl.static_range(KG):
            dot = tl.dot(queries[g], tl.trans(_group_tile(k, rows, g, D, True, USE_ASM)),
                         tl.zeros(s.shape, tl.float32) + starts_at[g][:, None])
            s += dot * k_scale[g][None, :]
    return s


@triton.jit
def _step_values(v, v_scales, rows, lanes_zero, D: tl.constexpr, FMT: tl.constexpr, operand: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """The values at ``rows`` as a ``[BLOCK_N, D]`` operand tile: a float
    cache's as stored, k8v4's decoded (V_SHRINK times smaller)."""
    if FMT == 0:
        tile = tl.load(v + rows[:, None] * D + tl.arange(0, D)[None, :]).to(operand)
    else:  # (one return: Triton compiles the code after a constexpr branch's return too)
        tile = _k8v4_values(v, v_scales, rows, lanes_zero, D, USE_ASM)
    return tile


@triton.jit
def _fixed_reference_step(l_slots, acc, m_i, n0, lo, hi, slot_lo, capacity, blocks, block_size, block_magic,
                          block_shift, HKV, kvh, queries, starts_at, k, k_scales, v, v_scales, lanes_zero,
                          D: tl.constexpr, FMT: tl.constexpr, KG: tl.constexpr, BLOCK_N: tl.constexpr,
                          operand: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    """One step of a split weighed against ``m_i`` (LAZY_BIAS): each slot
    lane's sum of weights ``l_slots`` ``[BLOCK_M, BLOCK_N]`` and ``acc``
    ``[BLOCK_M, D]`` taken on. ``MASKED``: positions from ``hi`` on weigh
    nothing (the loop's steps end by ``hi``: no mask)."""
    i, slot_ok, rows = _step_rows(n0, lo, hi, slot_lo, capacity, blocks, block_size, block_magic, block_shift,
                                  HKV, kvh, BLOCK_N, MASKED)
    s = tl.zeros(l_slots.shape, tl.float32) - m_i[:, None]  # the products start at -m: scores less the reference
    if MASKED:
        s += tl.where(slot_ok, 0.0, float("-inf"))[None, :]
    s = _step_scores(s, queries, starts_at, k, k_scales, rows, D, FMT, KG, operand, USE_ASM)
    p = _exp2(s, USE_ASM)
    l_slots += p
    acc = tl.dot(p.to(operand), _step_values(v, v_scales, rows, lanes_zero, D, FMT, operand, USE_ASM), acc)
    return l_slots, acc


# One query's splits weigh their positions against a fixed reference instead of a running max: the split's
# first step's largest score + LAZY_BIAS (log2 units). A weight 2^(s - m) meets the values as a float16
# operand: while every slot lane's sum of weights stays within 2^15, none is past float16's range; a
# split whose sums grow past it reads its positions again against a reference above its largest score
# (rare: 0.02-0.95% of programs on Gemma 3 and SmolLM2 over a long Python source, splits of 128-1024
# positions, steps of 32 and 64: bench/attention_reference.py).
LAZY_BIAS = tl.constexpr(8.0)
LAZY_LIMIT_WEIGHT = tl.constexpr(32768.0)  # 2^15: float16's largest power of two


@triton.jit
def _attention_kernel(
    q, k, v, k_scales, v_scales, table, table_lengths, starts, part_acc, part_ml,
    T, HKV, G, table_stride, block_size, block_magic, block_shift, splits, slots_per_split, window, scale,
    D: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_QUERY: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # q:        [B, T, HKV * G, D] float queries; sequence b's at positions starts[b]..starts[b]+T-1
    # k, v:     cache of one layer, [slots, HKV, D] (f16/int8) or [slots, HKV, D // 2] (k8v4 values);
    #           k_scales, v_scales [slots, HKV, D // 64] (k8v4 values: D // 32) float16
    # table:    [B, table_stride] int32, each sequence's blocks (table_lengths[b] of them): its
    #           position p lives in its ring's logical slot p % capacity (capacity = table_lengths[b]
    #           * block_size), which is store slot table[b, ls // block_size] * block_size
    #           + ls % block_size; the ring holds positions max(0, start + T - capacity).. of which
    #           the rows see those from first = max(that, start + 1 - window) on (window > 0)
    # part_acc: [B, splits, HKV, T * G, D] float32 unnormalised outputs of each split
    # part_ml:  [B, splits, HKV, T * G, 2] float32 each split's reference (its running max, or one query's fixed
    #           one; natural log units) and its sum of weights against it
    # grid:     (cdiv(T * G, BLOCK_M), HKV, B * splits); rows r = t * G + g are (query token, head in
    #           group) pairs of one KV head; split s scans positions first + [s * slots_per_split,
    #           (s+1) * slots_per_split) of its sequence (none, past a shorter sequence's end)
    # ONE_QUERY (T == 1): every row sees every position scanned, so the mask is the split's end only (a
    # vector added to the scores by the products themselves); otherwise each (row, position) is
    # masked, causally and by the window.
    # Positions, slots and rows are int32 (a context is < 2^31 positions); an element's offset is int64
    # from its slot's row on (a store may hold more than 2^31 elements). A slot's block is a multiply by
    # block_magic and a shift by block_shift (paging.divide_by_multiplying), not a division.
    #
    # Quantized keys keep each group's scale out of the tiles: a key group's dot with the queries is
    # scaled once per score (sum over groups of s_g * scale_g), its codes' offset (KEY_BIAS) taken away by
    # starting the dot at -KEY_BIAS * the group's query sum. An int8 value group's scale multiplies the
    # probabilities that meet it (one accumulator per group); k8v4's values are scaled in the tile (a
    # group of 32 there: splitting the tile per group made its loads narrower and cost more than it
    # saved). Scores are in log2 units (log2(e) folded into the queries' scale).
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
    KG: tl.constexpr = 1 if FMT == 0 else D // 64  # key groups (a scale each)
    KW: tl.constexpr = D // KG  # a key group's values
    VG: tl.constexpr = D // 64 if FMT == 1 else 1  # value groups
    VW: tl.constexpr = D // VG
    q_row = ((seq * T + t) * HKV * G + head).to(tl.int64)
    kd = tl.arange(0, KW)
    queries = ()
    starts_at = ()  # each quantized key group's dot starts here: minus its codes' offset's share
    for g in tl.static_range(KG):
        qd = kd if FMT == 0 else (kd // 16) * 16 + operand_order(kd)  # a quantized key group's (_group_tile)
        qg = tl.load(q + q_row[:, None] * D + g * KW + qd[None, :], mask=row_ok[:, None], other=0.0)
        qg = (qg.to(tl.float32) * (scale * 1.4426950408889634)).to(operand)
        queries = queries + (qg,)
        if FMT != 0:
            starts_at = starts_at + (-(tl.sum(qg.to(tl.float32), axis=1) * KEY_BIAS),)
    q_pos = start + t
    end = start + T
    # The positions any row sees, oldest first: none a full ring has overwritten, none before the first
    # row's window. Splits cut them, so a sliding layer's ring is read only where its window reaches.
    first = tl.maximum(end - capacity, 0)
    if window > 0:
        first = tl.maximum(first, start + 1 - window)
    lo = sp * slots_per_split
    hi = tl.minimum(lo + slots_per_split, end - first)
    # Position first + lo + i lives in logical slot (first + lo + i) % capacity: one division a program,
    # then a split (at most a ring long) wraps past the ring's end at most once.
    slot_lo = (first + lo) % capacity
    # 0, from a loaded position (< 2^31) so that the compiler cannot fold it (_k8v4_values)
    lanes_zero = (start + tl.arange(0, BLOCK_N)) >> 31
    # One query over float16 or k8v4 values: a fixed reference (LAZY_BIAS), so a step finds no max across
    # the warps and rescales nothing; each slot lane keeps its own sum until the end. Not for int8 (its
    # weights meet its value scales in float16, where 2^15 times a scale can overflow), nor for tiles past
    # 4096 accumulators a program (the lanes' sums on top of them spilled registers: f16 D=128 x 64 heads
    # 56-236 bytes, D=256 x 32 up to 32; k8v4 D=128 x 64 404-984, D=256 x 32 664-808, D=512 392-568).
    FIXED_REFERENCE: tl.constexpr = ONE_QUERY and FMT != 1 and BLOCK_M * D <= 4096
    if FIXED_REFERENCE:
        # The reference: the first step's largest score + LAZY_BIAS, that step's scores taken on as they are.
        i, slot_ok, rows = _step_rows(lo, lo, hi, slot_lo, capacity, blocks, block_size, block_magic,
                                      block_shift, HKV, kvh, BLOCK_N)
        s = _step_scores(tl.zeros((BLOCK_M, BLOCK_N), tl.float32) + tl.where(slot_ok, 0.0, float("-inf"))[None, :],
                         queries, starts_at, k, k_scales, rows, D, FMT, KG, operand, USE_ASM)
        m_i = tl.max(s, axis=1) + LAZY_BIAS
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)  # an empty split (its m is stored as -inf below)
        p = _exp2(s - m_i[:, None], USE_ASM)
        l_slots = p
        acc = tl.dot(p.to(operand), _step_values(v, v_scales, rows, lanes_zero, D, FMT, operand, USE_ASM))
        # Whole steps in the loop, unmasked; a partial last one after it.
        whole_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        n_from = lo + BLOCK_N
        scanning = lo < hi
        while scanning:
            for n0 in range(n_from, whole_end, BLOCK_N):
                l_slots, acc = _fixed_reference_step(
                    l_slots, acc, m_i, n0, lo, hi, slot_lo, capacity, blocks, block_size, block_magic,
                    block_shift, HKV, kvh, queries, starts_at, k, k_scales, v, v_scales, lanes_zero,
                    D, FMT, KG, BLOCK_N, operand, USE_ASM, False)
            if (whole_end < hi) & (whole_end >= n_from):  # (the first pass's first step is done above)
                l_slots, acc = _fixed_reference_step(
                    l_slots, acc, m_i, whole_end, lo, hi, slot_lo, capacity, blocks, block_size, block_magic,
                    block_shift, HKV, kvh, queries, starts_at, k, k_scales, v, v_scales, lanes_zero,
                    D, FMT, KG, BLOCK_N, operand, USE_ASM, True)
            # A slot lane's sum bounds each of its weights: none past LAZY_LIMIT_WEIGHT, none past float16's
            # range. Else the split once more, against m_i + log2 of the row's largest lane sum (at least
            # its largest score: no weight past 1, and this loop ends), or m_i + 100 where a weight passed
            # float32's range too (a sum of inf: then as many passes as it takes).
            lane_max = tl.max(l_slots, axis=1)
            scanning = tl.max(lane_max, axis=0) > LAZY_LIMIT_WEIGHT
            m_i = tl.where(scanning, m_i + tl.minimum(tl.log2(lane_max), 100.0), m_i)
            acc = tl.where(scanning, 0.0, acc)
            l_slots = tl.where(scanning, 0.0, l_slots)
            n_from = tl.where(scanning, lo, hi)
        l_i = tl.sum(l_slots, axis=1)
        m_i = tl.where(lo < hi, m_i, float("-inf"))
        accs = (acc,)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        accs = ()
        for g in tl.static_range(VG):
            accs = accs + (tl.zeros((BLOCK_M, VW), tl.float32),)
        for n0 in range(lo, hi, BLOCK_N):
            i, slot_ok, rows = _step_rows(n0, lo, hi, slot_lo, capacity, blocks, block_size, block_magic,
                                          block_shift, HKV, kvh, BLOCK_N)
            if ONE_QUERY:  # past the split's end, -inf, added to the scores
                s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32) + tl.where(slot_ok, 0.0, float("-inf"))[None, :]
            else:
                s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            s = _step_scores(s, queries, starts_at, k, k_scales, rows, D, FMT, KG, operand, USE_ASM)
            if not ONE_QUERY:
                k_pos = first + i
                allowed = slot_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
                allowed &= (window <= 0) | (q_pos[:, None] - k_pos[None, :] < window)
                s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = _exp2(s - m_safe[:, None], USE_ASM)
            corr = _exp2(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe), USE_ASM)
            l_i = l_i * corr + tl.sum(p, axis=1)
            m_i = m_new
            if FMT == 1:
                p16 = p.to(operand)
                v_scale = _columns(tl.load(v_scales + rows[:, None] * VG + tl.arange(0, VG)[None, :]), BLOCK_N, VG)
                new = ()
                for g in tl.static_range(VG):
                    tile = _group_tile(v, rows, g, D, False, USE_ASM)
                    new = new + (accs[g] * corr[:, None] + tl.dot(p16 * v_scale[g][None, :], tile),)
                accs = new
            else:
                values = _step_values(v, v_scales, rows, lanes_zero, D, FMT, operand, USE_ASM)
                accs = (accs[0] * corr[:, None] + tl.dot(p.to(operand), values),)
    out_row = (((seq * splits + sp) * HKV + kvh) * T * G + r).to(tl.int64)
    vd = tl.arange(0, VW)
    if FMT == 2:
        accs = (accs[0] * V_SHRINK,)
    for g in tl.static_range(VG):
        tl.store(part_acc + out_row[:, None] * D + g * VW + vd[None, :], accs[g], mask=row_ok[:, None])
    tl.store(part_ml + out_row * 2, m_i * 0.6931471805599453, mask=row_ok)
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
    # Positions a sequence's rows see: its ring's, its length's and its window's (the first row's
    # window and the chunk) least.
    n_slots = max(min(tables.capacity(i), s + t, window + t - 1 if window else s + t) for i, s in enumerate(starts))
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
        **{**c, "ONE_QUERY": t == 1, "USE_ASM": q.is_cuda}, num_warps=launch.num_warps,
    )
    out = torch.empty((b, t, h, d), dtype=torch.float32, device=q.device)
    merge = merge_launch(d)
    _merge_splits_kernel[(b * hkv * t * g,)](part_acc, part_ml, out, splits, hkv, t * g, g, **merge.constexprs,
                                             num_warps=merge.num_warps)
    return out

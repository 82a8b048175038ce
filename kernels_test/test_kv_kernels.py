"""KV cache formats: quantize-on-write, and attention reading the cache directly.

Triton (through the interpreter) against the torch path, and both against a
dense float64 attention over the same (dequantized) keys and values.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
import torch
from helpers import report_mismatch

from strata_kernels import KVStore, attention, kv_read, kv_write, kv_write_consecutive, write_and_attend
from strata_kernels.kv_quant import bytes_per_token, hadamard
from strata_kernels.formats import lookup_table
from strata_kernels.attention import decode_attention
from strata_kernels.paging import BlockTables
from strata_kernels.reference_kv import kv_dequantize, kv_quantize, round_scale_bits

FORMATS = ["f16", "int8", "k8v4"]
# The rerun of the ``cpu_kernels`` tests for another CPU variant (test_cpu_kernels_targets) sets this: the
# Triton interpreter's results do not depend on the CPU variant, and they were most of that rerun's time.
CHECK_TRITON = os.environ.get("STRATA_RERUN_CPU_KERNELS_ONLY") != "1"
# Triton's attention multiplies on the tensor cores: scaled queries, keys,
# probabilities and values rounded to 16 bits (float16 for float32 queries),
# sums in float32, so each output is off by about 2^-11 of the values it
# averages. An indexing or masking bug is off by the values themselves.
TRITON = dict(atol=2e-3, rtol=2e-3)


def _close(got, expected, backend) -> tuple[bool, str]:
    """``got`` within the backend's tolerance of ``expected``, and the report."""
    tol = TRITON if backend == "triton" else dict(atol=2e-5, rtol=0.0)
    return torch.allclose(got, expected, **tol), report_mismatch(got, expected, tol["atol"])


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["int8", "k8v4"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_quantize_on_write_triton_equals_torch(fmt, head_dim):
    keys, values = _rand(9, 2, head_dim, seed=1) * 3, _rand(9, 2, head_dim, seed=2)
    keys[3] = 0.0  # an all-zero row: scale 0, codes 0
    positions = torch.tensor([16, 5, 6, 7, 8, 9, 10, 11, 12])  # distinct slots, one wrapped
    a = KVStore.allocate(fmt, 13, 2, head_dim)
    b = KVStore.allocate(fmt, 13, 2, head_dim)
    kv_write(a, positions, keys, values, backend="torch")
    kv_write(b, positions, keys, values, backend="triton")
    for name in ("k", "v", "k_scales", "v_scales"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if fmt == "k8v4":  # 7 significant bits: the GPU's value decode is exact only for those (WORD_IQ4_SCALED)
        assert not (a.v_scales.view(torch.int16) & 15).any() and a.v_scales.abs().max() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_back_within_half_a_step(fmt):
    d = 128
    keys, values = _rand(5, 2, d, seed=3), _rand(5, 2, d, seed=4)
    keys[:, :, 7] *= 30  # an outlier channel, as Gemma 3's keys have
    store = KVStore.allocate(fmt, 8, 2, d)
    pos = torch.arange(5)
    kv_write(store, pos, keys, values)
    k, v = kv_read(store, pos)
    if fmt == "f16":
        assert not store.rotated
        assert torch.equal(k, keys) and torch.equal(v, values)
        return
    # Quantized rows live in the rotated basis, where the bounds hold.
    assert store.rotated
    h = hadamard(d)
    rot_k, rot_v = keys @ h, values @ h
    stored_k, stored_v = kv_dequantize(store, pos)
    assert torch.allclose(k, stored_k @ h, atol=1e-4) and torch.allclose(v, stored_v @ h, atol=1e-5)

    def within_half_a_step(stored, rotated):  # int8: max|group|/127/2
        step = rotated.reshape(5, 2, d // 64, 64).abs().amax(-1, keepdim=True) / 127
        return bool(((stored - rotated).reshape(5, 2, d // 64, 64).abs() <= step * 0.5 + 1e-5).all())

    assert within_half_a_step(stored_k, rot_k)
    # The rotation spreads the outlier: the keys read back are closer than
    # int8 groups over the raw channels could be (their step is set by it).
    raw_step = keys.reshape(5, 2, d // 64, 64).abs().amax(-1, keepdim=True) / 127
    assert float((k - keys).pow(2).mean()) < float(raw_step.pow(2).mean()) / 12 / 4
    if fmt == "int8":
        assert within_half_a_step(stored_v, rot_v)
    else:
        # With the extreme on the -127 level (the first scale tried), each value is
        # within 14/127 of it (the widest half-gap, above the top level); the
        # scale kept has at most that block's squared error.
        extreme = rot_v.reshape(5, 2, d // 32, 32).abs().amax(-1)
        err = (stored_v - rot_v).reshape(5, 2, d // 32, 32).square().sum(-1)
        assert bool((err <= 32 * (extreme * 14 / 127 * 1.002) ** 2 + 1e-6).all())
        assert float(err.max()) > 0  # it is a 4-bit format


def test_value_scales_round_to_seven_bits_to_nearest():
    """round_scale_bits: every float16 of either sign (all finite bit
    patterns below the largest binade) to the nearest with 7 significant
    bits, halves away from zero, a carry into the exponent where the
    mantissa overflows; then -1152 * s / 16 is exact in float16 for every
    scale up to 910 (what the GPU's value decode needs: _triton_convert.
    WORD_IQ4_SCALED, _triton_attention.V_SHRINK)."""
    bits = torch.arange(0, 0x7800, dtype=torch.int32)
    both = torch.cat([bits, bits | 0x8000]).to(torch.int16).view(torch.float16)
    rounded = round_scale_bits(both)
    assert not (rounded.view(torch.int16) & 15).any()
    exact, got = both.double(), rounded.double()
    step = torch.where(exact == 0, 1.0, exact.abs()).log2().floor().exp2().clamp(min=2.0**-14) * 2.0**-6
    assert bool(((got - exact).abs() <= step / 2).all())
    half_way = (exact.abs() / step).frac() == 0.5
    assert bool((got.abs()[half_way] > exact.abs()[half_way]).all())  # halves away from zero
    assert torch.equal(got.sign(), torch.where(got == 0, 0.0, exact.sign()))
    assert float(round_scale_bits(torch.tensor([1 + 2.0**-6 + 2.0**-7], dtype=torch.float16))) == 1 + 2.0**-5
    shrunk = (rounded.float() / 16).half()[got.abs() <= 910]
    assert torch.equal((shrunk.float() * -1152.0).half().double(), shrunk.double() * -1152.0)


def test_nf4_scale_search_beats_the_extreme_on_a_level():
    """Each 4-bit block keeps the least-error candidate scale: never worse
    than the first candidate (the extreme on the -127 level, its scale
    rounded to 7 bits as every candidate is), on Gaussian blocks (rotated
    values are close to that) 10% better or more."""
    blocks = _rand(4096, 32, seed=15)
    blocks[0] = 0.0  # all zero: scale 0
    codes, scales = kv_quantize(blocks.reshape(4096, 1, 32), "nf4", torch.float16)
    levels = lookup_table("iq4nl_values").float()
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(4096, 32).long()
    searched = (levels[nib] * scales.float().reshape(4096, 1) - blocks).square().sum(-1)
    top, bottom = blocks.amax(-1), blocks.amin(-1)
    first = round_scale_bits((torch.where(top >= -bottom, top, bottom) / -127.0).half()).float().unsqueeze(-1)
    y = torch.where(first != 0, blocks / torch.where(first != 0, first, 1.0), 0.0)
    nearest = levels[torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)]
    on_the_level = (nearest * first - blocks).square().sum(-1)
    assert scales[0, 0, 0] == 0 and float(searched[0]) == 0
    assert bool((searched <= on_the_level * (1 + 1e-6)).all())
    gain = 1 - float(searched.sum() / on_the_level.sum())
    print(f"4-bit scale search: squared error {gain:.1%} below the extreme-on-a-level scale")
    assert gain >= 0.10


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard(256)
    assert torch.allclose(h @ h, torch.eye(256), atol=1e-5) and torch.equal(h, h.T)


def test_bytes_per_token_of_the_formats():
    f16 = bytes_per_token("f16", 1, 256)
    assert bytes_per_token("int8", 1, 256) / f16 <= 0.53
    assert bytes_per_token("k8v4", 1, 256) / f16 <= 0.40
    store = KVStore.allocate("k8v4", 10, 1, 256)
    assert store.bytes_per_slot() == bytes_per_token("k8v4", 1, 256)


def store_tensors(store: KVStore) -> list[torch.Tensor]:
    return [t for t in (store.k, store.v, store.k_scales, store.v_scales) if t is not None]


def _dense(q, k, v, start, window, scale):
    """Float64 attention over every position 0..start+T-1 (no ring)."""
    t, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    qp = torch.arange(start, start + t)
    kp = torch.arange(k.shape[0])
    allowed = kp[None] <= qp[:, None]
    if window is not None:
        allowed &= qp[:, None] - kp[None] < window
    s = torch.einsum("thd,nhd->htn", q.double(), kk) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htn,nhd->thd", p, vv)


CASES = [  # head_dim, group (GQA ratio), context, window, chunk
    (64, 1, 37, None, 16),
    (128, 4, 61, 5, 16),  # window shorter than the context: the ring wraps
    (256, 8, 45, 1000, 16),  # window longer than the context
    (64, 4, 150, 40, 32),
]


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,group,context,window,chunk", CASES)
def test_prefill_and_decode_attention(fmt, head_dim, group, context, window, chunk):
    hkv, scale = 2, head_dim**-0.5
    keys, values = _rand(context, hkv, head_dim, seed=5), _rand(context, hkv, head_dim, seed=6)
    capacity = context if window is None else min(context, window + chunk)
    ring = KVStore.allocate(fmt, capacity, hkv, head_dim)
    ring_by_runs = KVStore.allocate(fmt, capacity, hkv, head_dim)  # written by kv_write_consecutive
    full = KVStore.allocate(fmt, context, hkv, head_dim)  # same codes, never wraps: the dense baseline's values
    kv_write(full, torch.arange(context), keys, values)
    k_all, v_all = kv_read(full, torch.arange(context))
    # Prefill in chunks, then decode one token at a time at the end.
    steps = [(s, min(context - 2, s + chunk)) for s in range(0, context - 2, chunk)]
    steps += [(context - 2, context - 1), (context - 1, context)]
    for s0, s1 in steps:
        kv_write(ring, torch.arange(s0, s1), keys[s0:s1], values[s0:s1])
        kv_write_consecutive(ring_by_runs, s0, keys[s0:s1], values[s0:s1])
        assert all(torch.equal(a, b) for a, b in zip(store_tensors(ring), store_tensors(ring_by_runs)))
        q = _rand(s1 - s0, hkv * group, head_dim, seed=s0)
        expected = _dense(q, k_all[:s1], v_all[:s1], s0, window, scale)
        by_torch = attention(q, ring, s0, window, scale, backend="torch")
        # backend="cpu": the compiled kernel on f16 decode steps, torch's fused attention on f16 chunks
        by_cpu = attention(q, ring, s0, window, scale, backend="cpu")
        assert torch.allclose(by_torch.double(), expected, atol=2e-5), report_mismatch(by_torch, expected.float(), 2e-5)
        if CHECK_TRITON:
            ok, report = _close(attention(q, ring, s0, window, scale, backend="triton"), by_torch, "triton")
            assert ok, report
        assert torch.allclose(by_cpu, by_torch, atol=2e-5), report_mismatch(by_cpu, by_torch, 2e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_split_over_the_context(fmt):
    """A long context is split across programs and merged by log-sum-exp."""
    hkv, group, d, context = 1, 4, 64, 700
    keys, values = _rand(context, hkv, d, seed=7), _rand(context, hkv, d, seed=8)
    store = KVStore.allocate(fmt, context, hkv, d)
    kv_write(store, torch.arange(context), keys, values)
    q = _rand(1, hkv * group, d, seed=9)
    by_torch = attention(q, store, context - 1, None, 0.125, backend="torch")
    by_cpu = attention(q, store, context - 1, None, 0.125, backend="cpu")  # chunks of 128 across threads
    if CHECK_TRITON:
        ok, report = _close(attention(q, store, context - 1, None, 0.125, backend="triton"), by_torch, "triton")
        assert ok, report
    assert torch.allclose(by_cpu, by_torch, atol=2e-5), report_mismatch(by_cpu, by_torch, 2e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_splits_merge_to_one_pass(fmt):
    """A context split 40 ways (the merge kernel's splits in three tiles of
    16, the last one partial) equals the torch path's one pass."""
    from strata_kernels._triton_attention import attention_triton
    from strata_kernels.launch_plans import FORMAT_CODES, KernelLaunch

    hkv, group, d, context = 2, 4, 64, 700
    store = KVStore.allocate(fmt, context, hkv, d)
    keys, values = _rand(context, hkv, d, seed=3), _rand(context, hkv, d, seed=4)
    kv_write(store, torch.arange(context), keys, values)
    q = _rand(1, hkv * group, d, seed=5)
    expected = attention(q, store, context - 1, None, 0.125, backend="torch")
    rotated = q @ hadamard(d) if store.rotated else q
    launch = KernelLaunch(dict(D=d, FMT=FORMAT_CODES[fmt], BLOCK_M=16, BLOCK_N=16))
    got = attention_triton(rotated[None], store, [context - 1], None, 0.125, BlockTables.contiguous(context),
                           launch=(launch, 40))[0]
    got = got @ hadamard(d) if store.rotated else got
    ok, report = _close(got, expected, "triton")
    assert ok, report


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spike", [14.0, 40.0, 120.0], ids=["within-reach", "past-float16", "past-float32"])
# (the interpreter's numpy warns where a weight past float16's range is cast, or past float32's is made,
# before the split is read again)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
def test_decode_score_far_above_the_first_steps(fmt, spike):
    """A later key whose score passes the first step's largest by ~20, ~60
    or ~170 log2 units (a weight of 2^20, 2^60 or 2^170 against the first
    step's: past float16's range, then float32's, for a kernel that weighs
    a split against its first step, as the one-query kernel does) still
    gives the exact path's output, whichever split holds it. Both ways of
    weighing (float16 and k8v4: a 16-row tile, D = 64, against a fixed
    reference; a 64-row tile, D = 128, by a running max, as int8 always)."""
    for d, block_m in ((64, 16), (128, 64)):
        _decode_with_a_far_score(fmt, spike, d, block_m)


def _decode_with_a_far_score(fmt, spike, d, block_m):
    from strata_kernels._triton_attention import attention_triton
    from strata_kernels.launch_plans import FORMAT_CODES, KernelLaunch

    hkv, group, context = 1, 4, 300
    q = _rand(1, hkv * group, d, seed=41)
    keys, values = 0.3 * _rand(context, hkv, d, seed=42), _rand(context, hkv, d, seed=43)
    keys[200, 0] = spike * q[0, 0] / q[0, 0].norm()  # head 0's score there: about 1.44 * spike log2 units
    store = KVStore.allocate(fmt, context, hkv, d)
    kv_write(store, torch.arange(context), keys, values)
    expected = attention(q, store, context - 1, None, 0.125, backend="torch")
    rotated = q @ hadamard(d) if store.rotated else q
    launch = KernelLaunch(dict(D=d, FMT=FORMAT_CODES[fmt], BLOCK_M=block_m, BLOCK_N=16))
    for splits in (1, 3):
        got = attention_triton(rotated[None], store, [context - 1], None, 0.125, BlockTables.contiguous(context),
                               launch=(launch, splits))[0]
        got = got @ hadamard(d) if store.rotated else got
        ok, report = _close(got, expected, "triton")
        assert ok, (d, block_m, splits, report)


def test_sliding_decode_reads_only_the_window():
    """A sliding layer's ring holds its window plus a chunk: a decode step
    reads only the window's slots. The older slots, set to NaN after the
    writes, leave the output as it was (masked after reading, a NaN key's
    score and a NaN value times a zero probability are NaN): at positions
    whose window wraps the ring's end and whose does not, split 1 and 3 ways."""
    from strata_kernels._triton_attention import attention_triton
    from strata_kernels.launch_plans import FORMAT_CODES, KernelLaunch

    hkv, group, d, window, chunk = 2, 4, 64, 40, 16
    capacity = window + chunk
    store = KVStore.allocate("f16", capacity, hkv, d, float_dtype=torch.float32)
    keys, values = _rand(150, hkv, d, seed=31), _rand(150, hkv, d, seed=32)
    tables = BlockTables.contiguous(capacity)
    launch = KernelLaunch(dict(D=d, FMT=FORMAT_CODES["f16"], BLOCK_M=16, BLOCK_N=16))
    for pos in (100, 130, 149):  # window [61, 100] wraps the 56-slot ring; [91, 130] and [110, 149] too
        kv_write(store, torch.arange(pos - capacity + 1, pos + 1), keys[pos - capacity + 1:pos + 1],
                 values[pos - capacity + 1:pos + 1])
        q = _rand(1, hkv * group, d, seed=pos)
        expected = attention(q, store, pos, window, 0.125, backend="torch")
        stale = torch.arange(pos - capacity + 1, pos + 1 - window) % capacity
        store.k[stale] = float("nan")
        store.v[stale] = float("nan")
        for splits in (1, 3):
            got = attention_triton(q[None], store, [pos], window, 0.125, tables, launch=(launch, splits))[0]
            ok, report = _close(got, expected, "triton")
            assert ok, (pos, splits, report)


@pytest.mark.parametrize("sms,heads,context", [(132, 8, 4096), (82, 8, 4096), (132, 1, 4096), (132, 64, 1024)])
def test_decode_splits_fill_every_sm_twice(sms, heads, context):
    """A decode step's programs (sequences x KV heads x splits) reach twice
    the device's SMs where the context has the tiles for it, every split at
    least a tile, and never fewer splits than the length alone asks for."""
    from strata_kernels.launch import attention_settings

    s = attention_settings(1, 4, context, 128, programs=heads, sms=sms)
    by_length = attention_settings(1, 4, context, 128)
    assert heads * s.splits >= 2 * sms or s.splits == -(-context // s.block_n)
    assert s.splits >= by_length.splits and s.splits * s.block_n <= context + s.block_n
    assert by_length.splits == context // 256  # the interpreter (no SM count): a split per 256 positions


# Three sequences in one store of 16-slot blocks, their blocks scattered and
# interleaved; the sliding case's tables are rings of 4 blocks (window 40 plus
# a chunk of 16, rounded up), which its 150 positions wrap twice.
SCATTERED = [[5, 2, 9, 0, 14, 7, 11, 3, 17, 20], [1, 12, 6, 19, 4, 15, 8, 21, 16, 23], [13, 10, 18, 22]]


@pytest.mark.parametrize("fmt,float_dtype", [("f16", torch.float32), ("f16", torch.bfloat16), ("int8", None),
                                             ("k8v4", None)], ids=["f16", "f16-bf16", "int8", "k8v4"])
@pytest.mark.cpu_kernels
@pytest.mark.parametrize("window", [None, 40])
def test_attention_reads_scattered_blocks_through_block_tables(fmt, float_dtype, window):
    """Prefill chunks and decode steps of three sequences sharing one store
    through block tables equal each sequence alone in its own ring, on every
    backend; a batched decode step (``decode_attention``: one CPU kernel
    call, one Triton write and launch for all three) equals the three steps
    one by one."""
    hkv, group, d, bs, chunk = 2, 4, 64, 16, 16
    lengths = [150, 97, 61]
    tables = [row[:4] if window else row for row in SCATTERED]
    if not window:
        tables[2] = tables[2][:4]  # 61 positions: 4 blocks
    shared = KVStore.allocate(fmt, 24 * bs, hkv, d, float_dtype=float_dtype)
    alone = [KVStore.allocate(fmt, n, hkv, d, float_dtype=float_dtype) for n in lengths]
    data = [(_rand(n, hkv, d, seed=10 + i), _rand(n, hkv, d, seed=20 + i)) for i, n in enumerate(lengths)]
    seq_tables = [BlockTables.of([t], bs) for t in tables]
    for i, n in enumerate(lengths):
        k, v = data[i]
        for s0 in range(0, n - 1, chunk):
            s1 = min(n - 1, s0 + chunk)
            q = _rand(s1 - s0, hkv * group, d, seed=s0 + i)
            expected = write_and_attend(q, k[s0:s1], v[s0:s1], alone[i], s0, window, d**-0.5, "torch")
            for backend in ("torch", "triton", "cpu") if CHECK_TRITON else ("torch", "cpu"):
                if backend != "torch":  # the other backends read what torch's write left
                    got = attention(q, shared, s0, window, d**-0.5, backend, seq_tables[i])
                else:
                    got = write_and_attend(q, k[s0:s1], v[s0:s1], shared, s0, window, d**-0.5, backend,
                                           seq_tables[i])
                ok, report = _close(got, expected, backend)
                assert ok, (backend, report)
    # The last position of every sequence, one query each, as one batched step.
    q = _rand(3, hkv * group, d, seed=99)
    last_k = torch.stack([k[-1] for k, _ in data])
    last_v = torch.stack([v[-1] for _, v in data])
    positions = torch.tensor([n - 1 for n in lengths])
    expected = torch.cat([write_and_attend(q[i:i + 1], last_k[i:i + 1], last_v[i:i + 1], alone[i], n - 1, window,
                                           d**-0.5, "torch") for i, n in enumerate(lengths)])
    for backend in ("torch", "cpu", "triton") if CHECK_TRITON else ("torch", "cpu"):
        got = decode_attention(q, last_k, last_v, shared, positions, window, d**-0.5,
                               BlockTables.of(tables, bs), backend)
        ok, report = _close(got, expected, backend)
        assert ok, (backend, report)
    # Triton's one launch with the context split 4 ways: the shorter sequences'
    # last splits hold nothing and must weigh nothing in the merge.
    from strata_kernels._triton_attention import attention_triton
    from strata_kernels.launch_plans import FORMAT_CODES, KernelLaunch

    if CHECK_TRITON:
        rotated = q @ hadamard(d) if shared.rotated else q
        small = KernelLaunch(dict(D=d, FMT=FORMAT_CODES[shared.fmt], BLOCK_M=16, BLOCK_N=16))
        got = attention_triton(rotated[:, None], shared, positions.tolist(), window, d**-0.5,
                               BlockTables.of(tables, bs), launch=(small, 4))[:, 0]
        got = got @ hadamard(d) if shared.rotated else got
        ok, report = _close(got, expected, "triton")
        assert ok, report
    for i, n in enumerate(lengths):  # every position each sequence keeps reads back as written
        first = 0 if window is None else max(0, n - 4 * bs)
        a = kv_read(shared, torch.arange(first, n), seq_tables[i])
        b = kv_read(alone[i], torch.arange(first, n))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@given(d=st.integers(1, 2**31 - 1), x=st.integers(0, 2**31 - 1))
@example(d=1, x=2**31 - 1)
@example(d=3, x=2**31 - 1)
@example(d=2**31 - 1, x=2**31 - 2)
@example(d=641, x=641 * 3350575 - 1)
def test_a_slot_s_block_is_a_multiply_and_a_shift(d, x):
    """The attention kernel's division of a slot by the block size (any
    size: a whole ring is one block) by a 32-bit high multiply and a shift:
    exact for every slot below 2**31, ``magic`` an int32's bits."""
    from strata_kernels.paging import divide_by_multiplying

    magic, shift = divide_by_multiplying(d)
    assert -2**31 <= magic < 2**31
    assert (((2 * x) * (magic % 2**32)) >> 32) >> shift == x // d


def test_block_tables_find_slots_and_merge_runs():
    tables = BlockTables.of([[3, 4, 0]], 8)
    assert tables.capacity() == 24
    assert tables.runs(0, 0, 24) == [(0, 24, 16), (16, 0, 8)]  # blocks 3 and 4 are adjacent: one run
    assert tables.runs(0, 20, 30) == [(20, 4, 4), (24, 24, 6)]  # the ring wraps to block 3
    assert tables.runs(0, 0, 16, limit=10) == [(0, 24, 8), (8, 32, 8)]  # each at most 10
    assert [tables.slot(0, p) for p in (0, 9, 17, 25)] == [24, 33, 1, 25]
    assert tables.slots(0, torch.tensor([0, 9, 17, 25])).tolist() == [24, 33, 1, 25]
    assert BlockTables.contiguous(10).runs(0, 7, 13) == [(7, 7, 3), (10, 0, 3)]


def test_bad_shapes_are_clear():
    store = KVStore.allocate("int8", 8, 2, 64)
    with pytest.raises(ValueError, match=r"keys and values must both be \[T, 2, 64\]"):
        kv_write(store, torch.arange(3), torch.zeros(3, 1, 64), torch.zeros(3, 1, 64))
    with pytest.raises(ValueError, match="do not fit a cache of 2 KV heads of dim 64"):
        attention(torch.zeros(1, 3, 64), store, 0, None, 1.0)
    with pytest.raises(ValueError, match="kv format must be one of f16, int8, k8v4"):
        KVStore.allocate("q4", 8, 2, 64)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        KVStore.allocate("k8v4", 8, 2, 96)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("context", [4096, 32768])
def test_gpu_attention_large(fmt, context):
    hkv, group, d = 8, 4, 128
    store = KVStore.allocate(fmt, context, hkv, d, device="cuda")
    keys = torch.randn(context, hkv, d, device="cuda")
    kv_write(store, torch.arange(context, device="cuda"), keys, torch.randn_like(keys))
    q = torch.randn(1, hkv * group, d, device="cuda")
    ref = attention(q, store, context - 1, None, d**-0.5, backend="torch")
    out = attention(q, store, context - 1, None, d**-0.5, backend="triton")
    assert torch.allclose(out, ref, atol=1e-3)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_cpu_decode_kernel_over_float_storage(window, storage, long):
    """The CPU fast path stores f16-format keys and values in bfloat16 (the
    exact path in float32); the compiled decode kernel reads either in place,
    as the torch reference does after widening them to float32. A
    long context gives the kernel enough chunks of positions that each task
    takes every KV head of its chunk (a short one: one KV head per task); 3
    query heads per KV head leave a group of scores short of 16 lanes."""
    threads = torch.get_num_threads()
    hkv, group, d = 2, 3 if long else 4, 128
    context = 128 * 4 * threads + 77 if long else 700
    store = KVStore.allocate("f16", context, hkv, d, float_dtype=storage)
    keys, values = _rand(context, hkv, d, seed=10), _rand(context, hkv, d, seed=11)
    kv_write_consecutive(store, 0, keys, values)
    assert store.k.dtype == storage and torch.equal(store.k, keys.to(storage))
    q = _rand(1, hkv * group, d, seed=12)
    by_torch = attention(q, store, context - 1, window, d**-0.5, backend="torch")
    by_cpu = attention(q, store, context - 1, window, d**-0.5, backend="cpu")
    assert torch.allclose(by_cpu, by_torch, atol=2e-5), report_mismatch(by_cpu, by_torch, 2e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 24])
def test_write_and_attend_in_one_call_equals_write_then_attend(storage, window):
    """The CPU kernel writes a decode step's key and value into its ring slot
    and attends, in one call: the same cache and the same output as a write
    and the torch attention, across the ring's wrap."""
    hkv, group, d, capacity = 2, 4, 64, 40
    one = KVStore.allocate("f16", capacity, hkv, d, float_dtype=storage)
    two = KVStore.allocate("f16", capacity, hkv, d, float_dtype=storage)
    keys, values = _rand(100, hkv, d, seed=13), _rand(100, hkv, d, seed=14)
    kv_write_consecutive(one, 0, keys[:30], values[:30])
    kv_write_consecutive(two, 0, keys[:30], values[:30])
    for pos in range(30, 100 if window else capacity):  # a full-attention layer never wraps
        q = _rand(1, hkv * group, d, seed=pos)
        fused = write_and_attend(q, keys[pos:pos + 1], values[pos:pos + 1], one, pos, window, 0.125, backend="cpu")
        kv_write_consecutive(two, pos, keys[pos:pos + 1], values[pos:pos + 1])
        apart = attention(q, two, pos, window, 0.125, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(store_tensors(one), store_tensors(two)))
        assert torch.allclose(fused, apart, atol=2e-5), report_mismatch(fused, apart, 2e-5)


@pytest.mark.cpu_kernels
def test_write_and_attend_other_formats_write_then_attend():
    store, twin = KVStore.allocate("int8", 16, 1, 64), KVStore.allocate("int8", 16, 1, 64)
    keys, values, q = _rand(1, 1, 64, seed=1), _rand(1, 1, 64, seed=2), _rand(1, 4, 64, seed=3)
    out = write_and_attend(q, keys, values, store, 0, None, 0.125, backend="cpu")
    kv_write(twin, torch.arange(1), keys, values)
    assert all(torch.equal(a, b) for a, b in zip(store_tensors(store), store_tensors(twin)))
    assert torch.allclose(out, attention(q, twin, 0, None, 0.125, backend="torch"), atol=2e-5)

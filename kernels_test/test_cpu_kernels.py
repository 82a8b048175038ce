"""The compiled CPU kernels (``backend="cpu"``): dequantize bit-exact against
gguf-py, qmatmul against float64, for every type they read.

The first test to run compiles ``csrc/`` (about 50 s on 2 cores;
torch caches the build afterwards). A machine without a C++ compiler fails
here, loudly: the fast CPU path would silently fall back to dense weights.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import assert_bit_exact, gguf_reference, matmul_tolerance, random_quant_tensor, report_mismatch

from strata_kernels import QuantTensor, block_format, cpu_kernels, dequantize, qmatmul
from strata_kernels.launch import CPU_GEMV_MAX_M, CPU_SLAB_ROWS
from strata_kernels.paging import BlockTables

pytestmark = pytest.mark.cpu_kernels  # run again for each ISA variant (test_cpu_kernels_targets.py)

CPU_TYPES = sorted(cpu_kernels.CPU_KERNEL_TYPES, key=lambda t: t.value)


def test_the_kernels_build_here():
    assert cpu_kernels.available(), cpu_kernels.build_error()


def _blocks_per_row(qtype: T, k: int) -> int:
    return max(1, k // block_format(qtype).block_size)


@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row,seed", [(1, 1, 0), (7, 2, 1), (37, 3, 2)])
def test_dequantize_matches_gguf_bit_for_bit(qtype, rows, blocks_per_row, seed):
    qt = random_quant_tensor(qtype, rows, blocks_per_row, seed)
    full = dequantize(qt, backend="cpu")
    assert_bit_exact(full, gguf_reference(qt))
    # Equal values, NaN where float32 has NaN (random IQ1_M blocks spell a NaN d from their scale bits).
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(dequantize(qt, torch.bfloat16, backend="cpu"), full.bfloat16(), **exact)
    torch.testing.assert_close(dequantize(qt, torch.float16, backend="cpu"), full.half(), **exact)


def test_real_model_tensors_dequantize_bit_for_bit(model_gguf):
    seen = set()
    for name in model_gguf.tensor_names():
        qt = model_gguf.tensor(name)
        if qt.qtype not in cpu_kernels.CPU_KERNEL_TYPES or (qt.qtype, qt.cols) in seen:
            continue
        seen.add((qt.qtype, qt.cols))
        part = qt.row_slice(0, min(qt.rows, 300))
        assert_bit_exact(dequantize(part, backend="cpu"), gguf_reference(part))
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= {q for q, _ in seen}


def _check(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    w = dequantize(qt, backend="torch")
    expected = x.double() @ w.double().T
    actual = qmatmul(x, qt, backend="cpu")
    assert actual.shape == (x.shape[0], qt.rows) and actual.dtype == x.dtype
    tol = matmul_tolerance(x, w, x.dtype)
    if x.shape[0] <= CPU_GEMV_MAX_M:
        # The GEMV rounds x to 16-bit codes per 32 columns: each value moves by
        # at most half a code, 2^-16 of its group's largest (the float32 bound
        # above covers that only once K is a few hundred).
        amax = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1)
        tol = tol + 2.0**-16 * amax @ w.double().abs().reshape(w.shape[0], -1, 32).sum(-1).T
    bad = (actual.double() - expected).abs() > tol
    assert not bad.any(), report_mismatch(actual, expected.to(actual.dtype), atol=float(tol.max()))
    return actual


@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, CPU_GEMV_MAX_M, 16, 33])
def test_qmatmul_matches_float64(qtype, m):
    """Both sides of the crossover: the GEMV (m <= CPU_GEMV_MAX_M) and the
    GEMM over dequantized slabs."""
    qt = random_quant_tensor(qtype, 13, _blocks_per_row(qtype, 512), seed=200 + m)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
    _check(x, qt)


@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5, CPU_GEMV_MAX_M, 33])
def test_qmatmul_bfloat16_activations(qtype, m):
    """bfloat16 in, bfloat16 out, float32 accumulation: within the output's
    rounding of the float64 product of the same bfloat16 inputs, and the GEMV
    within one bfloat16 step of its float32 result on the same values."""
    qt = random_quant_tensor(qtype, 9, _blocks_per_row(qtype, 512), seed=7)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    actual = _check(x, qt)
    if m <= CPU_GEMV_MAX_M:
        by_float32 = cpu_kernels.gemv(x.float(), qt)
        step = by_float32.abs() * 2.0**-8 + 1e-5
        assert ((actual.float() - by_float32).abs() <= step).all(), \
            report_mismatch(actual.float(), by_float32, atol=float(step.max()))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_prefill_gemm_in_bfloat16_under_float32_activations(qtype):
    """``gemm_dtype=torch.bfloat16`` (the default path's prefill matmuls on a
    CPU with the bf16 dot product): float32 in and out, the product taken by
    torch's bfloat16 GEMM on the bfloat16 roundings of x and of the weight;
    a decode step's rows still go through the float32 GEMV."""
    qt = random_quant_tensor(qtype, 37, _blocks_per_row(qtype, 512), seed=11)
    x = torch.randn(CPU_GEMV_MAX_M + 5, qt.cols, generator=torch.Generator().manual_seed(12))
    y = cpu_kernels.qmatmul_cpu(x, qt, torch.bfloat16)
    assert y.dtype == torch.float32
    w = dequantize(qt, torch.bfloat16, backend="cpu")
    assert torch.equal(y, (x.bfloat16() @ w.T).float())
    few = x[:CPU_GEMV_MAX_M]
    assert torch.equal(cpu_kernels.qmatmul_cpu(few, qt, torch.bfloat16), cpu_kernels.gemv(few, qt))


def test_qmatmul_real_weights(model_gguf):
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.3.ffn_down.weight", "blk.0.attn_v.weight"):
        qt = model_gguf.tensor(name).row_slice(0, 29)
        x = torch.randn(2, qt.cols, generator=torch.Generator().manual_seed(3))
        _check(x, qt)


def test_the_head_in_slabs_equals_row_by_row(model_gguf):
    """More rows than one slab: the GEMM side walks the weight in slabs."""
    head = model_gguf.tensor("token_embd.weight").row_slice(0, CPU_SLAB_ROWS + 77)
    x = torch.randn(CPU_GEMV_MAX_M + 1, head.cols, generator=torch.Generator().manual_seed(4))
    full = qmatmul(x, head, backend="cpu")
    assert full.shape == (x.shape[0], head.rows)
    tail = head.row_slice(CPU_SLAB_ROWS, head.rows)
    assert torch.allclose(full[:, CPU_SLAB_ROWS:], qmatmul(x, tail, backend="cpu"), rtol=0, atol=1e-5)


def test_results_do_not_depend_on_the_thread_count():
    """Each output row is summed by one thread in a fixed order."""
    qt = random_quant_tensor(T.Q6_K, 301, 2, seed=9)
    x = torch.randn(2, qt.cols, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qmatmul(x, qt, backend="cpu")
        torch.set_num_threads(2)
        two = qmatmul(x, qt, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_input_is_clear():
    other = random_quant_tensor(T.MXFP4, 3, 1, 0)
    with pytest.raises(NotImplementedError, match="the CPU kernels read .*Q4_K.*not MXFP4; use backend='torch'"):
        qmatmul(torch.randn(1, other.cols), other, backend="cpu")
    with pytest.raises(NotImplementedError, match="not MXFP4"):
        dequantize(other, backend="cpu")
    qt = random_quant_tensor(T.Q8_0, 4, 2, 0)
    with pytest.raises(ValueError, match="x has K=32 columns but the weight .* has K=64"):
        qmatmul(torch.randn(2, 32), qt, backend="cpu")
    with pytest.raises(RuntimeError, match=f"gemv takes 1 to {CPU_GEMV_MAX_M} rows"):
        cpu_kernels.gemv(torch.randn(CPU_GEMV_MAX_M + 1, 64), qt)
    with pytest.raises(RuntimeError, match="a row of blocks has 68 bytes, K=32 needs 34"):
        cpu_kernels.kernels().gemv(torch.randn(1, 32), [qt.data], [int(T.Q8_0)], 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to show that backend='cpu' refuses it")
@pytest.mark.gpu
def test_cpu_backend_refuses_cuda_tensors():
    qt = random_quant_tensor(T.Q8_0, 4, 2, 0).to("cuda")
    with pytest.raises(ValueError, match="backend='cpu' runs on CPU tensors"):
        qmatmul(torch.randn(1, 64, device="cuda"), qt, backend="cpu")


# --- the GEMV's groups of steps ----------------------------------------------------

@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
def test_gemv_every_width_past_the_groups(qtype):
    """The SIMD builds read 4 (AVX-512) or 2 (AVX2) 32-weight steps at a time
    and the steps past the last whole group one by one: K of every remainder
    modulo 4 steps (32-weight blocks), and one to three super-blocks, against
    float64, for 1 to 8 rows of x."""
    block = block_format(qtype).block_size
    for blocks in ([1, 2, 3, 4, 5, 6, 7, 9, 11] if block == 32 else [1, 2, 3]):
        qt = random_quant_tensor(qtype, 7, blocks, seed=blocks)
        for m in (1, 2, 5, CPU_GEMV_MAX_M):
            _check(torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m + blocks)), qt)


@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
def test_a_row_of_x_gives_the_same_bits_whatever_shares_its_call(qtype):
    """Each row of x is reduced in the same order whatever the other rows:
    a sequence decoded in a batch gets the bits it gets alone (the default
    path's batched decode rests on this)."""
    block = block_format(qtype).block_size
    qt = random_quant_tensor(qtype, 11, 7 if block == 32 else 3, seed=5)
    x = torch.randn(CPU_GEMV_MAX_M, qt.cols, generator=torch.Generator().manual_seed(6)) * 3
    alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], qt) for i in range(x.shape[0])])
    for m in range(2, CPU_GEMV_MAX_M + 1):
        assert torch.equal(cpu_kernels.gemv(x[:m], qt), alone[:m]), m


# --- several weights in one call ------------------------------------------------

@pytest.mark.parametrize("m", [1, 4, CPU_GEMV_MAX_M])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemv_many_equals_one_weight_at_a_time(m, dtype):
    """q/k/v or gate/up in one call: the same rows, bit for bit, as one call
    each, whatever the mix of types and row counts."""
    weights = [random_quant_tensor(T.Q5_0, 37, 8, 1), random_quant_tensor(T.Q4_K, 5, 1, 2),
               random_quant_tensor(T.Q6_K, 64, 1, 3), random_quant_tensor(T.Q8_0, 300, 8, 4)]
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    together = cpu_kernels.gemv_many(x, weights)
    assert len(together) == len(weights)
    for y, w in zip(together, weights):
        assert y.shape == (m, w.rows) and y.dtype == dtype
        assert torch.equal(y, cpu_kernels.gemv(x, w))


# --- the small ops of a decode step -----------------------------------------------

def _norm_float64(x, weight, eps, residual=None, rope=None):
    y = x.double()
    if weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    if rope is not None:
        cos, sin = (t.double() for t in rope)
        half = y.shape[-1] // 2
        y = y * cos + torch.cat([-y[..., half:], y[..., :half]], -1) * sin
    return y if residual is None else residual.double() + y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# The rotary embedding applies to [T, H, D] (queries and keys); D=100 has a tail past the SIMD lanes.
@pytest.mark.parametrize("shape,with_rope", [((1, 640), False), ((3, 4, 256), False), ((3, 4, 256), True),
                                             ((5, 2, 100), False), ((5, 2, 100), True)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "no-norm"])
def test_rms_norm_rope_residual_match_float64(dtype, shape, with_rope, with_residual, with_norm):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=g) + 0.5 if with_norm else None
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    rope = None
    if with_rope:
        angles = torch.rand(shape[0], 1, shape[-1] // 2, generator=g) * 6
        angles = torch.cat([angles, angles], -1)
        rope = (angles.cos(), angles.sin())
    if weight is None and residual is None and rope is not None:
        actual = cpu_kernels.rope(x, *rope)  # Llama's queries and keys: the rotation alone
    else:
        actual = cpu_kernels.rms_norm(x, weight, 1e-6, residual, rope)
    expected = _norm_float64(x, weight, 1e-6, residual, rope)
    assert actual.shape == x.shape and actual.dtype == dtype
    # Float32 inside, rounded once: within float32 noise, or half a bfloat16 step.
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert torch.allclose(actual.double(), expected, rtol=rtol, atol=1e-5), \
        report_mismatch(actual.float(), expected.float(), atol=1e-5)


def test_decode_ops_bad_input_is_clear():
    x = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[64\]"):
        cpu_kernels.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be contiguous, with x's shape and dtype"):
        cpu_kernels.rms_norm(x, torch.ones(64), 1e-6, residual=torch.zeros(2, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[T, 1, D\]"):
        cpu_kernels.rms_norm(x, torch.ones(64), 1e-6, rope=(torch.ones(3, 1, 64), torch.ones(3, 1, 64)))
    k = torch.zeros(10, 1, 40)
    at = lambda *p: torch.tensor(p, dtype=torch.long)  # noqa: E731
    ring = BlockTables.contiguous(10)
    with pytest.raises(RuntimeError, match="head dim 40 is not a multiple of 16"):
        cpu_kernels.attention_decode(torch.zeros(1, 2, 40), k, k, at(2), None, 1.0, ring)
    k = torch.zeros(10, 1, 64)
    with pytest.raises(RuntimeError, match="position 12 sees 13 positions, more than its 10 slots hold"):
        cpu_kernels.attention_decode(torch.zeros(1, 2, 64), k, k, at(12), None, 1.0, ring)
    with pytest.raises(RuntimeError, match="new_k and new_v must hold 1 x 1 x 64 values"):
        cpu_kernels.attention_decode(torch.zeros(1, 2, 64), k, k, at(3), None, 1.0, ring, torch.zeros(2, 64),
                                     torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="block 7 is not in 0..4"):
        cpu_kernels.attention_decode(torch.zeros(1, 2, 64), k, k, at(1), None, 1.0, BlockTables.of([[7]], 2))
    with pytest.raises(RuntimeError, match="block_size 3 does not divide the 10 slots"):
        cpu_kernels.attention_decode(torch.zeros(1, 2, 64), k, k, at(1), None, 1.0, BlockTables.of([[0]], 3))
    with pytest.raises(RuntimeError, match="gate and up must be float32 or bfloat16 tensors of one shape and dtype"):
        cpu_kernels.gelu_tanh_mul(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="gate and up must be float32 or bfloat16 tensors of one shape and dtype"):
        cpu_kernels.silu_mul(torch.zeros(3, dtype=torch.float16), torch.zeros(3, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2048), (3, 100)])  # 100: a tail past the SIMD lanes
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_gated_activations_match_float64(dtype, shape, act):
    g = torch.Generator().manual_seed(shape[-1])
    gate = (torch.randn(shape, generator=g) * 4).to(dtype)
    gate.view(-1)[:5] = torch.tensor([30.0, -30.0, 0.0, -1e-3, -100.0])  # saturated both ways, zero, tiny
    up = torch.randn(shape, generator=g).to(dtype)
    if act == "silu":
        actual = cpu_kernels.silu_mul(gate, up)
        expected = torch.nn.functional.silu(gate.double()) * up.double()
    else:
        actual = cpu_kernels.gelu_tanh_mul(gate, up)
        expected = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    assert actual.shape == gate.shape and actual.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert torch.allclose(actual.double(), expected, rtol=rtol, atol=1e-6), \
        report_mismatch(actual.float(), expected.float(), atol=1e-6)


# --- a decoder layer's decode step in two calls --------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["plain", "biases", "qk-norms+post-norms"])
def test_fused_decode_blocks_equal_their_kernels_one_by_one(dtype, variant):
    """``attention_block`` and ``mlp_block`` (csrc/decode_block_cpu.cpp):
    the same bits as the kernels they compose, called one by one, for each
    optional part (q/k/v biases; per-head q/k norms and post-norms)."""
    g = torch.Generator().manual_seed(len(variant))
    hidden, heads, kv_heads, d, ffn, capacity, pos = 256, 6, 2, 32, 256, 40, 29
    qkv = [random_quant_tensor(T.Q4_K, n, 1, s) for n, s in ((heads * d, 1), (kv_heads * d, 2), (kv_heads * d, 3))]
    o, gate = random_quant_tensor(T.Q8_0, hidden, 6, 4), random_quant_tensor(T.Q4_0, ffn, 8, 5)
    up, down = random_quant_tensor(T.Q6_K, ffn, 1, 6), random_quant_tensor(T.Q5_0, hidden, 8, 7)
    weight = lambda n: torch.rand(n, generator=g) + 0.5  # noqa: E731
    x = torch.randn(1, hidden, generator=g).to(dtype)
    biases = [torch.randn(w.rows, generator=g).to(dtype) for w in qkv] if variant == "biases" else []
    qk = (weight(d), weight(d)) if variant.startswith("qk") else (None, None)
    post = (weight(hidden), weight(hidden)) if variant.startswith("qk") else (None, None)
    angles = torch.rand(1, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rings = [torch.randn(capacity, kv_heads, d, generator=g).bfloat16() for _ in range(2)]
    norms, eps, scale, k = (weight(hidden), weight(hidden)), 1e-6, d**-0.5, cpu_kernels.built()

    # One by one, as the model files' modules call them.
    expected_rings = [r.clone() for r in rings]
    h = cpu_kernels.rms_norm(x, norms[0], eps)
    q, kk, v = cpu_kernels.gemv_many(h, qkv)
    if biases:
        q, kk, v = q + biases[0], kk + biases[1], v + biases[2]
    q = cpu_kernels.rms_norm(q.view(1, heads, d), qk[0], eps if qk[0] is not None else 0.0, None, (cos, sin))
    kk = cpu_kernels.rms_norm(kk.view(1, kv_heads, d), qk[1], eps if qk[1] is not None else 0.0, None, (cos, sin))
    positions, ring = torch.tensor([pos]), BlockTables.contiguous(capacity)
    att = cpu_kernels.attention_decode(q.float(), *expected_rings, positions, None, scale, ring, kk,
                                       v.view(1, kv_heads, d))
    y = cpu_kernels.gemv(att.reshape(1, heads * d).to(dtype), o)
    x1 = cpu_kernels.rms_norm(y, post[0], eps, x) if post[0] is not None else x + y
    h = cpu_kernels.rms_norm(x1, norms[1], eps)
    gu = cpu_kernels.gemv_many(h, [gate, up])
    y = cpu_kernels.gemv(cpu_kernels.silu_mul(*gu), down)
    x2 = cpu_kernels.rms_norm(y, post[1], eps, x1) if post[1] is not None else x1 + y

    fused1 = k.attention_block(x, norms[0], eps, [w.data for w in qkv], [int(w.qtype) for w in qkv], biases, *qk,
                               heads, kv_heads, d, cos, sin, *rings, positions, None, scale, ring.tables,
                               ring.lengths, ring.block_size, o.data, int(o.qtype), post[0])
    assert torch.equal(fused1, x1) and all(torch.equal(a, b) for a, b in zip(rings, expected_rings))
    fused2 = k.mlp_block(fused1, norms[1], eps, gate.data, int(gate.qtype), up.data, int(up.qtype), down.data,
                         int(down.qtype), 1, post[1])
    assert torch.equal(fused2, x2)

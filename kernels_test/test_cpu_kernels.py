"""The compiled CPU kernels (``backend="cpu"``): dequantize bit-exact against
gguf-py, qmatmul against float64, for every type they read.

The first test to run compiles ``csrc/gguf_cpu.cpp`` (about 30 s on 2 cores;
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
    assert torch.equal(dequantize(qt, torch.bfloat16, backend="cpu"), full.bfloat16())
    assert torch.equal(dequantize(qt, torch.float16, backend="cpu"), full.half())


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


@pytest.mark.parametrize("m", [1, 5, 33])
def test_qmatmul_bfloat16_activations(m):
    """bfloat16 in, bfloat16 out, float32 accumulation: within the output's
    rounding of the float64 product of the same bfloat16 inputs."""
    qt = random_quant_tensor(T.Q4_K, 9, 2, seed=7)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    _check(x, qt)


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
    iq = random_quant_tensor(T.IQ4_XS, 3, 1, 0)
    with pytest.raises(NotImplementedError, match="the CPU kernels read .*Q4_K.*not IQ4_XS; use backend='torch'"):
        qmatmul(torch.randn(1, iq.cols), iq, backend="cpu")
    with pytest.raises(NotImplementedError, match="not IQ4_XS"):
        dequantize(iq, backend="cpu")
    qt = random_quant_tensor(T.Q8_0, 4, 2, 0)
    with pytest.raises(ValueError, match="x has K=32 columns but the weight .* has K=64"):
        qmatmul(torch.randn(2, 32), qt, backend="cpu")
    with pytest.raises(RuntimeError, match=f"gemv takes 1 to {CPU_GEMV_MAX_M} rows"):
        cpu_kernels.gemv(torch.randn(CPU_GEMV_MAX_M + 1, 64), qt)
    with pytest.raises(RuntimeError, match="a row of blocks has 68 bytes, K=32 needs 34"):
        cpu_kernels.kernels().gemv(torch.randn(1, 32), qt.data, int(T.Q8_0), 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to show that backend='cpu' refuses it")
@pytest.mark.gpu
def test_cpu_backend_refuses_cuda_tensors():
    qt = random_quant_tensor(T.Q8_0, 4, 2, 0).to("cuda")
    with pytest.raises(ValueError, match="backend='cpu' runs on CPU tensors"):
        qmatmul(torch.randn(1, 64, device="cuda"), qt, backend="cpu")

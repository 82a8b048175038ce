"""Triton dequantize and qmatmul, run on the CPU through the interpreter.

dequantize must equal ``gguf.quants.dequantize`` bit for bit here (the
interpreter does not contract multiply-adds; on a GPU FMA contraction may move
a value by an ulp, which the GPU tests allow). qmatmul must match
``x @ dequantize(W).T`` computed in float64 within a tolerance that grows
with K.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T
from helpers import assert_bit_exact, gguf_reference, matmul_tolerance, random_quant_tensor, report_mismatch

from strata_kernels import QuantTensor, block_format, dequantize, qmatmul
from strata_kernels._triton_dequant import table_args
from strata_kernels._triton_unpack import SUB_BLOCK, TRITON_TABLES, sub_block_scales

TRITON_TYPES = [T(q) for q in TRITON_TABLES]


def _blocks_per_row(qtype: T, k_target: int) -> int:
    return max(1, k_target // block_format(qtype).block_size)


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row,seed", [(1, 1, 10), (13, 3, 11)])
def test_triton_dequantize_random_blocks(qtype, rows, blocks_per_row, seed):
    qt = random_quant_tensor(qtype, rows, blocks_per_row, seed)
    assert_bit_exact(dequantize(qt, backend="triton"), gguf_reference(qt))


def test_triton_dequantize_real_tensors(model_gguf):
    seen = set()
    for name in model_gguf.tensor_names():
        qt = model_gguf.tensor(name)
        if qt.qtype in seen or qt.qtype == T.F32 or len(qt.shape) != 2:
            continue
        seen.add(qt.qtype)
        part = qt.row_slice(0, 37)
        assert_bit_exact(dequantize(part, backend="triton"), gguf_reference(part))
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= seen


def test_triton_dequantize_casts(model_gguf):
    part = model_gguf.tensor("blk.0.attn_output.weight").row_slice(0, 5)
    full = dequantize(part, backend="torch")
    assert torch.equal(dequantize(part, torch.float16, backend="triton"), full.half())


def _check_qmatmul(x: torch.Tensor, qt: QuantTensor, backend: str) -> None:
    w = dequantize(qt, backend="torch")
    expected = x.double() @ w.double().T
    actual = qmatmul(x, qt, backend=backend)
    assert actual.shape == (x.shape[0], qt.rows) and actual.dtype == x.dtype
    tol = matmul_tolerance(x, w, x.dtype)
    bad = (actual.double() - expected).abs() > tol
    assert not bad.any(), report_mismatch(actual, expected.to(actual.dtype), atol=float(tol.max()))


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 16, 33])  # GEMV K tiles 256, 128 and 64; GEMM tiles 16 and 64
def test_qmatmul_matches_float64(qtype, m):
    n = 13  # odd, and not a multiple of any tile
    qt = random_quant_tensor(qtype, n, _blocks_per_row(qtype, 512), seed=100 + m)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
    _check_qmatmul(x, qt, "triton")
    _check_qmatmul(x, qt, "torch")


@pytest.mark.parametrize("m", [1, 16])
def test_qmatmul_half_activations(m):
    qt = random_quant_tensor(T.Q4_K, 7, 2, seed=5)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(0)).half()
    _check_qmatmul(x, qt, "triton")


def test_qmatmul_real_weight(model_gguf):
    qt = model_gguf.tensor("blk.3.ffn_down.weight").row_slice(0, 31)  # Q6_K, K=2048
    x = torch.randn(3, qt.cols, generator=torch.Generator().manual_seed(1))
    _check_qmatmul(x, qt, "triton")


def test_qmatmul_bad_input_is_clear():
    qt = random_quant_tensor(T.Q8_0, 4, 2, 0)
    with pytest.raises(ValueError, match="x has K=32 columns but the weight .* has K=64"):
        qmatmul(torch.randn(2, 32), qt)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got torch.int64"):
        qmatmul(torch.ones(2, 64, dtype=torch.long), qt)
    with pytest.raises(ValueError, match="x must be 2-D"):
        qmatmul(torch.randn(64), qt)
    with pytest.raises(ValueError, match="backend must be one of auto, triton, torch"):
        qmatmul(torch.randn(2, 64), qt, backend="cuda")
    with pytest.raises(ValueError, match="multiple of its block size 256"):
        QuantTensor(torch.zeros(4, 84, dtype=torch.uint8), T.Q2_K, (4, 300))


@triton.jit
def _every_scale(blocks, scales, offsets, K, row_bytes, QTYPE: tl.constexpr, BS: tl.constexpr,
                 TS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row ``program_id`` of a tensor: its sub-block scale and offset at every column."""
    n = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    scale, offset = sub_block_scales(blocks, row_bytes, n, k, QTYPE, BS, TS)
    tl.store(scales + n * K + k, scale + tl.zeros([BLOCK_K], tl.float32))
    tl.store(offsets + n * K + k, offset + tl.zeros([BLOCK_K], tl.float32))


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
def test_sub_block_is_the_scale_granularity(qtype):
    """The GEMV applies one scale (and offset) per ``SUB_BLOCK`` weights, so
    ``sub_block_scales`` must be constant over each such run (else the GEMV is
    wrong) and differ between neighbouring runs of random blocks (else the run
    could be longer, and the GEMV does more scale work than it needs)."""
    fmt = block_format(qtype)
    qt = random_quant_tensor(qtype, 5, max(1, 256 // fmt.block_size), seed=21)
    table_args(qt)  # the type has a Triton kernel
    scales, offsets = torch.empty(qt.rows, qt.cols), torch.empty(qt.rows, qt.cols)
    _every_scale[(qt.rows,)](qt.data, scales, offsets, qt.cols, qt.data.stride(0), QTYPE=int(qtype),
                             BS=fmt.block_size, TS=fmt.type_size, BLOCK_K=qt.cols)
    sub = SUB_BLOCK[int(qtype)]
    for values in (scales, offsets):
        runs = values.reshape(qt.rows, -1, sub)
        assert torch.equal(runs, runs[..., :1].expand_as(runs)), f"{qtype.name}: a scale changes inside a sub-block"
    pairs = scales.reshape(qt.rows, -1, 2 * sub)
    assert not torch.equal(pairs[..., :sub], pairs[..., sub:]), f"{qtype.name}: sub-blocks of {2 * sub} would do"


# --- GPU only: bf16 (wrong under the interpreter) and large shapes --------------

cuda = pytest.mark.gpu


@cuda
@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
def test_gpu_dequantize_within_an_ulp(qtype):
    qt = random_quant_tensor(qtype, 257, 16, seed=7)
    expected = gguf_reference(qt)
    actual = dequantize(qt.to("cuda"), backend="triton").cpu()
    ulp = torch.finfo(torch.float32).eps * expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
    bad = (actual - expected).abs() > ulp * 2
    assert not bad.any(), report_mismatch(actual, expected)


@cuda
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.IQ4_XS, T.IQ3_S, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 8, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_qmatmul_large(qtype, m, dtype):
    qt = random_quant_tensor(qtype, 4096, 4096 // block_format(qtype).block_size, seed=m).to("cuda")
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    w = dequantize(qt, backend="torch")
    expected = x.double() @ w.double().T
    actual = qmatmul(x, qt)
    tol = matmul_tolerance(x, w, dtype) * (4 if dtype == torch.float32 else 1)
    bad = (actual.double() - expected).abs() > tol
    assert not bad.any(), report_mismatch(actual.cpu(), expected.cpu().to(actual.dtype))

"""``gemv_arithmetic`` (the GPU GEMVs' arithmetic in torch, what real
models' GPU-path accuracy is measured through) against the kernels
themselves under the Triton interpreter: equal up to float32 summation (2e-6
of the sum of |products|, where the paths differ from the exact product by
1e-5 to 3e-4), for every type with a word layout, on each path (one row: the
word GEMV; 2-8 rows: the tensor cores' where the type has one; a prompt:
dense)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers import random_quant_tensor
from strata_kernels import planes_matmul
from strata_kernels.gemv_arithmetic import mma_arithmetic, planes_arithmetic, words_arithmetic
from strata_kernels.qmatmul import gemv_path
from strata_kernels.word_planes import WORD_TYPES, WordPlanes, dequantize_planes


def _case(qtype: T, m: int, seed: int):
    qt = random_quant_tensor(qtype, 24, 512 // WORD_TYPES[qtype].block_weights, seed=seed)
    planes = WordPlanes.of(qt)
    x = torch.randn(m, planes.cols, generator=torch.Generator().manual_seed(seed))
    x[:, :32] *= 50  # one block far larger: x's per-row and per-block scales matter
    return planes, x


@pytest.mark.parametrize("qtype", list(WORD_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8, 12])
def test_the_arithmetic_is_what_the_kernels_compute(qtype, m):
    planes, x = _case(qtype, m, seed=m + int(qtype))
    weights = dequantize_planes(planes).double()
    magnitude = x.double().abs() @ weights.abs().T  # the sum of |products|
    kernels = planes_matmul(x, planes).double()
    arithmetic = planes_arithmetic(x, planes, gemv_path(m, planes)).double()
    assert ((arithmetic - kernels).abs() <= 2e-6 * magnitude + 1e-9).all()
    # and the arithmetic is the path's own, not the exact product's (which it differs from)
    exact = x.double() @ weights.T
    if gemv_path(m, planes) != "dense":
        assert ((kernels - exact).abs() > 4e-6 * magnitude).any()


def test_each_path_s_arithmetic_differs_from_the_others():
    """x's 16-bit codes and the tensor cores' float16 are not the same
    rounding: the test above would see one path's arithmetic standing in for
    the other's."""
    planes, x = _case(T.Q4_K, 4, seed=9)
    magnitude = x.double().abs() @ dequantize_planes(planes).double().abs().T
    gap = (words_arithmetic(x, planes).double() - mma_arithmetic(x, planes).double()).abs()
    assert (gap > 4e-6 * magnitude).any()


def test_inside_gpu_arithmetic_planes_matmul_computes_it():
    """The measurement mode: inside the block, a CPU tensor's planes_matmul
    is the arithmetic (in float32, each weight's forms kept), outside it the
    kernels run again."""
    from strata_kernels.gemv_arithmetic import active, gpu_arithmetic

    planes, x = _case(T.Q4_K, 4, seed=2)
    magnitude = x.double().abs() @ dequantize_planes(planes).double().abs().T
    with gpu_arithmetic():
        assert active()
        inside = planes_matmul(x, planes).double()
        assert torch.equal(planes_matmul(x, planes).double(), inside)  # the kept weights, the same result
    assert not active()
    arithmetic = planes_arithmetic(x, planes, gemv_path(4, planes)).double()
    assert ((inside - arithmetic).abs() <= 1e-6 * magnitude + 1e-9).all()
    assert ((inside - planes_matmul(x, planes).double()).abs() <= 2e-6 * magnitude + 1e-9).all()

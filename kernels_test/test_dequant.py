"""``dequantize`` equals ``gguf.quants.dequantize`` exactly, for every type."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import assert_bit_exact, gguf_reference, random_quant_tensor

from strata_kernels import SUPPORTED_TYPES, QuantTensor, dequantize, embedding_rows

ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row,seed", [(1, 1, 0), (7, 2, 1), (13, 3, 2)])
def test_random_blocks_match_gguf(qtype, rows, blocks_per_row, seed):
    qt = random_quant_tensor(qtype, rows, blocks_per_row, seed)
    assert_bit_exact(dequantize(qt), gguf_reference(qt))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.IQ2_XXS], ids=lambda t: t.name)
def test_other_dtypes_are_the_float32_values_cast(qtype):
    qt = random_quant_tensor(qtype, 5, 1, 3)
    full = dequantize(qt)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert torch.equal(dequantize(qt, dtype=dtype), full.to(dtype))


def test_rows_lookup_equals_full_dequantize():
    qt = random_quant_tensor(T.Q6_K, 11, 2, 4)
    index = torch.tensor([[0, 10], [3, 3]])
    assert torch.equal(embedding_rows(qt, index), dequantize(qt)[index])


def test_unsupported_type_names_the_supported_ones():
    qt = QuantTensor(torch.zeros(1, 40, dtype=torch.uint8), T.Q8_1, (1, 32))
    with pytest.raises(NotImplementedError, match="supported types: .*Q4_K"):
        dequantize(qt)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of its block size 256"):
        QuantTensor(torch.zeros(1, 144, dtype=torch.uint8), T.Q4_K, (1, 200))
    with pytest.raises(ValueError, match=r"needs data of shape \(2, 144\)"):
        QuantTensor(torch.zeros(1, 144, dtype=torch.uint8), T.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="2-D uint8"):
        QuantTensor(torch.zeros(1, 144, dtype=torch.int8), T.Q4_K, (1, 256))


def test_real_model_tensors_match_gguf(model_gguf):
    gguf = model_gguf
    seen = set()
    for name in gguf.tensor_names():
        qt = gguf.tensor(name)
        if qt.qtype in seen:
            continue
        seen.add(qt.qtype)
        # A few hundred rows of each type keep the comparison quick.
        part = QuantTensor(qt.data[:300].reshape(-1, qt.data.shape[1]), qt.qtype, (min(300, qt.rows), qt.cols))
        assert_bit_exact(dequantize(part), gguf_reference(part))
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.F32} <= seen

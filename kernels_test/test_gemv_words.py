"""The word-layout GEMV (``word_planes``, ``_triton_gemv_words``) under the
Triton interpreter: the layout holds the blocks' weights bit for bit, and the
GEMV over it agrees with float64 products of those weights for every type it
reads, every row count a decode step has, split K or not, within the
16-bit rounding of the activations. (The interpreter runs the plain-Triton
form of ``dp2a``; a GPU runs the inline PTX, the same integer arithmetic.)"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from helpers import random_quant_tensor
from strata_kernels.word_planes import WORD_TYPES, WordPlanes, dequantize_planes

TYPES = list(WORD_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_word_layout_holds_the_blocks_weights_bit_for_bit(qtype):
    qt = random_quant_tensor(qtype, 5, 6, seed=int(qtype))
    planes = WordPlanes.of(qt)
    expected = torch.from_numpy(gguf_quants.dequantize(qt.data.numpy(), qtype)).reshape(5, -1)
    assert torch.equal(dequantize_planes(planes), expected)
    assert planes.nbytes == qt.nbytes  # codes and scales, nothing added
    assert planes.quants.is_contiguous() and planes.scales.shape == (6, 5)


def test_a_type_without_a_word_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="Q4_K has no word layout; types with one: Q8_0, Q4_0"):
        WordPlanes.of(random_quant_tensor(T.Q4_K, 2, 1, seed=1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_gemv_matches_float64_products(qtype, m, splits):
    from strata_kernels._triton_gemv_words import gemv_words

    qt = random_quant_tensor(qtype, 37, 16, seed=m + 10 * splits)  # 37 rows: a partial row tile
    planes = WordPlanes.of(qt)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] *= 1000  # blocks of x at very different scales
    out = gemv_words(x, planes, splits=splits, block_c=4)
    ref = x.double() @ dequantize_planes(planes).double().T
    # 16-bit codes per 32 values: each block's products within 2^-15 of its largest |x| times |w|.
    bound = (x.double().abs().view(m, -1, 32).amax(dim=2) / 32767 * 32 * 0.6
             ) @ dequantize_planes(planes).double().abs().view(37, -1, 32).amax(dim=2).T
    assert out.shape == (m, 37) and out.dtype == x.dtype
    assert ((out.double() - ref).abs() <= bound + 1e-6).all(), (out.double() - ref).abs().max()


def test_k_that_is_not_whole_tiles_is_refused():
    from strata_kernels._triton_gemv_words import gemv_words

    planes = WordPlanes.of(random_quant_tensor(T.Q8_0, 4, 3, seed=2))  # 24 words: 6 chunks
    with pytest.raises(ValueError, match="6 chunks of 4 words a row are not whole tiles of 4"):
        gemv_words(torch.randn(1, planes.cols), planes, block_c=4)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 8])
def test_compiled_gemv_equals_its_plain_form_and_the_products_at_real_size(qtype, m):
    from strata_kernels._triton_gemv_words import gemv_words

    qt = random_quant_tensor(qtype, 4096, 14336 // 32, seed=3).to("cuda")
    planes = WordPlanes.of(qt)
    x = torch.randn(m, qt.cols, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    with_dp2a = gemv_words(x, planes, use_asm=True)
    assert torch.equal(with_dp2a, gemv_words(x, planes, use_asm=False))  # the same integers, summed alike
    ref = x.double() @ dequantize_planes(planes).double().T
    assert ((with_dp2a.double() - ref).abs().max() / ref.abs().max()).item() < 1e-4

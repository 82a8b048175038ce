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
from strata_kernels.word_planes import WORD_TYPES, WordPlanes, bytes_per_weight, dequantize_planes

TYPES = list(WORD_TYPES)


def _blocks_for(qtype, cols: int) -> int:
    """GGUF blocks a row of ``cols`` weights holds in ``qtype``."""
    return cols // WORD_TYPES[qtype].block_weights


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_word_layout_holds_the_blocks_weights_bit_for_bit(qtype):
    qt = random_quant_tensor(qtype, 5, _blocks_for(qtype, 768), seed=int(qtype))
    planes = WordPlanes.of(qt)
    expected = torch.from_numpy(gguf_quants.dequantize(qt.data.numpy(), qtype)).reshape(5, -1)
    assert torch.equal(dequantize_planes(planes), expected)
    assert planes.nbytes == pytest.approx(bytes_per_weight(qtype) * 5 * 768)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_1):
        assert planes.nbytes == qt.nbytes  # codes and scales, nothing added
    else:  # a 16-bit sub-block word where the blocks pack 12 bits (IQ4_XS: 8; Q5_0: d twice), at most ~12% more
        assert qt.nbytes < planes.nbytes <= 1.091 * qt.nbytes
    assert all(p.is_contiguous() and p.device == qt.device for p in planes.planes)
    assert planes.quants.shape == (5, 768 * planes.bits // 32)


@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_every_high_bit_lands_on_its_own_weight(qtype):
    """Codes that differ from a block's in one weight's high bits alone
    dequantize differently in that weight alone (a high-bit word laid out
    wrong would move or lose it)."""
    qt = random_quant_tensor(qtype, 1, 1, seed=5)
    base = dequantize_planes(WordPlanes.of(qt))
    planes = WordPlanes.of(qt)
    moved = 0
    for weight in (0, 5, 17, 31, 100, 255):
        chunk, i = divmod(weight, 32)
        half, within = divmod(i, 16)
        word, byte = divmod(within, 4)
        high = planes.high.clone().view(torch.uint8)
        if qtype == T.Q5_K:
            high[0, 4 * chunk + byte] ^= 1 << (word + 4 - 4 * half)
        else:
            high[0, 8 * chunk + 4 * half + byte] ^= 1 << (2 * word)
        flipped = dequantize_planes(WordPlanes(qtype, 1, 256, planes.quants, high=high.view(torch.int32),
                                               sub=planes.sub, supers=planes.supers))
        changed = (flipped != base).nonzero()[:, 1].tolist()
        assert changed in ([weight], [])  # [] only where the weight's sub-block scale is 0
        moved += changed == [weight]
    assert moved >= 4


def test_a_type_without_a_word_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="Q2_K has no word layout; types with one: Q8_0, Q4_0, Q4_K"):
        WordPlanes.of(random_quant_tensor(T.Q2_K, 2, 1, seed=1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_gemv_matches_float64_products(qtype, m, splits):
    from strata_kernels._triton_gemv_words import gemv_words

    qt = random_quant_tensor(qtype, 37, _blocks_for(qtype, 512), seed=m + 10 * splits)  # 37 rows: a partial tile
    planes = WordPlanes.of(qt)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] *= 1000  # blocks of x at very different scales
    out = gemv_words(x, planes, splits=splits, block_c=(4 if planes.kind.grid else 8) if planes.kind.superblocks else 4)
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


def test_a_superblock_tile_that_splits_a_superblock_is_refused():
    from strata_kernels._triton_gemv_words import gemv_words

    planes = WordPlanes.of(random_quant_tensor(T.Q4_K, 4, 2, seed=2))
    with pytest.raises(ValueError, match="whole superblocks of 8 chunks, got 4"):
        gemv_words(torch.randn(1, planes.cols), planes, block_c=4)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 8])
def test_compiled_gemv_equals_its_plain_form_and_the_products_at_real_size(qtype, m):
    from strata_kernels._triton_gemv_words import gemv_words

    qt = random_quant_tensor(qtype, 4096, _blocks_for(qtype, 14336), seed=3).to("cuda")
    planes = WordPlanes.of(qt)
    x = torch.randn(m, qt.cols, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    with_dp2a = gemv_words(x, planes, use_asm=True)
    assert torch.equal(with_dp2a, gemv_words(x, planes, use_asm=False))  # the same integers, summed alike
    ref = x.double() @ dequantize_planes(planes).double().T
    assert ((with_dp2a.double() - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_planes_dequantize_on_the_triton_path_bit_for_bit(qtype):
    """A prompt's matmuls read the weight dequantized by a Triton kernel into
    a dense matrix: equal to the torch reference (and so to the blocks) in
    float32 and float16; bfloat16 within its rounding (the interpreter
    truncates where a GPU rounds to nearest). 37 rows and 20 or 6 blocks of
    32: partial tiles both ways."""
    from strata_kernels._triton_planes_dequant import dequantize_planes_into

    planes = WordPlanes.of(random_quant_tensor(qtype, 37, _blocks_for(qtype, 640 if qtype in (T.Q8_0, T.Q4_0)
                                                                       else 768), seed=int(qtype)))
    exact = dequantize_planes(planes)
    for dtype in (torch.float32, torch.float16):
        out = dequantize_planes_into(planes, torch.full(exact.shape, float("nan"), dtype=dtype))
        assert torch.equal(out, exact.to(dtype)), dtype
    out = dequantize_planes_into(planes, torch.empty(exact.shape, dtype=torch.bfloat16)).float()
    assert ((out - exact).abs() <= exact.abs() * 2 ** -7).all()


def test_a_prompt_takes_the_dense_path_over_the_planes_in_a_reused_scratch():
    from strata_kernels import planes_matmul
    from strata_kernels.qmatmul import _SCRATCH

    _SCRATCH.pop((torch.device("cpu"), torch.float32), None)  # an earlier test's larger weight
    small = WordPlanes.of(random_quant_tensor(T.Q4_K, 16, 1, seed=3))
    large = WordPlanes.of(random_quant_tensor(T.Q6_K, 40, 2, seed=4))
    for planes in (large, small):
        x = torch.randn(12, planes.cols, generator=torch.Generator().manual_seed(planes.rows))
        assert torch.allclose(planes_matmul(x, planes), x @ dequantize_planes(planes).T, atol=1e-5, rtol=1e-5)
    assert _SCRATCH[(torch.device("cpu"), torch.float32)].numel() == 40 * 512  # the larger weight's, kept


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.IQ3_S], ids=lambda t: t.name)
def test_grouped_gemv_multiplies_each_run_by_its_own_expert(qtype):
    """One launch for a mixture's decode step: runs of routed rows (1 to 8
    rows each, any experts, in any order of experts) each times their own
    expert's matrix; a row in no run stays zero."""
    from strata_kernels._triton_gemv_words import gemv_words_grouped

    experts, n = 5, 24  # 24 rows an expert: a partial row tile
    qt = random_quant_tensor(qtype, experts * n, _blocks_for(qtype, 512), seed=int(qtype))
    planes = WordPlanes.of(qt)
    weights = dequantize_planes(planes).double().view(experts, n, -1)
    runs = [(4, 0, 3), (0, 3, 1), (2, 4, 8), (4, 13, 2)]  # rows 12 is in no run
    x = torch.randn(15, qt.cols, generator=torch.Generator().manual_seed(1))
    out = gemv_words_grouped(x, planes, experts, runs, block_c=8)
    assert out.shape == (15, n)
    for e, start, count in runs:
        ref = x[start:start + count].double() @ weights[e].T
        assert ((out[start:start + count].double() - ref).abs().max() / ref.abs().max()) < 1e-4, (e, start)
    assert not out[12].any()
    with pytest.raises(ValueError, match="1 to 8 rows"):
        gemv_words_grouped(x, planes, experts, [(0, 0, 9)])


MMA_TEST_TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q4_1, T.Q5_0, T.Q5_1]


@pytest.mark.parametrize("qtype", MMA_TEST_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [2, 5, 8])
def test_tensor_core_gemv_matches_float64_products(qtype, m):
    """2 to 8 rows of x on the tensor cores: each weight's code times its
    block scale rounded once to float16 (the offsets, a min or a bias, as a
    column of their own against x's sums), x scaled per row into float16:
    within float16's rounding of the products. The planes_matmul route takes
    it for these rows."""
    from strata_kernels import planes_matmul
    from strata_kernels._triton_gemv_mma import gemv_mma
    from strata_kernels.launch_plans import MMA_KINDS, gemv_mma_launch
    from strata_kernels.qmatmul import MMA_COLS, MMA_TYPES, gemv_path

    assert set(MMA_TYPES) == set(MMA_KINDS) == set(MMA_TEST_TYPES)
    assert MMA_COLS == 32 * gemv_mma_launch(int(qtype)).constexprs["BLOCK_B"]
    qt = random_quant_tensor(qtype, 37, _blocks_for(qtype, 512), seed=m)
    planes = WordPlanes.of(qt)
    x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] *= 1000
    ref = x.double() @ dequantize_planes(planes).double().T
    scale = (x.double().abs() @ dequantize_planes(planes).double().abs().T)  # the sum of |products|
    for out in (gemv_mma(x, planes, splits=3), planes_matmul(x, planes)):
        assert out.shape == (m, 37)
        assert ((out.double() - ref).abs() <= 1e-3 * scale + 1e-6).all(), ((out.double() - ref).abs() / scale).max()
    assert gemv_path(m, planes) == "mma" and gemv_path(1, planes) == "words" and gemv_path(9, planes) == "dense"


def test_a_weight_whose_scales_overflow_the_conversion_takes_the_word_gemv():
    """1024 x a block scale of 64 or more is no float16: such a weight (none
    real) is multiplied by the word GEMV, correctly."""
    from strata_kernels import planes_matmul
    from strata_kernels.qmatmul import gemv_path

    qt = random_quant_tensor(T.Q4_0, 16, 16, seed=1)
    blocks = qt.data.view(16, 16, 18)
    blocks[3, 5, :2] = torch.tensor([100.0], dtype=torch.float16).view(torch.uint8)  # d = 100
    planes = WordPlanes.of(qt)
    assert not planes.fits_mma and WordPlanes.of(random_quant_tensor(T.Q4_0, 16, 16, seed=1)).fits_mma
    assert gemv_path(4, planes) == "words"
    x = torch.randn(4, qt.cols, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ dequantize_planes(planes).double().T
    assert ((planes_matmul(x, planes).double() - ref).abs().max() / ref.abs().max()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", MMA_TEST_TYPES, ids=lambda t: t.name)
def test_compiled_tensor_core_gemv_equals_its_plain_form_at_real_size(qtype):
    from strata_kernels._triton_gemv_mma import gemv_mma

    qt = random_quant_tensor(qtype, 4096, _blocks_for(qtype, 14336), seed=4).to("cuda")
    planes = WordPlanes.of(qt)
    x = torch.randn(8, qt.cols, device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    compiled = gemv_mma(x, planes, use_asm=True)
    assert torch.equal(compiled, gemv_mma(x, planes, use_asm=False))  # the conversions are exact either way
    ref = x.double() @ dequantize_planes(planes).double().T
    assert ((compiled.double() - ref).abs().max() / ref.abs().max()).item() < 2e-3

"""The GPU GEMVs' arithmetic in torch: what ``gemv_words`` and ``gemv_mma``
compute from ``WordPlanes``, up to float32 summation order, fast on a CPU.

The Triton interpreter runs the kernels themselves, but a real model's
decode step through it takes minutes (Gemma 3's 262,144-row head alone);
accuracy over hundreds of positions is measured through this instead
(``bench/gpu_path_accuracy.py``), and ``kernels_test/test_gemv_arithmetic.py``
holds each kernel, run by the interpreter, to it.

- The word GEMV (one row; 2-8 rows of the types the tensor cores' GEMV
  does not take): x rounded to 16-bit codes per 32 values (``prepare``'s
  scale, max |x| / 32767), then exact integer products with the weights'
  codes, scaled: x's codes times the exact weights.
- The tensor-core GEMV (2-8 rows): each weight's ``code x scale`` rounded
  once to float16 (the type's offset apart), x per row over its largest
  magnitude as a float16, the offsets against x's sums over 16 rounded to
  float16.
- A prompt's rows (the dense path): the exact weights, ``x @ W.T``.

``planes_arithmetic(x, planes, path)`` computes ``qmatmul.gemv_path``'s path.
Products accumulate in float64 here: the kernels' float32 sums differ from
them by float32 rounding alone. Inside ``gpu_arithmetic()``,
``planes_matmul`` on CPU tensors computes this way instead of launching the
kernels, in float32 with each weight's float32 form kept for the block (a
model's weights once more): fast enough for a few hundred positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from gguf import GGMLQuantizationType as T

from .formats import lookup_table
from .word_planes import BLOCK, WordPlanes, _codes, block_scales, dequantize_planes

HALF = 16  # weights per offset (the tensor-core GEMV's offsets column: one per 16)

# While gpu_arithmetic() is active: each weight's float32 forms, by the planes' id and what they are.
_KEPT: dict[tuple[int, str], tuple] | None = None


@contextmanager
def gpu_arithmetic() -> Iterator[None]:
    """While inside, ``planes_matmul`` on CPU tensors returns
    ``planes_arithmetic`` (in float32, weights kept) instead of running the
    kernels (under the Triton interpreter)."""
    global _KEPT
    previous, _KEPT = _KEPT, {}
    try:
        yield
    finally:
        _KEPT = previous


def active() -> bool:
    return _KEPT is not None


def _kept(planes: WordPlanes, what: str, make):
    """``make()`` in float32, once per weight while ``gpu_arithmetic`` is
    active; in float64, afresh, otherwise."""
    if _KEPT is None:
        return tuple(t.double() for t in make())
    key = (id(planes), what)
    if key not in _KEPT:
        _KEPT[key] = tuple(t.float() for t in make())
    return _KEPT[key]


def words_arithmetic(x: torch.Tensor, planes: WordPlanes) -> torch.Tensor:
    """``gemv_words``' result: x's 16-bit codes per 32 (made as ``prepare``
    makes them, in float32) times the exact weights."""
    m, k = x.shape
    xf = x.float().view(m, k // BLOCK, BLOCK)
    scale = xf.abs().amax(dim=2, keepdim=True) / 32767.0
    codes = torch.round(xf / torch.where(scale > 0, scale, 1.0))
    (weights,) = _kept(planes, "exact", lambda: (dequantize_planes(planes),))
    x_codes = (codes.double() * scale.double()).view(m, k)
    return (x_codes.to(weights.dtype) @ weights.T).to(x.dtype)


def mma_weights(planes: WordPlanes) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor-core GEMV's weights: float64 ``[rows, cols]`` of each
    weight's ``code x scale`` rounded to float16 (the type's unsigned code:
    Q6_K's plus 32, IQ4's codebook value plus 128), and float64 ``[rows,
    cols / 16]`` the offset each 16 weights take away (rounded to float16)."""
    rows, cols = planes.rows, planes.cols
    scale = block_scales(planes).double()  # [rows, cols / 16], float16 values
    codes = _codes(planes).reshape(rows, cols).double()
    kind = planes.kind
    if planes.qtype == T.Q8_0:
        offset = torch.zeros_like(scale)
    elif planes.qtype == T.Q4_0:
        offset = 8 * scale
    elif planes.qtype == T.Q6_K:
        codes, offset = codes + 32, 32 * scale
    elif planes.qtype == T.IQ4_XS:
        values = lookup_table("iq4nl_values", codes.device).double()
        codes, offset = values[codes.long()] + 128, 128 * scale
    else:  # dmin x min: Q4_K, Q5_K from sub's high byte; Q4_1, Q5_0, Q5_1 from the type's unit min
        supers = planes.supers.t()
        dmin = ((supers >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).double()
        dmin = dmin.repeat_interleave(kind.chunks_per_super * 2, dim=1)
        if kind.unit_min is not None:
            minimum = torch.full_like(dmin, float(kind.unit_min))
        else:
            minimum = ((planes.sub.t().int() >> 8) & 0xFF).double().repeat_interleave(2, dim=1)
        offset = (dmin * minimum).float().half().double()
    tiles = (codes * scale.repeat_interleave(HALF, dim=1)).half().double()
    return tiles, offset


def mma_arithmetic(x: torch.Tensor, planes: WordPlanes) -> torch.Tensor:
    """``gemv_mma``'s result (``prepare_mma``'s x: float16 per row over max
    |x|; the offsets against float16 sums over 16)."""
    m, k = x.shape
    xf = x.float()
    magnitude = xf.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    rounded = (xf / magnitude).half()
    tiles, offset = _kept(planes, "mma", lambda: mma_weights(planes))
    wide = tiles.dtype
    rounded_sums = rounded.float().view(m, k // HALF, HALF).sum(dim=2).half().to(wide)  # float32, as prepared
    out = rounded.to(wide) @ tiles.T - rounded_sums @ offset.T
    return (out * magnitude.to(wide)).to(x.dtype)


def planes_arithmetic(x: torch.Tensor, planes: WordPlanes, path: str) -> torch.Tensor:
    """``planes_matmul``'s result for ``x`` ``[M, K]`` on ``path``
    (``qmatmul.gemv_path``'s answer: ``"mma"``, ``"words"`` or ``"dense"``)."""
    if path == "mma":
        return mma_arithmetic(x, planes)
    if path == "words":
        return words_arithmetic(x, planes)
    (weights,) = _kept(planes, "exact", lambda: (dequantize_planes(planes),))
    return (x.to(weights.dtype) @ weights.T).to(x.dtype)

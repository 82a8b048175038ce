"""Shared helpers for kernel tests: random GGUF blocks and a readable mismatch report."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from strata_kernels import QuantTensor, block_format

# Byte offsets of the float16 scale fields in each block: random bytes there
# could be inf/nan, which no quantizer writes, so they get finite values.
F16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.TQ1_0: (52,), T.TQ2_0: (64,), T.MXFP4: (),
    T.IQ1_S: (0,), T.IQ1_M: (), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,),
    T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}


def random_quant_tensor(qtype: T, rows: int, blocks_per_row: int, seed: int) -> QuantTensor:
    """Random bytes in every field, finite float16 scales."""
    fmt = block_format(qtype)
    rng = np.random.default_rng(seed)
    cols = blocks_per_row * fmt.block_size
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == T.F16:
            raw = values.astype(np.float16).view(np.uint8)
        elif qtype == T.BF16:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = values.view(np.uint8)
        return QuantTensor(torch.from_numpy(raw.reshape(rows, -1).copy()), qtype, (rows, cols))
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, fmt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == T.IQ1_M:
        # Its float16 scale is spread over the top nibbles of four words (d's bits 12-15 are byte 55's top
        # nibble): clearing d's exponent bit 14 keeps it finite.
        blocks[:, 55] &= 0b1011_1111
    data = torch.from_numpy(blocks.reshape(rows, -1))
    return QuantTensor(data, qtype, (rows, cols))


def report_mismatch(actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> str:
    """How many elements differ, the first indices and the largest difference."""
    diff = (actual.double() - expected.double()).abs()
    bad = diff > atol + rtol * expected.double().abs()
    bad |= actual.isnan() != expected.isnan()
    if not bad.any():
        return ""
    idx = bad.nonzero()[:5].tolist()
    return (
        f"{int(bad.sum())} of {bad.numel()} elements differ; first at {idx}; "
        f"max abs diff {float(diff[bad].max()):.6g}"
    )


def gguf_reference(qt: QuantTensor) -> torch.Tensor:
    values = gguf_quants.dequantize(qt.data.numpy(), qt.qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(qt.shape)


def assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == torch.float32
    # Bit equality (so -0.0 vs 0.0 would count), with NaN placement compared too.
    same = actual.view(torch.int32) == expected.view(torch.int32)
    assert bool(same.all()), report_mismatch(actual, expected)


def matmul_tolerance(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Float32 accumulation error grows with K: bound it by K * eps * |x| @ |w|^T
    (FlagGems scales atol with the reduction length the same way), plus the
    rounding of the output to its dtype."""
    k = x.shape[1]
    magnitude = x.double().abs() @ w.double().abs().T
    return 2.0 * k * 2.0**-24 * magnitude + torch.finfo(out_dtype).eps * magnitude + 1e-6

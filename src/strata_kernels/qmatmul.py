"""``qmatmul``: activations times a GGUF-quantized weight, never materialising
the dense weight on the Triton path; ``planes_matmul``: times a weight in its
GPU word layout (a decode step's GEMV on the words; a prompt's dense matmul
over the weight dequantized into a reused scratch)."""

from __future__ import annotations

import os

import torch
from gguf import GGMLQuantizationType as T

from .backends import resolve_backend
from .dequant import dequantize
from .launch import GEMV_MAX_M
from .quant_tensor import QuantTensor
from .word_planes import WordPlanes, dequantize_planes, pairing_of

# The types the tensor cores' GEMV converts (launch_plans.MMA_KINDS; here without importing triton).
MMA_TYPES = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q4_1, T.Q5_0, T.Q5_1)
# The tensor-core GEMV's K step (launch_plans.gemv_mma_launch: 8 blocks of 32): other widths take the word GEMV.
MMA_COLS = 256

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def qmatmul(x: torch.Tensor, qt: QuantTensor, backend: str = "auto") -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` and ``qt`` of logical shape ``[N, K]``;
    returns ``[M, N]`` in ``x``'s dtype (accumulated in float32 on Triton)."""
    if len(qt.shape) != 2:
        raise ValueError(f"qmatmul needs a 2-D weight [N, K], got shape {qt.shape}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] != qt.cols:
        raise ValueError(f"x has K={x.shape[1]} columns but the weight {qt.shape} has K={qt.cols}")
    if x.device != qt.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qt.device}; move one of them")
    chosen = resolve_backend(x.device, backend)
    if chosen == "triton":
        from ._triton_qmatmul import qmatmul_triton

        return qmatmul_triton(x, qt)
    if chosen == "cpu":
        from .cpu_kernels import qmatmul_cpu

        return qmatmul_cpu(x, qt)
    return x @ dequantize(qt, x.dtype, backend="torch").T


def gemv_path(rows: int, planes: WordPlanes) -> str:
    """Which kernel multiplies ``rows`` rows of x by ``planes``: ``"words"``
    (the word GEMV: one row, and the types the tensor cores' GEMV does not
    convert), ``"mma"`` (2 to 8 rows, on the tensor cores, where the weight's
    scales fit: ``WordPlanes.fits_mma``) or ``"dense"`` (a prompt: the planes
    dequantized and a dense matmul). Weights whose x is
    prepared alike (the same path and, for ``"words"``, pairing) share it."""
    if rows > GEMV_MAX_M:
        return "dense"
    if rows > 1 and planes.qtype in MMA_TYPES and planes.cols % MMA_COLS == 0 and planes.fits_mma:
        return "mma"
    return "words"


def preparation_key(rows: int, planes: WordPlanes) -> str:
    path = gemv_path(rows, planes)
    return f"words-{pairing_of(planes)}" if path == "words" else path


def prepare_rows(x: torch.Tensor, planes: WordPlanes):
    """``x`` ``[M, K]`` prepared once for ``planes_matmul`` over every weight
    with the same ``preparation_key`` (q/k/v, gate/up), or None where the
    path needs nothing (a prompt's dense matmul)."""
    path = gemv_path(x.shape[0], planes)
    if path == "mma":
        from ._triton_gemv_mma import prepare_mma

        return prepare_mma(x)
    if path == "words":
        from ._triton_gemv_words import prepare

        return prepare(x, planes)
    return None


def planes_matmul(x: torch.Tensor, planes: WordPlanes, prepared=None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` and a weight in its GPU word layout
    (``word_planes``), in ``x``'s dtype, by ``gemv_path``'s kernel (under the
    Triton interpreter on CPU tensors): a decode step's rows by a GEMV, a
    prompt's by the weight dequantized to ``x``'s dtype and a dense matmul
    (the tensor cores' speed). ``prepared``: ``prepare_rows(x, ...)``, if made."""
    if x.dim() != 2 or x.shape[1] != planes.cols:
        raise ValueError(f"x must be [M, {planes.cols}], got shape {tuple(x.shape)}")
    if not x.is_cuda:
        from . import gemv_arithmetic

        if gemv_arithmetic.active():  # the kernels' arithmetic in torch (a measurement on a CPU)
            return gemv_arithmetic.planes_arithmetic(x, planes, gemv_path(x.shape[0], planes))
    path = gemv_path(x.shape[0], planes)
    if path == "mma":
        from ._triton_gemv_mma import gemv_mma

        return gemv_mma(x, planes, prepared)
    if path == "words":
        from ._triton_gemv_words import gemv_words

        return gemv_words(x, planes, prepared=prepared)
    if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from ._triton_planes_dequant import dequantize_planes_into

        return x @ dequantize_planes_into(planes, _scratch(x, planes.rows, planes.cols)).T
    return x @ dequantize_planes(planes).to(x.dtype).T


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` matrix of ``x``'s dtype on its device, in one buffer
    per device and dtype kept for the next prompt (grown to the largest
    weight seen): the dequantized weight lives only until its matmul, which
    the stream runs before the next layer's dequantization writes here."""
    key = (x.device, x.dtype)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < rows * cols:
        _SCRATCH.pop(key, None)  # the smaller one goes before the larger is made
        buffer = _SCRATCH[key] = torch.empty(rows * cols, dtype=x.dtype, device=x.device)
    return buffer[:rows * cols].view(rows, cols)

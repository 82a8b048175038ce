"""``qmatmul``: activations times a GGUF-quantized weight, never materialising
the dense weight on the Triton path; ``planes_matmul``: times a weight in its
GPU word layout (a decode step's GEMV on the words; a prompt's dense matmul
over the weight dequantized into a reused scratch)."""

from __future__ import annotations

import os

import torch

from .backends import resolve_backend
from .dequant import dequantize
from .launch import GEMV_MAX_M
from .quant_tensor import QuantTensor
from .word_planes import WordPlanes, dequantize_planes

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


def prepare_rows(x: torch.Tensor, planes: WordPlanes):
    """``x`` ``[M, K]`` prepared once for ``planes_matmul`` over every weight
    whose words pair as ``planes``' do (q/k/v, gate/up), or None past a
    decode step's rows (those take the dense path, which needs nothing)."""
    if x.shape[0] > GEMV_MAX_M:
        return None
    from ._triton_gemv_words import prepare

    return prepare(x, planes)


def planes_matmul(x: torch.Tensor, planes: WordPlanes, prepared=None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` and a weight in its GPU word layout
    (``word_planes``), in ``x``'s dtype: the word GEMV for a decode step's
    rows (M <= 8; under the Triton interpreter on CPU tensors), else the
    weight dequantized to ``x``'s dtype and a dense matmul (a prompt: the
    tensor cores' speed). ``prepared``: ``prepare_rows(x, ...)``, if made."""
    if x.dim() != 2 or x.shape[1] != planes.cols:
        raise ValueError(f"x must be [M, {planes.cols}], got shape {tuple(x.shape)}")
    if x.shape[0] <= GEMV_MAX_M:
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

"""``qmatmul``: activations times a GGUF-quantized weight, never materialising
the dense weight on the Triton path."""

from __future__ import annotations

import torch

from .backends import resolve_backend
from .dequant import dequantize
from .quant_tensor import QuantTensor

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

"""CPU kernels: GEMVs that read GGUF blocks directly (``csrc/gguf_cpu.cpp``)
and the small operations of a decode step (``csrc/decode_cpu.cpp``).

The C++ sources are compiled on first use with the machine's compiler, through
``torch.utils.cpp_extension`` (about 50 s on 2 cores, then cached by torch
under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). It is
built with ``-march=native``: it runs where it was built, with the widest SIMD
the machine has (AVX-512 with AVX512_BF16, AVX2, or plain C++; the module's
``simd`` says which). ``STRATA_CPU_MARCH=haswell`` (any ``-march`` value)
builds for another target instead, in a build of its own. Importing this
module builds nothing; ``available()`` says whether the build worked, and why
not when it did not, and callers fall back to the torch path then.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from .launch import CPU_GEMV_MAX_M, CPU_SLAB_ROWS
from .quant_tensor import QuantTensor

log = logging.getLogger(__name__)

# The types gguf_cpu.cpp decodes.
CPU_KERNEL_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("gguf_cpu.cpp", "decode_cpu.cpp", "bindings.cpp")]
_lock = threading.Lock()
_module = None
_error: str | None = None


def target() -> str:
    """The ``-march`` the kernels are built for: ``STRATA_CPU_MARCH``, default native."""
    return os.environ.get("STRATA_CPU_MARCH", "native")


def _build():
    from torch.utils.cpp_extension import load

    march = target()
    name = "strata_cpu_kernels" if march == "native" else "strata_cpu_kernels_" + re.sub(r"\W", "_", march)
    # -ffp-contract=off: dequantize must round exactly as gguf-py does (no
    # fused multiply-adds unless the source asks for one).
    return load(name=name, sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
                extra_cflags=["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def kernels():
    """The compiled module, building it on first call; None if it cannot be
    built here (the reason is logged once and kept in ``build_error()``)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as exc:  # a missing compiler, ninja, or headers
                _error = f"{type(exc).__name__}: {exc}".strip()
                log.warning("CPU GGUF kernels could not be built, using the torch path instead: %s", _error)
    return _module


def available() -> bool:
    return kernels() is not None


def build_error() -> str | None:
    kernels()
    return _error


def supports(qt: QuantTensor) -> bool:
    """Whether ``qt`` can be read by these kernels (not whether they built)."""
    return qt.device.type == "cpu" and qt.qtype in CPU_KERNEL_TYPES and len(qt.shape) == 2


def check_supported(qt: QuantTensor) -> None:
    if qt.qtype not in CPU_KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in CPU_KERNEL_TYPES))
        raise NotImplementedError(f"the CPU kernels read {names}, not {qt.qtype.name}; use backend='torch'")


def gemv(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """``x @ W.T`` for float32 or bfloat16 ``x`` ``[M, K]``, ``M <= 8``,
    reading each block of ``qt`` once; ``[M, N]`` in x's dtype (accumulated
    in float32). bfloat16 ``x`` uses the CPU's bf16 dot-product instructions
    where it has them (AVX512_BF16) for types of up to 7-bit codes."""
    return kernels().gemv(x, [qt.data], [int(qt.qtype)], qt.cols)[0]


def gemv_many(x: torch.Tensor, weights: list[QuantTensor]) -> list[torch.Tensor]:
    """``[x @ W.T for W in weights]`` in one call and one parallel region
    (the q/k/v or gate/up projections of a decode step), same contract as
    ``gemv``; the weights may be of different types."""
    return kernels().gemv(x, [w.data for w in weights], [int(w.qtype) for w in weights], x.shape[-1])


def dequantize_into(qt: QuantTensor, out: torch.Tensor) -> torch.Tensor:
    """Write the dense 2-D ``qt`` into ``out`` (float32 or bfloat16, ``[N, K]``).
    float32 values equal ``gguf.quants.dequantize`` bit for bit."""
    kernels().dequantize(qt.data, int(qt.qtype), qt.cols, out)
    return out


def dequantize_cpu(qt: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    check_supported(qt)
    kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty((qt.rows, qt.cols), dtype=kernel_dtype)
    return dequantize_into(qt, out).to(dtype).reshape(qt.shape)


def qmatmul_cpu(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """``x @ W.T`` in ``x``'s dtype: the GEMV for up to ``CPU_GEMV_MAX_M`` rows,
    else torch's GEMM over slabs of weight rows dequantized in x's dtype
    (float32 for float16 x), so no dense copy of the whole weight is made."""
    check_supported(qt)
    if x.shape[0] <= CPU_GEMV_MAX_M:
        if x.dtype in (torch.float32, torch.bfloat16):
            return gemv(x, qt)
        return gemv(x.float(), qt).to(x.dtype)
    work = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    out = torch.empty((x.shape[0], qt.rows), dtype=work.dtype)
    slab = torch.empty((min(CPU_SLAB_ROWS, qt.rows), qt.cols), dtype=work.dtype)
    for r0 in range(0, qt.rows, CPU_SLAB_ROWS):
        part = qt.row_slice(r0, min(qt.rows, r0 + CPU_SLAB_ROWS))
        w = dequantize_into(part, slab[:part.rows])
        torch.matmul(work, w.T, out=out[:, r0:r0 + part.rows])
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim of float32
    or bfloat16 ``x`` (weight float32), in one call; then, with ``rope``
    (float32 cos/sin ``[T, 1, D]`` for ``x`` ``[T, H, D]``), the NEOX rotary
    embedding; then, with ``residual``, ``residual + result``. Float32 inside,
    rounded once to x's dtype."""
    cos, sin = rope if rope is not None else (None, None)
    return kernels().rms_norm(x.contiguous(), weight, eps, residual, cos, sin)


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, window: int | None,
                     scale: float, new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
    """One query at ``position``: ``q`` ``[H, D]`` float32 over a ring of keys
    and values ``[capacity, Hkv, D]`` (both float32 or both bfloat16; position
    p in slot ``p % capacity``), every position from ``max(0, position -
    window + 1)`` (0 without a window) on; ``[H, D]`` float32. With ``new_k``
    and ``new_v`` (``[1, Hkv, D]``), the query's own key and value are written
    into its slot first. Each K and V row is read once; D a multiple of 16."""
    return kernels().attention_decode(q.contiguous(), k, v, position, window, scale, new_k, new_v)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The NEOX rotary embedding of ``x`` ``[T, H, D]`` (float32 or bfloat16)
    by float32 cos/sin ``[T, 1, D]``, in one call, float32 inside, rounded
    once to x's dtype (``rms_norm``'s rotation without the norm)."""
    return kernels().rms_norm(x.contiguous(), None, 0.0, None, cos, sin)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (float32 or bfloat16, one shape
    and dtype) in one call, float32 inside, rounded once."""
    return kernels().gated_mul(gate, up, 0)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (float32 or bfloat16, one shape and dtype) in one
    call, float32 inside, rounded once."""
    return kernels().gated_mul(gate, up, 1)

"""Which implementation runs a kernel call: Triton (CUDA, or its CPU
interpreter), the compiled CPU kernels, or the torch reference. Above both
the launch settings (``launch``) and the CPU kernels, which it checks have
built before it names them."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch", "cpu")


def resolve_backend(device: torch.device, backend: str) -> str:
    """``auto``: CUDA tensors go to Triton, CPU tensors to torch. ``triton`` on
    CPU tensors runs under the Triton interpreter, which must be switched on
    before triton is first imported. ``cpu``: the compiled CPU kernels
    (``cpu_kernels``), asked for explicitly because the first use compiles
    them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' runs on CPU tensors, not on {device.type}")
        from . import cpu_kernels

        cpu_kernels.built()  # or a RuntimeError saying why they did not build
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported, or use backend='torch'"
        )
    if backend == "triton" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on CUDA (or the CPU interpreter), not on {device.type}")
    return backend

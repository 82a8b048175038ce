"""The ``Backend``: how one device runs its part of a model, chosen once at
load and handed to every layer placed there."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from strata_kernels import QuantTensor, cpu_kernels
from strata_kernels.formats import FLOAT_TYPES

KERNELS = ("torch", "cpu", "triton", "meta")


@dataclass(frozen=True)
class Backend:
    """One device's choices.

    ``kernels``:
    - ``"torch"``: weights dequantized once at load, torch ops (float32: the
      exact path; also bfloat16 on a CPU where the kernels could not build);
    - ``"cpu"``: GGUF blocks read by the compiled CPU kernels (float32 or
      bfloat16 activations), norms, RoPE, gated activations and attention
      fused there;
    - ``"triton"``: GGUF blocks read by the Triton kernels on a GPU;
    - ``"meta"``: weights another process of a split holds (shapes only).

    ``prefill_matmuls``: the dtype the CPU kernels' prefill GEMMs run in
    (``ComputePath.prefill_matmuls``).

    Invariant: ``"cpu"`` only on the CPU, on a fast compute path, with the
    kernels built; ``"triton"`` on CUDA, or on the CPU where
    ``STRATA_CPU_KERNELS=triton`` and the Triton interpreter are both set (the
    GPU path's layers and kernels run on the host, slowly: how tests check
    that path without a GPU).
    """

    device: torch.device
    activations: torch.dtype
    kernels: str
    prefill_matmuls: torch.dtype | None = None

    @classmethod
    def choose(cls, device: torch.device | str, activations: torch.dtype, fast: bool = True,
               prefill_matmuls: torch.dtype | None = None) -> "Backend":
        """The one place the kernels are decided: ``fast`` (a compute path
        other than the exact one, see ``compute_path``) takes the CPU kernels
        where they built (a failed build was logged, and the torch ops serve)."""
        device = torch.device(device)
        if device.type == "meta":
            kernels = "meta"
        elif device.type == "cuda" or _triton_on_the_cpu():
            kernels = "triton"
        elif fast and cpu_kernels.available():
            kernels = "cpu"
        else:
            kernels = "torch"
        return cls(device, activations, kernels, prefill_matmuls if kernels == "cpu" else None)

    @property
    def cpu_kernels(self) -> bool:
        return self.kernels == "cpu"

    @property
    def attention(self) -> str:
        """``strata_kernels.attention``'s backend for this device's KV cache."""
        return "cpu" if self.cpu_kernels else "auto"

    def keeps_blocks(self, weight: QuantTensor) -> bool:
        """Whether a layer keeps ``weight`` as GGUF blocks rather than a dense
        copy: where kernels read the type (Triton: every block type; the CPU
        kernels: the types they support), and always on meta (no bytes)."""
        if self.kernels == "meta":
            return True
        if self.kernels == "triton":
            return weight.qtype not in FLOAT_TYPES
        return self.cpu_kernels and cpu_kernels.supports(weight)

    def describe(self) -> str:
        names = {"torch": "torch ops on dense weights", "cpu": "compiled CPU kernels on GGUF blocks",
                 "triton": "Triton kernels on GGUF blocks", "meta": "held by another process"}
        return f"{self.device} {str(self.activations).removeprefix('torch.')}: {names[self.kernels]}"


def _triton_on_the_cpu() -> bool:
    """The GPU path's code on the host (``Backend``'s invariant says when)."""
    if os.environ.get("STRATA_CPU_KERNELS") != "triton":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("STRATA_CPU_KERNELS=triton runs the GPU path under the Triton interpreter: set "
                           "TRITON_INTERPRET=1 too (before triton is imported), or unset STRATA_CPU_KERNELS")
    return True

"""Which compute path a ``dtype`` setting means on a device, decided once at
load and reported by ``props()``:

- ``"auto"`` (the default): the fastest path whose accuracy holds. On a CPU,
  the compiled kernels reading GGUF blocks with float32 activations (within
  KL 0.0003 of the exact path on the reference texts; bfloat16 activations,
  10-20x further off, made a seeded request's text depend on whether its
  prefix came from the conversation cache, since a decode step and a prefill
  chunk compute a position with different arithmetic). Where the CPU has
  the bfloat16 dot product (``cpu_kernels.bf16_matmul``), prefill matmuls
  (more than ``CPU_GEMV_MAX_M`` rows) run in bfloat16: 2.5x torch's float32
  GEMM there, KL 0.003 on the reference texts; in float32 they left Gemma's
  prefill at 0.99x llama.cpp's, whose int8 dot products that CPU also has.
  Decode steps (the GEMV) stay float32 either way. The exact path if the
  kernels cannot be built here. On CUDA, the Triton kernels with bfloat16
  activations.
- ``"bfloat16"``: the kernels with bfloat16 activations, on any CPU.
- ``"float32"``: the exact reference path (weights dequantized to float32
  once, torch ops) on a CPU; Triton with float32 activations on CUDA.

The fast paths' distance from the exact one is measured in
``tests/test_fast_path.py`` (top-1 agreement, mean KL, greedy tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ComputePath:
    """A resolved ``dtype``: the activations' dtype, whether weights stay
    GGUF blocks read by kernels (``fast``) rather than dense exact copies,
    the reason, in words, for ``props()``, and the dtype prefill matmuls run
    in where it differs from the activations'.

    Invariant: ``activations`` is float32 or bfloat16; ``fast`` is False only
    on a CPU (every GPU path reads blocks); ``prefill`` is None or bfloat16
    under float32 activations, on a fast CPU path.
    """

    requested: str
    activations: torch.dtype
    fast: bool
    reason: str
    prefill: torch.dtype | None = None

    @property
    def prefill_matmuls(self) -> torch.dtype:
        """The dtype matmuls over more than a decode step's rows run in."""
        return self.prefill or self.activations

    @property
    def kv_float(self) -> torch.dtype:
        """What the f16 KV format is stored as on a CPU (``f16_storage_dtype``):
        bfloat16 on a fast path, float32 activations included (half the bytes
        a decode step's attention reads; each key and value rounded once),
        float32 on the exact path."""
        return torch.bfloat16 if self.fast else torch.float32

    @property
    def name(self) -> str:
        """``"auto"`` resolved: the activations' dtype name."""
        return str(self.activations).removeprefix("torch.")


EXACT = ComputePath("float32", torch.float32, False, "the exact path (dense float32 weights)")


def resolve(dtype: str, device: torch.device | str) -> ComputePath:
    """``dtype`` (one of ``DTYPE_NAMES``) on ``device`` (the first stage's,
    for a split: activations cross stages in one dtype)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    kind = torch.device(device).type
    if kind != "cpu":
        activations = torch.float32 if dtype == "float32" else torch.bfloat16
        why = "asked for" if dtype != "auto" else "auto: bfloat16 on a GPU"
        return ComputePath(dtype, activations, True, f"{why}; Triton kernels on GGUF blocks")
    if dtype == "float32":
        return ComputePath(dtype, torch.float32, False, "asked for: the exact path (dense float32 weights)")

    from strata_kernels import cpu_kernels

    if not cpu_kernels.available():
        why = f"the CPU kernels could not be built ({cpu_kernels.build_error()})"
        if dtype == "auto":
            return ComputePath(dtype, torch.float32, False, f"auto: {why}, so the exact float32 path")
        return ComputePath(dtype, torch.bfloat16, False, f"asked for; {why}, so dense bfloat16 weights")
    isa = cpu_kernels.isa()
    if dtype == "bfloat16":
        return ComputePath(dtype, torch.bfloat16, True, f"asked for; CPU kernels ({isa}) on GGUF blocks")
    if cpu_kernels.bf16_matmul():
        return ComputePath(dtype, torch.float32, True,
                           f"auto: CPU kernels ({isa}) on GGUF blocks, float32 activations; prefill matmuls in "
                           f"bfloat16 (this CPU has the bf16 dot product)", torch.bfloat16)
    return ComputePath(dtype, torch.float32, True,
                       f"auto: CPU kernels ({isa}) on GGUF blocks, float32 activations")

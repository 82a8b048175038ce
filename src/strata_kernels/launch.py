"""Backend choice and launch settings for every kernel, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "triton", "torch", "cpu")

# qmatmul: at most this many rows of x take the GEMV path (weights unpacked in
# registers, products reduced per row); more take the GEMM path (dequantized
# tiles into tl.dot). Not yet measured (no GPU so far): 8 is the GEMV's own row
# cap. `python bench/kernels.py --crossover` on the target GPU prints the M up
# to which the GEMV wins per type and the value to set here.
GEMV_MAX_M = 8

# qmatmul on the CPU kernels (backend="cpu"): at most this many rows of x go
# through the GEMV that reads each block once; more take a bfloat16 (or
# float32) copy of a slab of weight rows into torch's GEMM. bench/cpu_matmul.py
# on 2 cores: at M=8 the GEMV still beats the slab on every weight of the
# default model (ffn_down 0.31 against 0.52 ms, attn_q 0.14 against 0.33), so
# the limit is the GEMV's own (it is compiled for 1..8 rows), not a crossover.
CPU_GEMV_MAX_M = 8
# Weight rows dequantized at a time on the CPU GEMM side (bounds the temporary:
# 16384 rows of 640 bf16 values are 21 MB).
CPU_SLAB_ROWS = 16384


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


@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_settings(op: str, m: int, n: int, k: int, block_size: int) -> Launch:
    """Tile sizes and warps for ``op`` in {"dequantize", "gemv", "gemm"} on an
    ``[m, k] x [n, k]^T`` problem whose weights come in blocks of ``block_size``."""
    if n < 1 or k < 1 or m < 0:
        raise ValueError(f"sizes must be positive, got M={m}, N={n}, K={k}")
    if k % block_size:
        raise ValueError(f"K={k} is not a multiple of the block size {block_size}")
    if n * k >= 2**40:
        raise ValueError(f"a {n}x{k} weight is beyond what these kernels index (2**40 elements)")
    # One tile of K spans whole blocks: a 256-weight super-block, or 4 small blocks.
    block_k = min(256 if block_size == 256 else 128, _pow2_at_least(k))
    if op == "dequantize":
        return Launch(1, 16, block_k, 4)
    if op == "gemv":
        if m > GEMV_MAX_M:
            raise ValueError(f"the GEMV path takes at most {GEMV_MAX_M} rows, got {m}")
        return Launch(_pow2_at_least(max(1, m)), 16, block_k, 4)
    if op == "gemm":
        return Launch(min(64, max(16, _pow2_at_least(m))), 64, 64, 4)
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class AttentionLaunch:
    splits: int
    block_m: int
    block_n: int
    num_warps: int


def attention_settings(t: int, group: int, n_slots: int, head_dim: int) -> AttentionLaunch:
    """Decode (one query): rows are the heads of a group; the context is split
    so that about 64 programs per KV head share it. Prefill: query tiles,
    one pass over the context each."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 512:
        raise ValueError(f"attention kernels need a power-of-two head dim in [16, 512], got {head_dim}")
    block_n = 32 if head_dim >= 256 else 64
    if t == 1:
        splits = max(1, min(64, n_slots // 256))
        return AttentionLaunch(splits, max(16, _pow2_at_least(group)), block_n, 4)
    return AttentionLaunch(1, 32 if head_dim >= 256 else 64, block_n, 4)

"""A layer's KV cache storage: ``KVStore`` in one of the ``KV_FORMATS``
(how each format lays out codes and scales: ``kv_quant``'s docstring).
Below the quantize-on-write (``kv_quant``) and its Triton kernel, which
both read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_FORMATS = ("f16", "int8", "k8v4")


INT8_GROUP = 64


INT4_BLOCK = 32


@dataclass(frozen=True)
class KVStore:
    """One layer's keys and values in a cache format.

    Invariant: ``k``/``v`` are ``[capacity, kv_heads, ...]``; for ``f16`` they
    hold the values; for ``int8`` they hold int8 codes ``[C, Hkv, D]`` with
    float16 ``k_scales``/``v_scales`` ``[C, Hkv, D // 64]``; for ``k8v4`` ``k``
    is as in int8 and ``v`` holds packed 4-bit codes ``[C, Hkv, D // 2]``
    (uint8) with ``v_scales`` ``[C, Hkv, D // 32]``. Quantized formats hold
    the rows rotated by ``hadamard(head_dim)`` (``rotated``); f16 holds them as given.
    """

    fmt: str
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    head_dim: int

    @classmethod
    def allocate(cls, fmt: str, capacity: int, kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", float_dtype: torch.dtype | None = None) -> "KVStore":
        if fmt not in KV_FORMATS:
            raise ValueError(f"kv format must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
        if fmt != "f16" and (head_dim % INT8_GROUP or head_dim & (head_dim - 1)):
            raise ValueError(f"the {fmt} KV format needs a power-of-two head dim of at least 64, got {head_dim}")
        device = torch.device(device)
        if fmt == "f16":
            dtype = float_dtype or (torch.float16 if device.type == "cuda" else torch.float32)
            shape = (capacity, kv_heads, head_dim)
            return cls(fmt, torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device), None, None, head_dim)
        k = torch.zeros((capacity, kv_heads, head_dim), dtype=torch.int8, device=device)
        k_scales = torch.zeros((capacity, kv_heads, head_dim // INT8_GROUP), dtype=torch.float16, device=device)
        if fmt == "int8":
            v = torch.zeros_like(k)
            v_scales = torch.zeros_like(k_scales)
        else:
            v = torch.zeros((capacity, kv_heads, head_dim // 2), dtype=torch.uint8, device=device)
            v_scales = torch.zeros((capacity, kv_heads, head_dim // INT4_BLOCK), dtype=torch.float16, device=device)
        return cls(fmt, k, v, k_scales, v_scales, head_dim)

    @property
    def rotated(self) -> bool:
        """Whether rows are stored in the Walsh-Hadamard basis: queries must be
        rotated to score them, and attention outputs rotated back."""
        return self.fmt != "f16"

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None)

    def bytes_per_slot(self) -> int:
        return self.nbytes // self.capacity

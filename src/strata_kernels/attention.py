"""Attention over a KV cache in any of its formats, reading it directly."""

from __future__ import annotations

import torch

from .kv_quant import KVStore, hadamard, kv_write_consecutive
from .launch import attention_settings, resolve_backend


def attention(q: torch.Tensor, store: KVStore, start: int, window: int | None, scale: float,
              backend: str = "auto") -> torch.Tensor:
    """Causal grouped-query attention for queries ``q`` ``[T, H, D]`` at
    positions ``start..start+T-1``, over ``store`` already holding positions
    up to ``start+T-1``; a sliding layer passes its ``window``. One query
    (decode) splits the context across programs and merges the parts by
    log-sum-exp; many (prefill) tile the queries. Returns float32 ``[T, H, D]``.
    A rotated (quantized) store is scored with the query rotated like its
    keys, and the output is rotated back here, for every backend.
    ``backend="cpu"`` runs one query over float32 or bfloat16 f16-format
    storage with the compiled CPU kernel, anything else with the torch reference."""
    t, h, d = q.shape
    if d != store.head_dim or h % store.kv_heads:
        raise ValueError(
            f"queries [T, {h}, {d}] do not fit a cache of {store.kv_heads} KV heads of dim {store.head_dim}"
        )
    if start < 0 or t < 1:
        raise ValueError(f"need at least one query at a position >= 0, got T={t}, start={start}")
    chosen = resolve_backend(q.device, backend)
    if chosen == "cpu" and _cpu_decode(q, store):
        # A decode step over float32 or bfloat16 storage: the compiled kernel,
        # reading the visible ring slots in place (the window's first position on).
        from . import cpu_kernels

        return cpu_kernels.attention_decode(q[0].float(), store.k, store.v, start, window, scale).reshape(1, h, d)
    if store.rotated:
        q = q.float() @ hadamard(d, q.device)
    if chosen in ("torch", "cpu"):  # the CPU kernel covers the decode case above only
        from .reference import attention as attention_torch

        out = attention_torch(q, store, start, window, scale)
    else:
        from ._triton_attention import attention_triton

        s = attention_settings(t, h // store.kv_heads, min(store.capacity, start + t), d)
        out = attention_triton(q, store, start, window, scale, s.splits, s.block_m, s.block_n, s.num_warps)
    return out @ hadamard(d, out.device) if store.rotated else out


def _cpu_decode(q: torch.Tensor, store: KVStore) -> bool:
    """Whether the CPU kernel covers this call: one query over float32 or
    bfloat16 f16-format storage, a head dim that is a multiple of 16."""
    return (q.shape[0] == 1 and store.fmt == "f16" and store.k.dtype in (torch.float32, torch.bfloat16)
            and store.head_dim % 16 == 0)


def write_and_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, store: KVStore, start: int,
                     window: int | None, scale: float, backend: str = "auto") -> torch.Tensor:
    """``kv_write_consecutive(store, start, keys, values)`` then ``attention(q,
    store, start, window, scale)``: a layer's step. On the CPU kernel's decode
    case the two are one call (the kernel writes the row it is about to read)."""
    cpu = resolve_backend(q.device, backend) == "cpu"
    if cpu and _cpu_decode(q, store) and keys.shape == values.shape == (1, store.kv_heads, store.head_dim):
        from . import cpu_kernels

        h, d = q.shape[1], q.shape[2]
        return cpu_kernels.attention_decode(q[0].float(), store.k, store.v, start, window, scale,
                                            keys, values).reshape(1, h, d)
    kv_write_consecutive(store, start, keys, values, backend)
    return attention(q, store, start, window, scale, backend)

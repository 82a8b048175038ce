"""Attention over a KV cache in any of its formats, reading it directly."""

from __future__ import annotations

import torch

from .kv_quant import KVStore, hadamard
from .launch import attention_settings, resolve_backend


def attention(q: torch.Tensor, store: KVStore, start: int, window: int | None, scale: float,
              backend: str = "auto") -> torch.Tensor:
    """Causal grouped-query attention for queries ``q`` ``[T, H, D]`` at
    positions ``start..start+T-1``, over ``store`` already holding positions
    up to ``start+T-1``; a sliding layer passes its ``window``. One query
    (decode) splits the context across programs and merges the parts by
    log-sum-exp; many (prefill) tile the queries. Returns float32 ``[T, H, D]``.
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
    float_storage = store.fmt == "f16" and store.k.dtype in (torch.float32, torch.bfloat16)
    if chosen == "cpu" and t == 1 and float_storage and d % 16 == 0:
        # A decode step over float32 or bfloat16 storage: the compiled kernel,
        # reading the visible ring slots in place (the window's first position on).
        from . import cpu_kernels
        from .reference import slot_runs

        first = 0 if window is None else max(0, start - window + 1)
        runs = [(slot, n) for _, slot, n in slot_runs(first, start + 1, store.capacity)]
        return cpu_kernels.attention_decode(q[0].float(), store.k, store.v, runs, scale).reshape(1, h, d)
    if chosen in ("torch", "cpu"):  # the CPU kernel covers the decode case above only
        from .reference import attention as attention_torch

        return attention_torch(q, store, start, window, scale)
    from ._triton_attention import attention_triton

    s = attention_settings(t, h // store.kv_heads, min(store.capacity, start + t), d)
    out = attention_triton(q, store, start, window, scale, s.splits, s.block_m, s.block_n, s.num_warps)
    if store.fmt == "k8v4":
        out = out @ hadamard(d, out.device)
    return out

"""Attention over a KV cache in any of its formats, reading it directly."""

from __future__ import annotations

import torch

from .backends import resolve_backend
from .kv_quant import KVStore, hadamard, kv_write_consecutive, kv_write_slots
from .paging import BlockTables


def attention(q: torch.Tensor, store: KVStore, start: int, window: int | None, scale: float,
              backend: str = "auto", tables: BlockTables | None = None) -> torch.Tensor:
    """Causal grouped-query attention for queries ``q`` ``[T, H, D]`` of one
    sequence at positions ``start..start+T-1``, over ``store`` already
    holding positions up to ``start+T-1`` in the slots of the sequence's
    block table ``tables`` (one row; None: the store is the sequence's own
    ring); a sliding layer passes its ``window``. One query
    (decode) splits the context across programs and merges the parts by
    log-sum-exp; many (prefill) tile the queries. Returns float32 ``[T, H, D]``.
    A rotated (quantized) store is scored with the query rotated like its
    keys, and the output is rotated back here, for every backend.
    ``backend="cpu"`` over float32 or bfloat16 f16-format storage runs one
    query with the compiled CPU kernel and many (a prompt) with torch's fused
    CPU attention (``_prefill_sdpa``); anything else takes the torch reference."""
    t, h, d = q.shape
    if d != store.head_dim or h % store.kv_heads:
        raise ValueError(
            f"queries [T, {h}, {d}] do not fit a cache of {store.kv_heads} KV heads of dim {store.head_dim}"
        )
    if start < 0 or t < 1:
        raise ValueError(f"need at least one query at a position >= 0, got T={t}, start={start}")
    if tables is None:
        tables = BlockTables.contiguous(store.capacity, q.device)
    chosen = resolve_backend(q.device, backend)
    if chosen == "cpu" and _cpu_decode(q, store):
        # A decode step over float32 or bfloat16 storage: the compiled kernel,
        # reading the visible slots in place (the window's first position on).
        from . import cpu_kernels

        positions = torch.tensor([start], dtype=torch.long)
        return cpu_kernels.attention_decode(q.float(), store.k, store.v, positions, window, scale, tables)
    if chosen == "cpu" and _cpu_storage(store):
        return _prefill_sdpa(q, store, start, window, scale, tables)
    if store.rotated:
        q = q.float() @ hadamard(d, q.device)
    if chosen in ("torch", "cpu"):  # the CPU kernel covers the decode case above only
        from .reference_kv import attention as attention_torch

        out = attention_torch(q, store, start, window, scale, tables=tables)
    else:
        from ._triton_attention import attention_triton

        out = attention_triton(q[None], store, [start], window, scale, tables)[0]
    return out @ hadamard(d, out.device) if store.rotated else out


def _cpu_storage(store: KVStore) -> bool:
    """f16-format storage the CPU paths read in place (float32 or bfloat16)."""
    return store.fmt == "f16" and store.k.dtype in (torch.float32, torch.bfloat16)


def cpu_decode_reads(store: KVStore) -> bool:
    """Whether the CPU decode kernel reads ``store`` in place: float32 or
    bfloat16 f16-format storage, a head dim that is a multiple of 16."""
    return _cpu_storage(store) and store.head_dim % 16 == 0


def _cpu_decode(q: torch.Tensor, store: KVStore) -> bool:
    """Whether the CPU kernel covers this call: one query over storage it reads."""
    return q.shape[0] == 1 and cpu_decode_reads(store)


def _prefill_sdpa(q: torch.Tensor, store: KVStore, start: int, window: int | None, scale: float,
                  tables: BlockTables) -> torch.Tensor:
    """Many queries over float32/bfloat16 storage through torch's fused CPU
    attention (flash-style tiles, no [T, n] score matrix per head in memory,
    which the reference's chunked softmax costs as five torch ops per
    chunk): the visible ring slots gathered in position order, a boolean
    causal (and window) mask, the keys and values in the queries' dtype
    (float32 on the exact path's precision, bfloat16 where the activations
    are). Returns float32 ``[T, H, D]``."""
    t, h, d = q.shape
    end = start + t
    first = 0 if window is None else max(0, start - window + 1)
    runs = tables.runs(0, first, end)

    def visible(ring: torch.Tensor) -> torch.Tensor:  # in position order; a view where the slots are one run
        parts = [ring[slot:slot + n] for _, slot, n in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    k, v = visible(store.k), visible(store.v)
    q_pos = torch.arange(start, end, device=q.device)[:, None]
    k_pos = torch.arange(first, end, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    # [1, heads, positions, D]: with the batch dimension torch takes its fused
    # kernel (without it, the unfused one: 2.5x slower at 1024 positions).
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None],
        attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).float()


def write_and_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, store: KVStore, start: int,
                     window: int | None, scale: float, backend: str = "auto",
                     tables: BlockTables | None = None) -> torch.Tensor:
    """``kv_write_consecutive(store, start, keys, values, tables=tables)`` then
    ``attention(q, store, start, window, scale, tables=tables)``: one
    sequence's step in a layer. On the CPU kernel's decode case the two are
    one call (the kernel writes the row it is about to read)."""
    if tables is None:
        tables = BlockTables.contiguous(store.capacity, q.device)
    cpu = resolve_backend(q.device, backend) == "cpu"
    if cpu and _cpu_decode(q, store) and keys.shape == values.shape == (1, store.kv_heads, store.head_dim):
        return decode_attention(q, keys, values, store, torch.tensor([start], dtype=torch.long), window, scale,
                                tables, backend)
    kv_write_consecutive(store, start, keys, values, backend, tables)
    return attention(q, store, start, window, scale, backend, tables)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, store: KVStore,
                     positions: torch.Tensor, window: int | None, scale: float, tables: BlockTables,
                     backend: str = "auto") -> torch.Tensor:
    """A decode step of ``B`` sequences in one layer: sequence ``b``'s key and
    value ``[B, Hkv, D]`` written at ``positions[b]`` (int64 ``[B]``, on the
    CPU) through row ``b`` of ``tables``, then its one query ``q[b]``
    ``[B, H, D]`` attending over its positions up to there. Float32
    ``[B, H, D]``. The CPU kernels take the whole batch in one call (its
    chunks shared among the threads), Triton one write and one launch (a
    program per query tile, KV head, sequence and split of its context); the
    torch reference one sequence at a time."""
    b, h, d = q.shape
    if len(tables) != b or positions.shape != (b,) or keys.shape != (b, store.kv_heads, store.head_dim):
        raise ValueError(f"a decode step of {b} sequences needs {b} block tables, positions [{b}] and keys "
                         f"[{b}, {store.kv_heads}, {store.head_dim}]; got {len(tables)}, "
                         f"{tuple(positions.shape)} and {tuple(keys.shape)}")
    if resolve_backend(q.device, backend) == "cpu" and cpu_decode_reads(store):
        from . import cpu_kernels

        return cpu_kernels.attention_decode(q.float(), store.k, store.v, positions, window, scale, tables,
                                            keys, values)
    starts = positions.tolist()
    if resolve_backend(q.device, backend) == "triton":
        from ._triton_attention import attention_triton

        slots = torch.tensor([tables.slot(i, p) for i, p in enumerate(starts)], dtype=torch.long,
                             device=store.k.device)
        kv_write_slots(store, slots, keys, values, backend)
        if store.rotated:
            q = q.float() @ hadamard(d, q.device)
        out = attention_triton(q[:, None], store, starts, window, scale, tables)[:, 0]
        return out @ hadamard(d, out.device) if store.rotated else out
    return torch.cat([write_and_attend(q[i:i + 1], keys[i:i + 1], values[i:i + 1], store, starts[i], window, scale,
                                       backend, tables.one(i)) for i in range(b)])

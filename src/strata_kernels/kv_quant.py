"""The KV cache formats and quantize-on-write.

A layer's cache is a ``KVStore``: ``capacity`` slots. A sequence finds its
positions there through its block table (``paging.BlockTables``); a store
one sequence owns outright is a ring, position ``p`` in slot ``p % capacity``
(full-attention layers get enough slots never to wrap, sliding-window layers
their window plus one prefill chunk).

- ``f16``: keys and values as floats (float16 on a GPU; float32 on the CPU,
  where it is faster and exact).
- ``int8``: int8 codes, one float16 scale (max|x|/127) per group of 64 values
  of one head of one token.
- ``k8v4``: keys as in int8; values as 4-bit codes (two per byte, value
  ``2i`` in the low nibble) in blocks of 32 with one float16 scale each.
  The 16 levels are IQ4_NL's non-uniform ones (from ``gguf``), denser near
  zero where rotated values crowd (against uniform levels with scale
  max|x|/7 they took the KL divergence to the f16 cache from 0.156 to
  0.110 in one run). Each block keeps the candidate scale with the least
  squared error (``reference_kv.nf4_scale_candidates``), 15% less than the
  extreme-on-a-level scale alone, rounded to 7 significant bits
  (``reference_kv.NF4_SCALE_BITS``: 0.06% more squared error than 11 bits on
  Gaussian blocks) so that a GPU decodes a level times its scale in one
  fused multiply-add, exactly.

Both quantized formats store keys and values rotated by an orthonormal
Walsh-Hadamard transform over the head dimension (``KVStore.rotated``). The
rotation spreads a few large channels over the whole head, so a group's
scale is no longer set by one outlier: Gemma 3's keys have such channels.
Scores are unchanged because the query is rotated the same way
(``q·k = qH·kH``), and the attention output is rotated back, once per head.
On the default model's reference texts (``bench/kv_accuracy.py``, mean over
nudged runs) the rotation takes int8's KL divergence to the f16 cache from
0.025 to 0.006, and with the scale search k8v4's from 0.100 to 0.088.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .backends import resolve_backend
from .kv_store import INT4_BLOCK, INT8_GROUP, KV_FORMATS, KVStore  # noqa: F401  (KV_FORMATS: re-exported)
from .paging import BlockTables


def bytes_per_token(fmt: str, kv_heads: int, head_dim: int, float_bytes: int = 2) -> int:
    """Bytes one token costs in one layer, keys and values, scales included."""
    if fmt == "f16":
        return 2 * kv_heads * head_dim * float_bytes
    key = kv_heads * (head_dim + 2 * head_dim // INT8_GROUP)
    if fmt == "int8":
        return 2 * key
    return key + kv_heads * (head_dim // 2 + 2 * head_dim // INT4_BLOCK)


@lru_cache(maxsize=None)
def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size ``dim`` (a power of two):
    symmetric and its own inverse."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).to(device=device, dtype=torch.float32)


def _check_rows(store: KVStore, keys: torch.Tensor, values: torch.Tensor) -> None:
    if keys.shape != values.shape or keys.dim() != 3 or keys.shape[1:] != (store.kv_heads, store.head_dim):
        raise ValueError(
            f"keys and values must both be [T, {store.kv_heads}, {store.head_dim}], "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[0] > store.capacity:
        raise ValueError(f"cannot write {keys.shape[0]} positions into {store.capacity} slots at once")


def kv_write_consecutive(store: KVStore, start: int, keys: torch.Tensor, values: torch.Tensor,
                         backend: str = "auto", tables: BlockTables | None = None) -> None:
    """``kv_write`` at positions ``start..start+T-1``, as a sequence writes.
    Float (f16-format) storage takes plain slice copies, one per contiguous
    run of slots, with no index tensors: at a decode step's one row those
    cost more than the copy."""
    if store.fmt != "f16":
        kv_write(store, torch.arange(start, start + keys.shape[0], device=keys.device), keys, values, backend,
                 tables)
        return
    _check_rows(store, keys, values)
    if tables is None:
        tables = BlockTables.contiguous(store.capacity)
    for pos, slot, n in tables.runs(0, start, start + keys.shape[0]):
        store.k[slot:slot + n] = keys[pos - start:pos - start + n]
        store.v[slot:slot + n] = values[pos - start:pos - start + n]


def kv_write(store: KVStore, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             backend: str = "auto", tables: BlockTables | None = None) -> None:
    """Quantize ``keys``/``values`` ``[T, Hkv, D]`` into the slots of ``positions`` ``[T]``, in place:
    the slots of one sequence's block table (``tables``, one row), or of a ring
    (``p % capacity``) without one.

    Positions must fall in distinct slots; consecutive positions, as a
    sequence writes them, always do. Two rows aimed at one slot would race."""
    _check_rows(store, keys, values)
    if positions.shape != (keys.shape[0],):
        raise ValueError(f"positions must be [{keys.shape[0]}], got {tuple(positions.shape)}")
    kv_write_slots(store, _slots(store, positions, tables), keys, values, backend)


def kv_write_slots(store: KVStore, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   backend: str = "auto") -> None:
    """Quantize ``keys``/``values`` ``[T, Hkv, D]`` into store slots ``slots``
    (int64 ``[T]``, distinct, on the store's device), in place: rows of any
    sequences (a decode step writes one row per sequence)."""
    _check_rows(store, keys, values)
    if store.rotated:
        h = hadamard(store.head_dim, keys.device)
        keys, values = keys.float() @ h, values.float() @ h
    if resolve_backend(keys.device, backend) == "triton" and store.fmt != "f16":
        from ._triton_kv_quant import kv_write_triton

        kv_write_triton(store, slots, keys, values)
        return
    from .reference_kv import kv_quantize

    for data, scales, x, fmt in ((store.k, store.k_scales, keys, "int8" if store.fmt != "f16" else "f16"),
                                 (store.v, store.v_scales, values, {"k8v4": "nf4"}.get(store.fmt, store.fmt))):
        codes, sc = kv_quantize(x, fmt, data.dtype)
        data[slots] = codes
        if scales is not None:
            scales[slots] = sc


def _slots(store: KVStore, positions: torch.Tensor, tables: BlockTables | None) -> torch.Tensor:
    positions = positions.to(store.k.device, torch.long)
    return positions % store.capacity if tables is None else tables.slots(0, positions)


def kv_read(store: KVStore, positions: torch.Tensor,
            tables: BlockTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[T, Hkv, D]`` (float32, original basis) at ``positions``
    (of one sequence's block table ``tables``, or of a ring without one)."""
    from .reference_kv import kv_dequantize

    slots = _slots(store, positions, tables)
    k, v = kv_dequantize(store, slots)
    if store.rotated:
        h = hadamard(store.head_dim, k.device)
        k, v = k @ h, v @ h
    return k, v

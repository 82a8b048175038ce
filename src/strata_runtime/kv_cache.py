"""The KV cache of one sequence, in a chosen format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_kernels import KV_FORMATS, KVStore, attention, kv_write_consecutive, write_and_attend
from strata_kernels.kv_quant import bytes_per_token as layer_bytes_per_token

# Prefill runs in chunks of at most this many tokens, so a sliding-window
# layer's ring needs only its window plus one chunk of slots.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class CacheSnapshot:
    """What ``KVCache.export`` returns: ``length`` and, per layer, the slots
    holding positions ``max(0, length - capacity) .. length - 1`` as stored
    (quantized formats stay quantized), ordered by position."""

    fmt: str
    length: int
    layers: list[dict[str, torch.Tensor]]


class KVCache:
    """Keys and values of every layer of one sequence.

    Invariant: layer ``l`` holds positions ``max(0, length - capacity_l) ..
    length - 1``, position ``p`` in slot ``p % capacity_l`` of its store.
    Full-attention layers have ``max_tokens`` slots (they never wrap);
    sliding-window layers have ``window + PREFILL_CHUNK`` (fewer if
    ``max_tokens`` is smaller), which is all a chunk of queries can reach.
    Storage is allocated once, here. ``ring=False`` gives every layer full
    capacity (the windows still mask): the equivalence tests' baseline.
    """

    def __init__(self, fmt: str, windows: list[int | None], kv_heads: int, head_dim: int, max_tokens: int,
                 device: torch.device | str | list = "cpu", float_dtype: torch.dtype | None = None, ring: bool = True,
                 layer_stages: list[int] | None = None):
        if fmt not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.windows = list(windows)
        self.max_tokens = max_tokens
        # The pipeline stage owning each layer (all 0 without a split).
        self.layer_stages = list(layer_stages) if layer_stages is not None else [0] * len(self.windows)
        # One device for all layers, or (a layer-split pipeline) one per layer.
        devices = device if isinstance(device, list) else [device] * len(self.windows)
        self.stores = [
            KVStore.allocate(fmt, _capacity(w if ring else None, max_tokens), kv_heads, head_dim, d, float_dtype)
            for w, d in zip(self.windows, devices)
        ]
        self.length = 0
        # Rank 0 of a split across processes: the stores of other ranks'
        # layers are on the meta device (shapes only) and their parts of a
        # snapshot are copied through this link (``ranks.RankPipeline``).
        self.remote = None
        self.remote_id: int | None = None  # this cache's id on the other ranks

    # --- writing and reading ----------------------------------------------

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize-on-write ``[T, Hkv, D]`` keys/values at positions ``start..start+T-1``."""
        self._check_write(start, keys.shape[0])
        kv_write_consecutive(self.stores[layer], start, keys, values)

    def write_and_attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                         scale: float, backend: str = "auto") -> torch.Tensor:
        """``write`` then ``attend``: a layer's step, one kernel call where the
        CPU kernels cover it (a decode step)."""
        self._check_write(start, keys.shape[0])
        return write_and_attend(q, keys, values, self.stores[layer], start, self.windows[layer], scale, backend)

    def _check_write(self, start: int, n: int) -> None:
        if start != self.length:
            raise ValueError(f"cache holds {self.length} positions; cannot write at {start}")
        if start + n > self.max_tokens:
            raise ValueError(
                f"the sequence needs {start + n} positions but the cache holds {self.max_tokens}; "
                f"load the model with a larger context_length"
            )

    def attend(self, layer: int, q: torch.Tensor, start: int, scale: float, backend: str = "auto") -> torch.Tensor:
        """Attention of queries ``[T, H, D]`` at ``start..`` over this layer
        (written up to ``start+T-1``), on ``strata_kernels.attention``'s ``backend``."""
        return attention(q, self.stores[layer], start, self.windows[layer], scale, backend)

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions written (after every layer has written them)."""
        self.length += n

    # --- cutting back -------------------------------------------------------

    def trim(self, length: int) -> int:
        """Forget positions from ``length`` on, where every layer can; return
        the new length. A ring that has already overwritten what the kept
        prefix needs cannot be cut back: then the cache empties (0)."""
        length = min(self.length, max(0, length))
        for w, store in zip(self.windows, self.stores):
            oldest_kept = self.length - store.capacity
            # The next query (at ``length``) reaches back to ``length - w + 1``.
            if w is not None and oldest_kept > max(0, length - w + 1):
                length = 0
                break
        self.length = length
        return length

    def reset(self) -> None:
        self.length = 0

    # --- size -----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def bytes_per_token(self) -> int:
        """What one more token of context costs, all layers, scales included."""
        return sum(s.bytes_per_slot() for s in self.stores)

    # --- export / import ------------------------------------------------------

    def export(self) -> CacheSnapshot:
        layers = []
        for store in self.stores:
            first = max(0, self.length - store.capacity)
            slots = torch.arange(first, self.length, device=store.k.device) % store.capacity
            layers.append({name: t[slots].clone() for name, t in store_fields(store).items()})
        return CacheSnapshot(self.fmt, self.length, layers)

    def import_(self, snapshot: CacheSnapshot) -> None:
        if snapshot.fmt != self.fmt or len(snapshot.layers) != len(self.stores):
            raise ValueError(f"a {snapshot.fmt} snapshot of {len(snapshot.layers)} layers does not fit this "
                             f"{self.fmt} cache of {len(self.stores)} layers")
        if snapshot.length > self.max_tokens:
            raise ValueError(f"the snapshot holds {snapshot.length} positions; this cache holds {self.max_tokens}")
        for store, saved in zip(self.stores, snapshot.layers):
            first = max(0, snapshot.length - store.capacity)
            slots = torch.arange(first, snapshot.length, device=store.k.device) % store.capacity
            for name, t in store_fields(store).items():
                if saved[name].shape[0] != slots.shape[0]:
                    raise ValueError("the snapshot's layers were taken with different capacities")
                t[slots] = saved[name].to(t.device)
        self.length = snapshot.length


def _capacity(window: int | None, max_tokens: int) -> int:
    return max_tokens if window is None else min(max_tokens, window + PREFILL_CHUNK)


def store_fields(store: KVStore) -> dict[str, torch.Tensor]:
    """A layer store's tensors by name (scales only where the format has them)."""
    out = {"k": store.k, "v": store.v}
    if store.k_scales is not None:
        out.update(k_scales=store.k_scales, v_scales=store.v_scales)
    return out


def f16_storage_dtype(device: torch.device | str, activations: torch.dtype = torch.float32) -> torch.dtype:
    """How the f16 KV format is stored: float16 on a GPU; on the CPU in the
    activations' dtype: bfloat16 on the fast path (lossless, the values are
    bfloat16 already), float32 on the exact path."""
    if torch.device(device).type == "cuda":
        return torch.float16
    return torch.bfloat16 if activations == torch.bfloat16 else torch.float32


def f16_storage_bytes(device: torch.device | str, activations: torch.dtype = torch.float32) -> int:
    return torch.finfo(f16_storage_dtype(device, activations)).bits // 8


def format_bytes_per_token(fmt: str, n_layers: int, kv_heads: int, head_dim: int, float_bytes: int = 2) -> int:
    """Bytes per token of context for a model in ``fmt`` (every layer counted)."""
    return n_layers * layer_bytes_per_token(fmt, kv_heads, head_dim, float_bytes)

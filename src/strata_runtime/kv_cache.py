"""The KV cache of one sequence, in a chosen format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from strata_kernels import KV_FORMATS, KVStore, attention, kv_write_consecutive, write_and_attend
from strata_kernels.attention import cpu_decode_reads

from .placement import Placement
from .state import PREFILL_CHUNK, LayerState  # noqa: F401  (PREFILL_CHUNK: re-exported for the prefill loop)


@dataclass(frozen=True)
class CacheSnapshot:
    """What ``KVCache.export`` returns: ``length`` and, per layer, the slots
    holding positions ``max(0, length - capacity) .. length - 1`` as stored
    (quantized formats stay quantized), ordered by position."""

    fmt: str
    length: int
    layers: list[dict[str, torch.Tensor]]


class KVCache:
    """Keys and values of every layer of one sequence, laid out as the
    model's ``state_spec()`` says.

    Invariant: layer ``l`` holds positions ``max(0, length - capacity_l) ..
    length - 1``, position ``p`` in slot ``p % capacity_l`` of its store.
    Full-attention layers have ``max_tokens`` slots (they never wrap);
    sliding-window layers have ``window + PREFILL_CHUNK`` (fewer if
    ``max_tokens`` is smaller), which is all a chunk of queries can reach.
    f16 values are stored as ``f16_storage_dtype`` of the layer's device
    and the activations says (the split planner counts the same bytes).
    Storage is allocated once, here. ``ring=False`` gives every layer full
    capacity (the windows still mask): the equivalence tests' baseline.
    """

    def __init__(self, fmt: str, spec: Sequence[LayerState], max_tokens: int,
                 devices: torch.device | str | Sequence = "cpu", activations: torch.dtype = torch.float32,
                 ring: bool = True, layer_stages: Sequence[int] | None = None, stage: int | None = None,
                 float_dtype: torch.dtype | None = None):
        """``devices``: one for every layer, or one per layer (a layer split).
        ``layer_stages``: the split's stage of each layer; with ``stage`` (a
        split across processes: the stage this process runs) the other
        stages' stores are shapes on the meta device, typed as their own
        devices store them. ``float_dtype`` overrides the f16 storage."""
        if fmt not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.spec = list(spec)
        self.windows = [layer.window for layer in self.spec]
        self.max_tokens = max_tokens
        self.layer_stages = list(layer_stages) if layer_stages is not None else [0] * len(self.spec)
        devices = list(devices) if isinstance(devices, (list, tuple)) else [devices] * len(self.spec)
        self.stores = []
        for layer, device, owner in zip(self.spec, devices, self.layer_stages):
            dtype = float_dtype or f16_storage_dtype(device, activations)
            held_here = stage is None or owner == stage
            capacity = layer.capacity(max_tokens) if ring else max_tokens
            self.stores.append(KVStore.allocate(fmt, capacity, layer.kv_heads, layer.head_dim,
                                                device if held_here else "meta", dtype))
        self.length = 0
        # Rank 0 of a split across processes: the stores of other ranks'
        # layers are on the meta device (shapes only) and their parts of a
        # snapshot are copied through this link (``ranks.RankPipeline``).
        self.remote = None
        self.remote_id: int | None = None  # this cache's id on the other ranks

    @classmethod
    def for_placement(cls, fmt: str, spec: Sequence[LayerState], placement: Placement, max_tokens: int,
                      activations: torch.dtype) -> "KVCache":
        """The cache of a model placed as ``placement`` (the one way the
        runtime makes one: one device, a split, or one stage of a split
        across processes, whose other stages are shapes here)."""
        return cls(fmt, spec, max_tokens, placement.layer_devices, activations,
                   layer_stages=placement.layer_stages, stage=placement.stage)

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

    def decode_ring(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor, int | None] | None:
        """For a one-position step at ``start`` (checked as ``write`` checks
        it): ``layer``'s key and value rings and its window, where the CPU
        decode kernel reads that storage in place (``attention.cpu_decode_reads``);
        None where it does not."""
        self._check_write(start, 1)
        store = self.stores[layer]
        return (store.k, store.v, self.windows[layer]) if cpu_decode_reads(store) else None

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


def store_fields(store: KVStore) -> dict[str, torch.Tensor]:
    """A layer store's tensors by name (scales only where the format has them)."""
    out = {"k": store.k, "v": store.v}
    if store.k_scales is not None:
        out.update(k_scales=store.k_scales, v_scales=store.v_scales)
    return out


def f16_storage_dtype(device: torch.device | str, activations: torch.dtype = torch.float32) -> torch.dtype:
    """How the f16 KV format is stored: float16 on a GPU; on the CPU as
    ``activations`` says (a ``ComputePath.kv_float``): bfloat16 on a fast
    path, float32 on the exact path."""
    if torch.device(device).type == "cuda":
        return torch.float16
    return torch.bfloat16 if activations == torch.bfloat16 else torch.float32


def f16_storage_bytes(device: torch.device | str, activations: torch.dtype = torch.float32) -> int:
    return torch.finfo(f16_storage_dtype(device, activations)).bits // 8

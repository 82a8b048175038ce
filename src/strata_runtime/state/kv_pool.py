"""Sequence state reserved once, as blocks (``KVPool``): every attention
layer's keys and values, every recurrent layer's state, grouped by what
sequences hold of them (``BlockGroup``); and how each layer store is laid out."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from strata_kernels import KV_FORMATS, KVStore
from strata_kernels.recurrent import RecurrentStore

from ..files import Placement
from .spec import BLOCK_SIZE, RECURRENT, LayerState, RecurrentState


class BlockGroup:
    """The layers of one window (``key``: the window, None for full
    attention, ``RECURRENT`` for recurrent layers) share block ids: block
    ``b`` of the group is slots ``b * block_size ..`` of each of its layers'
    stores.

    Invariant: ``free`` and the blocks the group's sequences hold partition
    ``0..n_blocks-1``; a sequence holds at most ``ring_blocks`` (a sliding
    window's ring; None: a full-attention layer, which grows). A recurrent
    group's blocks are one slot each, one per sequence (``ring_blocks`` 1)."""

    def __init__(self, key: int | str | None, block_size: int, n_blocks: int, ring_blocks: int | None):
        self.key = key
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.ring_blocks = ring_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...: adjacent blocks merge runs

    @property
    def grows(self) -> bool:
        """Whether a sequence may take more blocks as it grows (not a recurrent slot)."""
        return self.key != RECURRENT

    def blocks_for(self, positions: int) -> int:
        """Blocks a sequence of ``positions`` holds in this group."""
        need = -(-positions // self.block_size)
        return need if self.ring_blocks is None else min(need, self.ring_blocks)


class KVPool:
    """Every layer's keys and values, reserved once as blocks that sequences
    hold (``KVCache``), grouped by window (``BlockGroup``).

    Invariant: ``stores[l]`` has ``n_blocks * block_size`` slots of its
    layer's group; nothing allocates storage after the constructor.
    ``private`` pools are one sequence's own (one block per group, as big
    as the sequence's capacity: the plain ring of a cache)."""

    def __init__(self, fmt: str, spec: Sequence[LayerState], groups: dict[int | str | None, tuple[int, int, int | None]],
                 devices: Sequence, activations: torch.dtype, layer_stages: Sequence[int], stage: int | None,
                 float_dtype: torch.dtype | None, private: bool = False, allocate: bool = True):
        """``groups``: per group key (``LayerState.group``), (block size,
        blocks, ring blocks or None).
        ``allocate=False``: the stores are shapes on the meta device (sizing only)."""
        if fmt not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.spec = list(spec)
        self.private = private
        self.groups = [BlockGroup(key, *groups[key]) for key in sorted(groups, key=_group_order)]
        index = {g.key: i for i, g in enumerate(self.groups)}
        self.layer_group = [index[layer.group] for layer in self.spec]
        self.layer_stages = list(layer_stages)
        self.stores = []
        for layer, device, owner, g in zip(self.spec, devices, self.layer_stages, self.layer_group):
            dtype = float_dtype or f16_storage_dtype(device, activations)
            held_here = (stage is None or owner == stage) and allocate
            group = self.groups[g]
            where = device if held_here else "meta"
            if isinstance(layer, RecurrentState):
                self.stores.append(RecurrentStore.allocate(group.n_blocks, layer.conv_window, layer.channels,
                                                           layer.v_heads, layer.d_k, layer.d_v, where))
            else:
                self.stores.append(KVStore.allocate(fmt, group.n_blocks * group.block_size, layer.kv_heads,
                                                    layer.head_dim, where, dtype))

    @classmethod
    def for_sequences(cls, fmt: str, spec: Sequence[LayerState], placement: Placement, sequences: float,
                      context: int, activations: torch.dtype, block_size: int = BLOCK_SIZE,
                      allocate: bool = True, spare_states: int = 0) -> "KVPool":
        """Room for ``sequences`` (may be fractional) sequences of ``context``
        tokens each, in blocks of ``block_size``; ``spare_states`` more
        recurrent slots (a speculative step writes recurrent state there)."""
        groups = {}
        for layer in spec:
            if isinstance(layer, RecurrentState):  # a slot per sequence
                groups[layer.group] = (1, max(1, math.ceil(sequences)) + spare_states, 1)
                continue
            ring = None if layer.window is None else -(-layer.capacity(context) // block_size)
            per_sequence = ring if ring is not None else -(-context // block_size)
            groups[layer.group] = (block_size, max(1, int(sequences * per_sequence)), ring)
        return cls(fmt, spec, groups, placement.layer_devices, activations, placement.layer_stages,
                   placement.stage, None, allocate=allocate)

    def allocate(self, group: int, n: int) -> list[int] | None:
        free = self.groups[group].free
        if n > len(free):
            return None
        return [free.pop() for _ in range(n)]

    def release(self, group: int, blocks: Sequence[int]) -> None:
        self.groups[group].free.extend(reversed(blocks))

    def free_blocks(self) -> list[int]:
        return [len(g.free) for g in self.groups]

    def total_blocks(self) -> int:
        return sum(g.n_blocks for g in self.groups)

    def bytes_per_token(self) -> int:
        """What one more token of context costs, all attention layers, scales included."""
        return sum(s.bytes_per_slot() for s in self.stores if isinstance(s, KVStore))

    def recurrent_bytes(self) -> int:
        """What one sequence's recurrent state takes, all recurrent layers."""
        return sum(s.bytes_per_slot() for s in self.stores if isinstance(s, RecurrentStore))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)


def _group_order(key: int | str | None) -> tuple[int, int]:
    """Full attention first, then sliding windows by size, then recurrent layers."""
    if key is None:
        return (0, 0)
    return (2, 0) if key == RECURRENT else (1, key)


def store_fields(store: KVStore | RecurrentStore) -> dict[str, torch.Tensor]:
    """A layer store's tensors by name, each indexed by slot first (KV:
    scales only where the format has them; recurrent: conv window and state)."""
    if isinstance(store, RecurrentStore):
        return store.fields()
    out = {"k": store.k, "v": store.v}
    if store.k_scales is not None:
        out.update(k_scales=store.k_scales, v_scales=store.v_scales)
    return out


def store_device(store: KVStore | RecurrentStore) -> torch.device:
    return store.device if isinstance(store, RecurrentStore) else store.k.device


def f16_storage_dtype(device: torch.device | str, activations: torch.dtype = torch.float32) -> torch.dtype:
    """How the f16 KV format is stored: float16 on a GPU; on the CPU as
    ``activations`` says (a ``ComputePath.kv_float``): bfloat16 on a fast
    path, float32 on the exact path."""
    if torch.device(device).type == "cuda":
        return torch.float16
    return torch.bfloat16 if activations == torch.bfloat16 else torch.float32


def f16_storage_bytes(device: torch.device | str, activations: torch.dtype = torch.float32) -> int:
    return torch.finfo(f16_storage_dtype(device, activations)).bits // 8

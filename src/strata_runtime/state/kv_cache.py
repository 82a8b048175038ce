"""Sequence state reserved once as blocks (``KVPool``), and one sequence's view of it (``KVCache``).

Attention layers keep keys and values per position; recurrent layers
(``spec.RecurrentState``) keep one state per sequence, held as a block of
one "position" (the state after the sequence's last token) in a group of
their own, so reserving, releasing and copying treat both alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from strata_kernels import KVStore, attention, kv_write_consecutive, write_and_attend
from strata_kernels.attention import cpu_decode_reads
from strata_kernels.paging import BlockTables
from strata_kernels.recurrent import RecurrentStore

from ..files import Placement
from .kv_pool import KVPool, store_device, store_fields
from .spec import DRAFT_MARGIN, RECURRENT, LayerState, RecurrentState


@dataclass(frozen=True)
class CacheSnapshot:
    """What ``KVCache.export`` returns: ``length`` and, per layer, the slots
    holding positions ``max(0, length - capacity) .. length - 1`` as stored
    (quantized formats stay quantized), ordered by position."""

    fmt: str
    length: int
    layers: list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class RecurrentRuns:
    """The rows of a step as a recurrent layer meets them: rows
    ``0..len(decode)-1`` are one token each of the sequences whose states
    are in slots ``decode`` (a tensor on the store's device, or None), then
    ``chains`` ``(first row, rows, source slot, slots)``: a sequence's rows
    stepped one at a time, row ``j`` from the state in ``slots[j - 1]``
    (``source`` for row 0) into ``slots[j]`` (a verify: the state after
    every draft position kept), then ``prefill`` runs ``(first row, rows,
    slot)`` of one sequence each, each from the state in ``copies``'s source
    for its slot where one is listed (``(source, slot)``), else in place."""

    store: RecurrentStore
    decode: torch.Tensor | None
    prefill: list[tuple[int, int, int]]
    chains: list[tuple[int, int, int, list[int]]] = ()
    copies: list[tuple[int, int]] = ()


class KVCache:
    """Keys and values of every layer of one sequence, in blocks of a
    ``KVPool`` laid out as the model's ``state_spec()`` says.

    Invariant: layer ``l`` holds positions ``max(0, length - capacity(l)) ..
    length - 1`` (a verify may have written up to ``DRAFT_MARGIN - 1``
    positions past ``length``: garbage, overwritten before it is read),
    found through the sequence's table of its group's blocks (``tables(l)``: position ``p`` in the ring of the blocks held, see
    ``strata_kernels.paging``). Full-attention layers can hold ``max_tokens``
    positions (they never wrap); sliding-window layers ``window +
    PREFILL_CHUNK`` rounded up to whole blocks (fewer if ``max_tokens`` is
    smaller), which is all a chunk of queries can reach. A sequence holds
    the blocks its length needs (``reserve`` takes more before a step
    writes); f16 values are stored as ``f16_storage_dtype`` of the layer's
    device and the activations say (the split planner counts the same bytes).
    Made by the constructor, a cache owns a private pool (its storage,
    allocated here); ``on_pool`` makes one over a shared pool, allocating
    nothing. ``ring=False`` gives every layer full capacity (the windows
    still mask): the equivalence tests' baseline.
    """

    def __init__(self, fmt: str, spec: Sequence[LayerState], max_tokens: int,
                 devices: torch.device | str | Sequence = "cpu", activations: torch.dtype = torch.float32,
                 ring: bool = True, layer_stages: Sequence[int] | None = None, stage: int | None = None,
                 float_dtype: torch.dtype | None = None, pool: KVPool | None = None):
        """``devices``: one for every layer, or one per layer (a layer split).
        ``layer_stages``: the split's stage of each layer; with ``stage`` (a
        split across processes: the stage this process runs) the other
        stages' stores are shapes on the meta device, typed as their own
        devices store them. ``float_dtype`` overrides the f16 storage."""
        spec = list(spec)
        if pool is None:
            devices = list(devices) if isinstance(devices, (list, tuple)) else [devices] * len(spec)
            capacity = {layer.group: layer.capacity(max_tokens) if ring or layer.group == RECURRENT else max_tokens
                        for layer in spec}
            pool = KVPool(fmt, spec, {w: (c, 1, 1) for w, c in capacity.items()}, devices, activations,
                          layer_stages if layer_stages is not None else [0] * len(spec), stage, float_dtype,
                          private=True)
        self.pool = pool
        self.fmt = pool.fmt
        self.spec = pool.spec
        self.windows = [layer.window for layer in self.spec]
        self.recurrent_layers = [i for i, layer in enumerate(self.spec) if isinstance(layer, RecurrentState)]
        self.max_tokens = max_tokens
        self.layer_stages = pool.layer_stages
        self.stores = pool.stores
        self.length = 0
        # Per group: the blocks held, in order, and their tables (made when they change).
        self.blocks: list[list[int]] = [[] for _ in pool.groups]
        self._tables: list[BlockTables | None] = [None] * len(pool.groups)
        if pool.private:  # the one block of each group is this sequence's
            self.blocks = [pool.allocate(g, 1) for g in range(len(pool.groups))]
        # Rank 0 of a split across processes: the stores of other ranks'
        # layers are on the meta device (shapes only) and their parts of a
        # snapshot are copied through this link (``ranks.RankPipeline``).
        self.remote = None
        self.remote_id: int | None = None  # this cache's id on the other ranks
        # A speculative step's spare recurrent slots (``speculation``): the
        # step writes this sequence's recurrent state there, one slot per
        # row of a decode or verify (one for a prompt chunk), and ``adopt``
        # makes one of them the sequence's after the step. None otherwise.
        self.shadow: list[int] | None = None

    @classmethod
    def for_placement(cls, fmt: str, spec: Sequence[LayerState], placement: Placement, max_tokens: int,
                      activations: torch.dtype) -> "KVCache":
        """The cache of a model placed as ``placement`` (the one way the
        runtime makes one: one device, a split, or one stage of a split
        across processes, whose other stages are shapes here)."""
        return cls(fmt, spec, max_tokens, placement.layer_devices, activations,
                   layer_stages=placement.layer_stages, stage=placement.stage)

    @classmethod
    def on_pool(cls, pool: KVPool, max_tokens: int) -> "KVCache":
        """An empty sequence over ``pool``'s blocks, holding none yet."""
        return cls(pool.fmt, pool.spec, max_tokens, pool=pool)

    # --- blocks -----------------------------------------------------------------

    def capacity(self, layer: int) -> int:
        """Positions ``layer`` keeps: older ones are overwritten (a ring).
        A ring that wraps vouches for ``DRAFT_MARGIN`` fewer than its slots:
        a verify cut back to this length may have written that many past it,
        over the oldest."""
        group = self.pool.groups[self.pool.layer_group[layer]]
        if self.pool.private:
            slots = group.block_size  # the one block is the whole ring
        else:
            slots = self.max_tokens if group.ring_blocks is None else group.ring_blocks * group.block_size
        if self.windows[layer] is None or slots >= self.max_tokens:  # full attention, a recurrent slot, no wrap
            return slots
        return slots - DRAFT_MARGIN

    def blocks_needed(self, n: int) -> list[int]:
        """More blocks, per group, before ``n`` more positions can be written."""
        return [max(0, g.blocks_for(min(self.length + n, self.max_tokens)) - len(held))
                for g, held in zip(self.pool.groups, self.blocks)]

    def reserve(self, n: int) -> bool:
        """Hold the blocks ``n`` more positions need; False (holding what it
        held before) where the pool has too few free."""
        need = self.blocks_needed(n)
        if not any(need):
            return True
        taken = []
        for g, k in enumerate(need):
            got = self.pool.allocate(g, k) if k else []
            if got is None:
                for g2, blocks in taken:
                    self.pool.release(g2, blocks)
                return False
            taken.append((g, got))
        for g, got in taken:
            if got:
                self.blocks[g] = self.blocks[g] + got
                self._tables[g] = None
        return True

    def release(self) -> None:
        """Give every block back to the pool (a shared pool's sequence) and empty."""
        self.length = 0
        if self.pool.private:
            return
        for g, held in enumerate(self.blocks):
            self.pool.release(g, held)
        self.blocks = [[] for _ in self.pool.groups]
        self._tables = [None] * len(self.pool.groups)

    @property
    def held_blocks(self) -> int:
        return sum(len(b) for b in self.blocks)

    def tables(self, layer: int) -> BlockTables:
        """This sequence's block table for ``layer`` (one row)."""
        g = self.pool.layer_group[layer]
        table = self._tables[g]
        if table is None:
            if not self.blocks[g]:
                raise ValueError("the sequence holds no blocks: reserve() them before a step writes")
            device = store_device(self.stores[layer])
            table = BlockTables.of([self.blocks[g]], self.pool.groups[g].block_size,
                                   device if device.type != "meta" else "cpu")
            self._tables[g] = table
        return table

    def slot_runs(self, layer: int, first: int, end: int) -> list[tuple[int, int, int]]:
        """``(first position, first slot, count)`` runs of ``layer``'s store
        holding positions ``first..end-1``, each contiguous in the store."""
        return self.tables(layer).runs(0, first, end)

    # --- writing and reading ----------------------------------------------

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize-on-write ``[T, Hkv, D]`` keys/values at positions ``start..start+T-1``."""
        self.check_write(start, keys.shape[0])
        kv_write_consecutive(self.stores[layer], start, keys, values, tables=self.tables(layer))

    def write_and_attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         backend: str = "auto") -> torch.Tensor:
        """``write`` at this sequence's next positions, then ``attend``: a
        layer's step, one kernel call where the CPU kernels cover it (a decode step)."""
        start = self.length
        self.check_write(start, keys.shape[0])
        return write_and_attend(q, keys, values, self.stores[layer], start, self.windows[layer], scale, backend,
                                self.tables(layer))

    def decode_view(self, layer: int, positions: torch.Tensor) -> tuple[KVStore, int | None, BlockTables] | None:
        """For a one-position step at ``positions`` ``[1]`` (checked as
        ``write`` checks it): ``layer``'s store, window and this sequence's
        table, where the CPU decode kernel reads that storage in place
        (``attention.cpu_decode_reads``); None where it does not (or for
        more than one position)."""
        if positions.shape[0] != 1:
            return None
        self.check_write(self.length, 1)
        store = self.stores[layer]
        return (store, self.windows[layer], self.tables(layer)) if cpu_decode_reads(store) else None

    def check_write(self, start: int, n: int) -> None:
        """Refuse a write of ``n`` positions at ``start`` that is not this
        sequence's next, or past its room; hold the blocks it needs."""
        if start != self.length:
            raise ValueError(f"cache holds {self.length} positions; cannot write at {start}")
        if start + n > self.max_tokens:
            raise ValueError(
                f"the sequence needs {start + n} positions but the cache holds {self.max_tokens}; "
                f"load the model with a larger context_length"
            )
        if any(self.blocks_needed(n)) and not self.reserve(n):
            raise ValueError(f"no free KV blocks for {n} more positions: the scheduler reserves them before a step")

    def attend(self, layer: int, q: torch.Tensor, start: int, scale: float, backend: str = "auto") -> torch.Tensor:
        """Attention of queries ``[T, H, D]`` at ``start..`` over this layer
        (written up to ``start+T-1``), on ``strata_kernels.attention``'s ``backend``."""
        return attention(q, self.stores[layer], start, self.windows[layer], scale, backend, self.tables(layer))

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions written (after every layer has written them)."""
        self.length += n

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` whose logits a ``last_only`` step returns: the last."""
        return x[-1:]

    # --- cutting back -------------------------------------------------------

    def trim(self, length: int) -> int:
        """Forget positions from ``length`` on, where every layer can; return
        the new length. A ring that has already overwritten what the kept
        prefix needs, or a recurrent state (which holds only the last
        position's), cannot be cut back: then the cache empties (0)."""
        length = min(self.length, max(0, length))
        if not self.resumes(self.length, length):
            length = 0
        self.length = length
        return length

    def resumes(self, length: int, position: int) -> bool:
        """Whether this sequence's state, written up to ``length``, can go on
        from ``position`` (<= ``length``) with nothing restored: every
        sliding ring still holds what a query at ``position`` reaches back to
        (``position - window + 1``), and every recurrent state is at ``position``."""
        if position == 0 or position == length:
            return True
        if self.recurrent_layers:
            return False
        return all(w is None or length - self.capacity(layer) <= max(0, position - w + 1)
                   for layer, w in enumerate(self.windows))

    @property
    def has_running_state(self) -> bool:
        """Whether some layer keeps only recent state (a ring, a recurrent
        state): a prefix of the sequence may then need a checkpoint to resume."""
        return any(w is not None for w in self.windows) or bool(self.recurrent_layers)

    def running_state(self, position: int) -> list[tuple[int, int, int]]:
        """``(layer, first, end)``: what a checkpoint at ``position`` keeps
        (the sequence written up to it): each sliding layer's last ``window``
        positions and each recurrent layer's state (its one "position",
        ``position - 1``); with the full-attention layers' positions from
        another source, the sequence resumes at ``position``."""
        out = []
        for layer, w in enumerate(self.windows):
            if w is not None:
                out.append((layer, max(0, position - w), position))
            elif layer in self.recurrent_layers:
                out.append((layer, position - 1, position))
        return out

    def recurrent_slot(self, layer: int) -> int:
        """This sequence's slot in recurrent ``layer``'s store (held: a step
        has checked its write), cleared where the sequence starts (length 0)."""
        slot = self.blocks[self.pool.layer_group[layer]][0]
        if self.length == 0:
            self.stores[layer].clear(slot)
        return slot

    def recurrent_runs(self, layer: int, rows: int) -> "RecurrentRuns":
        """How a step of ``rows`` positions of this sequence meets recurrent
        ``layer``: one decode row, or one run of prompt rows."""
        self.check_write(self.length, rows)
        slot = self.recurrent_slot(layer)
        store = self.stores[layer]
        if rows == 1:
            return RecurrentRuns(store, torch.tensor([slot], device=store.device), [])
        return RecurrentRuns(store, None, [(0, rows, slot)])

    def reset(self) -> None:
        self.length = 0

    def adopt(self, index: int, length: int) -> None:
        """After a step that wrote this sequence's recurrent state into
        ``shadow``: slot ``shadow[index]`` (the state after ``length``
        positions) becomes the sequence's, the others and its old slot go back."""
        g = self.pool.layer_group[self.recurrent_layers[0]]
        chosen = self.shadow[index]
        self.pool.release(g, [*self.blocks[g], *(s for s in self.shadow if s != chosen)])
        self.blocks[g] = [chosen]
        self._tables[g] = None
        self.shadow = None
        self.length = length

    def drop_shadow(self) -> None:
        """Give a step's spare recurrent slots back unused (the step did not run, or failed)."""
        if self.shadow is not None:
            self.pool.release(self.pool.layer_group[self.recurrent_layers[0]], self.shadow)
            self.shadow = None

    def copy_prefix(self, source: "KVCache", n: int) -> bool:
        """Make this empty cache hold ``source``'s first ``n`` positions (another
        sequence of the same pool, holding at least them), copying their rows
        on the device. False (this cache unchanged) where one of ``source``'s
        rings no longer holds all of them this cache would keep, or the pool
        has no blocks for them."""
        if self.length or n > source.length:
            raise ValueError("copy_prefix fills an empty cache from a sequence holding the prefix")
        if any(source.length - source.capacity(layer) > max(0, n - self.capacity(layer))
               for layer in range(len(self.stores))):
            return False
        if not self.reserve(n):
            return False
        for layer, store in enumerate(self.stores):
            positions = torch.arange(max(0, n - self.capacity(layer)), n, device=store_device(store))
            src, dst = source.tables(layer).slots(0, positions), self.tables(layer).slots(0, positions)
            for t in store_fields(store).values():
                t[dst] = t[src]
        self.length = n
        return True

    # --- size -----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """What this sequence's storage takes: its private pool, or the blocks it holds."""
        if self.pool.private:
            return self.pool.nbytes
        return sum(len(self.blocks[g]) * self.pool.groups[g].block_size * s.bytes_per_slot()
                   for g, s in zip(self.pool.layer_group, self.stores))

    def bytes_per_token(self) -> int:
        """What one more token of context costs, all layers, scales included."""
        return self.pool.bytes_per_token()

    # --- export / import ------------------------------------------------------

    def _slots(self, layer: int, length: int) -> torch.Tensor:
        """Slots of the positions ``layer`` keeps of the first ``length``, in position order."""
        first = max(0, length - self.capacity(layer))
        store = self.stores[layer]
        return self.tables(layer).slots(0, torch.arange(first, length, device=store_device(store)))

    def export(self) -> CacheSnapshot:
        layers = []
        for i, store in enumerate(self.stores):
            slots = self._slots(i, self.length)
            layers.append({name: t[slots].clone() for name, t in store_fields(store).items()})
        return CacheSnapshot(self.fmt, self.length, layers)

    def import_(self, snapshot: CacheSnapshot) -> None:
        if snapshot.fmt != self.fmt or len(snapshot.layers) != len(self.stores):
            raise ValueError(f"a {snapshot.fmt} snapshot of {len(snapshot.layers)} layers does not fit this "
                             f"{self.fmt} cache of {len(self.stores)} layers")
        if snapshot.length > self.max_tokens:
            raise ValueError(f"the snapshot holds {snapshot.length} positions; this cache holds {self.max_tokens}")
        self.length = 0
        if not self.reserve(snapshot.length):
            raise ValueError(f"no free KV blocks for the snapshot's {snapshot.length} positions")
        for i, (store, saved) in enumerate(zip(self.stores, snapshot.layers)):
            slots = self._slots(i, snapshot.length)
            for name, t in store_fields(store).items():
                if saved[name].shape[0] != slots.shape[0]:
                    raise ValueError("the snapshot's layers were taken with different capacities")
                t[slots] = saved[name].to(t.device)
        self.length = snapshot.length

"""What the conversation cache holds: parked snapshots and checkpoints, each
in a lease of the staging pool, and the outcomes its operations return."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from strata_kernels.recurrent import RecurrentStore

from ..state import KVCache, store_fields
from ..testing import fault_point
from .parked_entry import EntryMeta, Part
from .staging import Lease


@dataclass(frozen=True)
class Parked:
    tokens: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Restored:
    position: int  # the cache now holds positions 0 .. position-1
    source: str  # "live" (cut back in place), "parked" (from RAM) or "disk" (read back from the disk tier first)


@dataclass(frozen=True)
class Saved:
    position: int
    bytes: int


@dataclass(frozen=True)
class Skipped:
    """Work not done. ``reason`` is the log text; ``cause`` a short label
    that counters and metrics group by (see ``CAUSES``)."""

    reason: str
    cause: str = "other"


# Why an optimization was skipped, as counted in ``stats()["skipped_by_reason"]``.
CAUSES = {
    "no_pool": "the staging pool was refused at start (telemetry unknown, no room, or strict)",
    "too_large": "larger than the whole staging pool",
    "no_blocks": "no free KV blocks on the device to restore into",
    "pool_full": "not enough free pages even after evicting what may be evicted (nothing is evicted then)",
    "disk_writing": "the pages eviction would free were still being written to disk past the wait's bound",
    "orphan": "a snapshot on disk whose base is gone",
    "lease_failed": "taking pages from the pool ran out of memory",
    "out_of_memory": "the copy ran out of memory",
    "no_running_state": "the model has no running state to checkpoint",
    "disk_<reject cause>": "a file of the disk tier found wrong on reading it back (parked_entry.REJECT_CAUSES)",
    "disk_read_failed": "reading a file of the disk tier failed (the file is kept)",
    "not_needed": "nothing to do (too short, already parked); neither logged nor counted",
}


Outcome = Parked | Restored | Saved | Skipped

@dataclass
class Stored:
    """Position ranges of some layers of a cache, copied into one lease
    behind the entry's header (``parked_entry``).

    Invariant: the lease holds ``meta``'s header (``header`` bytes), then
    its payload; ``parts`` are ``meta.parts`` with offsets in the lease
    (payload offset + ``header``), tiling the lease from ``header`` on; each
    part holds rows ``first..end-1`` (by position) of one field of one
    layer's store."""

    lease: Lease
    meta: EntryMeta
    header: int
    spill: Any = None  # ``disk_tier._Spill`` while the disk writer may read the lease

    @property
    def parts(self) -> list[Part]:
        return [(layer, name, first, end, offset + self.header) for layer, name, first, end, offset in self.meta.parts]

    @property
    def nbytes(self) -> int:
        """Bytes of state held (the payload; the header is bookkeeping)."""
        return self.meta.payload_bytes

    @property
    def id(self) -> str:
        return self.meta.id


@dataclass(eq=False)
class Snapshot:
    """A parked sequence: ``tokens`` (whose KV it holds) and, per layer, the
    positions its store still held: ``0..length-1`` for full-attention layers,
    the ring's last ``capacity`` positions for sliding ones, the state after
    the last token for recurrent ones. Only a request of
    the same scope may restore it (``scope``: its digest, ``scope_digest``).

    A snapshot that extends an older one of its conversation (``base``: its
    tokens are a prefix of these) stores only what the base does not hold:
    per layer, positions from ``max(base.length, length - capacity)`` on.
    Invariant: the chain (``chain()``: the base's chain, then this one)
    holds every position above, and each member's bytes stay in the pool
    while a member after it does."""

    tokens: tuple[int, ...]
    stored: Stored
    scope: str = ""
    last_used: float = field(default_factory=time.monotonic)
    base: "Snapshot | None" = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def chain(self) -> list["Snapshot"]:
        """This snapshot's bases, oldest first, then itself: the copies a restore makes, in order."""
        return ([] if self.base is None else self.base.chain()) + [self]


@dataclass(eq=False)
class Checkpoint:
    """Running state at ``position`` of the sequence ``tokens``
    (``KVCache.running_state``): the last ``window`` positions of every
    sliding-window layer and the state of every recurrent layer. ``root`` checkpoints
    (the end of a system prompt) are never evicted. Only a request of the
    same scope (``scope``: its digest) may restore it."""

    tokens: tuple[int, ...]
    stored: Stored
    root: bool
    scope: str = ""
    last_used: float = field(default_factory=time.monotonic)

    @property
    def position(self) -> int:
        return len(self.tokens)


def plan_parts(cache: KVCache, layers: list[tuple[int, int, int]]) -> tuple[list[Part], int]:
    """The parts holding ``layers`` (layer, first, end), with payload offsets; the payload's bytes."""
    parts, offset = [], 0
    for layer, first, end in layers:
        for name, t in store_fields(cache.stores[layer]).items():
            parts.append((layer, name, first, end, offset))
            offset += (end - first) * t[0].numel() * t.element_size()
    return parts, offset

def copy_parts(cache: KVCache, stored: Stored, to_pool: bool, upto: int | None, stage: int) -> None:
    pieces = []  # (layer, field, first slot, slots, lease offset, bytes)
    for layer, name, first, end, offset in stored.parts:
        if cache.layer_stages[layer] != stage:
            continue
        t = store_fields(cache.stores[layer])[name]
        row = t[0].numel() * t.element_size()
        stop = end if upto is None else min(end, upto)
        for pos, slot, n in cache.slot_runs(layer, first, stop):
            pieces.append((layer, name, slot, n, offset + (pos - first) * row, n * row))
    if any(isinstance(cache.stores[layer], RecurrentStore) for layer, *_ in pieces):
        fault_point("recurrent_copy", stage)
    if cache.remote is not None and cache.remote.is_remote(stage):
        cache.remote.copy_stage(cache, stage, pieces, stored.lease, to_pool)
        return
    for layer, name, slot, n, at, _ in pieces:
        piece = store_fields(cache.stores[layer])[name][slot:slot + n]
        if to_pool:
            stored.lease.copy_in(at, piece)
        else:
            stored.lease.copy_out(at, piece)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""Room in the staging pool for the conversation cache: leases, eviction
and dropping entries.

Making room is an optimization's business, so it never makes things worse:
nothing is evicted for a lease that would fail anyway, a checkpoint never
displaces a parked conversation, and a snapshot whose file the disk writer
is still writing is waited for, never cut off (its file may be the
conversation's only copy to come).
"""

from __future__ import annotations

import time
from collections import Counter

from ..faults import describe, is_out_of_memory
from ..testing import fault_point
from . import parked_entry as entry
from .disk_tier import Spill
from .entries import Checkpoint, Skipped, Snapshot
from .memory import MiB
from .staging import Lease, StagingPool

# Making room waits at most this long for the disk writer to let go of a
# snapshot's pages: far less than prefilling a long conversation again.
SPILL_WAIT_S = 10.0


class PoolRoom:
    """The entries in ``pool`` and the making of room among them.

    Invariant: every snapshot and checkpoint owns one unreleased lease;
    a dropped entry's lease is released at once, or, while the disk writer
    still reads it, by the writer when it is done (its spill is then in
    ``_leaving`` until finished); ``counters`` count evictions and waits."""

    def __init__(self, pool: StagingPool, pool_refusal: str):
        self.pool = pool
        self.pool_refusal = pool_refusal
        self.snapshots: list[Snapshot] = []
        self.checkpoints: list[Checkpoint] = []
        self.counters: Counter[str] = Counter()
        self._leaving: list[Spill] = []  # spills of entries dropped from RAM, until the writer finishes them
        self.spill_wait_s = SPILL_WAIT_S

    def _lease(self, nbytes: int, what: str, evict_snapshots: bool, keep: frozenset = frozenset()) -> Lease | Skipped:
        """Pages for ``nbytes``, evicting what may be evicted (never ``keep``)
        only where that makes enough room: nothing is evicted for a lease
        that would fail anyway."""
        if self.pool.total_bytes == 0:
            return Skipped(f"no staging pool: {self.pool_refusal}", "no_pool")
        if nbytes > self.pool.total_bytes:
            return Skipped(f"staging pool: {what} needs {_mib(nbytes)}, the whole pool is {_mib(self.pool.total_bytes)}",
                           "too_large")
        short = self._shortfall(self.pool.pages_for(nbytes), evict_snapshots, keep)
        if short:
            return Skipped(short, "pool_full")
        evicted = 0
        deadline = time.monotonic() + self.spill_wait_s
        while True:
            try:
                fault_point("staging_lease")
                lease = self.pool.lease(nbytes)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                return Skipped(f"staging pool: lease failed ({describe(e)})", "lease_failed")
            if lease is not None:
                if evicted:
                    self.counters["evictions"] += evicted
                return lease
            step = self._evict_one(evict_snapshots, keep, deadline)
            if isinstance(step, Skipped):
                if evicted:
                    self.counters["evictions"] += evicted
                return step
            evicted += step == "evicted"

    def _shortfall(self, pages: int, evict_snapshots: bool, keep: frozenset) -> str | None:
        """Why ``pages`` cannot be had even after evicting all that may be
        evicted and waiting for the disk writer; None where they can."""
        free = self.pool.free_bytes // self.pool.page_bytes
        evictable = sum(len(item.stored.lease.pages) for item in self._evictable(evict_snapshots, keep))
        writing = sum(s.pages for s in self._leaving_ram())
        if pages <= free + evictable + writing:
            return None
        return (f"staging pool: need {_mib(pages * self.pool.page_bytes)}, {_mib(free * self.pool.page_bytes)} free "
                f"and {_mib((evictable + writing) * self.pool.page_bytes)} more that eviction could free; "
                "nothing evicted")

    def _evictable(self, evict_snapshots: bool, keep: frozenset) -> list[Snapshot | Checkpoint]:
        """Everything repeated evictions may free: non-root checkpoints and
        (when a snapshot is asking) every snapshot outside ``keep``, whose
        chains ``keep`` holds whole."""
        items: list = [c for c in self.checkpoints if not c.root and c not in keep]
        return items + [s for s in self.snapshots if s not in keep] if evict_snapshots else items

    def _leaving_ram(self) -> list[Spill]:
        """Spills of entries that left RAM, still being written (the writer frees their pages)."""
        self._leaving = [s for s in self._leaving if not s.finished.is_set()]
        return self._leaving

    def _evict_one(self, evict_snapshots: bool, keep: frozenset, deadline: float) -> str | Skipped:
        """Free the least recently used non-root checkpoint or (when a
        snapshot is asking) parked conversation, never one in ``keep``
        ("evicted"). A checkpoint never displaces a parked conversation:
        that would trade a whole conversation for a shortcut. A victim
        whose pages the disk writer still reads frees nothing now, and its
        file may be its only copy to come: the writer is waited for
        ("waited"; ``Skipped`` past ``deadline``), never cut off."""
        victims = [c for c in self.checkpoints if not c.root and c not in keep]
        if evict_snapshots:
            victims += [s for s in self._heads() if s not in keep]
        writing = {v: [m.stored.spill for m in self._members_dropped(v, keep)
                           if m.stored.spill is not None and not m.stored.spill.finished.is_set()] for v in victims}
        ready = [v for v in victims if not writing[v]]
        if ready:
            victim = min(ready, key=lambda x: x.last_used)
            if isinstance(victim, Snapshot):
                self._drop_conversation(victim, keep)
            else:
                self._drop(victim)
            return "evicted"
        spills = [s for v in victims for s in writing[v]] + self._leaving_ram()
        if not spills:
            return Skipped(f"staging pool: {_mib(self.pool.free_bytes)} free and nothing more to evict", "pool_full")
        first = min(spills, key=lambda s: s.order)  # the writer takes them in this order
        t0 = time.monotonic()
        if not first.finished.wait(max(0.0, deadline - t0)):
            self.counters["spill_waits_timed_out"] += 1
            return Skipped(f"staging pool: the disk writer still holds the pages eviction would free after "
                           f"{self.spill_wait_s:.0f} s", "disk_writing")
        self.counters["spill_waits"] += 1
        self.counters["spill_wait_seconds"] += time.monotonic() - t0
        return "waited"

    def _members_dropped(self, item: Snapshot | Checkpoint, keep: frozenset) -> list[Snapshot | Checkpoint]:
        """What evicting ``item`` drops: a checkpoint itself; a snapshot, with
        the bases nothing else extends (as ``_drop_conversation``)."""
        if not isinstance(item, Snapshot):
            return [item]
        out: list[Snapshot] = []
        while (item is not None and item not in keep
               and not any(s.base is item and s not in out for s in self.snapshots)):
            out.append(item)
            item = item.base
        return out

    def _heads(self) -> list[Snapshot]:
        """The snapshots no other extends: one per parked conversation (or branch of one)."""
        bases = {s.base for s in self.snapshots}
        return [s for s in self.snapshots if s not in bases]

    def _drop_conversation(self, head: Snapshot, keep: frozenset = frozenset()) -> None:
        """``head`` and each base of it that nothing else extends (and that is not in ``keep``)."""
        item: Snapshot | None = head
        while item is not None and item not in keep and not any(s.base is item for s in self.snapshots):
            base = item.base
            self._drop(item)
            item = base

    def _drop(self, item: Snapshot | Checkpoint) -> None:
        if isinstance(item, Snapshot):
            for dependent in [s for s in self.snapshots if s.base is item]:
                self._drop(dependent)  # it holds only what ``item`` does not
            self.snapshots.remove(item)
        else:
            self.checkpoints.remove(item)
        spill = item.stored.spill
        if spill is None:
            self._free(item.stored.lease)
        elif not spill.leave_ram(self._free):
            self._leaving.append(spill)  # its file may be the conversation's only copy to come: finished, not cut off

    def _free(self, lease: Lease) -> None:
        """Give a dropped entry's pages back (on the disk writer's thread
        where it was still writing them); the header is cleared first, so no
        later reader of a shared pool takes the pages for an entry."""
        lease.write(0, entry.cleared_flag())
        self.pool.release(lease)


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"

"""Reading parked conversations back from the disk tier into the staging
pool: a snapshot's file and the files of the bases it extends that RAM
lacks, the room for all of them checked before any is read."""

from __future__ import annotations

from typing import Any

from ..faults import describe
from . import parked_entry as entry
from .disk_tier import DiskEntry
from .entries import Skipped, Snapshot, Stored
from .parked_entry import EntryRejected
from .room import PoolRoom


class DiskReads(PoolRoom):
    """The reading side of the disk tier, a part of ``ConversationCache``:
    it uses the cache's ``disk``, ``disk_refusal``, ``slots``,
    ``skipped_by_reason`` and ``_commit`` besides the pool's room."""

    def _load_from_disk(self, found: DiskEntry, keep: frozenset) -> Snapshot | Skipped:
        """``found`` (and the bases it extends that RAM lacks) read back into
        pool pages and committed there, as a parked snapshot. The room for
        the whole chain is checked before anything is read."""
        missing, base = [found], None  # the chain's members on disk only, newest first
        while missing[-1].meta.base is not None:
            base_id = missing[-1].meta.base
            base = next((s for s in self.snapshots if s.stored.id == base_id), None)
            if base is not None:
                break
            on_disk = next((e for e in self.disk.snapshot_metas() if e.meta.id == base_id), None)
            if on_disk is None:
                self.disk.forget(missing[-1].meta.id, "orphan")
                return Skipped("the snapshot it extends is gone", "orphan")
            missing.append(on_disk)
        keep = keep | (frozenset(base.chain()) if base is not None else frozenset())
        pages = sum(entry.pages_needed(e.meta, self.pool.page_bytes) for e in missing)
        short = self._shortfall(pages, True, keep)
        if short:
            return Skipped(f"{short} (a {len(found.meta.tokens)}-token snapshot, {len(missing)} files)", "pool_full")
        for member in reversed(missing):
            snap = self._read_back(member, base, keep)
            if isinstance(snap, Skipped):
                return snap
            base, keep = snap, keep | {snap}
        return snap


    def _read_back(self, found: DiskEntry, base: Snapshot | None,
                   keep: frozenset) -> Snapshot | Skipped:
        """One file read into a new lease and committed as a snapshot extending ``base``."""
        meta = found.meta
        header = entry.header_bytes(meta, entry.pages_needed(meta, self.pool.page_bytes))
        lease = self._lease(header + meta.payload_bytes, f"a {len(meta.tokens)}-token snapshot from disk",
                             evict_snapshots=True, keep=keep)
        if isinstance(lease, Skipped):
            return lease
        lease.write(0, entry.encode_header(meta, lease.pages))
        try:
            digest = self.disk.read_into(found, lease, header)
        except Exception as e:  # the file was wrong (removed, counted) or reading failed (kept): skipped either way
            lease.write(0, entry.cleared_flag())
            self.pool.release(lease)
            cause = f"disk_{e.cause}" if isinstance(e, EntryRejected) else "disk_read_failed"
            return Skipped(f"reading {found.path.name} failed: {describe(e)}", cause)
        stored = Stored(lease, meta, header)
        self._commit(stored, digest)
        snap = Snapshot(meta.tokens, stored, meta.scope, base=base)
        self.snapshots.append(snap)
        while len(others := [s for s in self._heads() if s is not snap]) >= self.slots:
            self._drop_conversation(min(others, key=lambda s: s.last_used), frozenset(snap.chain()))
            self.counters["evictions"] += 1
        return snap


    def _disk_stats(self) -> dict[str, Any]:
        """The disk tier's figures, for ``ConversationCache.stats``."""
        disk = self.disk
        if disk is None:
            return {} if self.disk_refusal is None else {"disk_refused": self.disk_refusal}
        return {**disk.counters, "disk_entries": len(disk.snapshot_metas()), "disk_bytes": disk.used_bytes,
                "disk_bytes_total": disk.budget_bytes, "disk_foreign_entries": len(disk.foreign),
                "spill_skipped": sum(n for k, n in disk.skipped.items() if k.startswith("spill:")),
                # "spill:<cause>", "remove:failed" beside the cache's "<kind>:<cause>"
                "skipped_by_reason": {**self.skipped_by_reason, **disk.skipped}}

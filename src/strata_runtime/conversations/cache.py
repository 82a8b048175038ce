"""Parked conversations and running-state checkpoints, inside the staging pool.

Parking, restoring and checkpointing are optimizations: each returns an
outcome (``Parked``, ``Restored``, ``Saved``, ``Skipped(reason)``) and never
raises into the request. When memory is not there, the work is skipped,
logged in one greppable line and counted; the request is still served.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from typing import Any, Sequence

import torch

from ..faults import describe, is_out_of_memory
from ..state import KVCache
from ..testing import fault_point
from . import parked_entry as entry
from .disk_reads import DiskReads
from .disk_tier import DiskEntry, DiskTier
from .entries import (
    Checkpoint,
    Outcome,
    Parked,
    Restored,
    Saved,
    Skipped,
    Snapshot,
    Stored,
    common_prefix,
    copy_parts,
    plan_parts,
)
from .memory import MiB
from .parked_entry import EntryMeta, owner_digest, scope_digest
from .recovery import take_back
from .staging import StagingPool

log = logging.getLogger(__name__)


class ConversationCache(DiskReads):
    """Snapshots of parked sequences and checkpoints of running state, all in
    ``pool`` pages (room is made by ``PoolRoom``, entries read back from disk by ``DiskReads``).

    Invariant: every snapshot and checkpoint owns one unreleased lease, which
    begins with its committed header (``parked_entry``), so an engine that
    takes over a shared pool finds it (``recover``); a lease being written
    or dropped carries no committed header. At most ``slots`` conversations
    (snapshots no other extends, with their chains) are kept; counters count
    every outcome. Scopes are kept as digests (``scope_digest``).
    """

    def __init__(self, pool: StagingPool, slots: int = 8, checkpoint_every: int = 0, min_park_tokens: int = 16,
                 pool_refusal: str = "the pool is empty", fingerprint: str = "", durable: bool = False):
        if slots < 1:
            raise ValueError(f"a conversation cache needs at least 1 slot, got {slots}")
        super().__init__(pool, pool_refusal)
        self.slots = slots
        self.checkpoint_every = checkpoint_every
        self.min_park_tokens = min_park_tokens
        self.skipped_by_reason: Counter[str] = Counter()  # "kind:cause" -> count
        self.rejected_by_reason: Counter[str] = Counter()  # entries found but not taken back, by cause
        # The model's fingerprint (``Engine.state_fingerprint``): entries of another are never taken back.
        self.fingerprint = fingerprint
        # Whether entries outlive this process (a shared pool, a disk tier):
        # only then is each payload hashed, so a reader can check it.
        self.durable = durable
        self.disk: DiskTier | None = None  # the disk tier, once ``use_disk`` gives one
        self.disk_refusal: str | None = None  # why a disk tier asked for could not be used
        # Copies between a GPU cache and the (pinned) pool run on their own
        # stream, so they overlap other work instead of queueing behind it.
        self._copy_stream = torch.cuda.Stream() if pool.pinned and torch.cuda.is_available() else None

    # --- the one copy function ------------------------------------------------

    def _copy(self, point: str, cache: KVCache, stored: Stored, to_pool: bool,
              upto: int | None = None) -> Skipped | None:
        """Copy ``stored``'s parts between ``cache`` and the pool, one part per
        pipeline stage; a device-side failure in any part becomes ``Skipped``
        (the caller then drops the whole snapshot, on every stage) where it
        is out-of-memory; any other failure is raised (``faults``: it ends
        the engine, so a device in an unknown state serves nothing more)."""
        stages = sorted(set(cache.layer_stages))
        for stage in stages:
            try:
                fault_point(point, stage)
                if self._copy_stream is None:
                    copy_parts(cache, stored, to_pool, upto, stage)
                else:
                    # Wait for the writes that produced the cache, copy, and finish
                    # before anyone reads the pages or the restored cache.
                    self._copy_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self._copy_stream):
                        copy_parts(cache, stored, to_pool, upto, stage)
                    self._copy_stream.synchronize()
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                return Skipped(f"copy failed{_part(stage, stages)}: out of memory ({describe(e)})", "out_of_memory")
        return None

    # --- storing ranges of a cache --------------------------------------------

    def _store(self, cache: KVCache, layers, point: str, what: str, tokens: tuple[int, ...], scope: str,
               keep: frozenset = frozenset(), base: Snapshot | None = None, root: bool = False,
               owner: str = "") -> Stored | Skipped:
        """Copy ``layers`` of ``cache`` into a new lease behind a header that
        names them; commit the header once every byte is in (the flag last)."""
        parts, payload = plan_parts(cache, layers)
        meta = EntryMeta(kind="checkpoint" if point == "checkpoint_copy" else "snapshot", id=uuid.uuid4().hex,
                         tokens=tokens, parts=tuple(parts), payload_bytes=payload, fingerprint=self.fingerprint,
                         scope=scope, base=None if base is None else base.stored.id, root=root, created=time.time(),
                         owner=owner)
        n_pages = entry.pages_needed(meta, self.pool.page_bytes)
        header = entry.header_bytes(meta, n_pages)
        lease = self._lease(header + payload, what, evict_snapshots=point == "park_copy", keep=keep)
        if isinstance(lease, Skipped):
            return lease
        stored = Stored(lease, meta, header)
        try:
            # The header goes first, uncommitted: a copy cut off here is found and counted as such.
            lease.write(0, entry.encode_header(meta, lease.pages))
            failed = self._copy(point, cache, stored, to_pool=True)
            if not failed:
                digest = entry.payload_hash(v.numpy() for v in lease.byte_views(header, payload)) if self.durable else 0
                self._commit(stored, digest)
        except BaseException:
            lease.write(0, entry.cleared_flag())
            self.pool.release(lease)
            raise
        if failed:
            lease.write(0, entry.cleared_flag())
            self.pool.release(lease)
            return failed
        return stored

    def _commit(self, stored: Stored, digest: int) -> None:
        """Write the header's hashes, then the commit flag, last; a snapshot goes to the disk tier too."""
        stored.lease.write(0, entry.encode_header(stored.meta, stored.lease.pages, digest)[:entry.PREFIX_BYTES])
        stored.lease.write(entry.STATE_OFFSET, entry.commit_flag())
        if self.disk is not None and stored.meta.kind == "snapshot":
            stored.spill = self.disk.spill(stored.meta, stored.lease, stored.header, digest)

    # --- park -------------------------------------------------------------------

    def park(self, cache: KVCache, tokens: Sequence[int], scope: str = "") -> Outcome:
        """Copy the live sequence (``tokens``, all in ``cache``, computed for a
        request of ``scope``) into the pool."""
        tokens = tuple(tokens[:cache.length])
        owner, scope = owner_digest(scope), scope_digest(scope)
        # Nothing to do is not a failure: neither logged as one nor counted as skipped.
        if len(tokens) < self.min_park_tokens:
            return Skipped(f"not parked ({len(tokens)} tokens is too short to be worth it)", "not_needed")
        if any(s.tokens == tokens and s.scope == scope for s in self.snapshots):
            return Skipped("not parked (already parked)", "not_needed")
        t0 = time.perf_counter()
        # An older snapshot of this conversation (the longest this sequence
        # extends) stays and becomes the base: only what it lacks is copied,
        # and it is not touched before that copy is in, so a failed copy loses nothing.
        base = max((s for s in self.snapshots if s.scope == scope and s.length < len(tokens)
                    and tokens[:s.length] == s.tokens), key=lambda s: s.length, default=None)
        keep = frozenset(base.chain()) if base is not None else frozenset()
        start = 0 if base is None else base.length
        layers = [(i, max(start, len(tokens) - cache.capacity(i)), len(tokens)) for i in range(len(cache.stores))]
        while len(others := [s for s in self._heads() if s is not base]) >= self.slots:
            self._drop_conversation(min(others, key=lambda s: s.last_used), keep)
            self.counters["evictions"] += 1
        stored = self._store(cache, layers, "park_copy", f"a {len(tokens)}-token snapshot", tokens, scope, keep, base,
                             owner=owner)
        if isinstance(stored, Skipped) and stored.cause == "pool_full" and base is not None and self._on_disk(keep):
            # The conversation's own chain leaves no room for what it lacks (each member takes whole pages), and
            # all of it is on disk: park it whole instead, its chain evictable (losing the copy loses nothing).
            self.counters["chains_consolidated"] += 1
            base, keep = None, frozenset()
            layers = [(i, max(0, len(tokens) - cache.capacity(i)), len(tokens)) for i in range(len(cache.stores))]
            stored = self._store(cache, layers, "park_copy", f"a {len(tokens)}-token snapshot", tokens, scope,
                                 owner=owner)
        if isinstance(stored, Skipped):
            return self._record(Skipped(f"skip parking ({stored.reason})", stored.cause), "park")
        self.snapshots.append(Snapshot(tokens, stored, scope, base=base))
        for member in keep:
            member.last_used = time.monotonic()
        return self._record(Parked(len(tokens), stored.nbytes, time.perf_counter() - t0), "park")

    def _on_disk(self, members) -> bool:
        """Whether every one of ``members`` has its complete file on the disk tier."""
        return self.disk is not None and all(self.disk.has(m.stored.id) for m in members)

    # --- checkpoints --------------------------------------------------------------

    def save_checkpoint(self, cache: KVCache, tokens: Sequence[int], root: bool = False, scope: str = "") -> Outcome:
        """Save the running state of ``cache`` at its current length (``tokens`` are its tokens)."""
        tokens = tuple(tokens[:cache.length])
        scope = scope_digest(scope)
        p = len(tokens)
        running = cache.running_state(p)
        if not running:
            return self._record(Skipped("checkpoint save skipped (no running state)", "no_running_state"), "checkpoint")
        for c in self.checkpoints:
            if c.tokens == tokens and c.scope == scope:
                c.root |= root
                c.last_used = time.monotonic()
                return self._record(Saved(p, c.stored.nbytes), "checkpoint")
        stored = self._store(cache, running, "checkpoint_copy", f"a checkpoint at {p}", tokens, scope, root=root)
        if isinstance(stored, Skipped):
            return self._record(Skipped(f"checkpoint save skipped ({stored.reason})", stored.cause), "checkpoint")
        self.checkpoints.append(Checkpoint(tokens, stored, root, scope))
        return self._record(Saved(p, stored.nbytes), "checkpoint")

    def checkpoint_positions(self, start: int, end: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Positions in ``(start, end]`` where prefill should stop to save a checkpoint."""
        every = range(self.checkpoint_every, end + 1, self.checkpoint_every) if self.checkpoint_every else ()
        return sorted({p for p in (*every, *boundaries) if start < p <= end})

    # --- restore --------------------------------------------------------------------

    def _best_checkpoint(self, prompt: Sequence[int], upto: int, scope: str) -> Checkpoint | None:
        fits = [c for c in self.checkpoints
                if c.scope == scope and 0 < c.position <= upto and tuple(prompt[:c.position]) == c.tokens]
        return max(fits, key=lambda c: c.position, default=None)

    def _plan_restore(self, cache: KVCache, length: int, shared: int, prompt, scope: str):
        """Where a source holding ``length`` positions (``shared`` of them
        matching the prompt) can restart: (position, checkpoint or None)."""
        if cache.resumes(length, shared):
            return shared, None
        cp = self._best_checkpoint(prompt, shared, scope)
        return (cp.position, cp) if cp else (0, None)

    def longest_prefix(self, prompt: Sequence[int], scope: str = "") -> int:
        """The most tokens a parked snapshot or a checkpoint of ``scope``
        shares with the start of ``prompt`` (an upper bound on what a restore gives)."""
        scope = scope_digest(scope)
        return max((common_prefix(item.tokens, prompt) for item in (*self.snapshots, *self.checkpoints,
                                                                     *self.disk_only())
                    if item.scope == scope), default=0)

    def disk_only(self) -> list[DiskEntry]:
        """Snapshots on disk that RAM does not hold."""
        if self.disk is None:
            return []
        in_ram = {s.stored.id for s in self.snapshots}
        return [e for e in self.disk.snapshot_metas() if e.meta.id not in in_ram]

    def restore(self, cache: KVCache, live_tokens: Sequence[int], prompt: Sequence[int], scope: str = "",
                live_scope: str = "") -> Outcome:
        """Make ``cache`` (holding ``live_tokens`` of ``live_scope``) hold the
        longest prefix of ``prompt`` that the live sequence, a parked snapshot
        and the checkpoints of ``scope`` can give, leaving at least one prompt
        token to prefill."""
        scope, live_scope = scope_digest(scope), scope_digest(live_scope)
        limit = len(prompt) - 1
        live_shared = min(common_prefix(live_tokens[:cache.length], prompt), limit) if live_scope == scope else 0
        t0 = time.perf_counter()
        tried: set[str] = set()  # disk entries that could not be read back this time
        from_disk = False
        while True:
            best = (*self._plan_restore(cache, cache.length, live_shared, prompt, scope), None)
            for snap in (*self.snapshots, *(e for e in self.disk_only() if e.meta.id not in tried)):
                if snap.scope != scope:
                    continue
                shared = min(common_prefix(snap.tokens, prompt), limit)
                position, cp = self._plan_restore(cache, len(snap.tokens), shared, prompt, scope)
                if position > best[0]:
                    best = (position, cp, snap)
            position, cp, snap = best
            if not isinstance(snap, DiskEntry):
                break
            # The best is on disk only: read it back into the pool, or (skipped) plan again without it.
            loaded = self._load_from_disk(snap, frozenset([cp] if cp else []))
            if isinstance(loaded, Skipped):
                self._record(Skipped(f"restore from disk skipped ({loaded.reason})", loaded.cause), "disk_read")
                tried.add(snap.meta.id)
                continue
            snap, from_disk = loaded, True
            break
        if snap is not None:
            cache.reset()  # if the copy fails midway, the live state is cold and consistent
            if not cache.reserve(position):
                return self._record(Skipped("restore skipped (no free KV blocks on the device); prefilling from "
                                            "scratch", "no_blocks"), "restore")
            # Oldest first: a later member's positions overwrite a ring's older
            # ones. A member that starts at or past ``position`` adds nothing.
            for member in [m for m in snap.chain() if m.base is None or m.base.length < position]:
                failed = self._copy("restore_copy", cache, member.stored, to_pool=False, upto=position)
                if failed:
                    cache.reset()
                    return self._record(Skipped(f"restore skipped ({failed.reason}); prefilling from scratch",
                                                failed.cause), "restore")
            for member in snap.chain():
                member.last_used = time.monotonic()
        if cp is not None:
            failed = self._copy("restore_copy", cache, cp.stored, to_pool=False)
            if failed:
                cache.reset()
                return self._record(Skipped(f"restore skipped ({failed.reason}); prefilling from scratch", failed.cause),
                                    "restore")
            cp.last_used = time.monotonic()
        cache.length = position
        if snap is None:
            # Cutting the live sequence back is no restore: counted apart.
            return self._record(Restored(position, "live"), "reuse", time.perf_counter() - t0)
        if from_disk:
            self.counters["restored_from_disk"] += 1
        return self._record(Restored(position, "disk" if from_disk else "parked"), "restore",
                            time.perf_counter() - t0)

    # --- taking back a shared pool's entries ----------------------------------------

    def recover(self, fingerprint: str, row_bytes: dict[tuple[int, str], int]) -> dict[str, Any]:
        """Take back what a dead engine left in this (shared) pool
        (``recovery.take_back``); the cache must be empty."""
        return take_back(self, fingerprint, row_bytes)

    def use_disk(self, disk: DiskTier) -> None:
        """Write snapshots through to ``disk`` from now on, and restore from
        it; what the pool holds that the disk lacks is queued for it now."""
        self.disk = disk
        self.durable = True
        for snap in self.snapshots:
            if not disk.has(snap.stored.id):
                prefix = entry.parse_prefix(snap.stored.lease.read(0, entry.PREFIX_BYTES))
                snap.stored.spill = disk.spill(snap.stored.meta, snap.stored.lease, snap.stored.header,
                                               prefix.payload_hash)

    # --- bookkeeping -------------------------------------------------------------------

    def _record(self, outcome: Outcome, kind: str, seconds: float = 0.0) -> Outcome:
        if isinstance(outcome, Skipped):
            self.counters[f"{kind}_skipped"] += 1
            self.skipped_by_reason[f"{kind}:{outcome.cause}"] += 1
            log.warning("conversation cache: %s; %s", outcome.reason, self._summary())
        else:
            done = {"park": "parked", "restore": "restored", "reuse": "live_reused", "checkpoint": "checkpoints_saved"}
            self.counters[done[kind]] += 1
            log.info("conversation cache: %s; %s", _describe(outcome, seconds), self._summary())
        return outcome

    def _summary(self) -> str:
        return (f"parked={len(self.snapshots)} checkpoints={len(self.checkpoints)} "
                f"bytes={self.pool.used_bytes} evictions={self.counters['evictions']}")

    def stats(self) -> dict[str, Any]:
        """Counters (``parked``, ``restored``, ``live_reused``, ``checkpoints_saved``,
        ``<kind>_skipped``, ``evictions``, ``recovered_snapshots``,
        ``recovered_checkpoints``), ``skipped_by_reason`` keyed
        ``"<kind>:<cause>"``, ``rejected_by_reason`` (entries found at start
        and discarded, by ``parked_entry.REJECT_CAUSES``), and the pool's
        current figures."""
        return {
            **self.counters,
            "skipped_by_reason": dict(self.skipped_by_reason),
            "rejected_by_reason": dict(self.rejected_by_reason + (self.disk.rejected if self.disk else Counter())),
            **self._disk_stats(),
            "parked_now": len(self.snapshots),
            "checkpoints_now": len(self.checkpoints),
            "pool_bytes_used": self.pool.used_bytes,
            "pool_bytes_total": self.pool.total_bytes,
        }


def _describe(outcome: Outcome, seconds: float) -> str:
    if isinstance(outcome, Parked):
        return f"parked {outcome.tokens} tokens in {outcome.seconds * 1e3:.1f} ms"
    if isinstance(outcome, Restored) and outcome.source == "live":
        return f"reused {outcome.position} tokens of the live sequence in {seconds * 1e3:.1f} ms"
    if isinstance(outcome, Restored):
        where = "read back from disk" if outcome.source == "disk" else "parked"
        return f"restored {outcome.position} tokens from a snapshot {where} in {seconds * 1e3:.1f} ms"
    return f"checkpoint saved at {outcome.position} ({_mib(outcome.bytes)})"


def _part(stage: int, stages: list[int]) -> str:
    return f" in stage {stage}'s part (of {len(stages)}; skipped on every stage)" if len(stages) > 1 else ""


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"

"""Parked conversations and running-state checkpoints, inside the staging pool.

Parking, restoring and checkpointing are optimizations: each returns an
outcome (``Parked``, ``Restored``, ``Saved``, ``Skipped(reason)``) and never
raises into the request. When memory is not there, the work is skipped,
logged in one greppable line and counted; the request is still served.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from strata_kernels.recurrent import RecurrentStore

from .faults import describe, is_out_of_memory
from .kv_cache import KVCache
from .kv_pool import store_fields
from .memory import MiB
from .staging import Lease, StagingPool
from .testing import fault_point

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parked:
    tokens: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Restored:
    position: int  # the cache now holds positions 0 .. position-1
    source: str  # "live" (cut back in place) or "parked"


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
    "pool_full": "not enough free pages even after evicting what may be evicted",
    "lease_failed": "taking pages from the pool ran out of memory",
    "out_of_memory": "the copy ran out of memory",
    "no_running_state": "the model has no running state to checkpoint",
    "not_needed": "nothing to do (too short, already parked); neither logged nor counted",
}


Outcome = Parked | Restored | Saved | Skipped

# (layer, field name, first position, end position, byte offset in the lease)
_Part = tuple[int, str, int, int, int]


@dataclass
class _Stored:
    """Position ranges of some layers of a cache, copied into one lease.

    Invariant: ``parts`` tile ``lease`` from byte 0 in order; each part holds
    rows ``first..end-1`` (by position) of one field of one layer's store."""

    lease: Lease
    parts: list[_Part]
    nbytes: int


@dataclass(eq=False)
class Snapshot:
    """A parked sequence: ``tokens`` (whose KV it holds) and, per layer, the
    positions its store still held: ``0..length-1`` for full-attention layers,
    the ring's last ``capacity`` positions for sliding ones, the state after
    the last token for recurrent ones. Only a request of
    the same ``scope`` may restore it.

    A snapshot that extends an older one of its conversation (``base``: its
    tokens are a prefix of these) stores only what the base does not hold:
    per layer, positions from ``max(base.length, length - capacity)`` on.
    Invariant: the chain (``chain()``: the base's chain, then this one)
    holds every position above, and each member's bytes stay in the pool
    while a member after it does."""

    tokens: tuple[int, ...]
    stored: _Stored
    scope: str = ""
    last_used: float = field(default_factory=time.monotonic)
    base: "Snapshot | None" = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def chain(self) -> list["Snapshot"]:
        """This snapshot's bases, oldest first, then itself: the copies a restore makes, in order."""
        return ([] if self.base is None else self.base.chain()) + [self]


@dataclass
class Checkpoint:
    """Running state at ``position`` of the sequence ``tokens``
    (``KVCache.running_state``): the last ``window`` positions of every
    sliding-window layer and the state of every recurrent layer. ``root`` checkpoints
    (the end of a system prompt) are never evicted. Only a request of the
    same ``scope`` may restore it."""

    tokens: tuple[int, ...]
    stored: _Stored
    root: bool
    scope: str = ""
    last_used: float = field(default_factory=time.monotonic)

    @property
    def position(self) -> int:
        return len(self.tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ConversationCache:
    """Snapshots of parked sequences and checkpoints of running state, all in
    ``pool`` pages.

    Invariant: every snapshot and checkpoint owns one unreleased lease; at
    most ``slots`` conversations (snapshots no other extends, with their
    chains) are kept; counters count every outcome.
    """

    def __init__(self, pool: StagingPool, slots: int = 8, checkpoint_every: int = 0, min_park_tokens: int = 16,
                 pool_refusal: str = "the pool is empty"):
        if slots < 1:
            raise ValueError(f"a conversation cache needs at least 1 slot, got {slots}")
        self.pool = pool
        self.slots = slots
        self.checkpoint_every = checkpoint_every
        self.min_park_tokens = min_park_tokens
        self.snapshots: list[Snapshot] = []
        self.checkpoints: list[Checkpoint] = []
        self.counters: Counter[str] = Counter()
        self.skipped_by_reason: Counter[str] = Counter()  # "kind:cause" -> count
        self.pool_refusal = pool_refusal
        # Copies between a GPU cache and the (pinned) pool run on their own
        # stream, so they overlap other work instead of queueing behind it.
        self._copy_stream = torch.cuda.Stream() if pool.buffer.is_pinned() and torch.cuda.is_available() else None

    # --- the one copy function ------------------------------------------------

    def _copy(self, point: str, cache: KVCache, stored: "_Stored", to_pool: bool,
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
                    self._copy_parts(cache, stored, to_pool, upto, stage)
                else:
                    # Wait for the writes that produced the cache, copy, and finish
                    # before anyone reads the pages or the restored cache.
                    self._copy_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self._copy_stream):
                        self._copy_parts(cache, stored, to_pool, upto, stage)
                    self._copy_stream.synchronize()
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                return Skipped(f"copy failed{_part(stage, stages)}: out of memory ({describe(e)})", "out_of_memory")
        return None

    def _lease(self, nbytes: int, what: str, evict_snapshots: bool, keep: frozenset = frozenset()) -> Lease | Skipped:
        if self.pool.total_bytes == 0:
            return Skipped(f"no staging pool: {self.pool_refusal}", "no_pool")
        if nbytes > self.pool.total_bytes:
            return Skipped(f"staging pool: {what} needs {_mib(nbytes)}, the whole pool is {_mib(self.pool.total_bytes)}",
                           "too_large")
        evicted = 0
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
            if not self._evict_one(evict_snapshots, keep):
                return Skipped(f"staging pool: need {_mib(nbytes)}, {_mib(self.pool.free_bytes)} free "
                               f"after evicting {evicted}", "pool_full")
            evicted += 1

    def _evict_one(self, evict_snapshots: bool, keep: frozenset = frozenset()) -> bool:
        """Free the least recently used non-root checkpoint or (when a
        snapshot is asking) parked conversation, never one in ``keep``. A
        checkpoint never displaces a parked conversation: that would trade
        a whole conversation for a shortcut."""
        victims = [c for c in self.checkpoints if not c.root]
        if evict_snapshots:
            victims += [s for s in self._heads() if s not in keep]
        if not victims:
            return False
        victim = min(victims, key=lambda x: x.last_used)
        if isinstance(victim, Snapshot):
            self._drop_conversation(victim, keep)
        else:
            self._drop(victim)
        return True

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
        self.pool.release(item.stored.lease)

    # --- storing ranges of a cache --------------------------------------------

    @staticmethod
    def _plan(cache: KVCache, layers: list[tuple[int, int, int]]) -> tuple[list[_Part], int]:
        parts, offset = [], 0
        for layer, first, end in layers:
            for name, t in store_fields(cache.stores[layer]).items():
                parts.append((layer, name, first, end, offset))
                offset += (end - first) * t[0].numel() * t.element_size()
        return parts, offset

    @staticmethod
    def _copy_parts(cache: KVCache, stored: _Stored, to_pool: bool, upto: int | None, stage: int) -> None:
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

    def _store(self, cache: KVCache, layers, point: str, what: str, keep: frozenset = frozenset()) -> _Stored | Skipped:
        parts, nbytes = self._plan(cache, layers)
        lease = self._lease(nbytes, what, evict_snapshots=point == "park_copy", keep=keep)
        if isinstance(lease, Skipped):
            return lease
        stored = _Stored(lease, parts, nbytes)
        try:
            failed = self._copy(point, cache, stored, to_pool=True)
        except BaseException:
            self.pool.release(lease)
            raise
        if failed:
            self.pool.release(lease)
            return failed
        return stored

    # --- park -------------------------------------------------------------------

    def park(self, cache: KVCache, tokens: Sequence[int], scope: str = "") -> Outcome:
        """Copy the live sequence (``tokens``, all in ``cache``, computed for a
        request of ``scope``) into the pool."""
        tokens = tuple(tokens[:cache.length])
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
        stored = self._store(cache, layers, "park_copy", f"a {len(tokens)}-token snapshot", keep)
        if isinstance(stored, Skipped):
            return self._record(Skipped(f"skip parking ({stored.reason})", stored.cause), "park")
        self.snapshots.append(Snapshot(tokens, stored, scope, base=base))
        for member in keep:
            member.last_used = time.monotonic()
        return self._record(Parked(len(tokens), stored.nbytes, time.perf_counter() - t0), "park")

    # --- checkpoints --------------------------------------------------------------

    def save_checkpoint(self, cache: KVCache, tokens: Sequence[int], root: bool = False, scope: str = "") -> Outcome:
        """Save the running state of ``cache`` at its current length (``tokens`` are its tokens)."""
        tokens = tuple(tokens[:cache.length])
        p = len(tokens)
        running = cache.running_state(p)
        if not running:
            return self._record(Skipped("checkpoint save skipped (no running state)", "no_running_state"), "checkpoint")
        for c in self.checkpoints:
            if c.tokens == tokens and c.scope == scope:
                c.root |= root
                c.last_used = time.monotonic()
                return self._record(Saved(p, c.stored.nbytes), "checkpoint")
        stored = self._store(cache, running, "checkpoint_copy", f"a checkpoint at {p}")
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
        return max((common_prefix(item.tokens, prompt) for item in (*self.snapshots, *self.checkpoints)
                    if item.scope == scope), default=0)

    def restore(self, cache: KVCache, live_tokens: Sequence[int], prompt: Sequence[int], scope: str = "",
                live_scope: str = "") -> Outcome:
        """Make ``cache`` (holding ``live_tokens`` of ``live_scope``) hold the
        longest prefix of ``prompt`` that the live sequence, a parked snapshot
        and the checkpoints of ``scope`` can give, leaving at least one prompt
        token to prefill."""
        limit = len(prompt) - 1
        live_shared = min(common_prefix(live_tokens[:cache.length], prompt), limit) if live_scope == scope else 0
        best = (*self._plan_restore(cache, cache.length, live_shared, prompt, scope), None)
        for snap in self.snapshots:
            if snap.scope != scope:
                continue
            shared = min(common_prefix(snap.tokens, prompt), limit)
            position, cp = self._plan_restore(cache, snap.length, shared, prompt, scope)
            if position > best[0]:
                best = (position, cp, snap)
        position, cp, snap = best
        t0 = time.perf_counter()
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
        return self._record(Restored(position, "parked"), "restore", time.perf_counter() - t0)

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
        ``<kind>_skipped``, ``evictions``), ``skipped_by_reason`` keyed
        ``"<kind>:<cause>"``, and the pool's current figures."""
        return {
            **self.counters,
            "skipped_by_reason": dict(self.skipped_by_reason),
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
        return f"restored {outcome.position} tokens from a parked snapshot in {seconds * 1e3:.1f} ms"
    return f"checkpoint saved at {outcome.position} ({_mib(outcome.bytes)})"


def _part(stage: int, stages: list[int]) -> str:
    return f" in stage {stage}'s part (of {len(stages)}; skipped on every stage)" if len(stages) > 1 else ""


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"

"""Taking back the entries a dead engine left in a shared staging pool.

Every page of the pool is looked at once: a page that starts with an entry's
magic is the first page of an entry, whose header lists its other pages. An
entry is taken back only when it is committed, both of its hashes hold, it
is of this model (fingerprint), its parts have the sizes this model's
stores give them, and none of its pages is claimed by another entry taken
back; the rest are discarded (their first page cleared, so nothing finds
them again) and counted by cause (``parked_entry.REJECT_CAUSES``).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from . import parked_entry as entry
from .entries import Checkpoint, Snapshot, Stored
from .memory import MiB
from .parked_entry import EntryMeta, EntryRejected
from .staging import Lease, StagingPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """An entry taken back: its header and its lease (claimed from the pool)."""

    meta: EntryMeta
    lease: Lease
    header: int


def check_parts(meta: EntryMeta, row_bytes: dict[tuple[int, str], int]) -> None:
    """Raise ``EntryRejected`` unless each part's bytes are its positions
    times the row size of its layer's field in this model's stores."""
    at = 0
    for layer, name, first, end, offset in meta.parts:
        row = row_bytes.get((layer, name))
        if row is None or offset != at:
            raise EntryRejected("corrupt", f"part ({layer}, {name}) does not match this model's stores")
        at += (end - first) * row
    if at != meta.payload_bytes:
        raise EntryRejected("corrupt", f"parts of {at} bytes in a payload of {meta.payload_bytes}")


def read_entry(pool: StagingPool, page: int, fingerprint: str,
               row_bytes: dict[tuple[int, str], int]) -> tuple[EntryMeta, tuple[int, ...], int] | None:
    """(meta, pages, header bytes) of the entry whose first page is ``page``;
    None where no entry starts there; ``EntryRejected`` where one does that
    must not be loaded."""
    base = page * pool.page_bytes
    prefix = entry.parse_prefix(pool.buffer[base:base + entry.PREFIX_BYTES].numpy().tobytes())
    if prefix is None:
        return None
    if entry.PREFIX_BYTES + 4 * prefix.n_pages > pool.page_bytes:
        raise EntryRejected("corrupt", "its page list does not fit its first page")
    nbytes = prefix.header_bytes + prefix.payload_bytes
    table = pool.buffer[base + entry.PREFIX_BYTES:base + entry.PREFIX_BYTES + 4 * prefix.n_pages]
    pages = struct.unpack(f"<{prefix.n_pages}I", table.numpy().tobytes())
    if (not pages or pages[0] != page or pool.pages_for(nbytes) != len(pages)
            or not all(0 <= p < pool.n_pages for p in pages) or len(set(pages)) != len(pages)):
        raise EntryRejected("corrupt", "its page list does not describe its bytes")
    view = Lease(pool, pages, nbytes)  # not claimed: only read until the entry is trusted
    _, meta, _ = entry.parse_header(view.read(0, prefix.header_bytes), fingerprint)
    check_parts(meta, row_bytes)
    views = view.byte_views(prefix.header_bytes, prefix.payload_bytes)
    if entry.payload_hash(v.numpy() for v in views) != prefix.payload_hash:
        raise EntryRejected("corrupt", "the payload's hash does not hold")
    return meta, pages, prefix.header_bytes


def recover_entries(pool: StagingPool, fingerprint: str,
                    row_bytes: dict[tuple[int, str], int]) -> tuple[list[Found], Counter]:
    """Every entry of ``pool`` that may be taken back, claimed (a lease each),
    in the order they were written; and the causes of those that may not."""
    found: list[Found] = []
    rejected: Counter[str] = Counter()
    claimed: set[int] = set()
    for page in range(pool.n_pages):
        try:
            read = read_entry(pool, page, fingerprint, row_bytes)
            if read is None:
                continue
            meta, pages, header = read
            if claimed.intersection(pages):
                raise EntryRejected("overlap", "pages claimed by another entry")
        except EntryRejected as e:
            rejected[e.cause] += 1
            _clear(pool, page)
            continue
        claimed.update(pages)
        found.append(Found(meta, pool.claim(pages, header + meta.payload_bytes), header))
    found.sort(key=lambda f: f.meta.created)
    return found, rejected


def _clear(pool: StagingPool, page: int) -> None:
    at = page * pool.page_bytes
    pool.buffer[at:at + entry.STATE_OFFSET + 4].zero_()


def take_back(cc, fingerprint: str, row_bytes: dict[tuple[int, str], int]) -> dict[str, Any]:
    """Take back into ``cc`` (a ``ConversationCache``, empty: an engine's
    start) what a dead engine left in its shared pool: every entry
    ``recover_entries`` finds whose base is taken back too; log one line
    with the counts; return them."""
    if cc.snapshots or cc.checkpoints:
        raise RuntimeError("entries are taken back into an empty conversation cache only")
    cc.fingerprint = fingerprint
    t0 = time.perf_counter()
    found, rejected = recover_entries(cc.pool, fingerprint, row_bytes)
    by_id: dict[str, Snapshot] = {}
    now_wall, now = time.time(), time.monotonic()
    for f in found:  # oldest first: a snapshot's base comes before it
        meta, stored = f.meta, Stored(f.lease, f.meta, f.header)
        last_used = now - max(0.0, now_wall - meta.created)
        if meta.kind == "checkpoint":
            cc.checkpoints.append(Checkpoint(meta.tokens, stored, meta.root, meta.scope, last_used))
            continue
        base = None if meta.base is None else by_id.get(meta.base)
        if meta.base is not None and (base is None or meta.tokens[:base.length] != base.tokens):
            rejected["orphan"] += 1
            f.lease.write(0, entry.cleared_flag())
            cc.pool.release(f.lease)
            continue
        by_id[meta.id] = snap = Snapshot(meta.tokens, stored, meta.scope, last_used, base)
        cc.snapshots.append(snap)
    while len(heads := cc._heads()) > cc.slots:  # fewer slots than the last engine had
        cc._drop_conversation(min(heads, key=lambda s: s.last_used))
    cc.rejected_by_reason.update(rejected)
    cc.counters["recovered_snapshots"] += len(cc.snapshots)
    cc.counters["recovered_checkpoints"] += len(cc.checkpoints)
    summary = {"conversations": len(cc._heads()), "snapshots": len(cc.snapshots),
               "checkpoints": len(cc.checkpoints), "bytes": cc.pool.used_bytes,
               "rejected": dict(rejected), "seconds": time.perf_counter() - t0}
    if found or rejected:
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(rejected.items())) or "none"
        log.info("conversation cache: took back %d parked conversations (%d snapshots) and %d checkpoints "
                 "(%.1f MiB) from the shared staging pool in %.2f s; discarded: %s", summary["conversations"],
                 summary["snapshots"], summary["checkpoints"], cc.pool.used_bytes / MiB, summary["seconds"], causes)
    return summary

"""The rows of ``Scheduler.slots()``: what state the engine holds, where, for whom (the scheduler is
passed in, not imported: it imports this)."""

from __future__ import annotations

from ..conversations import owner_digest


def slot_rows(scheduler) -> list[dict]:
    """Every sequence the engine holds state for: running and waiting
    requests, residents (finished, on the device) and parked
    conversations (``where``: the tier, "ram" for the staging pool,
    "disk" for files of the disk tier that RAM does not hold).
    Scopes are not shown (they name clients); ``owner`` is the digest of
    the scope's owner (``parked_entry.owner_digest``), for a server to
    list each caller its own."""
    out = [{"id": s.id, "state": s.state, "tokens": len(s.tokens), "prompt_tokens": len(s.prompt),
            "generated_tokens": len(s.generated), "blocks": s.cache.held_blocks if s.cache else 0,
            "where": "device", "preemptions": s.preemptions, "owner": owner_digest(s.scope)}
           for s in (*scheduler.running, *scheduler.waiting)]
    out += [{"state": "resident", "tokens": len(r.tokens), "blocks": r.cache.held_blocks, "where": "device",
             "owner": owner_digest(r.scope)} for r in scheduler.residents]
    if scheduler.conversations is not None:
        out += [{"state": "parked", "tokens": snap.length, "bytes": snap.stored.nbytes, "where": "ram",
                 "owner": snap.stored.meta.owner} for snap in scheduler.conversations.snapshots]
        out += [{"state": "parked", "tokens": len(e.tokens), "bytes": e.meta.payload_bytes, "where": "disk",
                 "owner": e.meta.owner} for e in scheduler.conversations.disk_only()]
    return out

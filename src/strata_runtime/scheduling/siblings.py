"""One of a request's ``n`` choices taking its prompt state from the first
(its sibling) rather than reading the prompt again."""

from __future__ import annotations

from ..state import KVCache
from .sequence import FINISHED, PREFILLING, Generation


def state_from_sibling(scheduler, seq: Generation, limit: int) -> tuple[bool, KVCache | None]:
    """``(wait, cache)`` for a sequence that shares its prompt with ``seq.sibling``
    (one of a request's ``n`` choices): wait while the sibling reads the
    prompt, then copy the prompt's state from it. Where it cannot (the sibling
    ended, has recurrent layers, its ring moved past the prompt, or the pool
    has no room) the sequence goes on as any other (a resident left by the
    sibling still gives the prefix)."""
    sibling = seq.sibling
    if sibling.state == PREFILLING:  # it is reading the prompt now (a waiting one may stand behind us)
        return True, None
    seq.sibling = None
    source = sibling.cache
    # copy_prefix copies attention state (a sliding ring while it still holds the prompt), not recurrent state.
    if sibling.state == FINISHED or source is None or source.recurrent_layers or scheduler.private is not None \
            or source.length < limit or sibling.tokens[:limit] != seq.tokens[:limit]:
        return False, None
    return False, scheduler.admit_copy(seq, source, limit)

"""Reserving the conversation cache once, at engine start: its staging pool
(here, or in a segment the server reserved) and, where asked for, its disk
tier. Nothing later asks the host for more."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .cache import ConversationCache
from .directory import DirectoryRefused
from .disk_tier import DiskTier
from .memory import HostMemory, MiB
from .staging import StagingPool
from .staging_segment import StagingSegment, pin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSettings:
    """What the cache is reserved from (``EngineConfig``'s fields of the same names)."""

    conversation_cache_mib: int
    conversation_cache_slots: int
    checkpoint_every: int
    min_free_mib: int
    strict_conversation_cache: bool

    @classmethod
    def of(cls, config) -> "CacheSettings":
        return cls(config.conversation_cache_mib, config.conversation_cache_slots, config.checkpoint_every,
                   config.min_free_mib, config.strict_conversation_cache)


def reserve_conversations(settings: CacheSettings, on_cuda: bool, memory: HostMemory | None,
                          staging: StagingSegment | None) -> tuple[ConversationCache | None, str | None]:
    """The cache (None where ``conversation_cache_mib`` is 0) and the staging
    pool's admission decision. A refused pool still gets a cache: each park
    and checkpoint is then skipped, logged and counted with the refusal's reason."""
    if staging is not None:
        buffer = staging.map()
        pool = StagingPool.over(buffer, staging.page_bytes, pinned=on_cuda and not staging.refused and pin(buffer))
        cache = ConversationCache(pool, settings.conversation_cache_slots, settings.checkpoint_every, durable=True,
                                  pool_refusal=staging.decision.removeprefix("staging pool: "))
        return cache, staging.decision
    if settings.conversation_cache_mib == 0:
        return None, None
    pool, decision = StagingPool.reserve(
        settings.conversation_cache_mib * MiB,
        min_free_bytes=settings.min_free_mib * MiB,
        memory=memory or HostMemory(),
        strict=settings.strict_conversation_cache,
        pin=on_cuda,
    )
    cache = ConversationCache(pool, settings.conversation_cache_slots, settings.checkpoint_every,
                              pool_refusal=decision.message.removeprefix("staging pool: "))
    return cache, decision.message


def open_disk_tier(cache: ConversationCache, directory: str, budget_mib: int, disk_lock: int | None) -> None:
    """The disk tier is an optimization: a directory it cannot use (another
    user's, a symlink, locked by another server) leaves the cache without
    one, saying why (``stats()["disk_refused"]``)."""
    try:
        disk = DiskTier(directory, budget_mib * MiB, cache.fingerprint, lock_fd=disk_lock)
    except DirectoryRefused as e:
        cache.disk_refusal = str(e)
        log.warning("conversation cache: running without a disk tier: %s", e)
        return
    cache.use_disk(disk)

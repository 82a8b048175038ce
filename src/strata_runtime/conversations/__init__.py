"""Parking, restoring and checkpointing sequence state: the conversation cache and its entries, the
staging pool reserved once (in this process or a shared segment a server reserved), recovery of what an
earlier engine parked there, the disk tier and its directory, host memory telemetry."""

from .cache import ConversationCache
from .directory import lock_for_server
from .entries import Parked, Restored, common_prefix
from .memory import HostMemory, MiB
from .parked_entry import owner_digest
from .reserve import CacheSettings, open_disk_tier, reserve_conversations
from .staging import StagingPool
from .staging_segment import StagingSegment

__all__ = [
    "CacheSettings",
    "ConversationCache",
    "HostMemory",
    "MiB",
    "Parked",
    "Restored",
    "StagingPool",
    "StagingSegment",
    "common_prefix",
    "lock_for_server",
    "open_disk_tier",
    "owner_digest",
    "reserve_conversations",
]

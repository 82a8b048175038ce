"""The state a model keeps per layer, declared as data (``spec``), reserved once: the pool of KV blocks and
recurrent slots (``kv_pool``) and one sequence's view of it (``kv_cache``); the layout's fingerprint."""

from .kv_cache import KVCache, RecurrentRuns
from .kv_pool import KVPool, f16_storage_bytes, f16_storage_dtype, store_fields
from .layout import row_bytes, state_fingerprint
from .spec import (
    DRAFT_MARGIN,
    PREFILL_CHUNK,
    AttentionState,
    LayerState,
    RecurrentState,
    kv_bytes,
    kv_bytes_per_token,
    recurrent_bytes,
)

__all__ = [
    "AttentionState",
    "DRAFT_MARGIN",
    "KVCache",
    "KVPool",
    "LayerState",
    "PREFILL_CHUNK",
    "RecurrentRuns",
    "RecurrentState",
    "f16_storage_bytes",
    "f16_storage_dtype",
    "kv_bytes",
    "kv_bytes_per_token",
    "recurrent_bytes",
    "row_bytes",
    "state_fingerprint",
    "store_fields",
]

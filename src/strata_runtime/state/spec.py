"""The sequence state a model declares, per layer, as data.

A model's ``state_spec()`` (from its ``ModelArgs``, so planning needs no
weights) lists one entry per layer. Everything that sizes, stores or moves
state reads this list and nothing about the architecture: the KV cache
(``kv_cache.KVCache``), the split planner, ``strata info``, the conversation
cache. Attention layers keep entries per token (``AttentionState``),
recurrent layers a fixed-size state per sequence (``RecurrentState``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from strata_kernels.kv_quant import bytes_per_token as layer_bytes_per_token
from strata_kernels.recurrent import RecurrentStore

# Prefill runs in chunks of at most this many tokens, so a sliding-window
# layer's ring needs only its window plus one chunk of slots.
PREFILL_CHUNK = 512
# A verify (speculative decoding) writes up to this many positions past the
# length its sequence is then cut back to; in a sliding ring they overwrite
# the oldest slots, so a ring vouches for this many fewer positions than it
# holds (``KVCache.capacity``). Drafts are at most ``DRAFT_MARGIN - 1`` tokens.
DRAFT_MARGIN = 16
# Positions per KV block: the unit sequences hold and share in a pool (a
# multiple of every kernel's position tile).
BLOCK_SIZE = 32


@dataclass(frozen=True)
class AttentionState:
    """An attention layer keeps, per token of context, ``kv_heads`` keys and
    values of ``head_dim`` each; over the last ``window`` tokens only (a
    sliding-window layer: a ring of slots), or over all of them (None)."""

    kv_heads: int
    head_dim: int
    window: int | None = None

    def capacity(self, context: int) -> int:
        """Slots for a sequence of up to ``context`` tokens: all of them, or
        the window plus one prefill chunk (all a chunk of queries can reach)."""
        return context if self.window is None else min(context, self.window + PREFILL_CHUNK)

    def bytes_per_slot(self, kv: str, float_bytes: int) -> int:
        """One slot in KV format ``kv``, scales included; ``float_bytes``:
        how f16 values are stored (2, or 4 on the CPU's exact path)."""
        return layer_bytes_per_token(kv, self.kv_heads, self.head_dim, float_bytes)


    @property
    def group(self) -> int | None:
        """Layers of one group share block ids in a pool: one per window."""
        return self.window


# The block group of every recurrent layer: one "block" per sequence, its state.
RECURRENT = "recurrent"


@dataclass(frozen=True)
class RecurrentState:
    """A recurrent layer (Gated DeltaNet) keeps, per sequence, the last
    ``conv_window`` inputs of its causal convolution (``channels`` wide) and
    a ``[d_k, d_v]`` matrix per value head: the state after the sequence's
    last token, whatever its length. It cannot be cut back: a shorter
    prefix of the sequence needs a copy taken at that position (a checkpoint)."""

    conv_window: int
    channels: int
    v_heads: int
    d_k: int
    d_v: int
    window = None  # attends to nothing
    group = RECURRENT

    def capacity(self, context: int) -> int:
        """One slot: the state after the last position."""
        return 1

    def bytes_per_slot(self, kv: str = "", float_bytes: int = 4) -> int:
        """One sequence's state (float32 whatever the KV format)."""
        return RecurrentStore.slot_bytes(self.conv_window, self.channels, self.v_heads, self.d_k, self.d_v)


LayerState = AttentionState | RecurrentState


def kv_bytes(spec: Sequence[LayerState], context: int, kv: str, float_bytes: int) -> int:
    """What the layers of ``spec`` store for a sequence of ``context`` tokens."""
    return sum(layer.capacity(context) * layer.bytes_per_slot(kv, float_bytes) for layer in spec)


def kv_bytes_per_token(spec: Sequence[LayerState], kv: str, float_bytes: int) -> int:
    """What one more token of context costs where no ring has filled: every attention layer."""
    return sum(layer.bytes_per_slot(kv, float_bytes) for layer in spec if isinstance(layer, AttentionState))


def recurrent_bytes(spec: Sequence[LayerState]) -> int:
    """What the recurrent layers of ``spec`` keep per sequence, whatever its length."""
    return sum(layer.bytes_per_slot() for layer in spec if isinstance(layer, RecurrentState))

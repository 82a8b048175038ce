"""A draft model for speculative decoding: a smaller GGUF sharing the
target's vocabulary drafts each sequence's next tokens greedily, a few
forwards of its own ahead of the target's verify.

Its state is reserved at load beside the target's: a KV pool for as many
sequences as the target decodes together, each sequence holding a cache of
the draft model's in it. Before drafting, a sequence's draft cache is cut
back to what it shares with the sequence's tokens (a rejected draft, a
conversation that parted) and reads the tokens it lacks (the target's
accepted and corrected tokens), so no copy of state is made per verify.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..conversations import common_prefix
from ..errors import ModelFileError
from ..files import Placement
from ..models import build_model, check_vocabulary, decode_step, open_model, prefill
from ..state import KVCache, KVPool, RecurrentState
from ..text import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _DraftState:
    """One sequence's draft cache. Invariant: ``cache`` holds the draft
    model's state of ``held[:cache.length]``; ``rate`` is the running
    acceptance of its drafts (exponentially weighted)."""

    cache: KVCache
    held: tuple[int, ...] = ()
    rate: float = 1.0


class DraftModelDrafter:
    """Greedy drafts of up to ``max_draft`` tokens from ``model`` (the draft
    model, built on its own placement), its sequences' caches in ``pool``.

    Drafting costs a forward of the draft model per draft token, so the
    scheduler asks for no more than a sequence can verify this step
    (``limit``: ``costly``); the draft length also follows the running
    acceptance, as the suffix drafter's does."""

    costly = True

    def __init__(self, model, pool: KVPool, context_length: int, max_draft: int, path: Path):
        self.model = model
        self.pool = pool
        self.context_length = context_length
        self.max_draft = max_draft
        self.path = path
        self._states: dict[int, _DraftState] = {}

    @classmethod
    def load(cls, path: str | Path, target: Tokenizer, device: str, dtype: str, kv: str, sequences: int,
             context_length: int, max_draft: int, progress: bool) -> "DraftModelDrafter":
        """The draft model at ``path`` on ``device``, checked against the
        target's tokenizer ``target``, with KV for ``sequences`` sequences of
        ``context_length`` tokens reserved now."""
        opened = open_model(path)
        gguf = opened.gguf
        tokenizer = Tokenizer.from_gguf(gguf)
        check_vocabulary(gguf, tokenizer.vocab.size)
        if tokenizer.vocab.tokens != target.vocab.tokens:
            raise ModelFileError(
                f"{gguf.path}: the draft model's vocabulary ({tokenizer.vocab.size} tokens) is not the target's "
                f"({target.vocab.size}); a draft model must share the target's tokenizer (the same family, "
                f"often a smaller model or a lower-bit file of the same one)")
        if any(isinstance(layer, RecurrentState) for layer in opened.state_spec):
            raise ModelFileError(f"{gguf.path}: a draft model with recurrent layers cannot be cut back to an "
                                 f"accepted position; use an attention-only draft model")
        placement = Placement.one_device(device, len(opened.state_spec))
        model = build_model(opened, placement, dtype, progress, f"loading draft {gguf.path.name}")
        context = min(context_length, gguf.config.context_length)
        pool = KVPool.for_sequences(kv, model.state_spec(), model.placement, sequences, context,
                                    model.compute_path.kv_float)
        log.info("draft model %s: %d sequences of %d tokens reserved (%.1f MiB)", gguf.path.name, sequences,
                 context, pool.nbytes / 2**20)
        return cls(model, pool, context, max_draft, Path(gguf.path))

    def propose(self, sequence, limit: int | None = None) -> list[int]:
        tokens = sequence.tokens
        state = self._states.get(sequence.id)
        if state is None:
            state = self._states[sequence.id] = _DraftState(KVCache.on_pool(self.pool, self.context_length))
        k = min(self.max_draft, max(1, round(self.max_draft * state.rate)))
        if limit is not None:
            k = min(k, limit)
        if k < 1 or len(tokens) + k > self.context_length:
            return []
        cache = state.cache
        # What the cache holds that the sequence still has (at least one token to read: its logits draft).
        keep = min(common_prefix(state.held[:cache.length], tokens), len(tokens) - 1)
        if cache.trim(keep) != keep:
            cache.release()
        if not cache.reserve(len(tokens) - cache.length + k):
            cache.release()  # the draft pool is full: this sequence drafts nothing this step
            state.held = ()
            return []
        with torch.inference_mode():
            logits = prefill(self.model, cache, tokens[cache.length:])
            draft = [int(torch.argmax(logits))]
            while len(draft) < k:
                draft.append(int(torch.argmax(decode_step(self.model, cache, draft[-1]))))
        state.held = (*tokens, *draft[:-1])
        return draft

    def feedback(self, sequence, proposed: int, accepted: int) -> None:
        state = self._states.get(sequence.id)
        if proposed > 0 and state is not None:
            state.rate = 0.7 * state.rate + 0.3 * accepted / proposed

    def release(self, sequence) -> None:
        state = self._states.pop(sequence.id, None)
        if state is not None:
            state.cache.release()

    def describe(self) -> dict:
        return {"draft_model": str(self.path), "draft_kv_bytes": self.pool.nbytes}


"""Reserving the scheduler once, at engine start: the KV pool for the
sequences decoded together and, where speculation is on, its drafter (a
draft model's KV included). Nothing in the step path allocates device state."""

from __future__ import annotations

from typing import Any

from ..conversations import ConversationCache, HostMemory, MiB
from ..speculation import DraftModelDrafter, drafter_for, spare_states
from ..state import KVPool
from ..text import Tokenizer
from .scheduler import Scheduler


def reserve_scheduler(model, config, context_length: int, tokenizer: Tokenizer,
                      conversations: ConversationCache | None,
                      memory: HostMemory | None) -> tuple[Scheduler, str | None]:
    """The scheduler over ``model`` (``config``: an ``EngineConfig``) and why
    speculation is off where it was asked for (else None).

    The pool holds ``kv_memory_mib``, or ``parallel`` sequences of the
    context length. A split across processes runs one sequence at a time:
    each rank keeps its part of one cache (``split.ranks``), so its pool holds one sequence."""
    parallel = config.sequences(str(model.device))
    spec = model.state_spec()
    per_sequence = KVPool.for_sequences(config.kv, spec, model.placement, 1, context_length,
                                        model.compute_path.kv_float, allocate=False).nbytes
    if config.parallel is None and model.device.type == "cpu" and not config.distributed:
        # Sized from memory: at most a quarter of the host's headroom for KV, and never fewer than 2.
        headroom = (memory or HostMemory()).headroom()
        while parallel > 2 and headroom.known and parallel * per_sequence > headroom.bytes // 4:
            parallel -= 1
    sequences = parallel if config.kv_memory_mib is None else config.kv_memory_mib * MiB / per_sequence
    eog = tokenizer.end_of_generation
    if config.distributed:
        cache = model.new_cache(context_length, config.kv)  # the ranks' twin of this cache is the one they step
        drafting, refusal = _speculation(model, config, context_length, tokenizer, 1, private=True)
        return Scheduler(model, cache.pool, context_length, eog, max_running=1, conversations=conversations,
                         max_residents=1, private=cache, **drafting), refusal
    pool = KVPool.for_sequences(config.kv, spec, model.placement, sequences, context_length,
                                model.compute_path.kv_float, spare_states=spare_states(config.spec, spec, parallel))
    drafting, refusal = _speculation(model, config, context_length, tokenizer, parallel)
    return Scheduler(model, pool, context_length, eog, max_running=parallel, conversations=conversations,
                     max_residents=parallel, **drafting), refusal


def _speculation(model, config, context_length: int, tokenizer: Tokenizer, sequences: int,
                 private: bool = False) -> tuple[dict[str, Any], str | None]:
    """The scheduler's drafter where this model can speculate (else why not);
    a draft model's KV for ``sequences`` is reserved here."""
    def load_draft_model():
        return DraftModelDrafter.load(config.draft_model, tokenizer, str(model.device), config.dtype, config.kv,
                                      sequences, context_length, config.spec_tokens, config.progress)

    drafter, refusal = drafter_for(config.spec, config.spec_tokens, model.state_spec(),
                                   load_draft_model if config.draft_model else None, private)
    return ({} if drafter is None else {"drafter": drafter, "spec_tokens": config.spec_tokens}), refusal

"""The token loop: prefill, one decode step, and a generator of tokens."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from .kv_cache import KVCache


def prefill(model, cache: KVCache, tokens: Sequence[int]) -> torch.Tensor:
    """Run ``tokens`` after what ``cache`` holds; return the last position's logits ``[vocab]``."""
    start = cache.length
    ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
    positions = torch.arange(start, start + len(tokens), device=model.device)
    return model(ids, positions, cache, last_only=True)[0]


def decode_step(model, cache: KVCache, token: int) -> torch.Tensor:
    return prefill(model, cache, [token])


def generate_tokens(
    model,
    cache: KVCache,
    prompt: Sequence[int],
    sample: Callable[[torch.Tensor, Sequence[int]], int],
    max_tokens: int,
    end_of_generation: frozenset[int],
    on_prefilled: Callable[[], None] | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` tokens after ``prompt``, which ``cache`` must
    not yet hold (its first ``cache.length`` tokens may already be cached).
    An end-of-generation token is yielded and ends the loop."""
    history = list(prompt)
    if max_tokens == 0:
        return
    logits = prefill(model, cache, prompt[cache.length:])
    if on_prefilled is not None:
        on_prefilled()
    for i in range(max_tokens):
        token = sample(logits, history)
        history.append(token)
        yield token
        if token in end_of_generation or i == max_tokens - 1:
            return
        logits = decode_step(model, cache, token)

"""One sequence on its own cache: prefill in chunks and one decode step (the
scheduler runs sequences in batches; these serve logits, tests and benchmarks)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import Cancelled
from ..state import PREFILL_CHUNK, KVCache


def forward_chunks(model, cache: KVCache, tokens: Sequence[int], last_only: bool,
                   abort: Callable[[], bool] | None = None) -> torch.Tensor:
    """Run ``tokens`` after what ``cache`` holds, ``PREFILL_CHUNK`` at a time
    (the sliding-window rings are sized for that); logits of every position
    ``[T, vocab]``, or of the last one ``[1, vocab]``. ``abort`` is asked
    before each chunk (``Cancelled``: the cache then holds whole chunks only)."""
    outputs = []
    for c0 in range(0, len(tokens), PREFILL_CHUNK):
        if abort is not None and abort():
            raise Cancelled(f"prefill was cancelled after {c0} of {len(tokens)} tokens")
        chunk = tokens[c0:c0 + PREFILL_CHUNK]
        start = cache.length
        ids = torch.tensor(chunk, dtype=torch.long, device=model.device)
        positions = torch.arange(start, start + len(chunk), device=model.device)
        logits = model(ids, positions, cache, last_only=last_only)
        if not last_only or c0 + PREFILL_CHUNK >= len(tokens):
            outputs.append(logits)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # a decode step: no 1 MB copy


def prefill(model, cache: KVCache, tokens: Sequence[int], abort: Callable[[], bool] | None = None) -> torch.Tensor:
    """Run ``tokens`` after what ``cache`` holds; return the last position's logits ``[vocab]``."""
    return forward_chunks(model, cache, tokens, last_only=True, abort=abort)[-1]


def decode_step(model, cache: KVCache, token: int) -> torch.Tensor:
    return prefill(model, cache, [token])


def decode_logits_of(engine, token_lists) -> list[torch.Tensor]:
    """Each list of ``token_lists`` fed to ``engine`` one token a step from an
    empty cache (the decode path's kernels, not a prompt's): ``[len, vocab]`` logits per list."""
    out = []
    for tokens in token_lists:
        cache = engine.new_cache(len(tokens))
        with torch.inference_mode():
            out.append(torch.stack([decode_step(engine.model, cache, t).reshape(-1) for t in tokens]))
    return out


"""One sequence in flight (``Generation``: a request's tokens, its state's
progress and its outcome) and one finished sequence whose state stays on
the device for a returning prompt (``Resident``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..state import KVCache
from .sampling import Sampler, SamplingParams

WAITING, PREFILLING, DECODING, FINISHED = "waiting", "prefilling", "decoding", "finished"

@dataclass(eq=False)
class Generation:
    """One generation in flight.

    Invariant: ``tokens`` is the prompt then the generated tokens; the cache
    (while the sequence holds one) holds ``tokens[:cache.length]``. While
    prefilling ``cache.length < len(prompt)``; while decoding, every token
    but the last generated one is in the cache (the last is the next step's
    input). ``events`` are the tokens generated since the consumer last took
    them (``take()``); an end-of-generation token ends the sequence and is
    not among them.
    """

    id: int
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    max_tokens: int
    scope: str = ""
    boundaries: tuple[int, ...] = ()  # the prompt's chat turn boundaries (checkpoint candidates)
    root: int | None = None  # the boundary that is the conversation's pinned root
    checkpoints: tuple[int, ...] = ()  # prompt positions to save running state at, chosen at admission
    state: str = WAITING
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)  # being verified this step (``speculation``)
    sibling: "Generation | None" = None  # a sequence of the same prompt whose prompt state this one copies
    # Per generated token, where the sampling asks: (logprob, [(alternative, logprob), ...]); same length as generated.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    cache: KVCache | None = None
    cached_tokens: int = 0  # prompt tokens whose state was reused at admission
    admitted: int = -1  # admission order (preemption takes the most recent first)
    preemptions: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return self.state == FINISHED

    def take(self) -> list[int]:
        out, self.events = self.events, []
        return out

    def progress(self) -> str:
        """How far it got, for a log line or an error: "prefill ... after N of M tokens" or "generation ... after N tokens"."""
        if self.generated:
            return f"generation was cancelled after {len(self.generated)} tokens"
        read = self.cache.length if self.cache is not None else 0
        return f"prefill was cancelled after {read} of {len(self.prompt)} tokens"

    def stop(self, unused: int = 0) -> None:
        """End the sequence at a stop string; the last ``unused`` generated
        tokens came after it (a verify yields several tokens a step) and are
        dropped, with their positions in the cache, as if never generated."""
        if unused > 0:
            self.sampler.rollback(unused)
            del self.generated[-unused:]
            del self.logprobs[len(self.generated):]
            del self.tokens[-unused:]
            self.events = []
            if self.cache is not None and self.cache.length > len(self.tokens):
                self.cache.trim(len(self.tokens))
            # Decoding one token a step, the stop string would have ended it
            # first, whatever ended the step that yielded the dropped tokens.
            self.finish_reason, self.state = "stop", FINISHED
        self.cancel("stop")

    def cancel(self, reason: str = "cancelled") -> None:
        """End the sequence (its blocks go back at the next step); a consumer's stop string says "stop"."""
        if self.state != FINISHED:
            self.finish_reason = reason
            self.state = FINISHED


@dataclass
class Resident:
    """A finished sequence whose state stays on the device until its blocks are needed."""

    cache: KVCache
    tokens: tuple[int, ...]  # what the cache holds
    scope: str
    last_used: float = field(default_factory=time.monotonic)

"""Choosing the next token from logits."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy.

    The filters run in llama.cpp's default order: penalties, top-k, top-p,
    min-p, then temperature, then a draw from a generator seeded by ``seed``
    (a given seed reproduces the same tokens).
    """

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be at least 0, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be at least 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be at least 0 (0 turns it off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be above 0 (1 turns it off), got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.penalty_last_n >= 0, f"penalty_last_n must be at least 0, got {self.penalty_last_n}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws tokens for one request. Invariant: its generator is seeded once, at
    construction, so the same seed and logits give the same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """``logits`` ``[vocab]`` float32 for the next position; ``history`` the
        tokens so far (prompt included), for the penalties."""
        p = self.params
        # Sampling runs on the CPU: one copy of the logits per token beats a
        # device sync per filter.
        logits = apply_penalties(logits.float().cpu(), history, p)
        if p.greedy:
            return int(torch.argmax(logits))
        candidates = torch.arange(logits.shape[0])
        if 0 < p.top_k < logits.shape[0]:
            logits, candidates = torch.topk(logits, p.top_k)
        else:
            logits, order = torch.sort(logits, descending=True)
            candidates = candidates[order]
        # From here on, candidates are sorted by logit, highest first.
        if p.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs
            keep = int((before < p.top_p).sum())
            logits, candidates = logits[:keep], candidates[:keep]
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            keep = int((probs >= p.min_p * probs[0]).sum())
            logits, candidates = logits[:keep], candidates[:keep]
        probs = torch.softmax(logits / p.temperature, dim=-1)
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(candidates[choice])


def apply_penalties(logits: torch.Tensor, history: Sequence[int], p: SamplingParams) -> torch.Tensor:
    """Repetition (llama.cpp/CTRL style: divide positive logits, multiply
    negative ones), presence and frequency penalties over the last
    ``penalty_last_n`` tokens."""
    if p.penalty_last_n == 0 or not history:
        return logits
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return logits
    recent = torch.tensor(list(history)[-p.penalty_last_n:], dtype=torch.long)
    tokens, counts = torch.unique(recent, return_counts=True)
    logits = logits.clone()
    values = logits[tokens]
    if p.repetition_penalty != 1.0:
        values = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    values = values - counts.to(values.dtype) * p.frequency_penalty - p.presence_penalty
    logits[tokens] = values
    return logits

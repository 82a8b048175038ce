"""Choosing the next token from logits."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import RequestError
from ..text import Grammar
from .constraint import Constraint


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy
    (and so is any temperature below ``GREEDY_BELOW``).

    The filters run in llama.cpp's default order after the grammar's mask
    (where ``grammar`` is set) and ``logit_bias``: penalties, top-k, top-p, min-p, then
    temperature, then a draw from a generator seeded by ``seed`` (a given
    seed reproduces the same tokens).
    """

    MAX_STOP_STRINGS = 16  # OpenAI allows 4; agents send a few more. Each costs work on every token.
    MAX_STOP_CHARS = 256
    SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
    # Below this a draw is its argmax but for logits within ~1e-4 of the best:
    # greedy, rather than dividing logits by a number that overflows them.
    GREEDY_BELOW = 1e-5

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
    # What the generated text must match (a JSON schema, a Lark grammar, a regex), or None.
    grammar: Grammar | None = None
    # Added to the logits of these token ids before everything else but the grammar (OpenAI's logit_bias:
    # -100 bans a token, 100 all but forces it); a tuple of (token, bias) pairs, sorted.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    # Report each chosen token's log-probability under the model (its raw logits: before the grammar, biases,
    # penalties and temperature) and this many of the likeliest alternatives (0-20); None: none.
    logprobs: int | None = None

    MAX_LOGIT_BIAS = 300  # entries; OpenAI allows 300
    MAX_TOP_LOGPROBS = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "grammar", Grammar.of(self.grammar))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
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
            (len(self.stop) <= self.MAX_STOP_STRINGS,
             f"stop has {len(self.stop)} strings; at most {self.MAX_STOP_STRINGS} are allowed"),
            (all(len(s) <= self.MAX_STOP_CHARS for s in self.stop),
             f"each stop string may have at most {self.MAX_STOP_CHARS} characters"),
            (self.seed is None or self.SEED_RANGE[0] <= self.seed <= self.SEED_RANGE[1],
             f"seed must be a whole number in [-2**63, 2**64 - 1], got {self.seed}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= self.MAX_TOP_LOGPROBS),
             f"logprobs (the alternatives reported a token) must be a whole number in 0..{self.MAX_TOP_LOGPROBS}, "
             f"got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW


class Sampler:
    """Draws tokens for one request. Invariant: its generator is seeded once, at
    construction, so the same seed and logits give the same tokens; its
    ``constraint`` (a grammar, or None) has seen every token it returned."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None):
        self.params = params
        self.constraint = constraint
        # The last token's (logprob, [(alternative, logprob), ...]) where ``params.logprobs`` asks for them.
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """``logits`` ``[vocab]`` float32 for the next position; ``history`` the
        tokens so far (prompt included), for the penalties."""
        token = self._choose(logits, history)
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.params.logprobs is not None:
            self.last_logprobs = token_logprobs(logits, token, self.params.logprobs)
        return token

    def rollback(self, tokens: int) -> None:
        """The last ``tokens`` returned were dropped (a stop string came before them)."""
        if self.constraint is not None:
            self.constraint.rollback(tokens)

    def _choose(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        p, constraint = self.params, self.constraint
        # Sampling runs on the CPU: one copy of the logits per token beats a
        # device sync per filter.
        logits = logits.float().cpu()
        if constraint is not None:
            if p.greedy and not _penalized(p, history):
                best = int(torch.argmax(logits))
                if constraint.allows(best):  # the usual case inside a constrained answer: no mask applied
                    return best
        # The grammar's mask, the penalties and the bias commute (a forbidden logit stays -inf through
        # each), so a sampled step with top-k masks only its candidates when enough of them are allowed.
        logits = apply_penalties(apply_logit_bias(logits, p), history, p)
        head = None if constraint is None or p.greedy else allowed_top_k(logits, constraint, p.top_k)
        if constraint is not None and head is None:
            logits = constraint.restrict(logits)  # every filter below sees only what the grammar allows
        if p.greedy:
            return int(torch.argmax(logits))
        log_total = None  # log of the softmax denominator when candidates are not the whole support
        if head is not None:
            logits, candidates = head
        elif 0 < p.top_k < logits.shape[0]:
            logits, candidates = torch.topk(logits, p.top_k)
        elif p.top_p < 1.0 or p.min_p > 0.0:
            log_total = torch.logsumexp(logits, dim=-1)
            logits, candidates = reachable_head(logits, log_total, p)
        else:
            candidates = torch.arange(logits.shape[0])  # every token, unsorted: nothing below needs the order
        # From here on, wherever top-p or min-p cut them, candidates are sorted by logit, highest first.
        if p.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1) if log_total is None else torch.exp(logits - log_total)
            before = torch.cumsum(probs, dim=-1) - probs
            keep = int((before < p.top_p).sum())
            logits, candidates = logits[:keep], candidates[:keep]
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            keep = int((probs >= p.min_p * probs[0]).sum())
            logits, candidates = logits[:keep], candidates[:keep]
        # Scaled from the best logit down: nothing overflows whatever the temperature.
        probs = torch.softmax((logits - logits.max()) / p.temperature, dim=-1)
        return int(candidates[draw(probs, self.generator)])


def allowed_top_k(logits: torch.Tensor, constraint: Constraint, k: int,
                  widen: int = 4) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``k`` highest logits the grammar allows and their ids (highest first), read from the
    ``widen * k`` highest logits unmasked; None where top-k is off or fewer than ``k`` of those are
    allowed (then the caller masks the whole vocabulary: at 262K tokens that costs ~1 ms a token)."""
    n = min(logits.shape[0], constraint.vocab_size)
    if not 0 < k < n:
        return None
    head, ids = torch.topk(logits[:n], min(n, widen * k))
    allowed = constraint.allowed_among(ids)
    if int(allowed.sum()) < k:
        return None
    keep = allowed.nonzero().squeeze(1)[:k]
    return head[keep], ids[keep]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under ``logits`` and the ``top`` likeliest tokens' (best first)."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logprobs[token]), alternatives


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn with probability ``probs[i]`` (summing to 1 up to
    rounding) by inverse CDF from one uniform number: O(n), where
    ``torch.multinomial`` over the whole vocabulary takes 5 ms."""
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator) * cdf[-1]
    # right=True: the first index whose cdf exceeds u, so a zero-probability token is never drawn.
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def reachable_head(logits: torch.Tensor, log_total: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest logits, sorted, and their token ids: every token top-p and
    min-p can keep when top-k is off, without sorting the whole vocabulary
    (262K logits take 21 ms to sort, against under 1 ms for the rest of a
    draw). min-p keeps only logits within ``log(min_p)`` of the best; top-p
    nothing past the first ``k`` once their probabilities (``exp(logit -
    log_total)``, over the whole vocabulary) reach ``top_p``."""
    n = logits.shape[0]
    limit = n
    if p.min_p > 0.0:
        limit = int((logits >= logits.max() + math.log(p.min_p)).sum())
    k = min(256, limit)
    while True:
        head, ids = torch.topk(logits, k)
        if k == limit or (p.top_p < 1.0 and float(torch.exp(head - log_total).sum()) >= p.top_p):
            return head, ids
        k = min(4 * k, limit)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token, bias) pairs, from a dict (keys may be
    digit strings, as JSON writes them) or pairs; ``RequestError`` naming the entry otherwise."""
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else value
    out = {}
    try:
        for token, bias in items:
            if isinstance(token, str) and token.isdigit():
                token = int(token)
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids (whole numbers >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token}")
            out[token] = float(bias)
    except (TypeError, ValueError) as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError("logit_bias must map token ids to numbers in [-100, 100]") from None
    if len(out) > SamplingParams.MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(out)} entries; at most {SamplingParams.MAX_LOGIT_BIAS} are allowed")
    return tuple(sorted(out.items()))


def apply_logit_bias(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``logits`` with ``p.logit_bias`` added (ids past the vocabulary are ignored; -inf stays -inf)."""
    if not p.logit_bias:
        return logits
    ids = torch.tensor([t for t, _ in p.logit_bias if t < logits.shape[0]], dtype=torch.long)
    if not len(ids):
        return logits
    bias = torch.tensor([b for t, b in p.logit_bias if t < logits.shape[0]], dtype=logits.dtype)
    logits = logits.clone()
    logits[ids] += bias
    return logits


def _penalized(p: SamplingParams, history: Sequence[int]) -> bool:
    """Whether ``apply_penalties`` (or ``logit_bias``) changes anything."""
    if p.logit_bias:
        return True
    if p.penalty_last_n == 0 or not history:
        return False
    return not (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


def apply_penalties(logits: torch.Tensor, history: Sequence[int], p: SamplingParams) -> torch.Tensor:
    """Repetition (llama.cpp/CTRL style: divide positive logits, multiply
    negative ones), presence and frequency penalties over the last
    ``penalty_last_n`` tokens. A logit at -inf (a token a grammar forbids) stays there."""
    if p.penalty_last_n == 0 or not history or (
            p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return logits
    recent = torch.tensor(list(history)[-p.penalty_last_n:], dtype=torch.long)
    tokens, counts = torch.unique(recent, return_counts=True)
    logits = logits.clone()
    values = logits[tokens]
    if p.repetition_penalty != 1.0:
        values = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    values = values - counts.to(values.dtype) * p.frequency_penalty - p.presence_penalty
    # A penalty far from 1 can push a logit past float32's range; inf would make the softmax NaN.
    finite = torch.finfo(values.dtype).max
    logits[tokens] = torch.where(torch.isneginf(logits[tokens]), logits[tokens], values.clamp(-finite, finite))
    return logits

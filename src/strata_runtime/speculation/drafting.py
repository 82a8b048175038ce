"""Drafters for speculative decoding: guesses at a sequence's next tokens,
which the target model then checks several at a time in one forward.

A drafter has one small interface, ``propose(sequence) -> draft tokens``
(``sequence`` has an ``id`` and its ``tokens``: prompt then output), told
afterwards how many of a draft were accepted (``feedback``) and when a
sequence ends (``release``).

``SuffixDrafter`` costs no model memory: it looks up the sequence's last few
tokens among its own earlier tokens (prompt and output) and drafts what
followed them (continued with the match's period where what followed runs
into the suffix: a loop). Coding agents and long chats repeat themselves (a file being
rewritten, a tool's output quoted back), so the continuation of the longest
earlier match is often right for many tokens. It drafts fewer tokens as its
acceptance falls, and none for a while when drafting does not pay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class Drafted(Protocol):
    """What a drafter reads of a sequence."""

    id: int
    tokens: Sequence[int]


@dataclass
class _Index:
    """One sequence's lookup table.

    Invariant: ``ends[g]`` lists, oldest first, up to ``keep`` positions ``e <
    indexed`` at which the n-gram ``g`` ends (``tokens[e - n + 1:e + 1] == g``);
    every n-gram ending before ``indexed`` is listed (or was, before newer
    ones pushed it out). ``rate`` is the running acceptance (accepted / proposed
    tokens, exponentially weighted); ``pause`` the proposals still to skip.
    """

    ends: dict = field(default_factory=lambda: defaultdict(list))
    indexed: int = 0
    rate: float = 1.0
    proposals: int = 0
    pause: int = 0
    backoff: int = 0


class SuffixDrafter:
    """Drafts the continuation of the longest earlier match of a sequence's
    suffix.

    ``max_draft``: tokens per draft at most. ``ngram``: tokens that must
    match before anything is drafted (the lookup key). ``candidates``: the
    most recent occurrences of the key compared, each extended backwards (up
    to ``lookback`` tokens) to find the longest match. A draft is no longer
    than its match (a 3-token match drafts 3 tokens at most) nor than the
    acceptance allows (``max_draft`` times the running acceptance, at least
    1). When the running acceptance falls below ``min_rate`` the drafter
    stops for ``2**k`` proposals (k counting consecutive back-offs, at most
    64 proposals), then tries again.
    """

    def __init__(self, max_draft: int = 8, ngram: int = 3, candidates: int = 8, lookback: int = 64,
                 min_rate: float = 0.3):
        if max_draft < 1 or ngram < 1 or candidates < 1:
            raise ValueError(f"max_draft, ngram and candidates must be at least 1, got {max_draft}, {ngram}, "
                             f"{candidates}")
        self.max_draft = max_draft
        self.ngram = ngram
        self.candidates = candidates
        self.lookback = lookback
        self.min_rate = min_rate
        self._indexes: dict[int, _Index] = {}

    def propose(self, sequence: Drafted) -> list[int]:
        tokens = sequence.tokens
        index = self._indexes.setdefault(sequence.id, _Index())
        self._extend(index, tokens)
        if index.pause > 0:
            index.pause -= 1
            return []
        n = len(tokens)
        if n <= self.ngram:
            return []
        best, best_len = None, 0
        for end in reversed(index.ends.get(tuple(tokens[n - self.ngram:]), ())):
            length = self._match_length(tokens, end, n - 1)
            if length > best_len:
                best, best_len = end, length
        if best is None:
            return []
        allowed = max(1, round(self.max_draft * index.rate))
        # What followed the match; where that runs into the suffix itself (a
        # loop, a repeated line) it goes on as the draft so far: the sequence
        # repeating with the match's period.
        draft: list[int] = []
        for at in range(best + 1, best + 1 + min(allowed, best_len)):
            draft.append(tokens[at] if at < n else draft[at - n])
        return draft

    def feedback(self, sequence: Drafted, proposed: int, accepted: int) -> None:
        """``accepted`` of the ``proposed`` tokens of the last draft were right."""
        if proposed <= 0:
            return
        index = self._indexes.setdefault(sequence.id, _Index())
        index.proposals += 1
        weight = 0.3  # the last few drafts decide: a file quoted now, prose next
        index.rate = (1 - weight) * index.rate + weight * (accepted / proposed)
        if index.rate < self.min_rate:
            index.pause = min(64, 2 ** index.backoff)
            index.backoff += 1
            index.rate = self.min_rate  # try again at the floor, not at zero
        elif accepted:
            index.backoff = 0

    def release(self, sequence: Drafted) -> None:
        self._indexes.pop(sequence.id, None)

    # --- internals ----------------------------------------------------------------

    def _extend(self, index: _Index, tokens: Sequence[int]) -> None:
        """Index every n-gram ending before the last token (the last one's
        own n-gram is the key being looked up, so it must not find itself)."""
        k = self.ngram
        stop = len(tokens) - 1
        if index.indexed > stop:  # the sequence was cut back (a rejected draft, a restore)
            index.ends.clear()
            index.indexed = 0
        for end in range(max(index.indexed, k - 1), stop):
            ends = index.ends[tuple(tokens[end - k + 1:end + 1])]
            ends.append(end)
            if len(ends) > self.candidates:
                del ends[0]
        index.indexed = max(index.indexed, stop)

    def _match_length(self, tokens: Sequence[int], earlier: int, last: int) -> int:
        """How many tokens ending at ``earlier`` equal those ending at ``last``
        (at least the n-gram, at most ``lookback``)."""
        length = self.ngram
        while (length < self.lookback and earlier - length >= 0
               and tokens[earlier - length] == tokens[last - length]):
            length += 1
        return length

"""The suffix drafter: what it proposes is always the continuation of an
earlier occurrence of the sequence's suffix, it finds the longest one, its
incremental index equals a fresh one, and it drafts less (then nothing, for a
while) when its drafts are rejected."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime.speculation.drafting import SuffixDrafter


@dataclass
class Seq:
    id: int
    tokens: list[int] = field(default_factory=list)


def _occurs_before(tokens: list[int], gram: list[int], end: int) -> bool:
    return end >= len(gram) - 1 and tokens[end - len(gram) + 1:end + 1] == gram


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=120), st.integers(1, 4), st.integers(1, 10))
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_suffix(tokens, ngram, max_draft):
    drafter = SuffixDrafter(max_draft=max_draft, ngram=ngram)
    seq = Seq(0)
    for token in tokens:  # proposals after every token, as decoding makes them
        seq.tokens.append(token)
        draft = drafter.propose(seq)
        n = len(seq.tokens)
        assert len(draft) <= max_draft
        if draft:
            suffix = seq.tokens[n - ngram:]
            # What followed, continued periodically past the end: the draft is
            # what follows the occurrence in the sequence extended by the draft.
            extended = seq.tokens + draft
            starts = [e for e in range(n - 1) if _occurs_before(seq.tokens, suffix, e)
                      and extended[e + 1:e + 1 + len(draft)] == draft]
            assert starts, (seq.tokens, draft)
        elif n > ngram:
            # Nothing proposed: the suffix does not occur earlier.
            suffix = seq.tokens[n - ngram:]
            assert not any(_occurs_before(seq.tokens, suffix, e) for e in range(n - 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=80), st.integers(1, 4))
def test_the_incremental_index_equals_a_fresh_one(tokens, ngram):
    """Proposing after each token leaves the drafter where one that sees the
    whole sequence at once would be."""
    step_by_step = SuffixDrafter(ngram=ngram)
    seq = Seq(1)
    for token in tokens:
        seq.tokens.append(token)
        last = step_by_step.propose(seq)
    assert last == SuffixDrafter(ngram=ngram).propose(Seq(1, list(tokens)))


def test_the_longest_earlier_match_wins():
    # "9 1 2 3" occurs twice: followed by 8s, then by 7s. The suffix "5 9 1 2 3"
    # matches the older occurrence over 5 tokens, the more recent over 4.
    tokens = [5, 9, 1, 2, 3, 8, 8, 8, 4, 9, 1, 2, 3, 7, 7, 7, 0, 5, 9, 1, 2, 3]
    assert SuffixDrafter(max_draft=3, ngram=3).propose(Seq(2, tokens)) == [8, 8, 8]


def test_a_rewritten_file_is_drafted_to_the_end_of_the_match():
    file = list(range(100, 160))
    tokens = [1, 2] + file + [3, 4] + file[:20]  # the model is writing the file out again
    assert SuffixDrafter(max_draft=8).propose(Seq(3, tokens)) == file[20:28]


def test_a_draft_is_no_longer_than_its_match():
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3]  # a 3-token match
    assert SuffixDrafter(max_draft=8, ngram=3).propose(Seq(4, tokens)) == [4, 5, 6]


def test_rejected_drafts_shrink_then_pause_the_drafter_and_it_recovers():
    drafter = SuffixDrafter(max_draft=8, ngram=2, min_rate=0.3)
    seq = Seq(5, list(range(40)) * 3)  # every suffix repeats: a full draft is possible
    assert len(drafter.propose(seq)) == 8
    drafter.feedback(seq, 8, 2)  # rate 0.7 * 1 + 0.3 * 0.25 = 0.775: 6 tokens
    assert len(drafter.propose(seq)) == 6
    paused = 0
    for _ in range(6):  # every draft rejected: the rate falls below 0.3, the drafter pauses
        draft = drafter.propose(seq)
        if not draft:
            paused += 1
        drafter.feedback(seq, len(draft), 0)
    assert paused >= 1
    for _ in range(70):  # back-offs end; accepted drafts bring the length back up
        draft = drafter.propose(seq)
        drafter.feedback(seq, len(draft), len(draft))
    assert len(drafter.propose(seq)) == 8


def test_a_loop_is_drafted_with_its_period():
    tokens = [9, 9, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # "1 2 3" repeating: the latest match is three tokens back
    assert SuffixDrafter(max_draft=7, ngram=3).propose(Seq(5, tokens)) == [1, 2, 3, 1, 2, 3]  # the match's length
    assert SuffixDrafter(max_draft=7, ngram=2).propose(Seq(5, [4, 4, 4, 4, 4, 4, 4, 4, 4])) == [4] * 7


def test_release_forgets_the_sequence_and_bad_settings_are_refused():
    drafter = SuffixDrafter()
    seq = Seq(6, [1, 2, 3, 1, 2, 3, 1, 2])
    assert drafter.propose(seq)
    drafter.release(seq)
    assert 6 not in drafter._indexes
    with pytest.raises(ValueError, match="at least 1"):
        SuffixDrafter(max_draft=0)

"""Sampling filters, penalties, seeds, and the text stream's stop strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime.scheduling.sampling import Sampler, SamplingParams, apply_penalties, draw, reachable_head
from strata_runtime.text.stream import StopTextStream


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 400) -> set[int]:
    sampler = Sampler(params)
    return {sampler(logits, []) for _ in range(n)}


LOGITS = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -3.0])


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS[[3, 0, 1]], []) == 1


def test_top_k_limits_the_support():
    params = SamplingParams(temperature=5.0, top_k=2, top_p=1.0, min_p=0.0, seed=1)
    assert _draws(params, LOGITS) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # ~0.66, 0.24, 0.09, ...
    assert probs[0] < 0.7 < probs[0] + probs[1]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=2)
    assert _draws(params, LOGITS) == {0, 1}


def test_min_p_drops_tokens_far_below_the_best():
    # min_p 0.1 of p(0): keeps p >= 0.066, i.e. tokens 0, 1, 2.
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=3)
    assert _draws(params, LOGITS, 2000) == {0, 1, 2}


def test_seed_reproduces_and_different_seeds_differ():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)

    def run(seed):
        s = Sampler(SamplingParams(seed=seed, **params))
        return [s(logits, []) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def _kept_by_full_sort(logits: torch.Tensor, p: SamplingParams) -> list[int]:
    """top-p then min-p over the whole vocabulary, sorted: what the filters keep."""
    values, ids = torch.sort(logits, descending=True)
    probs = torch.softmax(values.double(), -1)
    keep = int(((torch.cumsum(probs, -1) - probs) < p.top_p).sum()) if p.top_p < 1.0 else len(ids)
    if p.min_p > 0.0:
        keep = min(keep, int((probs >= p.min_p * probs[0]).sum()))
    return ids[:keep].tolist()


@pytest.mark.parametrize("spread", [1.0, 8.0])  # a flat distribution (a wide nucleus) and a peaked one
@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (0.5, 0.0), (1.0, 0.05), (0.95, 0.05)])
def test_without_top_k_no_full_sort_misses_a_token(spread, top_p, min_p):
    """top_k=0 sorts only the head of the vocabulary: every token the filters
    keep (by a full sort) is in it, in order."""
    logits = torch.randn(262144, generator=torch.Generator().manual_seed(5)) * spread
    p = SamplingParams(top_k=0, top_p=top_p, min_p=min_p)
    head, ids = reachable_head(logits, torch.logsumexp(logits, -1), p)
    kept = _kept_by_full_sort(logits, p)
    # The same tokens with the same logits in the same order (equal logits may come in either order).
    assert set(ids[:len(kept)].tolist()) == set(kept)
    assert torch.equal(head[:len(kept)], logits[kept])
    assert torch.equal(head, logits[ids]) and bool((head[:-1] >= head[1:]).all())


def test_draw_follows_the_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2])
    generator = torch.Generator().manual_seed(11)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(4000)]), minlength=4)
    assert counts[2] == 0  # a zero-probability token is never drawn
    assert torch.allclose(counts.double() / 4000, probs.double(), atol=0.03)


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_penalties(logits, [0, 1], SamplingParams(repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(3)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [1, 1, 2], p)
    assert out.tolist() == [0.0, -1.0, -0.75]


def test_penalty_window():
    out = apply_penalties(torch.zeros(3), [0, 1, 2], SamplingParams(presence_penalty=1.0, penalty_last_n=1))
    assert out.tolist() == [0.0, 0.0, -1.0]


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be at least 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, "top_k must be at least 0"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("max_tokens", -5, "max_tokens must be at least 0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be above 0"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\]"),
    ("stop", ["ok", ""], "stop must be a list of non-empty strings"),
    ("stop", [f"s{i}" for i in range(17)], "stop has 17 strings; at most 16"),
    ("stop", ["x" * 257], "at most 256 characters"),
    ("seed", 2**64, r"seed must be a whole number in \[-2\*\*63, 2\*\*64 - 1\]"),
    ("seed", -(2**63) - 1, "seed must be a whole number"),
])
def test_bad_values_name_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


class _Pieces:
    """A stand-in decoder yielding fixed text pieces (the real one is tested with the tokenizer)."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def push(self, token):
        return self.pieces[token]

    def flush(self):
        return ""


def _run(pieces, stop):
    stream = StopTextStream(_Pieces(pieces), tuple(stop))
    shown = [stream.push(i) for i in range(len(pieces)) if not stream.stopped]
    shown.append(stream.finish())
    return "".join(shown), stream


def test_stop_string_across_pieces_is_cut_and_never_shown():
    text, stream = _run(["Hello wo", "rld, and ", "more"], ["world"])
    assert text == "Hello " and stream.stopped


def test_text_that_only_looked_like_a_stop_is_released():
    text, stream = _run(["abc wo", "w", "!"], ["world"])
    assert text == "abc wow!" and not stream.stopped


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab XY", max_size=4), max_size=8), st.text(alphabet="ab XY", min_size=1, max_size=3))
def test_stream_equals_cutting_the_whole_text(pieces, stop):
    text, _ = _run(pieces, [stop])
    whole = "".join(pieces)
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert text == expected


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=12), st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1,
                                                       max_size=4))
def test_held_back_text_is_the_longest_end_that_begins_a_stop(text, stops):
    """The per-character index of stop prefixes finds what trying every length finds."""
    stream = StopTextStream(_Pieces([]), tuple(stops))
    naive = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    assert stream._longest_stop_prefix_suffix(text) == naive



@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-7])
def test_a_vanishing_temperature_is_greedy(temperature):
    """logits / 1e-38 overflowed to inf, the softmax to NaN, and the draw then
    took the last candidate, the least likely, every time."""
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    assert _draws(params, LOGITS, n=50) == {0}


def test_an_extreme_repetition_penalty_stays_finite():
    """A penalty of 1e-40 divides a positive logit past float32's range: the
    penalized logits are clamped to finite values, so the draw still follows
    them (the repeated token, made overwhelmingly likely) and never NaN."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1e-40, seed=4)
    penalized = apply_penalties(LOGITS.clone(), [2], params)
    assert torch.isfinite(penalized).all()
    sampler = Sampler(params)
    assert {sampler(LOGITS, [2]) for _ in range(50)} == {2}


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0])
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100}))(logits, []) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={"3": 100}))(logits, []) == 3  # JSON's string keys
    draws = {Sampler(SamplingParams(temperature=1.0, seed=s, top_k=0, top_p=1.0, min_p=0.0,
                                    logit_bias={0: -100, 1: -100}))(logits, []) for s in range(40)}
    assert draws == {2, 3}


@pytest.mark.parametrize("bias,message", [({"x": 1}, "token ids"), ({1: 101}, r"\[-100, 100\]"),
                                          ({-1: 5}, "token ids"), ({1: True}, r"\[-100, 100\]"),
                                          ({i: 1 for i in range(301)}, "at most 300")])
def test_a_bad_logit_bias_is_refused_naming_the_entry(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)

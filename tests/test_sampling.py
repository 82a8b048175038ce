"""Sampling filters, penalties, seeds, and the text stream's stop strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime.sampling import Sampler, SamplingParams, apply_penalties
from strata_runtime.text_stream import StopTextStream


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

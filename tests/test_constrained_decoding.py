"""Constrained decoding: a grammar (JSON schema, any JSON object, Lark, regex)
in each sequence's sampler, through ``llguidance`` over the model's own
vocabulary.

A random-weight model has no reason to write JSON: every answer it gives
that parses and validates is the constraint's doing. Batching, preemption
and speculative verifies must give the tokens the sequence gets alone, as
they do without a grammar; a greedy choice the grammar allows is taken
without masking, and that shortcut must change nothing."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import CORPUS, Shape, write_tiny_model

import strata_runtime
from strata_runtime import Grammar, GrammarError
from strata_runtime.scheduling import Constraint
from strata_runtime.scheduling.sampling import allowed_top_k

# Bounded everywhere, so a random model can close every value within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
SEEDS = range(12)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    # 8 KiB of float32 KV a position: a pool of a few blocks is easy to make.
    return write_tiny_model(tmp_path_factory.mktemp("constrained") / "tiny.gguf", "qwen2",
                            Shape(hidden=128, layers=8, heads=4, kv_heads=4, head_dim=32), seed=3)


def _load(path, **options):
    options = {"dtype": "float32", "progress": False, "context_length": 256, "conversation_cache_mib": 0,
               **options}
    return strata_runtime.load(path, **options)


@pytest.fixture(scope="module")
def tiny(tiny_file):
    return _load(tiny_file, parallel=4)


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_a_random_model_writes_schema_valid_json_in_every_seeded_run(tiny):
    """Sampled at temperature 1.5 with every filter off (the widest choice a
    random model gets), four at a time: each answer validates and ends by
    the grammar's own end, not max_tokens."""
    prompts = ["The quick brown fox"] * len(SEEDS)
    got = [tiny.generate(p, max_tokens=160, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=s,
                         grammar={"json_schema": PERSON}) for p, s in zip(prompts, SEEDS)]
    for c in got:
        _valid(c.text, PERSON)
        assert c.finish_reason == "stop", c
    assert len({c.text for c in got}) > 1  # sampled, not one answer forced
    together = tiny.generate_many(prompts[:4], max_tokens=160, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                  seed=0, grammar={"json_schema": PERSON})
    assert [c.text for c in together] == [got[0].text] * 4  # batched, a seed gives the tokens it gives alone


def test_greedy_tokens_are_the_argmax_of_the_masked_logits(tiny):
    """The greedy shortcut (the best token taken unmasked where the grammar
    allows it) against masking every step, teacher-forced: at each position
    the generated token is the best logit among the tokens the grammar allows."""
    prompt = tiny.tokenize("def f(x):")
    grammar = Grammar.json_schema(PERSON)
    c = tiny.generate(prompt, max_tokens=120, temperature=0, grammar=grammar)
    _valid(c.text, PERSON)
    logits = tiny.logits(prompt + c.tokens)[len(prompt) - 1:]
    matcher = tiny.grammars.matcher(grammar)
    vocab = tiny.tokenizer.vocab.size
    forced = 0
    for i in range(len(c.tokens) + 1):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:vocab]).tolist()
        row = logits[i, :vocab]
        best = allowed[int(torch.argmax(row[allowed]))]
        if i == len(c.tokens):  # the answer ended: by an end-of-generation token the grammar allowed
            assert best in tiny.tokenizer.end_of_generation
            break
        assert c.tokens[i] == best, i
        forced += best != int(torch.argmax(row))
        assert matcher.consume_token(best)
    assert forced > 0  # the grammar overrode the model's choice somewhere, so the mask was applied


def test_a_sampled_step_masks_only_its_top_k_when_enough_of_them_are_allowed(tiny):
    """The top-k shortcut (mask the widened head, not the vocabulary) against
    masking every token, teacher-forced along a sampled answer: where it
    answers, its candidates are the masked logits' top k, in order; it
    answers inside strings and steps aside where few tokens are allowed."""
    prompt = tiny.tokenize("def f(x):")
    grammar = Grammar.json_schema(PERSON)
    c = tiny.generate(prompt, max_tokens=160, temperature=1.0, top_k=8, seed=4, grammar=grammar)
    _valid(c.text, PERSON)
    logits = tiny.logits(prompt + c.tokens)[len(prompt) - 1:]
    constraint = Constraint(tiny.grammars.matcher(grammar), tiny.tokenizer.vocab.size)
    answered = stepped_aside = 0
    for i, token in enumerate(c.tokens):
        row = logits[i].float()
        head = allowed_top_k(row, constraint, 8)
        masked = constraint.restrict(row)
        if head is None:
            stepped_aside += 1
            assert int(torch.isfinite(masked[torch.topk(row, 4 * 8).indices]).sum()) < 8, i  # and only then
        else:
            answered += 1
            values, ids = torch.topk(masked, 8)
            assert torch.equal(head[1], ids) and torch.equal(head[0], values), i
        constraint.advance(token)
    assert answered > 0 and stepped_aside > 0, (answered, stepped_aside)


def test_preempted_and_verified_sequences_give_the_tokens_they_give_alone(tiny_file, tiny):
    """A KV pool too small for four sequences (preemption recomputes their
    tokens as a prompt) and a draft model (the target itself: verifies of
    several rows) change no token of a constrained answer, greedy or seeded."""
    small = _load(tiny_file, parallel=4, kv_memory_mib=2)  # 8 blocks of 32 positions
    drafted = _load(tiny_file, parallel=4, spec="draft", draft_model=str(tiny_file), spec_tokens=4)
    prompts = [CORPUS[0], CORPUS[1], CORPUS[2], CORPUS[0][:40]]  # 20-40 tokens each
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        options = {"max_tokens": 120, "grammar": {"json_schema": PERSON}, **sampling}
        alone = [tiny.generate(p, **options).text for p in prompts]
        for engine in (small, drafted):
            got = engine.generate_many(prompts, **options)
            assert [c.text for c in got] == alone, engine.props().get("speculative")
            for c in got:
                _valid(c.text, PERSON)
    assert small.scheduler.counters["preemptions_recomputed"] >= 1, dict(small.scheduler.counters)
    assert drafted.scheduler.counters["spec_accepted_tokens"] > 0


def test_lark_and_regex_grammars(tiny):
    c = tiny.generate("The quick", max_tokens=40, temperature=1.0, seed=2, grammar=Grammar.regex(r"[0-9]{3}-[a-z]{2}"))
    assert len(c.text) == 6 and c.text[:3].isdigit() and c.text[3] == "-" and c.text[4:].isalpha()
    c = tiny.generate("The quick", max_tokens=40, temperature=1.0, seed=3,
                      grammar=Grammar.lark('start: "yes" | "no" | "maybe"'))
    assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop"


def test_a_stop_string_inside_a_constrained_answer_ends_it_there(tiny):
    c = tiny.generate("The quick", max_tokens=120, temperature=0, grammar={"json_schema": PERSON}, stop=['"age"'])
    assert c.finish_reason == "stop" and '"age"' not in c.text and c.text.startswith('{"name": "')


@pytest.mark.parametrize("schema,named", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "strin"}, "strin"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_a_schema_the_decoder_cannot_enforce_is_refused_naming_why(tiny, schema, named):
    with pytest.raises(GrammarError, match=named):
        tiny.generate("x", max_tokens=4, grammar={"json_schema": schema})
    assert tiny.generate("x", max_tokens=2, temperature=0).completion_tokens == 2  # and it goes on serving


def test_a_grammar_of_the_wrong_shape_is_refused_with_the_shapes_it_takes(tiny):
    for bad in ({"json": {}}, {"regex": ""}, {"json_object": False}, "x", {"lark": "a", "regex": "b"}):
        with pytest.raises(GrammarError, match="json_schema"):
            tiny.generate("x", max_tokens=4, grammar=bad)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                 st.dictionaries(st.sampled_from(["json_schema", "json_object", "lark", "regex", "x"]),
                                 st.one_of(st.booleans(), st.text(max_size=8), st.none(),
                                           st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)),
                                 max_size=2)))
def test_the_json_form_of_a_grammar_parses_or_is_refused(value):
    """``Grammar.of`` takes any JSON a client sends: a ``Grammar`` that
    round-trips through ``as_dict``, or ``GrammarError``, never another exception."""
    try:
        grammar = Grammar.of(value)
    except GrammarError:
        return
    assert grammar is None or Grammar.of(grammar.as_dict()) == grammar


def test_control_tokens_are_not_text_to_a_grammar(tiny):
    """The grammar vocabulary spells control tokens apart from their text: a
    regex that matches the text ``<|im_end|>`` never takes the control token."""
    end = tiny.tokenizer.ids["<|im_end|>"]
    constraint = Constraint(tiny.grammars.matcher(Grammar.regex(r"<\|im_end\|>")), tiny.tokenizer.vocab.size)
    assert not constraint.allows(end)
    c = tiny.generate("x", max_tokens=30, temperature=0, grammar=Grammar.regex(r"<\|im_end\|>"))
    assert c.text == "<|im_end|>" and end not in c.tokens


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_real_models_answer_in_the_schema(which, smollm2_file, model_file):
    engine = _load(smollm2_file if which == "smollm2" else model_file, dtype="auto", context_length=1024,
                   parallel=3)
    messages = [{"role": "user", "content": "Describe a user of a web shop as JSON."}]
    prompts = [engine.chat_prompt(messages)] * 3
    got = engine.generate_many(prompts, max_tokens=80, temperature=0.7, seed=5, grammar={"json_schema": PERSON})
    for c in got:
        _valid(c.text, PERSON)
        assert c.finish_reason == "stop"
    # Any JSON object (a random model would write numbers without end: a real one closes them).
    city = engine.chat_prompt([{"role": "user", "content": "What is the capital of France? Answer with a JSON "
                                                          "object whose one key is \"city\"."}])
    c = engine.generate(city, max_tokens=60, temperature=0, grammar=Grammar.json_object())
    assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop"


def test_logprobs_are_the_models_own_distribution_whatever_the_grammar(tiny):
    """Each generated token's log-probability and the likeliest alternatives
    come from the model's raw logits (teacher-forced here), before the
    grammar's mask: a constrained token may be one the model found unlikely."""
    prompt = tiny.tokenize("The quick brown fox")
    for grammar in (None, {"json_schema": PERSON}):
        c = tiny.generate(prompt, max_tokens=12, temperature=0, logprobs=3, grammar=grammar)
        assert len(c.logprobs) == len(c.tokens)
        expected = torch.log_softmax(tiny.logits(prompt + c.tokens)[len(prompt) - 1:], dim=-1)
        for i, (token, (logprob, top)) in enumerate(zip(c.tokens, c.logprobs)):
            assert logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
            assert [t for t, _ in top] == torch.topk(expected[i], 3).indices.tolist()
            if grammar is None:  # greedy and free: the token is the likeliest one
                assert token == top[0][0]
    assert tiny.generate(prompt, max_tokens=2, temperature=0).logprobs is None
    with pytest.raises(ValueError, match="0..20"):
        tiny.generate(prompt, max_tokens=2, logprobs=21)

"""Conversations through the engine: park and restore between alternating
conversations give the same greedy tokens as an engine that never parks, and
as cold runs up to where the cache's own rounding decides; faults never reach
the request.

The warm engines here run with ``parallel=1``: one conversation stays on the
device at a time, so every switch parks one and restores the other (with
room for both, nothing is parked: ``test_batching.py``).

On the exact path (``dtype="float32"``) a restored conversation holds the
very K/V it was parked with, so it equals an engine that kept it on the
device, bit for bit. Against a cold run that reads the whole prompt at once
it differs in rounding only: the returning turn's suffix is prefilled in a
chunk of its own, and torch's float32 CPU matmul does not give a row the same
bits at every row count (up to 6e-5 in values of ~25 on Gemma's [100, 640] x
[640, 1024]). The float16 cache hides that (log-probabilities within 1e-6);
a quantized cache's codes on a rounding boundary flip, moving log-probabilities
by up to 0.012 (``int8``) and 0.06 (``k8v4``), so a greedy token may part
from the cold run's only where the cold run's top two are that close. On the
default path a decode step (the integer GEMV) and a prefill chunk (a float
GEMM) compute the same position differently, so only closeness holds there
(``test_fast_path.py``).
"""


from __future__ import annotations

import pytest

from test_memory import _proc, _v2

import strata_runtime
from strata_runtime.conversations.memory import MiB, HostMemory
from strata_runtime.testing import OPTIMIZATION_POINTS, inject_fault

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short sentence."}
TOPICS = [
    ["Tell me about the river Danube.", "Which countries does it cross?", "And its length?"],
    ["Explain what a prime number is.", "Is 91 prime?", "What is the next prime after 97?"],
]


def _conversation_turns(engine, topic, answers):
    messages = [SYSTEM]
    for i, question in enumerate(topic):
        messages.append({"role": "user", "content": question})
        yield list(messages)
        messages.append({"role": "assistant", "content": answers[i]})


def _cold(model_file, kv, prompts, logprobs=None):
    cold = strata_runtime.load(model_file, dtype="float32", kv=kv, progress=False, context_length=1024, conversation_cache_mib=0)
    completions = [cold.generate(p, max_tokens=6, temperature=0, logprobs=logprobs) for p in prompts]
    return completions if logprobs else [c.tokens for c in completions]


# How far apart the cold run's top two log-probabilities may be where a warm
# greedy token parts from it: a few times the largest warm-against-cold shift
# of a log-probability measured for the cache (see the module's docstring).
NEAR_TIE = {"f16": 1e-4, "int8": 0.05, "k8v4": 0.25}


def _alternating_turns(engine):
    answers = [["It is a long river in Europe."] * 3, ["A number with exactly two divisors."] * 3]
    turns = [list(_conversation_turns(engine, t, a)) for t, a in zip(TOPICS, answers)]
    return [turns[0][0], turns[1][0], turns[0][1], turns[1][1], turns[0][2], turns[1][2]]


def _parts_only_at_a_near_tie(warm: list[int], cold, near_tie: float) -> bool:
    """Whether greedy ``warm`` equals ``cold``'s tokens up to their first
    difference, and there the cold run's two likeliest are warm's and its own
    within ``near_tie`` (after it the two runs continue different texts)."""
    for i, (w, c) in enumerate(zip(warm, cold.tokens)):
        if w != c:
            (first, p_first), (second, p_second) = cold.logprobs[i][1][:2]
            return first == c and second == w and p_first - p_second <= near_tie
    return len(warm) == len(cold.tokens)


@pytest.mark.parametrize("kv", ["f16", "int8", "k8v4"])
def test_alternating_conversations_equal_cold_runs(model_file, kv):
    settings = dict(dtype="float32", kv=kv, progress=False, context_length=1024, conversation_cache_mib=64,
                    min_free_mib=0, checkpoint_every=64)
    engine = strata_runtime.load(model_file, parallel=1, **settings)
    order = _alternating_turns(engine)
    warm = [engine.chat(messages, max_tokens=6, temperature=0) for messages in order]
    stats = engine.stats()
    assert stats["parked"] >= 4 and stats["restored"] >= 4
    assert any(w.cached_tokens > 30 for w in warm[2:])  # returning conversations skipped most of their prefill
    assert stats["pool_bytes_used"] <= stats["pool_bytes_total"]
    # Room for every turn's branch on the device: the same turns, nothing restored.
    roomy = strata_runtime.load(model_file, parallel=4, **settings)
    resident = [roomy.chat(messages, max_tokens=6, temperature=0) for messages in order]
    assert roomy.stats().get("restored", 0) == 0
    assert [w.tokens for w in warm] == [r.tokens for r in resident]
    assert [w.cached_tokens for w in warm] == [r.cached_tokens for r in resident]
    cold = _cold(model_file, kv, [engine.chat_prompt(m) for m in order], logprobs=2)
    for w, c in zip(warm, cold):
        assert _parts_only_at_a_near_tie(w.tokens, c, NEAR_TIE[kv]), (w.tokens, c.tokens, c.logprobs)
    assert sum(w.tokens == c.tokens for w, c in zip(warm, cold)) >= 5  # a near tie is rare


_cold_outputs: dict[tuple, list] = {}


@pytest.mark.parametrize("rate", [1.0, 0.5], ids=["every-call", "random-subset"])
@pytest.mark.parametrize("point", [p for p in OPTIMIZATION_POINTS if p != "recurrent_copy"])  # Gemma keeps no recurrent state
def test_every_fault_point_is_survived(model_file, point, rate):
    engine = strata_runtime.load(model_file, parallel=1, dtype="float32", progress=False, context_length=512,
                                 conversation_cache_mib=32, min_free_mib=0, checkpoint_every=8)
    prompts = [engine.tokenize(t) for t in (
        "The history of the printing press begins in the fifteenth century, when",
        "A recipe for bread needs flour, water, salt and yeast, and",
        "The history of the printing press begins in the fifteenth century, when Gutenberg",
    )]
    key = tuple(map(tuple, prompts))
    if key not in _cold_outputs:
        _cold_outputs[key] = _cold(model_file, "f16", prompts)
    cold = _cold_outputs[key]
    with inject_fault(point, rate=rate, seed=1) as fault:
        out = [engine.generate(p, max_tokens=6, temperature=0).tokens for p in prompts]
    assert out == cold
    assert fault.calls > 0
    stats = engine.stats()
    skipped = sum(v for k, v in stats.items() if k.endswith("_skipped"))
    assert fault.fired > 0 and skipped >= fault.fired
    assert sum(stats["skipped_by_reason"].values()) == skipped
    expected_cause = "lease_failed" if point == "staging_lease" else "out_of_memory"
    assert all(k.endswith(":" + expected_cause) for k in stats["skipped_by_reason"]), stats["skipped_by_reason"]


def test_no_conversation_cache_still_reuses_the_live_prefix(model_file):
    engine = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=256, conversation_cache_mib=0)
    assert engine.conversations is None and engine.stats() == {}
    engine.generate("The capital of France is", max_tokens=2, temperature=0)
    again = engine.generate("The capital of France is Paris, and", max_tokens=2, temperature=0)
    assert again.cached_tokens > 0


def _alternate(engine, n=3):
    prompts = ["The history of the printing press begins in the fifteenth century in Mainz, when",
               "A recipe for a simple country bread needs flour, water, salt and a little yeast, and"]
    return [engine.generate(prompts[i % 2], max_tokens=2, temperature=0).tokens for i in range(n)]


def test_pool_refused_under_strict_when_it_cannot_fit(model_file):
    engine = strata_runtime.load(model_file, parallel=1, dtype="float32", progress=False, context_length=64,
                                 conversation_cache_mib=10_000_000, strict_conversation_cache=True)
    assert engine.conversations.pool.total_bytes == 0
    assert "refused (strict)" in engine.pool_decision
    assert all(len(t) == 2 for t in _alternate(engine))
    stats = engine.stats()
    assert stats["park_skipped"] == stats["skipped_by_reason"]["park:no_pool"] == 2
    assert "refused (strict)" in stats["pool_decision"]


def test_load_admits_the_pool_against_a_cgroup_tighter_than_mem_available(model_file, tmp_path, caplog):
    """A fake cgroup v2 tree leaving 300 MiB while MemAvailable says 8 GiB:
    load() shrinks the requested 1 GiB pool to 300 MiB minus the 100 MiB floor."""
    caplog.set_level("INFO", logger="strata_runtime.conversations.staging")
    proc = _proc(tmp_path, available_kb=8 * 1024 * 1024, cgroup="0::/svc\n")
    cg = _v2(tmp_path, "/svc", str(4096 * MiB), current=(4096 - 300) * MiB, inactive=0)
    engine = strata_runtime.load(model_file, parallel=1, dtype="float32", progress=False, context_length=128, memory=HostMemory(proc, cg),
                                 conversation_cache_mib=1024, min_free_mib=100)
    assert engine.conversations.pool.total_bytes == 200 * MiB
    assert "shrunk to fit: 200 MiB of 1024 MiB requested (headroom 300 MiB; floor 100 MiB)" in caplog.text
    _alternate(engine)
    assert engine.stats()["parked"] == 2


def test_load_with_unknown_telemetry_refuses_parking_with_the_reason(model_file, tmp_path, caplog):
    caplog.set_level("INFO", logger="strata_runtime")
    proc = _proc(tmp_path, available_kb="lots")
    engine = strata_runtime.load(model_file, parallel=1, dtype="float32", progress=False, context_length=128, memory=HostMemory(proc, tmp_path),
                                 conversation_cache_mib=64, min_free_mib=0)
    assert engine.conversations.pool.total_bytes == 0
    cold = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=128, conversation_cache_mib=0)
    assert _alternate(engine) == _alternate(cold)
    assert engine.stats()["skipped_by_reason"] == {"park:no_pool": 2}
    skips = [r.getMessage() for r in caplog.records if "skip parking" in r.getMessage()]
    assert len(skips) == 2
    assert "skip parking (no staging pool: refused: memory telemetry unknown: cannot parse" in skips[0]


def test_two_long_conversations_alternating_with_a_pool_too_small_for_both(model_file, caplog):
    """The outage this project exists to prevent, scaled down: two ~600-token
    conversations alternate for 20 requests; the pool holds less than two
    snapshots and the slots allow more than fit. Every request is served,
    nothing raises, outputs equal runs without any conversation cache, and
    the counters agree with the log."""
    caplog.set_level("INFO", logger="strata_runtime.conversations.cache")
    engine = strata_runtime.load(model_file, parallel=1, dtype="float32", progress=False, context_length=1024, conversation_cache_mib=32,
                                 conversation_cache_slots=8, min_free_mib=0, checkpoint_every=256)
    references = [strata_runtime.load(model_file, dtype="float32", progress=False, context_length=1024, conversation_cache_mib=0)
                  for _ in range(2)]
    texts = ["The history of the printing press begins with Gutenberg in Mainz. ",
             "Rivers of Europe include the Danube, the Rhine and the Elbe. "]
    prompts = [engine.tokenize(t * 45) for t in texts]  # ~600 tokens each
    snapshot_bytes = 18 * 600 * 2 * 256 * 4
    assert engine.conversations.pool.total_bytes < 2 * snapshot_bytes
    for request in range(20):
        c = request % 2
        prompts[c] = prompts[c] + engine.tokenize(f" Question {request}: and then?", add_bos=False)
        out = engine.generate(prompts[c], max_tokens=4, temperature=0)
        expected = references[c].generate(prompts[c], max_tokens=4, temperature=0)
        assert out.tokens == expected.tokens, f"request {request}"
    # The last prompt of each conversation, cold: the two share only BOS, so
    # one engine without a conversation cache prefills each from scratch.
    cold = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=1024, conversation_cache_mib=0)
    for c in range(2):
        assert cold.generate(prompts[c], max_tokens=4, temperature=0).tokens == \
            references[c].generate(prompts[c], max_tokens=4, temperature=0).tokens
    stats = engine.stats()
    lines = [r.getMessage() for r in caplog.records]
    assert stats["parked"] == sum(m.startswith("conversation cache: parked") for m in lines) >= 19
    assert stats.get("restored", 0) == sum(m.startswith("conversation cache: restored") for m in lines)
    assert stats.get("live_reused", 0) == sum(m.startswith("conversation cache: reused") for m in lines)
    assert stats.get("park_skipped", 0) == sum(m.startswith("conversation cache: skip parking") for m in lines)
    assert stats["evictions"] >= 18
    assert stats["pool_bytes_used"] <= stats["pool_bytes_total"]

"""Continuous batching: sequences decoded together give what they give alone.

The exact path (float32) on both real models: greedy tokens of a sequence run
alone equal those it gets inside batches of 2, 4 and 8 mixed-length
sequences that arrive at different steps, except at a near-tie; logits of
batched decode steps equal the alone ones to rounding; seeded sampling gives
the same text. And the pool: KV storage is allocated once, at load; a
workload that needs more blocks than exist still completes every request,
with the preemptions counted.

A near-tie: where a batched run's greedy token differs from the alone run's,
the alone run's logits at that position must have their top two within
``NEAR_TIE`` (a batched matmul sums in another order: float32 rounding moves
a logit by about 1e-5 of its size, so only a tie that close can flip).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import strata_runtime
from strata_kernels import KVStore
from strata_runtime.scheduling.batch import Batch
from strata_runtime.models.generation import decode_step, prefill
from strata_runtime.models.layers import RopeCache, rope_inverse_frequencies, rope_tables
from strata_runtime.state.kv_cache import KVCache
from strata_runtime.scheduling.sampling import SamplingParams

NEAR_TIE = 1e-3  # logits
LOGIT_ATOL = 2e-3

TEXTS = [
    "The history of the river Danube begins",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Three facts about prime numbers: first,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the capital of France?\nA:",
    "The recipe needs flour, sugar, eggs and",
    "In 1969, the first people to walk on the Moon",
    "List of colours: red, green,",
]


def _alone(engine, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits of ``ids`` on a private cache."""
    cache = engine.new_cache(len(ids) + steps + 1)
    out, logits_seen = [], []
    with torch.inference_mode():
        logits = prefill(engine.model, cache, ids)
        for _ in range(steps):
            logits_seen.append(logits)
            token = int(logits.argmax())
            out.append(token)
            logits = decode_step(engine.model, cache, token)
    return out, logits_seen


def _check_greedy(alone_tokens, alone_logits, batched_tokens) -> None:
    for i, (a, b) in enumerate(zip(alone_tokens, batched_tokens)):
        if a != b:
            top = alone_logits[i].topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"token {i}: {b} batched, {a} alone, not a near-tie"
            return  # past a near-tie the texts part: nothing more to compare
    assert len(batched_tokens) == len(alone_tokens)


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def exact(request, smollm2_file, model_file):
    path = smollm2_file if request.param == "smollm2" else model_file
    return strata_runtime.load(path, dtype="float32", progress=False, context_length=1536, parallel=8,
                               conversation_cache_mib=0)


def test_batched_decode_logits_equal_alone(exact):
    """One decode step of 4 sequences at different lengths through one
    ``Batch`` (one batched attention call per layer) against each alone."""
    ids = [exact.tokenize(t) for t in TEXTS[:4]]
    pool = exact.scheduler.pool
    caches = [KVCache.on_pool(pool, exact.context_length) for _ in ids]
    with torch.inference_mode():
        firsts = [int(prefill(exact.model, c, x).argmax()) for c, x in zip(caches, ids)]
        batch = Batch(caches, [1] * len(caches))
        tokens = torch.tensor(firsts)
        batched = exact.model(tokens, batch.positions, batch, last_only=True)
    for c in caches:
        c.release()
    for i, x in enumerate(ids):
        alone = _alone(exact, x, 2)[1][1]
        assert torch.allclose(batched[i], alone, atol=LOGIT_ATOL, rtol=0), float((batched[i] - alone).abs().max())


# A step: each sequence's (next position, rows); its positions are the runs one after another.
_steps = st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), min_size=1, max_size=4),
                  min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(_steps)
def test_the_rotary_tables_of_every_step_are_its_positions_own(steps):
    """Whatever positions a run of steps brings (each a new tensor; runs of
    several sequences, starts shared between steps), the shared tables are
    those of the step's own positions, for each layer that asks."""
    cache = RopeCache()
    inv_freq = rope_inverse_frequencies(16, 10000.0)
    for runs in steps:
        positions = torch.cat([torch.arange(start, start + n) for start, n in runs])
        want = rope_tables(positions, inv_freq, torch.float32)
        for _ in range(2):  # two layers of the step
            got = cache.tables(positions, inv_freq, torch.float32)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), positions.tolist()


def test_a_step_after_one_with_the_same_first_position_and_count_gets_its_own_rotations(exact):
    """A batch's positions are each sequence's next ones, one after another:
    two steps may begin at the same position with the same count and differ
    after it (here ``[n, m]`` then ``[n, m + 1]``, another sequence first).
    The rotary tables are shared by a step's layers, never by the next step
    with other positions (they were, keyed on the first position and the
    count: the second step's rows were rotated as the first step's)."""
    a, b = exact.tokenize(TEXTS[0]), exact.tokenize(TEXTS[1])
    c = exact.tokenize(TEXTS[2] + TEXTS[3])[:len(a)]  # another prompt of a's length
    alone = {name: _alone(exact, ids, 3) for name, ids in (("b", b), ("c", c))}
    pool = exact.scheduler.pool
    caches = {name: KVCache.on_pool(pool, exact.context_length) for name in "abc"}
    with torch.inference_mode():
        for name, ids in (("a", a), ("b", b), ("c", c)):
            prefill(exact.model, caches[name], ids)
        first = Batch([caches["a"], caches["b"]], [1, 1])
        exact.model(torch.tensor([0, alone["b"][0][0]]), first.positions, first, last_only=True)
        second = Batch([caches["c"], caches["b"]], [1, 1])
        assert second.positions[0] == first.positions[0]
        logits = exact.model(torch.tensor([alone["c"][0][0], alone["b"][0][1]]), second.positions, second,
                             last_only=True)
    for cache in caches.values():
        cache.release()
    for row, want in ((0, alone["c"][1][1]), (1, alone["b"][1][2])):
        assert torch.allclose(logits[row], want, atol=LOGIT_ATOL, rtol=0), (row, float((logits[row] - want).abs().max()))


def test_default_path_batched_decode_is_bit_equal_to_alone(smollm2_file, monkeypatch):
    """On the CPU kernels a batched decode step is one fused call per layer
    half for all the sequences (GEMV rows are independent, each sequence's
    attention chunks are its own): the logits equal the alone ones bit for bit."""
    from strata_kernels import cpu_kernels

    fast = strata_runtime.load(smollm2_file, progress=False, context_length=1024, parallel=4,
                               conversation_cache_mib=0)
    assert fast.props()["cpu_kernels"] != "unused"
    ids = [fast.tokenize(t) for t in TEXTS[:4]]
    caches = [KVCache.on_pool(fast.scheduler.pool, fast.context_length) for _ in ids]
    with torch.inference_mode():
        firsts = [int(prefill(fast.model, c, x).argmax()) for c, x in zip(caches, ids)]
        rows = []
        kernels = cpu_kernels.built()
        real = kernels.attention_block
        monkeypatch.setattr(kernels, "attention_block", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
        batch = Batch(caches, [1] * len(caches))
        batched = fast.model(torch.tensor(firsts), batch.positions, batch, last_only=True)
        monkeypatch.undo()
    assert rows == [4] * len(fast.model.layers)  # every layer fused, the four sequences in one call
    for i, x in enumerate(ids):
        assert torch.equal(batched[i], _alone(fast, x, 2)[1][1]), i


@pytest.mark.parametrize("size", [2, 4, 8])
def test_greedy_tokens_alone_and_in_batches(exact, size):
    """``size`` sequences of different prompt lengths and lengths of output,
    through the scheduler with room for ``size // 2 + 1`` at once: later ones
    are admitted at later steps, as earlier ones finish."""
    scheduler = exact.scheduler
    texts = TEXTS[:size]
    steps = [6 + 3 * (i % 3) for i in range(size)]
    saved, scheduler.peak_running = scheduler.max_running, 0
    scheduler.max_running = size // 2 + 1
    try:
        seqs = [scheduler.submit(exact.tokenize(t), SamplingParams(max_tokens=n, temperature=0))
                for t, n in zip(texts, steps)]
        scheduler.run_until(lambda: all(s.done for s in seqs))
    finally:
        scheduler.max_running = saved
    assert scheduler.peak_running == size // 2 + 1
    for t, n, seq in zip(texts, steps, seqs):
        tokens, logits = _alone(exact, exact.tokenize(t), n)
        eos = [i for i, tok in enumerate(tokens) if tok in exact.tokenizer.end_of_generation]
        if eos:
            tokens, logits = tokens[:eos[0]], logits[:eos[0]]
        _check_greedy(tokens, logits, seq.generated)


def test_seeded_sampling_is_the_same_alone_and_batched(exact):
    sampling = dict(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    alone = [exact.generate_many([t], **sampling)[0].text for t in TEXTS[:3]]
    together = [c.text for c in exact.generate_many(TEXTS[:3], **sampling)]
    assert together == alone


def test_a_sliding_window_wraps_inside_a_batch(model_file):
    """Gemma's sliding layers (window 512, a ring of 1,024 positions): one
    sequence of 1,100 prompt tokens wraps its ring while a short one decodes beside it."""
    exact = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=1536, parallel=2,
                                conversation_cache_mib=0)
    assert any(s.window == 512 for s in exact.model.state_spec())
    long_ids = (exact.tokenize(" ".join(TEXTS)) * 12)[:1100]
    short_ids = exact.tokenize(TEXTS[4])
    seqs = [exact.scheduler.submit(x, SamplingParams(max_tokens=5, temperature=0)) for x in (short_ids, long_ids)]
    exact.scheduler.run_until(lambda: all(s.done for s in seqs))
    for x, seq in zip((short_ids, long_ids), seqs):
        tokens, logits = _alone(exact, x, 5)
        _check_greedy(tokens, logits, seq.generated)


def test_kv_is_allocated_once_and_a_small_pool_preempts(smollm2_file, monkeypatch):
    """100 mixed requests allocate no KV storage after load; with a pool too
    small for all of them at once, every request completes with the tokens
    of an unconstrained run, and the preemptions are counted."""
    small = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=512, parallel=4,
                                kv_memory_mib=10, conversation_cache_mib=0)  # 7 blocks of 32 positions
    roomy = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=512, parallel=4,
                                conversation_cache_mib=0)
    allocations = []
    real_allocate = KVStore.allocate.__func__
    monkeypatch.setattr(KVStore, "allocate", classmethod(lambda cls, *a, **k: allocations.append(a) or
                                                         real_allocate(cls, *a, **k)))
    prompts = [TEXTS[i % len(TEXTS)] + " " * (i % 5) for i in range(100)]
    got = small.generate_many(prompts[:8], max_tokens=64, temperature=0)
    got += small.generate_many(prompts[8:], max_tokens=2, temperature=0)
    assert allocations == []
    counters = small.scheduler.counters
    assert counters["preemptions_recomputed"] >= 1, dict(counters)
    assert all(c.finish_reason in ("stop", "length") for c in got) and len(got) == 100
    want = roomy.generate_many(prompts[:8], max_tokens=64, temperature=0)
    assert roomy.scheduler.counters["preemptions_recomputed"] == 0
    for prompt, g, w in zip(prompts, got, want):
        if g.tokens != w.tokens:  # a recomputed sequence read its tokens as a prompt: only a near-tie may part
            _, logits = _alone(roomy, roomy.tokenize(prompt), len(w.tokens))
            _check_greedy(w.tokens, logits, g.tokens)


def test_a_preempted_sequence_is_parked_when_the_staging_pool_has_room(smollm2_file):
    """The same small pool with a conversation cache: a preempted sequence is
    parked to the host (counted as ``parked``, none recomputed) and resumes
    from its parked state with the tokens of an unconstrained run."""
    small = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=512, parallel=4,
                                kv_memory_mib=10, conversation_cache_mib=64, min_free_mib=0)
    roomy = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=512, parallel=4,
                                conversation_cache_mib=0)
    prompts = TEXTS[:6]
    got = small.generate_many(prompts, max_tokens=48, temperature=0)
    counters = small.scheduler.counters
    assert counters["preemptions_parked"] >= 1 and counters["preemptions_recomputed"] == 0, dict(counters)
    assert small.stats()["restored"] >= 1, small.stats()
    want = roomy.generate_many(prompts, max_tokens=48, temperature=0)
    for prompt, g, w in zip(prompts, got, want):
        if g.tokens != w.tokens:
            _, logits = _alone(roomy, roomy.tokenize(prompt), len(w.tokens))
            _check_greedy(w.tokens, logits, g.tokens)


def test_two_alternating_conversations_stay_on_the_device(smollm2_file):
    """The seed's case: two clients alternate two conversations with room
    for both (``parallel=2``): nothing is parked or restored, and each
    returning turn reuses as many tokens as it would had the other
    conversation never run (its first token comes as soon as a live
    continuation's)."""
    both = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=1024, parallel=2,
                               conversation_cache_mib=64, min_free_mib=0)
    alone = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=1024, parallel=2,
                                conversation_cache_mib=64, min_free_mib=0)
    talks = {"a": [{"role": "user", "content": "Tell me about the river Danube."}],
             "b": [{"role": "user", "content": "Explain what a prime number is."}]}
    follow_ups = {"a": ["Which countries does it cross?", "How long is it?"],
                  "b": ["Is 91 prime?", "And 97?"]}
    cached = {"a": [], "b": []}
    for turn in range(3):
        for name in ("a", "b"):
            reply = both.chat(talks[name], max_tokens=12, temperature=0)
            cached[name].append(reply.cached_tokens)
            if name == "a":
                assert alone.chat(talks[name], max_tokens=12, temperature=0).cached_tokens == reply.cached_tokens
            if turn < 2:
                talks[name] = talks[name] + [{"role": "assistant", "content": reply.text},
                                             {"role": "user", "content": follow_ups[name][turn]}]
    stats = both.stats()
    assert stats.get("parked", 0) == 0 and stats.get("restored", 0) == 0 and stats["parked_now"] == 0, stats
    assert all(n > 40 for n in cached["a"][1:] + cached["b"][1:]), cached  # whole earlier turns reused
    assert both.scheduler.counters["prefix_copies"] == 1  # b's first turn shares a's system prompt


def test_n_choices_read_the_prompt_once_and_each_equals_its_seed_alone(exact):
    """``generate_n``: the first choice reads the prompt, the others copy its
    state (counted as prefix copies, each reporting the prompt as cached)
    and decode beside it; choice ``i`` gives the tokens ``seed + i`` gives alone."""
    prompt = exact.tokenize(TEXTS[0])
    before = exact.scheduler.counters["prefix_copies"]
    choices = exact.generate_n(prompt, 3, max_tokens=12, temperature=0.9, seed=11, cache_scope="n-choices")
    assert exact.scheduler.counters["prefix_copies"] - before == 2
    assert [c.cached_tokens for c in choices[1:]] == [len(prompt) - 1] * 2
    alone = [exact.generate(prompt, max_tokens=12, temperature=0.9, seed=11 + i, cache_scope=f"alone-{i}")
             for i in range(3)]
    assert [c.tokens for c in choices] == [c.tokens for c in alone]
    assert len({tuple(c.tokens) for c in choices}) > 1
    with pytest.raises(ValueError, match="1..16"):
        exact.generate_n(prompt, 0)

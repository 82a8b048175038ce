"""Speculative decoding (``--spec suffix``): the output is the output without it.

Each test runs the same requests on two engines of one model, one with the
suffix drafter and one without, and compares the generated token ids: greedy
token for token (real models on the default path, tiny models of every
architecture, alone and in batches), seeded sampling token for token (one
random draw per token: the verify samples each position as plain decoding
does) and, over many seeds, as a distribution. Every test also checks that
drafts were proposed and accepted (else it would compare two plain runs),
and the fault tests that verifies were skipped, counted, and nothing failed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from scipy.stats import chi2_contingency

import strata_runtime
from strata_runtime.errors import ModelFileError
from strata_runtime.scheduling.batch import Batch
from strata_runtime.models.generation import decode_step, prefill
from strata_runtime.state.kv_pool import KVPool
from strata_runtime.scheduling.sampling import Sampler, SamplingParams
from strata_runtime.scheduling.scheduler import Scheduler
from strata_runtime.scheduling.sequence import Generation
from strata_runtime.speculation.verify import make_drafter, spare_states
from strata_runtime.testing import inject_fault
from tiny_hybrid import HybridShape, write_hybrid_model
from tiny_models import Shape, write_tiny_model

CODE = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
        "class Calculator:\n    def __init__(self):\n        self.total = 0\n\n"
        "    def push(self, value):\n        self.total += value\n        return self.total\n")
# Requests whose answers repeat what the prompt holds (what speculation is for), and one that does not.
REWRITE = [{"role": "user", "content": f"Rename add to plus and rewrite the whole file:\n\n{CODE}"}]
QUOTE = [{"role": "user", "content": f"Repeat this text exactly, twice:\n\n{CODE}"}]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def _pair(path, **options):
    """Two engines of ``path``: speculating (suffix) and not."""
    options = {"progress": False, "conversation_cache_mib": 0, **options}
    return (strata_runtime.load(path, spec="suffix", **options), strata_runtime.load(path, spec="off", **options))


def _spec(engine) -> dict:
    return {k: v for k, v in engine.scheduler.counters.items() if k.startswith("spec_")}


def _assert_speculated(engine, before: dict | None = None) -> None:
    before = before or {}
    now = _spec(engine)
    assert now["spec_drafts"] > before.get("spec_drafts", 0), f"nothing was drafted: {now}"
    assert now["spec_accepted_tokens"] > before.get("spec_accepted_tokens", 0), f"no draft token accepted: {now}"


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_file):
    return _pair(smollm2_file, context_length=2048, parallel=4)


@pytest.fixture(scope="module", params=["gemma", "smollm2"])
def real_pair(request, model_file, smollm2_pair):
    """Both real models on the default path (the one users run): Gemma's
    sliding layers keep rings, SmolLM2 full attention only."""
    if request.param == "smollm2":
        return smollm2_pair
    return _pair(model_file, context_length=2048, parallel=4)


def test_greedy_output_is_the_output_without_speculation(real_pair):
    spec, plain = real_pair
    for messages in (REWRITE, QUOTE, PROSE):
        a = spec.chat(messages, temperature=0, max_tokens=64)
        b = plain.chat(messages, temperature=0, max_tokens=64)
        assert a.tokens == b.tokens, (messages[0]["content"][:40], a.text, b.text)
        assert a.finish_reason == b.finish_reason
    _assert_speculated(spec)
    props = spec.props()["speculative"]
    assert props == {"requested": "suffix", "mode": "suffix", "tokens": 7, "refusal": None}


def test_batched_greedy_output_is_the_output_without_speculation(real_pair):
    """Four prompts decoded together (verifies and plain decode rows in one step), as alone."""
    spec, plain = real_pair
    prompts = [spec.chat_prompt(m) for m in (REWRITE, QUOTE, PROSE)]
    before = _spec(spec)
    together = spec.generate_many(prompts, temperature=0, max_tokens=48)
    for prompt, got in zip(prompts, together):
        assert got.tokens == plain.generate(prompt, temperature=0, max_tokens=48).tokens
    _assert_speculated(spec, before)
    assert spec.scheduler.peak_running >= 2


def test_seeded_sampling_and_stop_strings_are_as_without_speculation(smollm2_pair):
    """A seeded sampler draws one number per token in both; a stop string
    inside a verify's tokens ends the answer where plain decoding ends it."""
    spec, plain = smollm2_pair
    before = _spec(spec)
    for seed in range(3):
        a = spec.chat(QUOTE, temperature=0.7, seed=seed, max_tokens=64)
        b = plain.chat(QUOTE, temperature=0.7, seed=seed, max_tokens=64)
        assert a.tokens == b.tokens and a.text == b.text
    a = spec.chat(QUOTE, temperature=0, max_tokens=96, stop=["Output"])
    b = plain.chat(QUOTE, temperature=0, max_tokens=96, stop=["Output"])
    assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
    assert b.finish_reason == "stop"
    # max_tokens just past the stop string: a verify may yield both in one step; the stop string wins, as it would.
    for extra in (0, 1, 3):
        n = len(b.tokens) + extra
        a = spec.chat(QUOTE, temperature=0, max_tokens=n, stop=["Output"])
        c = plain.chat(QUOTE, temperature=0, max_tokens=n, stop=["Output"])
        assert (a.tokens, a.text, a.finish_reason) == (c.tokens, c.text, c.finish_reason), extra
    _assert_speculated(spec, before)


def test_sliding_rings_wrap_under_verifies_and_the_conversation_comes_back(model_file):
    """Gemma's sliding layers (window 512, rings of 1,024 slots) past the
    wrap, verifies cut back there; the conversation is parked (another one
    takes the device) and returns for a second turn: the same tokens as
    without speculation, each turn."""
    spec, plain = _pair(model_file, context_length=2048, parallel=1, conversation_cache_mib=128, min_free_mib=0)
    numbered = "".join(f"# part {i}\n{CODE}" for i in range(13))
    first = [{"role": "user", "content": f"{numbered}\nRepeat the last part."}]
    assert 1024 - 64 < len(spec.chat_prompt(first)) < 1024  # the answer's verifies wrap the rings
    answers = [e.chat(first, temperature=0, max_tokens=64) for e in (spec, plain)]
    assert answers[0].tokens == answers[1].tokens
    for e in (spec, plain):
        e.chat(PROSE, temperature=0, max_tokens=4)  # parks the first conversation
    second = first + [{"role": "assistant", "content": answers[0].text},
                      {"role": "user", "content": "Now the first part."}]
    again = [e.chat(second, temperature=0, max_tokens=48) for e in (spec, plain)]
    assert again[0].tokens == again[1].tokens
    assert spec.conversations.stats()["restored"] >= 1
    _assert_speculated(spec)


def test_a_ring_cut_back_after_a_rejected_draft_vouches_only_for_what_it_holds(model_file):
    """A verify past the wrap of Gemma's rings, its whole draft wrong, cut
    back: every position the cache then holds (``export``) is what one
    decode step wrote (verify rows are decode rows: the same bits), and the
    slots the rejected positions overwrote are outside (``state.DRAFT_MARGIN``)."""
    engine = strata_runtime.load(model_file, progress=False, conversation_cache_mib=0, context_length=2048)
    ids = (engine.tokenize(CODE) * 40)[:1031]
    caches = [engine.new_cache(2048) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            prefill(engine.model, cache, ids[:1030])
        decode_step(engine.model, caches[0], ids[1030])
        verify = Batch([caches[1]], [8], verifies=1)  # the last token and 7 wrong draft tokens
        engine.model(torch.tensor([ids[1030], *[ids[5]] * 7]), verify.positions, verify, last_only=True)
    assert caches[1].trim(1031) == 1031
    plain, cut = caches[0].export(), caches[1].export()
    assert plain.length == cut.length == 1031
    for a, b in zip(plain.layers, cut.layers):
        assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("point", ["verify", "verify_forward"])
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_verify_that_fails_for_memory_is_skipped_and_the_request_served(smollm2_pair, point, rate):
    """Out of memory at planning (``verify``) or after a verify's forward
    wrote every position (``verify_forward``), always and at random: the
    step decodes one token instead, counted; the output is unchanged."""
    spec, plain = smollm2_pair
    before = _spec(spec)
    with inject_fault(point, rate=rate, seed=3) as fault:
        got = spec.chat(REWRITE, temperature=0, max_tokens=64)
    assert got.tokens == plain.chat(REWRITE, temperature=0, max_tokens=64).tokens
    assert fault.fired > 0
    skipped = _spec(spec)["spec_skipped_out_of_memory"] - before.get("spec_skipped_out_of_memory", 0)
    assert skipped == fault.fired
    assert spec.scheduler.counters["failed_steps"] == 0
    if rate < 1.0:
        _assert_speculated(spec, before)
    else:
        assert _spec(spec)["spec_drafts"] == before["spec_drafts"]


def test_verifies_failing_at_both_points_beside_another_sequence_leave_the_outputs_unchanged(model_file):
    """Two sequences decoding together, out of memory at random at both
    verify points: a step then mixes a plain row and a verify, or runs again
    without its verifies, so consecutive steps may start at the same
    position with the same row count and other positions after it. The
    outputs are those without speculation (these seeds gave one sequence
    another sequence's rotations when the rotary tables were keyed on the
    first position and the count; ``test_server_faults`` met it one run in four)."""
    code = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(6))
    prompts = [f"Repeat this code exactly:\n\n{code}", f"Copy this, then say done:\n\n{code}"]
    spec, plain = _pair(model_file, context_length=512, parallel=2)
    prompts = [spec.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    want = [plain.generate(p, temperature=0, max_tokens=48).tokens for p in prompts]
    for seed in (8, 31):
        with inject_fault("verify_forward", rate=0.5, seed=seed) as after, \
                inject_fault("verify", rate=0.3, seed=seed + 1000) as planned:
            got = [c.tokens for c in spec.generate_many(prompts, temperature=0, max_tokens=48)]
        assert got == want, (seed, [spec.detokenize(g) for g in got])
        assert after.fired > 0 and planned.fired > 0
    assert spec.scheduler.counters["failed_steps"] == 0


def _scheduler(engine, sequences: float, spec: bool, chunk_tokens: int = 512, running: int = 1) -> Scheduler:
    """A scheduler over ``engine``'s model with a pool of ``sequences`` full sequences' blocks."""
    model = engine.model
    pool = KVPool.for_sequences(engine.config.kv, model.state_spec(), model.placement, sequences,
                                engine.context_length, model.compute_path.kv_float)
    return Scheduler(model, pool, engine.context_length, engine.tokenizer.end_of_generation, max_running=running,
                     chunk_tokens=chunk_tokens, drafter=make_drafter("suffix" if spec else "off", 7))


def _run(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    seqs = [scheduler.submit(p, SamplingParams(temperature=0, max_tokens=max_tokens)) for p in prompts]
    scheduler.run_until(lambda: all(s.done for s in seqs))
    return [(s.generated, s.finish_reason, len(s.tokens)) for s in seqs]


def test_the_step_budget_and_a_full_pool_skip_verifies(tmp_path):
    """Drafts share the rows a step may carry, one row per sequence in turn
    (at most the GEMV's 8 decode rows; the prompt-chunk budget too): a
    sequence left without one decodes plainly ("budget"). A pool without a
    free block for a draft's positions skips it ("kv_blocks", never
    preempting for it), until the sequence has every block. Outputs unchanged."""
    engine = strata_runtime.load(write_tiny_model(tmp_path / "llama.gguf", "llama", Shape(), seed=5),
                                 dtype="float32", progress=False, conversation_cache_mib=0)
    prompts = _tiny_prompts(engine)
    # One sequence, 4 blocks of 32 positions, a step budget of 4 rows.
    spec, plain = (_scheduler(engine, 0.5, s, chunk_tokens=4) for s in (True, False))
    alone = _run(spec, prompts[:1], 200)
    assert alone == _run(plain, prompts[:1], 200) and alone[0][1] == "length"
    assert alone[0][2] in (128, 129)  # the pool's 128 positions (and the last token, never written)
    counts = spec.counters
    assert counts["spec_skipped_kv_blocks"] > 0 and counts["preemptions_recomputed"] == 0, counts
    assert counts["spec_accepted_tokens"] > 0 and counts["spec_accepted_at_4"] == 0, counts  # drafts cut to 4
    # Three sequences, 5 decode rows a step: 2 draft rows to share.
    spec, plain = (_scheduler(engine, 3, s, running=3) for s in (True, False))
    spec.speculation.step_rows = 5
    together = _run(spec, prompts, 100)
    assert together == _run(plain, prompts, 100)
    counts = spec.counters
    assert counts["spec_skipped_budget"] > 0 and counts["spec_accepted_tokens"] > 0, counts


def _tiny_prompts(engine) -> list[list[int]]:
    """Prompts whose continuations repeat (tiny random models loop, and the drafter finds the loop)."""
    text = "def f(x):\n    return x ** 2  # squares\n\nprint(f(3))"
    return [engine.tokenizer.encode(text)[:n] for n in (20, 9, 14)]


@pytest.mark.parametrize("arch,shape", [
    ("llama", Shape()), ("qwen2", Shape(hidden=96, heads=6, kv_heads=2, head_dim=16, tied=False)),
    ("qwen3", Shape(hidden=64, heads=4, kv_heads=2, head_dim=32)),
    ("qwen3moe", Shape(experts=4, experts_per_token=2, expert_ffn=32))])
def test_tiny_models_of_every_family_alone_and_in_batches(tmp_path, arch, shape):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, shape, seed=5)
    spec, plain = _pair(path, dtype="float32", context_length=256, parallel=3)
    prompts = _tiny_prompts(spec)
    alone = [plain.generate(p, temperature=0, max_tokens=120).tokens for p in prompts]
    assert [spec.generate(p, temperature=0, max_tokens=120).tokens for p in prompts] == alone
    assert [c.tokens for c in spec.generate_many(prompts, temperature=0, max_tokens=120)] == alone
    _assert_speculated(spec)


class OracleDrafter:
    """Drafts what plain decoding will write (``answers``: each prompt with
    its greedy continuation), every ``wrong``-th position of a draft made
    wrong: a verify that accepts some of its draft and rejects the rest.
    (A tiny random model writes no text the suffix drafter could match.)"""

    def __init__(self, answers: list[list[int]], wrong: int = 3, length: int = 5):
        self.answers, self.wrong, self.length = answers, wrong, length

    def propose(self, sequence) -> list[int]:
        tokens = list(sequence.tokens)
        for answer in self.answers:
            if answer[:len(tokens)] == tokens:
                draft = answer[len(tokens):len(tokens) + self.length]
                return [t if (len(tokens) + i) % self.wrong else (t + 1) % 300 for i, t in enumerate(draft)]
        return []

    def feedback(self, sequence, proposed: int, accepted: int) -> None:
        pass

    def release(self, sequence) -> None:
        pass


@pytest.mark.parametrize("faults", [(), (("verify", 0.3), ("verify_copy", 0.3), ("verify_forward", 0.3)),
                                    (("verify_copy", 1.0),), (("verify_forward", 1.0),)])
def test_a_hybrid_model_verifies_through_spare_recurrent_slots(tmp_path, faults):
    """Qwen3-Next style (Gated DeltaNet layers and attention, experts): a
    step with verifies writes every sequence's recurrent state to spare
    slots and adopts the accepted position's; alone, in batches (verifies
    beside plain decode rows and prompt chunks) and with out-of-memory at
    every verify fault point at random, and always in the state copy or the
    forward (each such step runs again without drafts): the output of plain
    decoding, and every spare slot back in the pool."""
    path = write_hybrid_model(tmp_path / "hybrid.gguf", HybridShape(), 11)
    engine = strata_runtime.load(path, dtype="float32", progress=False, conversation_cache_mib=0,
                                 context_length=256, parallel=3, spec="suffix")
    assert engine.props()["speculative"]["mode"] == "suffix"
    assert engine.scheduler.pool.groups[-1].n_blocks == 3 + spare_states("suffix", engine.model.state_spec(), 3)
    prompts = _tiny_prompts(engine)
    plain = _scheduler(engine, 3, False, running=3)
    alone = [_run(plain, [p], 60)[0] for p in prompts]
    model = engine.model
    pool = KVPool.for_sequences(engine.config.kv, model.state_spec(), model.placement, 3, 256,
                                model.compute_path.kv_float, spare_states=11)
    spec = Scheduler(model, pool, 256, engine.tokenizer.end_of_generation, max_running=3,
                     drafter=OracleDrafter([p + a[0] for p, a in zip(prompts, alone)]), spec_tokens=5)
    with contextlib.ExitStack() as stack:
        armed = [stack.enter_context(inject_fault(p, rate=rate, seed=i)) for i, (p, rate) in enumerate(faults)]
        assert [_run(spec, [p], 60)[0] for p in prompts] == alone
        assert _run(spec, prompts, 60) == alone
    counts = spec.counters
    if any(rate == 1.0 for _, rate in faults):  # no verify got through
        assert counts["spec_drafts"] == 0 and counts["spec_skipped_out_of_memory"] > 0, counts
    else:
        assert 0 < counts["spec_accepted_tokens"] < counts["spec_draft_tokens"], counts
    assert all(f.fired for f in armed) and counts["failed_steps"] == 0
    # One skip per verify planned while ``verify`` fired; per verify in the step where the others fired.
    assert counts["spec_skipped_out_of_memory"] >= sum(f.fired for f in armed)
    held = sum(r.cache.held_blocks for r in spec.residents)
    assert sum(pool.free_blocks()) + held == pool.total_blocks()


def test_sampled_tokens_are_distributed_as_without_speculation(tmp_path):
    """150 seeded runs of a short prompt each way: the tokens at positions
    2-7 are the same run by run, and their distributions (chi-squared test of
    homogeneity, with draft rejections seen) cannot be told apart at 99.9%."""
    path = write_tiny_model(tmp_path / "llama.gguf", "llama", Shape(), seed=5)
    spec, plain = _pair(path, dtype="float32", context_length=256)
    prompt = _tiny_prompts(spec)[0][:5]  # where this model's continuations vary at temperature 3, and loop
    runs = 150
    params = dict(temperature=3.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=8)
    with_spec = [spec.generate(prompt, seed=s, **params).tokens for s in range(runs)]
    without = [plain.generate(prompt, seed=s, **params).tokens for s in range(runs)]
    assert with_spec == without
    counts = _spec(spec)
    assert counts["spec_accepted_tokens"] > 0 and counts["spec_accepted_tokens"] < counts["spec_draft_tokens"], counts
    for position in range(2, 8):
        a = [t[position] for t in with_spec if len(t) > position]
        b = [t[position] for t in without if len(t) > position]
        tokens = sorted(set(a) | set(b))
        table = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
        if len(tokens) > 1:
            assert chi2_contingency(table).pvalue > 1e-3, (position, table)


def test_a_draft_model_sharing_the_vocabulary_drafts_and_the_output_is_unchanged(tmp_path):
    """``spec="draft"``: the target's own file as its draft (every greedy
    draft right) and a smaller model of the same vocabulary (drafts
    rejected too), alone and in batches: the output of plain decoding."""
    target = write_tiny_model(tmp_path / "target.gguf", "llama", Shape(), seed=5)
    small = write_tiny_model(tmp_path / "small.gguf", "llama", Shape(hidden=32, heads=2, kv_heads=1, ffn=48), seed=6)
    options = dict(dtype="float32", progress=False, conversation_cache_mib=0, context_length=256, parallel=3)
    plain = strata_runtime.load(target, **options)
    prompts = _tiny_prompts(plain)
    alone = [plain.generate(p, temperature=0, max_tokens=60).tokens for p in prompts]
    for draft in (target, small):
        spec = strata_runtime.load(target, spec="draft", draft_model=str(draft), **options)
        assert spec.props()["speculative"]["draft_model"] == str(draft)
        assert [spec.generate(p, temperature=0, max_tokens=60).tokens for p in prompts] == alone
        assert [c.tokens for c in spec.generate_many(prompts, temperature=0, max_tokens=60)] == alone
        counts = _spec(spec)
        assert counts["spec_drafts"] > 0, counts
        if draft == target:
            assert counts["spec_accepted_tokens"] == counts["spec_draft_tokens"], counts
        else:
            assert counts["spec_accepted_tokens"] < counts["spec_draft_tokens"], counts
        # Every draft cache went back to the draft model's pool with its sequence.
        drafter = spec.scheduler.speculation.drafter
        assert not drafter._states and sum(drafter.pool.free_blocks()) == drafter.pool.total_blocks()


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(tmp_path, smollm2_file):
    target = write_tiny_model(tmp_path / "target.gguf", "llama", Shape(), seed=5)
    with pytest.raises(ModelFileError, match="vocabulary .* is not the target's"):
        strata_runtime.load(target, spec="draft", draft_model=str(smollm2_file), progress=False,
                            conversation_cache_mib=0)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="spec must be one of"):
        strata_runtime.EngineConfig(spec="eagle")
    with pytest.raises(ValueError, match="spec_tokens must be a whole number in 1..15"):
        strata_runtime.EngineConfig(spec="suffix", spec_tokens=16)
    with pytest.raises(ValueError, match="spec='draft' needs draft_model"):
        strata_runtime.EngineConfig(spec="draft")
    with pytest.raises(ValueError, match="draft_model is used with spec='draft' only"):
        strata_runtime.EngineConfig(spec="suffix", draft_model="small.gguf")
    assert SamplingParams(temperature=0).greedy


def test_tokens_after_a_stop_string_are_dropped_and_the_stop_string_ends_the_answer():
    """A verify yields several tokens a step: the ones after a stop string go,
    and the answer ends "stop" even where the same step reached max_tokens
    (decoding one token a step, the stop string would have come first)."""
    seq = Generation(0, [1, 2], SamplingParams(), sampler=Sampler(SamplingParams()), max_tokens=3,
                     tokens=[1, 2, 3, 4, 5], generated=[3, 4, 5])
    seq.cancel("length")
    seq.stop(unused=2)
    assert (seq.generated, seq.tokens, seq.finish_reason, seq.done) == ([3], [1, 2, 3], "stop", True)
    seq = Generation(1, [1], SamplingParams(), sampler=Sampler(SamplingParams()), max_tokens=9,
                     tokens=[1, 7], generated=[7])
    seq.cancel("length")
    seq.stop()  # nothing after the stop string: whatever ended the sequence stands
    assert (seq.generated, seq.finish_reason) == ([7], "length")

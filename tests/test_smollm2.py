"""SmolLM2 135M Instruct (architecture ``llama``): chat, the conversation
cache, a layer split. Its agreement with the references is in
``test_reference_parity.py``, the default path's with the exact one in
``test_fast_path.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import strata_runtime

DATA = Path(__file__).parent / "data"


def test_chat_answers_and_stops_at_its_end_of_turn(smollm2):
    reply = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
                         temperature=0)
    assert "Paris" in reply.text and reply.finish_reason == "stop"
    assert smollm2.tokenizer.ids["<|im_end|>"] in smollm2.tokenizer.end_of_generation


def test_alternating_conversations_equal_cold_runs(smollm2_file):
    warm = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=1024, parallel=1,
                               conversation_cache_mib=64,
                               min_free_mib=0)
    cold = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=1024, conversation_cache_mib=0)
    a = [{"role": "user", "content": "Tell me about the river Danube."}]
    b = [{"role": "user", "content": "Explain what a prime number is."}]
    order = [a, b, a + [{"role": "assistant", "content": "It is a long river."},
                        {"role": "user", "content": "Which countries does it cross?"}],
             b + [{"role": "assistant", "content": "A number with two divisors."},
                  {"role": "user", "content": "Is 91 prime?"}]]
    got = [warm.chat(m, max_tokens=6, temperature=0) for m in order]
    want = [cold.generate(warm.chat_prompt(m), max_tokens=6, temperature=0).tokens for m in order]
    assert [g.tokens for g in got] == want
    assert warm.stats()["restored"] >= 1 and got[2].cached_tokens > 10
    assert warm.stats().get("checkpoint_skipped", 0) == 0  # no running state: nothing to checkpoint


def test_a_layer_split_gives_the_logits_and_tokens_of_one_stage(smollm2, smollm2_file):
    split = strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=512, devices=["cpu", "cpu"],
                                layer_split=[15], conversation_cache_mib=0)
    assert split.props()["stages"] == [{"device": "cpu", "layers": [0, 14]}, {"device": "cpu", "layers": [15, 29]}]
    reference = json.loads((DATA / "smollm2-135m-instruct-q4_1.float32.json").read_text())
    for case in reference["teacher_forced"]:
        tokens = case["tokens"][:300]
        assert torch.allclose(smollm2.logits(tokens), split.logits(tokens), atol=1e-5, rtol=0)
    for case in reference["greedy"][:3]:
        assert split.generate(case["prompt_tokens"], max_tokens=8, temperature=0).tokens == \
            smollm2.generate(case["prompt_tokens"], max_tokens=8, temperature=0).tokens

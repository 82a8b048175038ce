"""A layer split run in one process (two stages on cpu/cpu) against one stage."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import strata_runtime
from strata_runtime.split.pipeline import Pipeline
from strata_runtime.files.placement import SplitError


@pytest.fixture(scope="module")
def split(model_file):
    # parallel=1: one conversation on the device at a time, so alternating
    # prompts park and restore through the stages.
    return strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512, devices=["cpu", "cpu"],
                               layer_split=[9], conversation_cache_mib=64, min_free_mib=0, checkpoint_every=32,
                               parallel=1)


def test_two_stages_give_the_logits_and_greedy_tokens_of_one(engine, split, reference_float32):
    assert isinstance(split.model, Pipeline)
    assert split.props()["stages"] == [{"device": "cpu", "layers": [0, 8]}, {"device": "cpu", "layers": [9, 17]}]
    for case in reference_float32["teacher_forced"]:
        one, two = engine.logits(case["tokens"]), split.logits(case["tokens"])
        assert torch.allclose(one, two, atol=1e-5, rtol=0), float((one - two).abs().max())
    for case in reference_float32["greedy"]:
        assert split.generate(case["prompt_tokens"], max_tokens=16, temperature=0).tokens == \
            engine.generate(case["prompt_tokens"], max_tokens=16, temperature=0).tokens


def test_the_stages_park_and_restore_conversations_like_one(engine, split):
    """Alternating prompts through the split's conversation cache equal cold runs of one stage."""
    prompts = [engine.tokenize(t * 6) for t in ("The printing press came to Venice in 1469. ",
                                                 "Bread needs flour, water and salt. ")]
    order = [prompts[0], prompts[1], prompts[0] + prompts[1][1:4], prompts[1] + prompts[0][1:4]]
    warm = [split.generate(p, max_tokens=4, temperature=0) for p in order]
    cold = [strata_runtime.load(engine.gguf.path, dtype="float32", progress=False, context_length=512, conversation_cache_mib=0)
            .generate(p, max_tokens=4, temperature=0).tokens for p in order]
    assert [w.tokens for w in warm] == cold
    assert split.stats()["restored"] >= 1 and any(w.cached_tokens > 20 for w in warm[2:])


def test_a_split_decodes_sequences_together_like_one_stage(engine, model_file):
    """A batch of sequences through the stages (each stage's layers read
    their own blocks of the pool) gives one stage's greedy tokens."""
    split = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512,
                                devices=["cpu", "cpu"], layer_split=[9], parallel=3, conversation_cache_mib=0)
    prompts = ["The printing press came to Venice in", "Bread needs flour, water and", "The three largest rivers are"]
    together = split.generate_many(prompts, max_tokens=6, temperature=0)
    assert split.scheduler.peak_running == 3
    assert [t.tokens for t in together] == [engine.generate(p, max_tokens=6, temperature=0).tokens for p in prompts]


@pytest.mark.parametrize("options, message", [
    (dict(devices=["cpu", "cpu"], layer_split=[30]), "out of range"),
    (dict(devices=["cpu", "cpu"], layer_split=[5, 9]), "makes 3 stages but 2 devices"),
    (dict(devices=["cpu", "cpu", "cpu"], layer_split=[9, 4]), "strictly increasing"),
    (dict(devices=["cpu", "gpu"]), "is not 'cpu', 'cuda' or 'cuda:N'"),
])
def test_bad_split_arguments_fail_before_loading(model_file, options, message):
    with pytest.raises(SplitError, match=message):
        strata_runtime.load(model_file, dtype="float32", progress=False, **options)


def test_layer_split_without_devices_is_refused(model_file):
    with pytest.raises(ValueError, match="layer_split needs devices"):
        strata_runtime.load(model_file, dtype="float32", progress=False, layer_split=[9])


def test_cli_generates_through_a_split(model_file):
    args = ["--model", str(model_file), "--context-length", "128", "--temperature", "0", "-n", "6",
            "--conversation-cache-mib", "0"]
    one = subprocess.run([sys.executable, "-m", "strata_server.cli", "generate", "The capital of France is", *args],
                         capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "strata_server.cli", "generate", "The capital of France is", *args,
                          "--devices", "cpu,cpu", "--layer-split", "6"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout


@pytest.mark.gpu
def test_a_split_across_the_cpu_and_a_gpu_matches_one_stage(engine, model_file, reference_float32):
    """Stage 0 on the CPU (exact), stage 1 on CUDA (GGUF blocks through the
    Triton kernels): the hidden state crosses devices at layer 9."""
    split = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512, devices=["cpu", "cuda:0"],
                                layer_split=[9])
    assert {s.k.device.type for s in split.new_cache(16).stores} == {"cpu", "cuda"}
    for case in reference_float32["teacher_forced"]:
        ours, cpu = split.logits(case["tokens"]), engine.logits(case["tokens"])
        assert float((ours.argmax(-1) == cpu.argmax(-1)).float().mean()) >= 0.99
        assert float((ours - cpu).abs().max()) < 0.05


def test_a_fault_in_one_stage_part_skips_the_checkpoint_on_every_stage(engine, model_file, caplog):
    from strata_runtime.testing import inject_fault

    caplog.set_level("INFO", logger="strata_runtime.conversations.cache")
    split = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512, devices="cpu,cpu", layer_split="9",
                                conversation_cache_mib=64, min_free_mib=0, checkpoint_every=32)
    prompt = engine.tokenize("The printing press came to Venice in 1469. " * 8)
    with inject_fault("checkpoint_copy", stage=1) as fault:
        out = split.generate(prompt, max_tokens=4, temperature=0)
    assert fault.fired >= 2  # every checkpoint position of the prompt (32, 64, ...)
    assert out.tokens == engine.generate(prompt, max_tokens=4, temperature=0).tokens
    stats = split.stats()
    assert stats["checkpoint_skipped"] == fault.fired and stats.get("checkpoints_saved", 0) == 0
    assert stats["checkpoints_now"] == 0 and stats["pool_bytes_used"] == 0  # stage 0's part was given back too
    assert "in stage 1's part (of 2; skipped on every stage)" in caplog.text

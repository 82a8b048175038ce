"""The notebook API on the real default model."""

from __future__ import annotations

import pytest
import torch

import strata_runtime
from strata_runtime import Completion, StrataError
from strata_runtime.text.chat_template import ChatTemplateError

PROMPT = "The capital of France is"


def test_generate_returns_a_completion(engine, reference_llamacpp):
    case = reference_llamacpp["greedy"][0]
    out = engine.generate(PROMPT, max_tokens=12, temperature=0)
    assert isinstance(out, Completion)
    assert out.prompt_tokens == len(case["prompt_tokens"]) == 6
    assert out.completion_tokens == len(out.tokens) == 12
    assert out.finish_reason == "length"
    assert out.text == engine.detokenize(out.tokens)
    assert out.text.startswith(" the capital of")
    assert out.prefill_seconds > 0 and out.decode_seconds > 0 and out.decode_tokens_per_second > 0


def test_stream_yields_the_same_text(engine):
    pieces = list(engine.stream(PROMPT, max_tokens=12, temperature=0))
    assert len(pieces) > 1
    assert "".join(pieces) == engine.generate(PROMPT, max_tokens=12, temperature=0).text


def test_stop_string_ends_generation(engine):
    full = engine.generate(PROMPT, max_tokens=20, temperature=0).text
    assert "France" in full
    out = engine.generate(PROMPT, max_tokens=20, temperature=0, stop=["France"])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index("France")]


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROMPT, max_tokens=10, temperature=1.0, seed=42)
    b = engine.generate(PROMPT, max_tokens=10, temperature=1.0, seed=42)
    assert a.tokens == b.tokens


def test_end_of_generation_token_ends_the_loop(engine):
    """A sequence ends at an end-of-generation token, which is not among its tokens."""
    from strata_runtime.scheduling.sampling import SamplingParams
    from strata_runtime.scheduling.scheduler import Scheduler

    prompt = engine.tokenize(PROMPT)
    first = engine.generate(prompt, max_tokens=1, temperature=0).tokens[0]
    pool = engine.scheduler.pool
    free = pool.free_blocks()
    scheduler = Scheduler(engine.model, pool, engine.context_length, frozenset({first}), max_residents=0)
    seq = scheduler.submit(prompt, SamplingParams(temperature=0, max_tokens=10))
    scheduler.run_until(lambda: seq.done)
    assert seq.generated == [] and seq.finish_reason == "stop"
    assert pool.free_blocks() == free  # no resident kept: every block it took is back


def test_prefix_reuse_equals_a_cold_run(engine, model_file):
    first = engine.generate("Once upon a time, in a small village,", max_tokens=4, temperature=0)
    warm = engine.generate("Once upon a time, in a small village, there", max_tokens=8, temperature=0)
    assert warm.cached_tokens >= first.prompt_tokens - 1
    cold_engine_logits = engine.logits(engine.tokenize("Once upon a time, in a small village, there"))
    assert warm.tokens[0] == int(cold_engine_logits[-1].argmax())


def test_logits_do_not_disturb_the_live_sequence(engine):
    before = engine.generate(PROMPT, max_tokens=6, temperature=0).tokens
    engine.logits(engine.tokenize("Something else entirely"))
    after = engine.generate(PROMPT, max_tokens=6, temperature=0)
    assert after.tokens == before and after.cached_tokens == after.prompt_tokens - 1


def test_chat_template_renders_gemma_turns(engine):
    ids = engine.chat_prompt([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ])
    text = engine.tokenizer.decode(ids, special=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\n"
    assert ids.count(engine.tokenizer.bos_id) == 1
    assert engine.tokenizer.ids["<start_of_turn>"] in ids


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "x"}], "role must be one of system, developer, user, assistant, tool"),
    ([{"role": "user"}], "must be an object with 'role' and 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "must alternate"),
])
def test_bad_messages(engine, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        engine.chat(messages, max_tokens=1)


def test_props(engine, model_file):
    p = engine.props()
    assert p["architecture"] == "gemma3" and p["model"] == "Gemma 3 270m"
    assert p["context_length"] == 2048 and p["model_context_length"] == 32768
    assert p["dtype"] == "float32" and p["kv"] == "f16" and p["kv_storage"] == "float32"
    assert p["backend"] == ["cpu float32: torch ops on dense weights"]
    assert p["kv_bytes_per_token"] == 18 * 1 * (256 + 256) * 4
    assert p["path"] == str(model_file)


def test_tokenize_detokenize(engine):
    ids = engine.tokenize("Hello world")
    assert ids[0] == 2 and engine.detokenize(ids) == "Hello world"
    assert engine.tokenize("Hello world", add_bos=False) == ids[1:]


def test_bad_requests_are_clear_and_the_engine_keeps_serving(engine):
    with pytest.raises(StrataError, match="prompt is empty"):
        engine.generate([], max_tokens=1)
    with pytest.raises(StrataError, match="token id 999999999 is out of range"):
        engine.generate([2, 999999999], max_tokens=1)
    with pytest.raises(StrataError, match="the context holds 2048"):
        engine.generate([2] * 3000, max_tokens=1)
    with pytest.raises(ValueError, match="temperature must be at least 0"):
        engine.stream(PROMPT, temperature=-1)
    with pytest.raises(TypeError, match="sampling options are"):
        engine.generate(PROMPT, temprature=0)
    assert engine.generate(PROMPT, max_tokens=3, temperature=0).completion_tokens == 3


def test_generation_stops_at_the_context_end(model_file):
    small = strata_runtime.load(model_file, context_length=16, progress=False)
    out = small.generate(PROMPT, max_tokens=100, temperature=0)
    assert out.finish_reason == "length"
    assert out.prompt_tokens + out.completion_tokens == 16


def test_unknown_load_option(model_file):
    with pytest.raises(TypeError, match="unknown option.*dtpye.*load\\(\\) accepts"):
        strata_runtime.load(model_file, dtpye="float32")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        strata_runtime.load(model_file, dtype="int3")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        strata_runtime.load(model_file, device="tpu")


def test_zero_conversation_slots_with_a_pool_is_refused_at_load(model_file):
    """Issue 23, item 1: accepted before, then every request that left the
    live sequence failed in park (min() of no snapshots)."""
    with pytest.raises(ValueError, match="conversation_cache_slots must be at least 1 .*conversation_cache_mib to 0"):
        strata_runtime.load(model_file, conversation_cache_slots=0, progress=False)
    strata_runtime.EngineConfig(conversation_cache_slots=0, conversation_cache_mib=0)  # no pool: nothing to park


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(model_file):
    with pytest.raises(StrataError, match="torch sees no CUDA device; use device='cpu'"):
        strata_runtime.load(model_file, device="cuda")


@pytest.mark.gpu
def test_cuda_model_runs_on_gguf_blocks_and_matches_the_cpu(engine, model_file, reference_float32):
    from strata_runtime.models.layers import Linear

    gpu = strata_runtime.load(model_file, device="cuda", progress=False, context_length=1024)
    linears = [m for m in gpu.model.modules() if isinstance(m, Linear)]
    # Each projection in its GPU word layout where its type has one (Q4_K, Q6_K, Q8_0 ...), else its blocks.
    assert linears and all((m.planes is not None or m.qweight is not None) and m.weight is None for m in linears)
    assert any(m.planes is not None for m in linears)
    for case in reference_float32["teacher_forced"]:
        ours, cpu = gpu.logits(case["tokens"]), engine.logits(case["tokens"])
        agree = float((ours.argmax(-1) == cpu.argmax(-1)).float().mean())
        assert agree >= 0.99 and float((ours - cpu).abs().max()) < 0.05
    same = sum(
        gpu.generate(c["prompt_tokens"], max_tokens=16, temperature=0).tokens == c["generated"][:16]
        for c in reference_float32["greedy"]
    )
    assert same >= 4


def test_import_has_no_side_effects():
    import subprocess
    import sys

    code = (
        "import sys, torch; n = torch.get_num_threads();"
        "import strata_runtime, strata_kernels, strata_server;"
        "assert 'triton' not in sys.modules, 'triton imported';"
        "assert torch.get_num_threads() == n;"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr

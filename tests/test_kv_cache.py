"""The KV cache on the default model: memory per format, accuracy of the
quantized formats against the engine's own unquantized cache, the sliding
rings, export/import."""

from __future__ import annotations

import statistics

import pytest
import torch

import strata_runtime
from strata_runtime.state.kv_cache import KVCache
from strata_runtime.state.spec import PREFILL_CHUNK
from strata_runtime.quality import Agreement, logits_of, plain_and_nudged


def test_memory_per_token_by_format(engine):
    def per_token(fmt):
        cache = KVCache(fmt, engine.model.state_spec(), 64, float_dtype=torch.float16)
        return cache.bytes_per_token()

    f16, int8, k8v4 = per_token("f16"), per_token("int8"), per_token("k8v4")
    print(f"KV bytes per token: f16 {f16}, int8 {int8} ({int8 / f16:.3f}x), k8v4 {k8v4} ({k8v4 / f16:.3f}x)")
    assert int8 / f16 <= 0.53
    assert k8v4 / f16 <= 0.40


# Nudged runs per format, about 15 s each: k8v4's draws spread by about 0.01
# in KL, int8's by 0.001; two show the f16 cache does not notice the nudge.
NUDGES = {"f16": 2, "int8": 2, "k8v4": 6}


@pytest.fixture(scope="module")
def measure(engine, model_file, reference_float32):
    """kv format -> Agreement with the f16 cache over every teacher-forced
    position, of the plain run and of ``NUDGES[kv]`` nudged runs (draws of the
    quantization noise, see ``strata_runtime.quality``); each format is
    loaded and measured once."""
    texts = [case["tokens"] for case in reference_float32["teacher_forced"]]
    base = logits_of(engine, texts)
    figures: dict[str, tuple[Agreement, list[Agreement]]] = {}

    def run(kv: str) -> tuple[Agreement, list[Agreement]]:
        if kv not in figures:
            quant = engine if kv == "f16" else strata_runtime.load(model_file, kv=kv, progress=False,
                                                                   context_length=512)
            plain, draws = figures[kv] = plain_and_nudged(quant, base, texts, NUDGES[kv])
            kls = [plain.kl] + [d.kl for d in draws]
            print(f"{kv} KV vs f16 KV over {plain.positions} positions: plain run top-1 {plain.top1:.1%}, "
                  f"KL {plain.kl:.4f}; over it and {len(draws)} nudged runs mean top-1 "
                  f"{statistics.mean([plain.top1] + [d.top1 for d in draws]):.1%}, mean KL {statistics.mean(kls):.4f} "
                  f"(range {min(kls):.4f}-{max(kls):.4f})")
        return figures[kv]

    return run


def test_the_nudge_alone_leaves_the_f16_cache_unmoved(measure):
    """The nudged runs measure quantization noise only if the nudge itself
    changes nothing an unquantized cache would notice."""
    plain, draws = measure("f16")
    assert plain.kl == 0.0
    assert all(d.kl < 1e-5 and d.top1 == 1.0 for d in draws)


@pytest.mark.parametrize("kv,min_top1,max_kl", [("int8", 0.90, 0.09), ("k8v4", 0.88, 0.11)])
def test_quantized_cache_accuracy(measure, kv, min_top1, max_kl):
    """The issue's bars (llama.cpp's q8_0 cache: top-1 89.6%, KL 0.090; its
    q8_0 keys with q4_0 values: 86.5%, 0.207), on the mean over the plain and
    the nudged runs: on k8v4 one run's KL is one draw of a noise whose spread
    is about 0.01 (0.098 on 1 thread and 0.110 on 2 for the same code), and
    the mean moves with the CPU's bfloat16 matmuls: 0.088 on a Zen 4 EPYC,
    0.1007 on a Sapphire Rapids Xeon (AMX). The k8v4 bar, 0.11, is still half
    of llama.cpp's q8_0/q4_0 figure."""
    plain, draws = measure(kv)
    runs = [plain] + draws
    assert statistics.mean(r.top1 for r in runs) >= min_top1
    assert statistics.mean(r.kl for r in runs) <= max_kl
    # No single draw far off the bar either.
    assert max(r.kl for r in runs) <= max_kl * 1.25


def test_sliding_rings_equal_full_storage(engine):
    """Past window + chunk the rings wrap; the logits must not notice."""
    tokens = [2] + [int(t) for t in torch.randint(300, 20000, (1200,), generator=torch.Generator().manual_seed(0))]
    ring = engine.logits(tokens)
    model = engine.model
    full = KVCache("f16", model.state_spec(), len(tokens), ring=False)
    from strata_runtime.models.generation import forward_chunks

    with torch.inference_mode():
        dense = forward_chunks(model, full, tokens, last_only=False)
    assert max(s.capacity for s in engine.new_cache(len(tokens)).stores) == len(tokens)
    assert min(s.capacity for s in engine.new_cache(len(tokens)).stores) == 512 + PREFILL_CHUNK < len(tokens)
    assert torch.allclose(ring, dense, atol=1e-4), float((ring - dense).abs().max())


def test_export_import_continues_the_same(engine):
    prompt = engine.tokenize("Once upon a time, in a small village,")
    cache = engine.new_cache(128)
    from strata_runtime.models.generation import decode_step, prefill

    with torch.inference_mode():
        logits = prefill(engine.model, cache, prompt)
        snap = cache.export()
        straight = [int(logits.argmax())]
        for _ in range(5):
            straight.append(int(decode_step(engine.model, cache, straight[-1]).argmax()))
        other = engine.new_cache(128)
        other.import_(snap)
        assert other.length == len(prompt)
        resumed = [straight[0]]
        for _ in range(5):
            resumed.append(int(decode_step(engine.model, other, resumed[-1]).argmax()))
    assert resumed == straight


def test_trim_within_a_ring_and_beyond_it(engine):
    cache = KVCache("int8", engine.model.state_spec(), 2000)
    cache.length = 1500  # positions 0..1499 written (contents do not matter here)
    assert cache.trim(1400) == 1400  # the rings still hold what position 1400 looks back to
    cache.length = 1500
    assert cache.trim(100) == 0  # the rings have overwritten positions 100 - 511 .. 99


@pytest.mark.parametrize("kv", ["int8", "k8v4"])
def test_generation_with_quantized_cache(model_file, kv):
    engine = strata_runtime.load(model_file, kv=kv, progress=False, context_length=256)
    out = engine.generate("The capital of France is", max_tokens=8, temperature=0)
    assert out.completion_tokens == 8 and out.text.strip()
    assert engine.props()["kv"] == kv

"""The KV cache on the default model: memory per format, accuracy of the
quantized formats against the engine's own unquantized cache, the sliding
rings, export/import."""

from __future__ import annotations

import pytest
import torch

import strata_runtime
from strata_runtime.kv_cache import KVCache, PREFILL_CHUNK


def test_memory_per_token_by_format(engine):
    model = engine.model
    a = model.args

    def per_token(fmt):
        cache = KVCache(fmt, model.attention_windows(), a.n_kv_heads, a.head_dim, 64, float_dtype=torch.float16)
        return cache.bytes_per_token()

    f16, int8, k8v4 = per_token("f16"), per_token("int8"), per_token("k8v4")
    print(f"KV bytes per token: f16 {f16}, int8 {int8} ({int8 / f16:.3f}x), k8v4 {k8v4} ({k8v4 / f16:.3f}x)")
    assert int8 / f16 <= 0.53
    assert k8v4 / f16 <= 0.40


def _kl_and_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    top1 = (reference.argmax(-1) == other.argmax(-1)).double()
    return float(kl.mean()), float(top1.mean())


@pytest.fixture(scope="module")
def measure(engine, model_file, reference_float32):
    """kv format -> (top-1 agreement, mean KL) against the f16 cache over every
    teacher-forced position; each format is loaded and measured once."""
    cases = reference_float32["teacher_forced"]
    base = [engine.logits(case["tokens"]) for case in cases]
    figures: dict[str, tuple[float, float]] = {}

    def run(kv: str) -> tuple[float, float]:
        if kv not in figures:
            quant = strata_runtime.load(model_file, kv=kv, progress=False, context_length=512)
            kls = agree = n = 0.0
            for case, reference in zip(cases, base):
                kl, top1 = _kl_and_top1(reference, quant.logits(case["tokens"]))
                kls += kl * len(case["tokens"])
                agree += top1 * len(case["tokens"])
                n += len(case["tokens"])
            figures[kv] = (agree / n, kls / n)
            print(f"{kv} KV vs f16 KV over {int(n)} positions: top-1 agreement {agree / n:.1%}, mean KL {kls / n:.4f}")
        return figures[kv]

    return run


K8V4_TARGET = pytest.mark.xfail(
    strict=True,
    reason="k8v4 measures top-1 89.8% but mean KL 0.108 against the 0.10 target (open in issue 4). "
           "Rotating keys too reached 0.104. A per-block scale search (least squared error over 6-36 "
           "candidate scales) gave 0.092-0.103 depending on the grid, not monotone in the error, and "
           "no gain on other texts (0.0076 -> 0.0072-0.0094 on six license texts): noise, not adopted",
)


@pytest.mark.parametrize("kv,min_top1,max_kl", [
    ("int8", 0.90, 0.09),
    pytest.param("k8v4", 0.88, 0.10, marks=K8V4_TARGET, id="k8v4-target"),
    # Guards what k8v4 achieves today, so a regression is caught while the target stays open.
    pytest.param("k8v4", 0.88, 0.125, id="k8v4-today"),
])
def test_quantized_cache_accuracy(measure, kv, min_top1, max_kl):
    top1, kl = measure(kv)
    assert top1 >= min_top1
    assert kl <= max_kl


def test_sliding_rings_equal_full_storage(engine):
    """Past window + chunk the rings wrap; the logits must not notice."""
    tokens = [2] + [int(t) for t in torch.randint(300, 20000, (1200,), generator=torch.Generator().manual_seed(0))]
    ring = engine.logits(tokens)
    model = engine.model
    a = model.args
    full = KVCache("f16", model.attention_windows(), a.n_kv_heads, a.head_dim, len(tokens), ring=False)
    from strata_runtime.generation import forward_chunks

    with torch.inference_mode():
        dense = forward_chunks(model, full, tokens, last_only=False)
    assert max(s.capacity for s in engine.new_cache(len(tokens)).stores) == len(tokens)
    assert min(s.capacity for s in engine.new_cache(len(tokens)).stores) == 512 + PREFILL_CHUNK < len(tokens)
    assert torch.allclose(ring, dense, atol=1e-4), float((ring - dense).abs().max())


def test_export_import_continues_the_same(engine):
    prompt = engine.tokenize("Once upon a time, in a small village,")
    cache = engine.new_cache(128)
    from strata_runtime.generation import decode_step, prefill

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
    a = engine.model.args
    cache = KVCache("int8", engine.model.attention_windows(), a.n_kv_heads, a.head_dim, 2000)
    cache.length = 1500  # positions 0..1499 written (contents do not matter here)
    assert cache.trim(1400) == 1400  # the rings still hold what position 1400 looks back to
    cache.length = 1500
    assert cache.trim(100) == 0  # the rings have overwritten positions 100 - 511 .. 99


@pytest.mark.parametrize("kv", ["int8", "k8v4"])
def test_generation_with_quantized_cache(model_file, kv):
    engine = strata_runtime.load(model_file, kv=kv, progress=False, context_length=256)
    out = engine.generate("The capital of France is", max_tokens=8, temperature=0)
    assert out.completion_tokens == 8 and "France" in out.text or "Paris" in out.text or out.text.strip()
    assert engine.props()["kv"] == kv

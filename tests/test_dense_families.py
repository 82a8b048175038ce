"""Tiny random-weight llama, qwen2 and qwen3 files against HF transformers
(float32, loading the same GGUF): an independent implementation of each family.

Tolerance of the exact path: 1e-4 on logits up to ~100. Both sides compute
in float32 from the same dequantized weights (gguf-py's, bit-exact with
ours), so they differ only by the order of float32 sums (one rounding is
~1e-7 of the value; a few layers of matmuls and softmaxes add up to ~3e-5
here). A wrong rotation layout, a missing bias or norm, or a mis-sized head
moves logits by whole units.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import CORPUS, Shape, fused_and_layer_by_layer_decode, transformers_logits, write_tiny_model

import strata_runtime

CASES = [  # (shape, weight type, seed): odd head counts, GQA ratios 1/3/4, tied and untied heads
    (Shape(), Q.F32, 0),
    (Shape(hidden=96, heads=6, kv_heads=2, head_dim=16, tied=False), Q.Q8_0, 1),
    (Shape(hidden=96, heads=3, kv_heads=3, head_dim=32), Q.Q4_0, 2),
    (Shape(hidden=64, heads=4, kv_heads=1, head_dim=16, tied=False), Q.Q5_0, 3),
]
QWEN3_HEAD = (Shape(hidden=64, heads=4, kv_heads=2, head_dim=32), Q.Q8_0, 4)  # head_dim != hidden / heads
TEXT = " ".join(CORPUS[:3])


def _load(path, dtype="float32", **options):
    """The exact path unless ``dtype`` says otherwise."""
    return strata_runtime.load(path, dtype=dtype, progress=False, conversation_cache_mib=0, context_length=256,
                               **options)


@pytest.mark.parametrize("arch, shape, qtype, seed",
                         [(a, *c) for a in ("llama", "qwen2", "qwen3") for c in CASES] + [("qwen3", *QWEN3_HEAD)],
                         ids=lambda v: getattr(v, "name", None) if isinstance(v, Q) else None)
def test_exact_path_equals_transformers(tmp_path, arch, shape, qtype, seed):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, shape, seed, qtype)
    engine = _load(path)
    ids = engine.tokenize(TEXT)
    ours = engine.logits(ids)
    ref = transformers_logits(path, ids, shape.head_dim if arch == "qwen3" else None)
    assert ours.shape == ref.shape
    assert ref.abs().max() > 10  # peaked: a wrong model cannot hide in small numbers
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return float(kl.mean())


# Bounds against the exact path over ~130 positions of a peaked random model:
# bfloat16 activations (fast path), int8 KV and k8v4 KV (4-bit values).
BOUNDS = {("bfloat16", "f16"): (0.005, 0.90), ("float32", "int8"): (0.005, 0.95),
          ("float32", "k8v4"): (0.03, 0.85), ("bfloat16", "k8v4"): (0.03, 0.85)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_path_and_quantized_kv_within_bounds(tmp_path, arch):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, Shape(hidden=128, heads=2, kv_heads=1, head_dim=64,
                                                                   tied=False), 5, Q.Q8_0)
    exact = _load(path)
    ids = exact.tokenize(TEXT)
    reference = exact.logits(ids)
    for (dtype, kv), (max_kl, min_top1) in BOUNDS.items():
        logits = _load(path, dtype=dtype, kv=kv).logits(ids)
        kl, top1 = _kl(logits, reference), float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        print(f"{arch} {dtype} {kv}: KL {kl:.4f}, top-1 {top1:.1%}")
        assert kl <= max_kl and top1 >= min_top1, (dtype, kv, kl, top1)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_decode_steps_equal_the_layer_by_layer_ones(tmp_path, arch, dtype):
    """On the CPU kernels a decode step runs each layer as two compiled calls
    (``fused_decode``): the same logits, bit for bit, as the layer's modules
    one by one; q/k/v biases (qwen2) and per-head q/k norms (qwen3)
    included. A step the fused call does not cover (a prefill chunk, int8
    KV) runs the modules."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, Shape(hidden=192, heads=3, kv_heads=1, head_dim=64),
                            6, Q.Q4_0)
    engine = _load(path, dtype=dtype)
    fused, layered, layers = fused_and_layer_by_layer_decode(engine, engine.tokenize(TEXT))
    assert layers == len(engine.model.layers)
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))
    int8 = _load(path, dtype=dtype, kv="int8")
    fused, layered, _ = fused_and_layer_by_layer_decode(int8, int8.tokenize(TEXT), steps=2)
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))
    assert all(b.fused_decode is None for b in _load(path).model.layers)  # the exact path has no fused step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_equals_transformers(tmp_path, arch):
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, Shape(), 0)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = _load(path).tokenizer
    for text in CORPUS[:3] + ["  leading spaces and 99999 digits\n\n\tand tabs", "naïve café 🦙"]:
        assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), text


def test_an_untied_head_through_an_in_process_split(tmp_path):
    path = write_tiny_model(tmp_path / "untied.gguf", "qwen2", Shape(hidden=64, layers=4, tied=False), 8, Q.Q8_0)
    one = _load(path)
    split = _load(path, devices=["cpu", "cpu"], layer_split=[2])
    ids = one.tokenize(TEXT)
    torch.testing.assert_close(split.logits(ids), one.logits(ids), atol=1e-5, rtol=0)


def test_yarn_rope_scaling_equals_transformers(tmp_path):
    """YaRN (factor 4 over an original context of 32; the text runs past it):
    the blended frequencies and the attention factor."""
    path = write_tiny_model(tmp_path / "yarn.gguf", "llama", Shape(hidden=64, heads=2, kv_heads=1, head_dim=32), 9,
                            Q.Q8_0, yarn=(4.0, 32))
    engine = _load(path)
    ids = engine.tokenize(TEXT)
    assert len(ids) > 100
    ours = engine.logits(ids)
    ref = transformers_logits(path, ids, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32})
    plain = transformers_logits(path, ids)
    assert float((ref - plain).abs().max()) > 1.0  # the scaling matters on this text
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_llama3_rope_freqs_equal_transformers(tmp_path):
    """llama3's per-frequency scaling, stored in the file as ``rope_freqs.weight``
    (the divisors of the plain frequencies), against transformers' own llama3 rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    head_dim = 32
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=head_dim,
                         rope_parameters={"rope_theta": 10000.0, **params})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    divisors = (plain / scaled).numpy()
    assert divisors.max() > 4  # the slow frequencies are scaled down
    path = write_tiny_model(tmp_path / "llama3.gguf", "llama", Shape(hidden=64, heads=2, kv_heads=1, head_dim=32), 10,
                            Q.Q8_0, rope_freqs=divisors)
    engine = _load(path)
    ids = engine.tokenize(TEXT)
    ref = transformers_logits(path, ids, rope_parameters=params)
    torch.testing.assert_close(engine.logits(ids), ref, atol=1e-4, rtol=0)

"""Every dense family, Qwen3-MoE and Qwen3-Next on a CUDA device (GGUF blocks through the
compiled Triton kernels), against the exact float32 path on the CPU; and the conversation
cache on CUDA (pinned pool, copy stream): park and restore equal cold runs.

Tiny random-weight files (tests/tiny_models.py), written here, so the run
needs no model download: `pytest -m gpu tests/test_cuda_families.py` on a
GPU (bench/gpu_check.sh runs it). Skipped, saying so, without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import CORPUS, Shape, write_tiny_model

import strata_runtime

pytestmark = pytest.mark.gpu

TEXT = " ".join(CORPUS[:3])
SHAPE = Shape(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=False)


def _load(path, **options):
    options.setdefault("conversation_cache_mib", 0)
    return strata_runtime.load(path, progress=False, context_length=256, **options)


def _agreement(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return float(kl.mean()), float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


# gguf-py quantizes the small-block types (the K-quants are random blocks); the kernels tests cover every
# type. Q5_1 has no word layout: its layers read their GGUF blocks.
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_family_matches_the_exact_cpu_path(tmp_path, arch, qtype):
    from strata_runtime.models.layers import Linear

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, SHAPE, 11, qtype)
    exact = _load(path, dtype="float32")
    ids = exact.tokenize(TEXT)
    reference = exact.logits(ids)
    for kv, (max_kl, min_top1) in {"f16": (0.01, 0.9), "int8": (0.01, 0.9), "k8v4": (0.05, 0.8)}.items():
        gpu = _load(path, device="cuda", kv=kv)
        linears = [m for m in gpu.model.modules() if isinstance(m, Linear)]
        # Every projection reads its word planes or GGUF blocks (the float32 token table is dense).
        kept = [m.planes if qtype != Q.Q5_1 else m.qweight for m in linears]
        assert sum(k is not None and m.weight is None for k, m in zip(kept, linears)) >= 7 * SHAPE.layers
        logits = gpu.logits(ids).float().cpu()
        kl, top1 = _agreement(logits, reference)
        print(f"{arch} {qtype.name} {kv}: KL {kl:.4f}, top-1 {top1:.1%}")
        assert kl <= max_kl and top1 >= min_top1, (kv, kl, top1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_cuda_mixture_of_experts_matches_the_exact_cpu_path(tmp_path, qtype):
    """Qwen3-MoE on CUDA: the experts' blocks through the grouped Triton
    kernels (a GEMV launch for the experts with a decode step's rows, a GEMM
    launch for a prompt's), within the dense families' bounds."""
    shape = Shape(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_per_token=2, expert_ffn=256,
                  tied=False)
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, 14, qtype)
    exact = _load(path, dtype="float32")
    ids = exact.tokenize(TEXT)
    reference = exact.logits(ids)
    gpu = _load(path, device="cuda")
    assert gpu.model.layers[0].mlp.kernel == {"gate": "auto", "up": "auto", "down": "auto"}
    kl, top1 = _agreement(gpu.logits(ids).float().cpu(), reference)
    print(f"qwen3moe {qtype.name}: KL {kl:.4f}, top-1 {top1:.1%}")
    assert kl <= 0.02 and top1 >= 0.9, (kl, top1)
    # Decode steps (the GEMV launch), two sequences at once: each step's logits as the prefill's would be.
    done = gpu.generate_many([CORPUS[0][:30], CORPUS[1][:40]], max_tokens=8, temperature=0)
    assert [len(c.tokens) for c in done] == [8, 8]
    for c, prompt in zip(done, (CORPUS[0][:30], CORPUS[1][:40])):
        prefilled = gpu.logits(gpu.tokenize(prompt) + c.tokens[:-1]).float().cpu()[-8:]
        assert (prefilled.argmax(-1) == torch.tensor(c.tokens)).float().mean() >= 0.75


def test_cuda_hybrid_matches_the_exact_cpu_path(tmp_path):
    """Qwen3-Next: the recurrent layers' Triton decode steps over state slots
    on the GPU, their prompts by the chunked delta rule; a conversation parked
    and restored with its recurrent state (pinned pool, copy stream) and
    resumed from a checkpoint gives the cold run's tokens."""
    from tiny_hybrid import HybridShape, write_hybrid_model

    shape = HybridShape(hidden=256, heads=4, kv_heads=2, head_dim=64, rotary_dim=16, k_heads=2, v_heads=4, d_k=64,
                        d_v=64)
    path = write_hybrid_model(tmp_path / "hybrid.gguf", shape, 15, Q.Q8_0)
    exact = _load(path, dtype="float32")
    ids = exact.tokenize(TEXT)
    reference = exact.logits(ids)
    gpu = _load(path, device="cuda", conversation_cache_mib=32, min_free_mib=0, checkpoint_every=8, parallel=1)
    kl, top1 = _agreement(gpu.logits(ids).float().cpu(), reference)
    print(f"qwen3next Q8_0: KL {kl:.4f}, top-1 {top1:.1%}")
    assert kl <= 0.02 and top1 >= 0.9, (kl, top1)
    prompts = [ids[:40], ids[:30] + ids[50:70], ids[:40] + ids[80:90]]
    warm = [gpu.generate(p, max_tokens=8, temperature=0).tokens for p in prompts]
    cold = _load(path, device="cuda")
    assert warm == [cold.generate(p, max_tokens=8, temperature=0).tokens for p in prompts]
    assert gpu.stats()["restored"] >= 1 and gpu.stats()["checkpoints_saved"] >= 1


@pytest.mark.parametrize("kv", ["f16", "k8v4"])
def test_park_and_restore_on_cuda_equal_cold_runs(tmp_path, kv):
    path = write_tiny_model(tmp_path / "llama.gguf", "llama", SHAPE, 12, Q.Q8_0)
    engine = _load(path, device="cuda", kv=kv, conversation_cache_mib=32, min_free_mib=0, checkpoint_every=8)
    # The pool is pinned host memory and the copies run on their own stream.
    assert engine.conversations.pool.buffer.is_pinned()
    assert engine.conversations._copy_stream is not None
    first, second = CORPUS[0], CORPUS[1]
    prompts = [engine.tokenize(t) for t in (first, second, first + " " + second, second + " " + first)]
    warm = [engine.generate(p, max_tokens=6, temperature=0) for p in prompts]
    cold_engine = _load(path, device="cuda", kv=kv)
    cold = [cold_engine.generate(p, max_tokens=6, temperature=0).tokens for p in prompts]
    assert [w.tokens for w in warm] == cold
    stats = engine.stats()
    assert stats["parked"] >= 2 and stats["restored"] >= 1, stats
    assert any(w.cached_tokens > 10 for w in warm[2:]), [w.cached_tokens for w in warm]


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)])
def test_a_split_from_the_cpu_to_cuda_equals_one_device(tmp_path, arch, tied):
    """Layers 0-1 on the CPU (torch backend), 2-3 on CUDA (Triton): the
    hidden state crosses devices, and a tied head reads its own copy of the
    token table on the last stage."""
    shape = Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=tied)
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, shape, 13, Q.Q8_0)
    exact = _load(path, dtype="float32")
    ids = exact.tokenize(TEXT)
    split = _load(path, devices=["cpu", "cuda:0"], layer_split=[2])
    assert [b.split(":")[0] for b in split.props()["backend"]] == ["cpu float32", "cuda"]
    inner = split.model.model
    assert inner.embedding.device.type == "cpu" and inner.output.device.type == "cuda"
    assert (inner.output is inner.embedding) is False
    kl, top1 = _agreement(split.logits(ids).float().cpu(), exact.logits(ids))
    print(f"{arch} cpu->cuda split: KL {kl:.4f}, top-1 {top1:.1%}")
    assert kl <= 0.01 and top1 >= 0.9

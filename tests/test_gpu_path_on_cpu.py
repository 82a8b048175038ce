"""The GPU path's layers on this CPU-only machine: with ``STRATA_CPU_KERNELS=triton``
and the Triton interpreter, a model's projections are built in their GPU word
layout (``strata_kernels.word_planes``) and a decode step's matmuls run the
word GEMV kernel (``_triton_gemv_words``, its plain-Triton form) exactly as
CUDA would launch them; a prompt's take the dense path over the same planes.

Tiny random-weight llama files of each type with a word layout that the test
files can hold, against the exact float32 path on the same file: a prompt,
six teacher-forced decode steps, then four tokens at once (a verify, on the
tensor-core GEMV). A decode step's only difference from the exact path is
x's 16-bit codes per 32 values, so its logits agree to within parts in 10^4
of their largest; a verify's rows, with each weight rounded to float16, to
within parts in 10^3; the top token is the same at every step.
(`tests/test_cuda_families.py` runs the same on a GPU with the compiled kernels.)
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import CORPUS, Shape, write_tiny_model

import strata_runtime

SHAPE = Shape(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=False)


VERIFY = 4  # tokens fed at once after the decode steps, as a speculative verify does: the 2-8 row GEMV


def _teacher_forced(engine, ids: list[int], next_ids: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt ``ids``, then after each of ``next_ids`` fed as
    a decode step but the last ``VERIFY``, then after each of those, fed at once."""
    from strata_runtime.models.generation import decode_step, forward_chunks, prefill

    cache = engine.new_cache(len(ids) + len(next_ids) + 1)
    with torch.inference_mode():
        out = [prefill(engine.model, cache, ids).float()]
        for token in next_ids[:-VERIFY]:
            out.append(decode_step(engine.model, cache, token).float())
        out.extend(forward_chunks(engine.model, cache, next_ids[-VERIFY:], last_only=False).float())
    return out


def _both_paths(monkeypatch, path, steps: int):
    """The file loaded on the exact path and on the GPU word path, and the
    logits each gives for the same prompt and teacher-forced decode steps."""
    options = dict(progress=False, context_length=128, conversation_cache_mib=0, dtype="float32")
    exact = strata_runtime.load(path, **options)
    ids = exact.tokenize(CORPUS[0])[:24]
    forced = [int(t) for t in exact.tokenize(CORPUS[1])[:steps]]
    monkeypatch.setenv("STRATA_CPU_KERNELS", "triton")
    gpu_path = strata_runtime.load(path, **options)
    return gpu_path, _teacher_forced(gpu_path, ids, forced), _teacher_forced(exact, ids, forced)


# A one-row decode step differs from the exact path only by x's 16-bit codes; the verify's rows run the
# tensor-core GEMV, which rounds each weight (code x scale) to float16 and meets the K-quants' mins with x's
# float16 sums: parts in 10^3 of the largest logit (Q4_K's mins the most: 4.9e-3 and KL 1.2e-4 on a Zen 4,
# under 1e-4 on a Sapphire Rapids). A misplaced weight or scale moves the logits by far more than either.
DECODE_BOUNDS = dict(kl=1e-4, relative=5e-3)
VERIFY_BOUNDS = dict(kl=5e-4, relative=1e-2)


def _assert_agree(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """The same top token at every step; KL and the largest logit difference
    (relative to the largest logit) within the bounds of the step's path."""
    for step, (g, e) in enumerate(zip(got, expected)):
        bounds = VERIFY_BOUNDS if step >= len(got) - VERIFY else DECODE_BOUNDS
        kl = torch.nn.functional.kl_div(g.log_softmax(-1), e.log_softmax(-1), log_target=True, reduction="sum")
        assert g.argmax() == e.argmax() and kl < bounds["kl"], (step, float(kl))
        assert (g - e).abs().max() < bounds["relative"] * e.abs().max(), step


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_1, Q.IQ3_S, Q.IQ2_XXS],
                         ids=lambda t: t.name)
def test_the_gpu_word_path_matches_the_exact_path(tmp_path, monkeypatch, qtype):
    from strata_runtime.models.layers import Linear

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", SHAPE, 5, qtype)
    gpu_path, got, expected = _both_paths(monkeypatch, path, 6 + VERIFY)
    linears = [m for m in gpu_path.model.modules() if isinstance(m, Linear)]
    assert sum(m.planes is not None for m in linears) == 7 * SHAPE.layers + 1  # q k v o gate up down, the head
    assert all(m.qweight is None for m in linears if m.planes is not None)  # the blocks are not kept
    # The prompt's projections take the planes dequantized (exact); the head, on the last row only, the GEMV;
    # the verify's four rows the tensor-core GEMV, head included.
    _assert_agree(got, expected)


MOE_CASES = [(Shape(experts=4, experts_per_token=2, expert_ffn=32), Q.Q8_0),
             (Shape(hidden=256, heads=4, kv_heads=1, head_dim=64, experts=6, experts_per_token=2, expert_ffn=256),
              Q.Q4_K)]


@pytest.mark.parametrize("shape,qtype", MOE_CASES, ids=["Q8_0", "Q4_K"])
def test_a_mixture_of_experts_on_the_gpu_word_path_matches_the_exact_path(tmp_path, monkeypatch, shape, qtype):
    """Qwen3-MoE's expert tensors in word planes (the blocks dropped): a
    prompt's experts take their rows of the planes dequantized, a decode
    step's routed rows one grouped GEMV launch per tensor."""
    from strata_runtime.models.moe import MoEFeedForward

    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, 3, qtype)
    gpu_path, got, expected = _both_paths(monkeypatch, path, 4 + VERIFY)
    moes = [m for m in gpu_path.model.modules() if isinstance(m, MoEFeedForward)]
    assert len(moes) == shape.layers and all(set(m.planes) == {"gate", "up", "down"} and m.up_exps is None
                                             for m in moes)
    _assert_agree(got, expected)


def test_the_gpu_path_on_the_cpu_needs_the_interpreter(monkeypatch):
    from strata_runtime.files import Backend

    monkeypatch.setenv("STRATA_CPU_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 too"):
        Backend.choose("cpu", torch.float32)


def _random_weight(qtype, rows: int, cols: int, seed: int):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels_test"))
    from helpers import random_quant_tensor

    return random_quant_tensor(qtype, rows, cols // (256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32), seed=seed)


@pytest.mark.parametrize("rows", [1, 4, 8, 12])
def test_projections_share_x_by_path_and_pairing(rows):
    """q/k/v-like projections of mixed types read one x: at one row the word
    GEMV prepares it once per pairing (Q4_K with Q6_K, Q8_0 its own), at 2-8
    the tensor-core GEMV once for all; every output equals its layer alone."""
    from strata_kernels import dequantize
    from strata_runtime.files import Backend
    from strata_runtime.models.layers import Linear, Projections

    backend = Backend(torch.device("cpu"), torch.float32, "triton")
    layers = [Linear(_random_weight(q, 48, 512, seed=i), backend)
              for i, q in enumerate([Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_K])]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    together = Projections(*layers)(x)
    for layer, y in zip(layers, together):
        assert torch.equal(y, layer.matmul(x))
    weights = [dequantize(_random_weight(q, 48, 512, seed=i)) for i, q in enumerate([Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_K])]
    for w, y in zip(weights, together):
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_a_token_table_in_word_planes_embeds_and_scores(qtype):
    """A quantized token table on the GPU path is held as word planes alone:
    a lookup dequantizes just the rows asked for, equal to the blocks'; a
    decode step's scores come from the word GEMV, in float32."""
    from strata_kernels import embedding_rows
    from strata_runtime.files import Backend
    from strata_runtime.models.layers import TiedEmbedding

    table = _random_weight(qtype, 300, 256, seed=9)
    embedding = TiedEmbedding(table, Backend(torch.device("cpu"), torch.bfloat16, "triton"))
    assert embedding.out.planes is not None and embedding.out.qweight is None and embedding.device.type == "cpu"
    tokens = torch.tensor([[5, 299, 0], [17, 17, 150]])
    assert torch.equal(embedding(tokens), embedding_rows(table, tokens, torch.bfloat16))
    x = torch.randn(1, table.cols).to(torch.bfloat16)
    scores = embedding.logits(x)
    exact = x.double() @ embedding_rows(table, torch.arange(300)).double().T
    assert scores.dtype == torch.float32 and scores.argmax() == exact.argmax()
    assert ((scores.double() - exact).abs().max() / exact.abs().max()) < 1e-3

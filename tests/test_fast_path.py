"""The default compute path (``dtype="auto"``: every weight kept as its GGUF
blocks and read by the compiled CPU kernels, float32 activations, prefill
matmuls in bfloat16 where the CPU has the bf16 dot product) and the
bfloat16 one against the exact float32 path, on the reference texts of both
real models (issue 19's bar: top-1 agreement >= 95%, mean KL <= 0.03,
greedy tokens equal up to near-ties).

This machine's CPU decides which kernel build runs;
``kernels_test/test_cpu_kernels_targets.py`` runs this file again under
the avx2 build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import strata_runtime
from strata_kernels import cpu_kernels
from strata_runtime.files.backend import Backend
from strata_runtime.models.layers import Linear
from strata_runtime.quality import agreement, logits_of

pytestmark = pytest.mark.cpu_kernels  # the AVX2 variant's run repeats these (test_cpu_kernels_targets.py)

DATA = Path(__file__).parent / "data"
PATHS = [("gemma", "auto"), ("smollm2", "auto"), ("gemma", "bfloat16"), ("smollm2", "bfloat16")]


def _pair(request, model, dtype, model_file, smollm2_file):
    if model == "gemma":
        exact = request.getfixturevalue("engine")
        reference = json.loads((DATA / "gemma-3-270m-q4_k_m.float32.json").read_text())
        path = model_file
    else:
        exact = request.getfixturevalue("smollm2")
        reference = json.loads((DATA / "smollm2-135m-instruct-q4_1.float32.json").read_text())
        path = smollm2_file
    fast = strata_runtime.load(path, dtype=dtype, progress=False, context_length=512, conversation_cache_mib=0)
    return exact, fast, reference


@pytest.fixture(scope="module", params=PATHS, ids=lambda p: "-".join(p))
def pair(request, model_file, smollm2_file):
    """(the exact engine, a fast engine, the float32 reference) of one model."""
    return _pair(request, *request.param, model_file, smollm2_file)


@pytest.fixture(scope="module", params=["gemma", "smollm2"])
def default_pair(request, model_file, smollm2_file):
    """The same for the default path alone: bfloat16 activations part from
    the exact path's greedy tokens at clear margins (SmolLM2: 0.081)."""
    return _pair(request, request.param, "auto", model_file, smollm2_file)


def test_the_path_says_what_it_chose_and_why(pair):
    _, fast, _ = pair
    props = fast.props()
    expected = "float32" if props["compute_path"]["requested"] == "auto" else "bfloat16"
    assert props["dtype"] == props["compute_path"]["activations"] == expected
    assert f"CPU kernels ({cpu_kernels.isa()})" in props["compute_path"]["reason"]
    assert props["backend"] == [f"cpu {expected}: compiled CPU kernels on GGUF blocks"]
    assert props["cpu_kernels"].startswith(f"{cpu_kernels.isa()} (this CPU runs ")
    assert props["kv_storage"] == "bfloat16"  # half the bytes of float32 for decode attention to read
    # Prefill matmuls: bfloat16 where torch's bf16 GEMM runs on bf16 hardware (auto), else the activations'.
    prefill = "bfloat16" if expected == "bfloat16" or cpu_kernels.bf16_matmul() else "float32"
    assert props["compute_path"]["prefill_matmuls"] == prefill
    assert ("prefill matmuls in bfloat16" in props["compute_path"]["reason"]) == (
        props["compute_path"]["requested"] == "auto" and prefill == "bfloat16")
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert {str(m.gemm_dtype).removeprefix("torch.") for m in linears} == {prefill}


def test_fast_path_stays_close_to_float32(pair):
    """Teacher-forced over the reference texts: mean KL <= 0.03 and top-1
    agreement >= 95% against the exact path."""
    engine, fast, reference = pair
    texts = [case["tokens"] for case in reference["teacher_forced"]]
    a = agreement(logits_of(engine, texts), logits_of(fast, texts))
    print(f"{fast.props()['model']}: dtype={fast.props()['compute_path']['requested']} ({fast.props()['dtype']} activations) vs float32 over "
          f"{a.positions} positions: top-1 agreement {a.top1:.1%}, mean KL {a.kl:.4f}")
    assert a.kl <= 0.03
    assert a.top1 >= 0.95


def test_fast_path_decode_steps_stay_close_to_float32(pair):
    """The same bar for the decode path, which runs other kernels (the GEMV,
    the one-query attention, the fused norms): the reference texts fed one
    token per step (the first 128 of each), each step's logits against the
    exact path's."""
    from strata_runtime.models import decode_logits_of

    engine, fast, reference = pair
    texts = [case["tokens"][:128] for case in reference["teacher_forced"]]
    a = agreement(logits_of(engine, texts), decode_logits_of(fast, texts))
    print(f"{fast.props()['model']}: decode steps of dtype={fast.props()['compute_path']['requested']} vs float32 over {a.positions} positions: "
          f"top-1 agreement {a.top1:.1%}, mean KL {a.kl:.4f}")
    assert a.kl <= 0.03
    assert a.top1 >= 0.95


# Where two paths may part: float32's own top-2 logits closer than this. The
# default path's activations enter each matmul as 16-bit codes and its keys
# and values are stored in bfloat16 (8 significant bits): a key of about 30
# moves by up to 0.06 when rounded, so a gap under 0.05 between two
# candidates is a tie that any other rounding could break either way.
NEAR_TIE = 0.05


def test_fast_path_greedy_tokens_equal_the_float32_path(default_pair):
    """For every reference prompt the first 16 greedy tokens are identical,
    or identical up to a position where the exact path itself is at a near
    tie (and then, of course, the continuations differ)."""
    engine, fast, reference = default_pair
    identical = 0
    for case in reference["greedy"]:
        exact = engine.generate(case["prompt_tokens"], max_tokens=16, temperature=0).tokens
        quick = fast.generate(case["prompt_tokens"], max_tokens=16, temperature=0).tokens
        if quick == exact:
            identical += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(exact, quick)) if a != b)
        logits = engine.logits(case["prompt_tokens"] + exact[:at])[-1]
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1])
        print(f"{case['prompt']!r}: parts at token {at}, where float32's top-2 margin is {margin:.3f}")
        assert margin < NEAR_TIE, f"{case['prompt']!r} parted at token {at} with a clear float32 margin of {margin:.3f}"
        assert quick[at] in logits.topk(2).indices.tolist(), "the fast path chose a token outside the near tie"
    print(f"default path: first 16 greedy tokens identical to float32 for {identical}/{len(reference['greedy'])} "
          "prompts")


def test_gemma_fused_decode_steps_equal_the_layer_by_layer_ones(default_pair):
    """The fused decode step (two compiled calls a layer) on the real files,
    Gemma's sandwich norms and sliding windows included: the same logits,
    bit for bit, as the layers' modules one by one."""
    from tiny_models import fused_and_layer_by_layer_decode

    _, fast, reference = default_pair
    fused, layered, layers = fused_and_layer_by_layer_decode(fast, reference["teacher_forced"][0]["tokens"][:40])
    assert layers == len(fast.model.layers)
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))


def test_fast_path_keeps_every_weight_as_gguf_blocks(model_file, model_gguf):
    """No dense copy of any matrix: each Linear holds the file's blocks (the
    same bytes), so the weights take what the GGUF file takes."""
    fast = strata_runtime.load(model_file, progress=False, context_length=64, conversation_cache_mib=0)
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 7 * model_gguf.config.block_count + 1
    assert all(m.weight is None and m.qweight is not None for m in linears)
    head = fast.model.embedding.out.qweight
    assert torch.equal(head.data[:4], model_gguf.tensor("token_embd.weight").data[:4])
    assert sum(m.qweight.nbytes for m in linears) == sum(
        model_gguf.tensor(n).nbytes for n in model_gguf.tensor_names() if model_gguf.tensor(n).qtype.name != "F32")


def test_fast_path_falls_back_to_dense_bfloat16_for_a_type_the_kernels_do_not_read():
    from gguf import GGMLQuantizationType as T

    from strata_kernels import QuantTensor

    from strata_runtime.models import weight_paths

    other = QuantTensor(torch.zeros(2, 17 * 8, dtype=torch.uint8), T.MXFP4, (2, 256))
    assert not cpu_kernels.supports(other)
    layer = Linear(other, Backend.choose("cpu", torch.bfloat16))
    assert layer.qweight is None and layer.weight.dtype == torch.bfloat16
    iq = QuantTensor(torch.zeros(2, 136, dtype=torch.uint8), T.IQ4_XS, (2, 256))
    both = torch.nn.ModuleList([layer, Linear(iq, Backend.choose("cpu", torch.bfloat16))])
    assert weight_paths(both) == {"IQ4_XS": "GGUF blocks", "MXFP4": "dense copy (0.0 MiB)"}


def test_loading_a_type_the_kernels_cannot_read_warns_with_its_cost(tmp_path, caplog):
    """A tiny file in MXFP4 (which the CPU kernels do not read): the default
    path dequantizes it at load, says so in a warning naming the type and the
    memory, and ``props()`` reports it as a dense copy."""
    import logging

    from gguf import GGMLQuantizationType as T
    from tiny_models import Shape, write_tiny_model

    path = write_tiny_model(tmp_path / "mxfp4.gguf", "llama", Shape(), seed=1, qtype=T.MXFP4)
    with caplog.at_level(logging.WARNING, logger="strata_runtime.models.loader"):
        engine = strata_runtime.load(path, progress=False, context_length=64, conversation_cache_mib=0)
    (record,) = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert "MXFP4" in record.getMessage() and "MiB" in record.getMessage()
    assert engine.props()["compute_path"]["weights"]["MXFP4"].startswith("dense copy (")
    assert engine.generate("The quick", max_tokens=4, temperature=0).completion_tokens == 4

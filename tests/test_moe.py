"""Qwen3-MoE (``qwen3moe``): tiny random-weight files against HF transformers
(float32, loading the same GGUF), the independent implementation.

Tolerance of the exact path: 1e-4 plus 5e-5 of the logit (both sides compute
in float32 from gguf-py's dequantization and add the routed experts in the
same order, so they differ by the order of float32 sums inside each matmul:
about 1e-7 of a value per rounding, a few e-5 of the largest logits after
reductions of 256 in the widest shape here). The router is scaled to be
decisive (logits of a few units), so rounding cannot flip a choice, and the
experts chosen must be the same at every position of every layer.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import CORPUS, Shape, moe_config, transformers_logits, transformers_router_choices, write_tiny_model

import strata_runtime
from strata_runtime.models.moe import MoEFeedForward

TEXT = " ".join(CORPUS[:3])
CASES = [  # (shape, expert weight type, seed)
    (Shape(experts=4, experts_per_token=2, expert_ffn=32), Q.Q8_0, 0),
    (Shape(hidden=96, heads=6, kv_heads=2, head_dim=16, experts=8, experts_per_token=4, expert_ffn=64,
           tied=False), Q.Q4_0, 1),
    (Shape(hidden=256, heads=4, kv_heads=1, head_dim=64, experts=6, experts_per_token=2, expert_ffn=256), Q.Q4_K, 2),
    (Shape(experts=5, experts_per_token=1, expert_ffn=32), Q.F32, 3),
    (IQ_SHAPE := Shape(hidden=256, heads=4, kv_heads=1, head_dim=64, experts=4, experts_per_token=2,
                       expert_ffn=256, tied=False), Q.IQ4_XS, 4),
]


def _load(path, dtype="float32", **options):
    return strata_runtime.load(path, dtype=dtype, progress=False, conversation_cache_mib=0, context_length=256,
                               **options)


def _our_choices(engine, ids) -> list[torch.Tensor]:
    """Per layer, the experts our router picks for each position, ``[T, k]`` sorted."""
    seen: list[torch.Tensor] = []
    real = MoEFeedForward.route

    def recording(self, x):
        chosen, weights = real(self, x)
        seen.append(chosen.sort(-1).values)
        return chosen, weights

    MoEFeedForward.route = recording
    try:
        engine.logits(ids)
    finally:
        MoEFeedForward.route = real
    return seen


@pytest.mark.parametrize("shape, qtype, seed", CASES, ids=lambda v: v.name if isinstance(v, Q) else None)
def test_exact_path_equals_transformers(tmp_path, shape, qtype, seed):
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, seed, qtype)
    engine = _load(path)
    ids = engine.tokenize(TEXT)
    ours = engine.logits(ids)
    ref = transformers_logits(path, ids, moe=moe_config(shape))
    assert ref.abs().max() > 10  # peaked: a wrong model cannot hide in small numbers
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=5e-5)
    theirs = transformers_router_choices(path, ids, shape)
    mine = _our_choices(engine, ids)
    assert len(mine) == len(theirs) == shape.layers
    for layer, (a, b) in enumerate(zip(mine, theirs)):
        assert torch.equal(a, b), f"layer {layer}: experts chosen differ at {(a != b).any(-1).nonzero().tolist()}"
    used = torch.cat(mine).unique()
    assert len(used) > shape.experts_per_token  # the router spreads tokens over experts


def test_a_file_whose_tensors_disagree_with_its_expert_count_is_refused(tmp_path):
    from strata_runtime.errors import ModelFileError

    shape = Shape(experts=4, experts_per_token=2, told_experts=6)
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, 0, Q.Q8_0)
    with pytest.raises(ModelFileError, match=r"layer 0: the file says 6 experts, but its router and gate, up and "
                                             r"down expert tensors have shapes"):
        _load(path)


def test_props_name_the_experts(tmp_path):
    shape, qtype, seed = CASES[1]
    engine = _load(write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, seed, qtype))
    assert engine.props()["experts"] == {"count": 8, "per_token": 4}


# The dense families' bounds against the exact path (test_dense_families.py),
# except bfloat16 activations: 0.01, not 0.005 (measured 0.0054): a router
# whose top two are within bfloat16's rounding picks the other expert, which
# moves that row by more than rounding.
BOUNDS = {("auto", "f16"): (0.005, 0.90), ("bfloat16", "f16"): (0.01, 0.90), ("float32", "int8"): (0.005, 0.95),
          ("float32", "k8v4"): (0.03, 0.85)}
FAST = Shape(hidden=128, heads=2, kv_heads=1, head_dim=64, experts=8, experts_per_token=2, expert_ffn=64, tied=False)


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return float(kl.mean())


def test_default_path_and_quantized_kv_within_bounds(tmp_path):
    """The CPU kernels read the experts' blocks (each routed expert's GEMV or
    GEMM), in float32 or bfloat16 activations, and the KV formats: within
    the dense families' bounds of the exact path."""
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", FAST, 5, Q.Q8_0)
    exact = _load(path)
    ids = exact.tokenize(TEXT)
    reference = exact.logits(ids)
    for (dtype, kv), (max_kl, min_top1) in BOUNDS.items():
        engine = _load(path, dtype=dtype, kv=kv)
        if dtype != "float32":
            assert engine.model.layers[0].mlp.kernel == {"gate": "cpu", "up": "cpu", "down": "cpu"}
        logits = engine.logits(ids)
        kl, top1 = _kl(logits, reference), float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        print(f"qwen3moe {dtype} {kv}: KL {kl:.4f}, top-1 {top1:.1%}")
        assert kl <= max_kl and top1 >= min_top1, (dtype, kv, kl, top1)


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.IQ3_S], ids=lambda t: t.name)
def test_iq_files_run_on_the_kernels_within_bounds(tmp_path, qtype):
    """An IQ file's projections and experts stay GGUF blocks read by the CPU
    kernels (no dense copy), within the default path's bounds of the exact path."""
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", IQ_SHAPE, 6, qtype)
    exact, fast = _load(path), _load(path, dtype="auto")
    assert fast.props()["compute_path"]["weights"] == {qtype.name: "GGUF blocks"}
    assert fast.model.layers[0].mlp.kernel == {"gate": "cpu", "up": "cpu", "down": "cpu"}
    ids = exact.tokenize(TEXT)
    reference, logits = exact.logits(ids), fast.logits(ids)
    kl, top1 = _kl(logits, reference), float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    max_kl, min_top1 = BOUNDS[("auto", "f16")]
    assert kl <= max_kl and top1 >= min_top1, (kl, top1)


def test_a_two_stage_split_counts_and_runs_the_experts(tmp_path):
    """The planner counts each layer's expert tensors with its weights, and
    an in-process split over two stages gives the one-device logits."""
    from strata_runtime.files.gguf_file import GGUFFile
    from strata_runtime.split.pipeline import plan_split

    shape = Shape(hidden=64, layers=4, experts=6, experts_per_token=2, expert_ffn=32, tied=False)
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, 6, Q.Q8_0)
    gguf = GGUFFile.open(path)
    infos = {t.name: t.nbytes for t in gguf.tensor_infos()}
    stages = plan_split(gguf, ["cpu", "cpu"], [2], context=256)
    expert_bytes = [sum(n for name, n in infos.items() if name.startswith(f"blk.{i}.") and "_exps" in name)
                    for i in range(4)]
    layer_bytes = [sum(n for name, n in infos.items() if name.startswith(f"blk.{i}.")) for i in range(4)]
    assert all(e > 0 for e in expert_bytes)
    embed, head = infos["token_embd.weight"], infos["output.weight"] + infos["output_norm.weight"]
    assert [s.weight_bytes for s in stages] == [embed + sum(layer_bytes[:2]), sum(layer_bytes[2:]) + head]
    one = _load(path)
    split = _load(path, devices=["cpu", "cpu"], layer_split=[2])
    ids = one.tokenize(TEXT)
    torch.testing.assert_close(split.logits(ids), one.logits(ids), atol=1e-5, rtol=0)


def test_greedy_tokens_alone_and_in_a_batch(tmp_path):
    """Routing spans a batch: four sequences decoded together (their rows
    routed in one step, each expert read once for all of them) give the
    greedy tokens each gives alone."""
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", FAST, 7, Q.Q8_0)
    engine = _load(path, parallel=4)
    prompts = [CORPUS[i][:20 + 9 * i] for i in range(4)]
    together = engine.generate_many(prompts, max_tokens=12, temperature=0)
    assert engine.scheduler.peak_running == 4
    for prompt, got in zip(prompts, together):
        alone = engine.generate(prompt, max_tokens=12, temperature=0)
        assert got.tokens == alone.tokens, prompt


def test_served_by_strata_serve_with_its_experts_in_the_metrics(tmp_path):
    """A real server on the MoE file: the official OpenAI client's streamed
    completion equals the engine's own greedy text, and ``/metrics`` and
    ``/props`` name the experts."""
    import openai
    from live_server import healthy_server

    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", FAST, 8, Q.Q8_0)
    want = _load(path, dtype="auto").generate(CORPUS[0][:30], max_tokens=8, temperature=0).text
    with healthy_server("--model", str(path), "--context-length", "256", "--conversation-cache-mib", "0") as s:
        client = openai.OpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0, timeout=120)
        pieces = [c.choices[0].text for c in client.completions.create(model="moe", prompt=CORPUS[0][:30],
                                                                       max_tokens=8, temperature=0, stream=True)]
        assert "".join(pieces) == want
        m = s.metrics()
        assert m["strata_model_experts"] == 8 and m["strata_model_experts_per_token"] == 2
        assert s.http.get("/props").json()["experts"] == {"count": 8, "per_token": 2}


def test_the_conversation_cache_parks_restores_and_skips_faults(tmp_path):
    """Parked and restored like a dense model (experts keep no state: a
    snapshot is the attention KV, and with no running state there is nothing
    to checkpoint): a restored conversation continues as a cold run does,
    and a failed copy is skipped and leaves the cache cold."""
    from strata_runtime.conversations.cache import ConversationCache, Parked, Restored, Skipped
    from strata_runtime.models.generation import forward_chunks
    from strata_runtime.conversations.memory import MiB
    from strata_runtime.conversations.staging import StagingPool
    from strata_runtime.testing import inject_fault

    engine = _load(write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", FAST, 9, Q.Q8_0))
    cc = ConversationCache(StagingPool(16, MiB), slots=4)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 300, (n,), generator=g).tolist() for n in (120, 80))

    def run(cache, tokens):
        with torch.inference_mode():
            return forward_chunks(engine.model, cache, tokens[cache.length:], last_only=False)

    cache = engine.new_cache(256)
    run(cache, a[:64])
    assert cc.save_checkpoint(cache, a[:64]).cause == "no_running_state"
    run(cache, a)
    assert isinstance(cc.park(cache, a), Parked)
    cache.reset()
    run(cache, b)
    prompt = a + b[:10]
    assert cc.restore(cache, b, prompt) == Restored(120, "parked")
    warm = run(cache, prompt)
    cold = run(engine.new_cache(256), prompt)[120:]
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())
    cc = ConversationCache(StagingPool(16, MiB), slots=4)
    cache = engine.new_cache(256)
    run(cache, a)
    assert isinstance(cc.park(cache, a), Parked)
    cache.reset()
    run(cache, b)
    with inject_fault("restore_copy"):
        outcome = cc.restore(cache, b, a + [7])
    assert isinstance(outcome, Skipped) and cache.length == 0


def test_strata_info_names_the_experts_and_their_bytes_per_stage(tmp_path):
    import subprocess
    import sys

    shape = Shape(hidden=64, layers=4, experts=6, experts_per_token=2, expert_ffn=32)
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", shape, 6, Q.Q8_0)
    out = subprocess.run([sys.executable, "-m", "strata_server.cli", "info", str(path), "--devices",
                          "cpu,cpu", "--layer-split", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "experts:         6 per layer, 2 per token, feed-forward 32 each" in out.stdout
    # 3 expert tensors of 6 x 32 x 64 Q8_0 weights (34 bytes per 32) per layer, 2 layers a stage
    per_stage = 2 * 3 * 6 * 32 * 64 // 32 * 34 / 2**20
    assert out.stdout.count(f"(experts {per_stage:.1f} MiB of the weights)") == 2, out.stdout

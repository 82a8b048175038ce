"""Qwen3-Next (``qwen3next``): recurrent Gated DeltaNet layers and gated
attention, on tiny random-weight GGUFs written here (``tiny_hybrid``), against
transformers' own Qwen3-Next modules holding the same weights (float32).

Tolerance of the exact path: logits within 2e-4 (absolute; they reach about
15) of the oracle's, and the same argmax at every position. The chunked
prefill and the token-by-token recurrence agree within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tiny_hybrid import HybridShape, oracle_logits, oracle_model, write_hybrid_model
from tiny_models import CORPUS

import strata_runtime
from strata_runtime.models.generation import decode_step, prefill

TEXT = CORPUS[0] + " " + CORPUS[1]
CASES = [  # (shape, projection type, seed)
    (HybridShape(), Q.F32, 1),
    (HybridShape(recurrent_list=(True, False, True, False)), Q.Q8_0, 2),
    (HybridShape(layers=3, interval=3, k_heads=4, v_heads=4, d_k=8, d_v=8, conv_kernel=3, rotary_dim=16), Q.F32, 3),
]


def _load(path, dtype="float32", **options):
    options = {"progress": False, "conversation_cache_mib": 0, "context_length": 1024, **options}
    return strata_runtime.load(path, dtype=dtype, **options)


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory):
    return write_hybrid_model(tmp_path_factory.mktemp("hybrid") / "hybrid.gguf", HybridShape(), 11)


@pytest.mark.parametrize("shape,qtype,seed", CASES, ids=["interval-4", "listed-layers-q8", "one-key-head-per-value"])
def test_exact_path_equals_transformers(tmp_path, shape, qtype, seed):
    path = write_hybrid_model(tmp_path / "hybrid.gguf", shape, seed, qtype)
    engine = _load(path)
    ids = engine.tokenize(TEXT)
    assert len(ids) > 64  # past one chunk of the delta rule
    ours = engine.logits(ids)
    ref = oracle_logits(oracle_model(path, shape), ids)
    assert ref.abs().max() > 5  # peaked: a wrong model cannot hide in small numbers
    diff = float((ours - ref).abs().max())
    print(f"qwen3next {qtype.name} seed {seed}: max |ours - transformers| {diff:.1e} of |logit| up to "
          f"{float(ref.abs().max()):.1f} over {len(ids)} positions")
    assert diff <= 2e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    kinds = ["recurrent" if type(s).__name__ == "RecurrentState" else "attention" for s in engine.model.state_spec()]
    assert kinds == ["recurrent" if r else "attention" for r in shape.recurrent()]


def test_a_file_whose_ssm_metadata_disagrees_with_its_tensors_is_refused(tmp_path):
    from strata_runtime.errors import ModelFileError

    path = write_hybrid_model(tmp_path / "broken.gguf", HybridShape(told_state_size=8), 3)
    with pytest.raises(ModelFileError, match=r"layer 0: the recurrent layer's tensors have shapes .*ssm\.\* metadata"):
        _load(path)


def test_chunked_prefill_equals_the_step_by_step_recurrence(hybrid_file):
    """A 700-token prompt read in chunks (of 512 rows, the delta rule in
    chunks of 64) against the same prompt read one token at a time; then
    greedy decoding from each: the same tokens, logits within 1e-4."""
    engine = _load(hybrid_file)
    ids = (engine.tokenize(TEXT) * 12)[:700]
    chunked = engine.logits(ids)
    cache = engine.new_cache(760)
    with torch.inference_mode():
        stepped = torch.stack([prefill(engine.model, cache, ids[:1]).reshape(-1)] +
                              [decode_step(engine.model, cache, t).reshape(-1) for t in ids[1:]])
    torch.testing.assert_close(stepped, chunked, atol=1e-4, rtol=0)

    def greedy(cache, logits):
        out = []
        with torch.inference_mode():
            for _ in range(16):
                token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
                out.append((token, logits.reshape(-1, logits.shape[-1])[-1]))
                logits = decode_step(engine.model, cache, token)
        return out

    after_chunks = engine.new_cache(760)
    with torch.inference_mode():
        first = prefill(engine.model, after_chunks, ids)
    a, b = greedy(after_chunks, first), greedy(cache, stepped[-1])
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, la), (_, lb) in zip(a, b):
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "auto"], ids=["exact", "cpu-kernels"])
def test_greedy_tokens_alone_and_in_a_batch(hybrid_file, dtype):
    """Four sequences decoded together (each recurrent layer's decode one
    batched step over their state slots, by the torch reference or the
    compiled CPU step; prompt chunks beside them) give the tokens each gives alone."""
    engine = _load(hybrid_file, dtype, parallel=4)
    assert engine.model.layers[0].mixer.kernels == ("cpu" if dtype == "auto" else "auto")
    prompts = [CORPUS[i][:20 + 9 * i] for i in range(4)]
    together = engine.generate_many(prompts, max_tokens=12, temperature=0)
    assert engine.scheduler.peak_running == 4
    for prompt, got in zip(prompts, together):
        assert got.tokens == engine.generate(prompt, max_tokens=12, temperature=0).tokens, prompt


def test_the_recurrent_state_is_reserved_once_per_sequence(hybrid_file):
    engine = _load(hybrid_file, parallel=3)
    pool = engine.scheduler.pool
    shape = HybridShape()
    per_layer = 4 * ((shape.conv_kernel - 1) * (2 * shape.k_heads * shape.d_k + shape.v_heads * shape.d_v)
                     + shape.v_heads * shape.d_k * shape.d_v)
    assert pool.recurrent_bytes() == 3 * per_layer  # three recurrent layers of four
    recurrent = [s for s in pool.stores if type(s).__name__ == "RecurrentStore"]
    assert [s.state.shape[0] for s in recurrent] == [3, 3, 3]
    props = engine.props()
    assert props["recurrent_bytes_per_sequence"] == 3 * per_layer
    assert props["kv_bytes_per_token"] == pool.bytes_per_token() > 0


def test_a_two_stage_split_carries_recurrent_state_on_both_stages(tmp_path):
    shape = HybridShape(layers=4, recurrent_list=(True, False, True, True))
    path = write_hybrid_model(tmp_path / "hybrid.gguf", shape, 4)
    one = _load(path)
    split = _load(path, devices=["cpu", "cpu"], layer_split=[2])
    ids = one.tokenize(TEXT)
    torch.testing.assert_close(split.logits(ids), one.logits(ids), atol=1e-5, rtol=0)
    assert split.generate(ids, max_tokens=8, temperature=0).tokens == one.generate(ids, max_tokens=8,
                                                                                     temperature=0).tokens


def test_default_path_close_to_the_exact_one(tmp_path):
    path = write_hybrid_model(tmp_path / "hybrid.gguf", HybridShape(), 5, Q.Q8_0)
    exact, fast = _load(path), _load(path, dtype="auto")
    ids = exact.tokenize(TEXT)
    ref, got = exact.logits(ids), fast.logits(ids)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    print(f"qwen3next auto: KL {float(kl):.4f}, top-1 {float(top1):.1%}")
    assert kl < 0.05 and top1 > 0.85

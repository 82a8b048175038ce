"""Tiny random-weight GGUFs of the dense families (llama, qwen2, qwen3), written
by the tests, and HF ``transformers`` (float32, loading the same file) as the
independent implementation they are compared with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2026 and we tokenize 12345 numbers!",
          "def f(x):\n    return x ** 2  # squares\n\nprint(f(3))",
          "system user assistant: answer briefly. What is two plus two? Four. Thanks!"] * 10
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Shape:
    """A tiny model's sizes. ``head_dim`` may differ from hidden/heads (qwen3 does)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 96
    tied: bool = True


def bpe_vocabulary():
    """A byte-level BPE trained on ``CORPUS`` with ChatML's special tokens: (tokens, merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokens = [t for t, _ in sorted(hf.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(hf.to_str())["model"]["merges"]]
    return tokens, merges


def write_tiny_model(path: Path, arch: str, shape: Shape, seed: int,
                     qtype: GGMLQuantizationType = GGMLQuantizationType.F32, yarn: tuple[float, int] | None = None,
                     rope_freqs: np.ndarray | None = None) -> Path:
    """A ``arch`` GGUF with random weights scaled so the logits are peaked;
    the projections stored as ``qtype``, norms and biases as F32. ``yarn``:
    (factor, original context) as ``rope.scaling.*``; ``rope_freqs``: llama3's
    per-frequency divisors as the ``rope_freqs.weight`` tensor."""
    rng = np.random.default_rng(seed)
    tokens, merges = bpe_vocabulary()
    vocab = len(tokens)
    s = shape
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    if yarn is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)

    def weight(name: str, rows: int, cols: int, scale: float, quantized: bool = True) -> None:
        array = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if quantized and qtype != GGMLQuantizationType.F32:
            data = quantize(array, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, array)

    def vector(name: str, n: int, around: float, spread: float) -> None:
        w.add_tensor(name, (around + rng.standard_normal(n) * spread).astype(np.float32))

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    weight("token_embd.weight", vocab, s.hidden, 1.0, quantized=False)
    for i in range(s.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", s.hidden, 1.0, 0.1)
        weight(p + "attn_q.weight", q, s.hidden, s.hidden ** -0.5)
        weight(p + "attn_k.weight", kv, s.hidden, s.hidden ** -0.5)
        weight(p + "attn_v.weight", kv, s.hidden, s.hidden ** -0.5)
        weight(p + "attn_output.weight", s.hidden, q, q ** -0.5)
        if arch == "qwen2":
            for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                vector(p + name, n, 0.0, 0.5)
        if arch == "qwen3":
            vector(p + "attn_q_norm.weight", s.head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", s.head_dim, 1.0, 0.1)
        vector(p + "ffn_norm.weight", s.hidden, 1.0, 0.1)
        weight(p + "ffn_gate.weight", s.ffn, s.hidden, s.hidden ** -0.5)
        weight(p + "ffn_up.weight", s.ffn, s.hidden, s.hidden ** -0.5)
        weight(p + "ffn_down.weight", s.hidden, s.ffn, s.ffn ** -0.5)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    vector("output_norm.weight", s.hidden, 1.0, 0.1)
    if not s.tied:
        weight("output.weight", vocab, s.hidden, 4 * s.hidden ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_logits(path: Path, token_ids: list[int], head_dim: int | None = None,
                        rope_parameters: dict | None = None):
    """float32 logits ``[T, vocab]`` from HF transformers loading ``path``.
    ``head_dim``: given to the config (transformers' GGUF loader does not read
    ``qwen3.attention.key_length``, and defaults it to 128)."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {} if head_dim is None else {"head_dim": head_dim}
    if rope_parameters is not None:  # transformers' GGUF loader reads no rope scaling for these families
        extra["rope_parameters"] = {"rope_theta": 10000.0, **rope_parameters}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra)
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def fused_and_layer_by_layer_decode(engine, token_ids: list[int], steps: int = 6):
    """The logits of ``steps`` greedy decode steps after a prefill of
    ``token_ids``, once through each layer's fused decode step
    (``fused_decode.FusedDecode``) and once layer by layer (the fused step
    switched off): ``(fused, layered, number of fused layers)``."""
    from strata_runtime.generation import decode_step, prefill

    blocks = list(engine.model.layers)
    fused = [block.fused_decode for block in blocks]

    def run(on: bool) -> list[torch.Tensor]:
        for block, f in zip(blocks, fused):
            block.fused_decode = f if on else None
        try:
            cache = engine.new_cache(len(token_ids) + steps)
            with torch.inference_mode():
                logits = prefill(engine.model, cache, token_ids)
                out = []
                for _ in range(steps):
                    logits = decode_step(engine.model, cache, int(logits.argmax()))
                    out.append(logits)
            return out
        finally:
            for block, f in zip(blocks, fused):
                block.fused_decode = f

    return run(True), run(False), sum(f is not None for f in fused)

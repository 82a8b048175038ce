"""Tiny random-weight GGUFs of the dense families (llama, qwen2, qwen3) and of
Qwen3-MoE (qwen3moe), written by the tests, and HF ``transformers`` (float32, loading the same file) as the
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
    experts: int = 0  # qwen3moe: experts per layer (and expert_count, unless told_experts says otherwise),
    experts_per_token: int = 2  # of which each token uses this many,
    expert_ffn: int = 32  # each a gated MLP this wide
    told_experts: int | None = None  # an expert_count that disagrees with the tensors (a broken file)


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


# K-quant super-blocks: (bytes, offset of d, offset of dmin or None, std of a
# weight in units of d for random codes and scales; dmin set to center them).
K_QUANT_SPREAD = {GGMLQuantizationType.Q4_K: (144, 0, 2, 143.0, 7.5),
                  GGMLQuantizationType.Q5_K: (176, 0, 2, 285.0, 15.5),
                  GGMLQuantizationType.Q6_K: (210, 208, None, 1350.0, 0.0)}


def random_k_blocks(rng, qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random codes and sub-block scales of a K-quant tensor of logical
    ``shape``, with the super-block scales set so the weights spread about ``std``."""
    size, at_d, at_dmin, spread, center = K_QUANT_SPREAD[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    d = np.float16(std / spread)
    blocks[..., at_d:at_d + 2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    if at_dmin is not None:
        blocks[..., at_dmin:at_dmin + 2] = np.frombuffer(np.float16(d * center).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], -1)


# Types gguf-py cannot quantize whose one float16 scale d sits at this offset (no minimum): random codes and
# sub-block scales, d set from their measured spread.
_Q = GGMLQuantizationType
SCALED_BLOCKS = {_Q.Q3_K: 108, _Q.IQ4_NL: 0, _Q.IQ4_XS: 0, _Q.IQ3_S: 0, _Q.IQ3_XXS: 0, _Q.IQ2_XXS: 0, _Q.IQ2_XS: 0,
                 _Q.IQ2_S: 0, _Q.IQ1_S: 0}


def random_scaled_blocks(rng, qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random blocks of a ``SCALED_BLOCKS`` type whose weights spread about ``std`` (d chosen from the spread
    the same codes give with d = 1: the weights are linear in d)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block_size, size = GGML_QUANT_SIZES[qtype]
    at_d = SCALED_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block_size, size), dtype=np.uint8)
    blocks[..., at_d:at_d + 2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    spread = float(dequantize(blocks.reshape(-1, size)[:256], qtype).std())
    blocks[..., at_d:at_d + 2] = np.frombuffer(np.float16(std / spread).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], -1)


class RandomTensors:
    """Adds random tensors to a GGUF being written: ``weight`` (projections,
    stored as ``qtype`` where ``quantized``, else F32) and ``vector`` (norms,
    biases: F32 about ``around``)."""

    def __init__(self, writer: GGUFWriter, rng, qtype: GGMLQuantizationType):
        self.w, self.rng, self.qtype = writer, rng, qtype

    def weight(self, name: str, rows: int, cols: int, scale: float, quantized: bool = True, experts: int = 0) -> None:
        shape = (experts, rows, cols) if experts else (rows, cols)
        if quantized and (self.qtype in K_QUANT_SPREAD or self.qtype in SCALED_BLOCKS):
            # gguf-py cannot quantize these: random blocks
            random_blocks = random_k_blocks if self.qtype in K_QUANT_SPREAD else random_scaled_blocks
            data = random_blocks(self.rng, self.qtype, shape, scale)
            self.w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=self.qtype)
            return
        array = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if quantized and self.qtype != GGMLQuantizationType.F32:
            data = quantize(array, self.qtype)
            self.w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=self.qtype)
        else:
            self.w.add_tensor(name, array)

    def vector(self, name: str, n: int, around: float, spread: float) -> None:
        self.w.add_tensor(name, (around + self.rng.standard_normal(n) * spread).astype(np.float32))


def new_writer(path: Path, arch: str, shape, context: int, rotary_dim: int, chat_template: str | None = None,
               extra_tokens: tuple[str, ...] = ()) -> tuple[GGUFWriter, int]:
    """A GGUF writer for ``arch`` with the sizes of ``shape`` (hidden, layers,
    ffn, heads, kv_heads, head_dim) and the test vocabulary written (``extra_tokens``
    appended as user-defined tokens, as ``<tool_call>`` is in Qwen's); (writer, vocabulary size)."""
    tokens, merges = bpe_vocabulary()
    tokens = tokens + list(extra_tokens)
    s = shape
    w = GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(rotary_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 4 if t in extra_tokens else 1 for t in tokens])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    return w, len(tokens)


def finish_writer(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_model(path: Path, arch: str, shape: Shape, seed: int,
                     qtype: GGMLQuantizationType = GGMLQuantizationType.F32, yarn: tuple[float, int] | None = None,
                     rope_freqs: np.ndarray | None = None, chat_template: str | None = None,
                     extra_tokens: tuple[str, ...] = (), context: int = 256) -> Path:
    """A ``arch`` GGUF with random weights scaled so the logits are peaked;
    the projections stored as ``qtype``, norms and biases as F32. ``yarn``:
    (factor, original context) as ``rope.scaling.*``; ``rope_freqs``: llama3's
    per-frequency divisors as the ``rope_freqs.weight`` tensor."""
    s = shape
    w, vocab = new_writer(path, arch, s, context, s.head_dim, chat_template, extra_tokens)
    t = RandomTensors(w, np.random.default_rng(seed), qtype)
    weight, vector = t.weight, t.vector
    if yarn is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    if arch == "qwen3moe":
        w.add_expert_count(s.experts if s.told_experts is None else s.told_experts)
        w.add_expert_used_count(s.experts_per_token)
        w.add_expert_feed_forward_length(s.expert_ffn)

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
        if arch in ("qwen3", "qwen3moe"):
            vector(p + "attn_q_norm.weight", s.head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", s.head_dim, 1.0, 0.1)
        vector(p + "ffn_norm.weight", s.hidden, 1.0, 0.1)
        if arch == "qwen3moe":  # a decisive router (logits of a few units), then the experts
            weight(p + "ffn_gate_inp.weight", s.experts, s.hidden, 3 * s.hidden ** -0.5, quantized=False)
            weight(p + "ffn_gate_exps.weight", s.expert_ffn, s.hidden, s.hidden ** -0.5, experts=s.experts)
            weight(p + "ffn_up_exps.weight", s.expert_ffn, s.hidden, s.hidden ** -0.5, experts=s.experts)
            weight(p + "ffn_down_exps.weight", s.hidden, s.expert_ffn, s.expert_ffn ** -0.5, experts=s.experts)
            continue
        weight(p + "ffn_gate.weight", s.ffn, s.hidden, s.hidden ** -0.5)
        weight(p + "ffn_up.weight", s.ffn, s.hidden, s.hidden ** -0.5)
        weight(p + "ffn_down.weight", s.hidden, s.ffn, s.ffn ** -0.5)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    vector("output_norm.weight", s.hidden, 1.0, 0.1)
    if not s.tied:
        weight("output.weight", vocab, s.hidden, 4 * s.hidden ** -0.5)
    finish_writer(w)
    return path


def transformers_logits(path: Path, token_ids: list[int], head_dim: int | None = None,
                        rope_parameters: dict | None = None, moe: dict | None = None):
    """float32 logits ``[T, vocab]`` from HF transformers loading ``path``.
    ``head_dim``: given to the config (transformers' GGUF loader does not read
    ``qwen3.attention.key_length``, and defaults it to 128); ``moe``: config
    fields its loader leaves at their defaults for qwen3moe (``moe_config``)."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {} if head_dim is None else {"head_dim": head_dim}
    extra.update(moe or {})
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
    from strata_runtime.models.generation import decode_step, prefill

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


def moe_config(shape: Shape) -> dict:
    """What transformers' GGUF loader does not read for qwen3moe: the experts'
    width (it reads no ``expert_feed_forward_length``), and the top-k weights'
    renormalization, which llama.cpp always applies for this architecture
    but ``Qwen3MoeConfig`` defaults off."""
    return {"moe_intermediate_size": shape.expert_ffn, "norm_topk_prob": True, "head_dim": shape.head_dim}


def transformers_router_choices(path: Path, token_ids: list[int], shape: Shape) -> list[torch.Tensor]:
    """Per layer, the experts transformers' router picks for each position, ``[T, k]`` sorted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 **moe_config(shape))
    seen: list[torch.Tensor] = []
    # The router returns (logits, top-k weights, top-k expert ids).
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2].sort(-1).values))
             for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen

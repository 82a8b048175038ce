"""Llama (Llama 2 and 3, SmolLM, Mistral files that say ``llama``), as its GGUF describes it.

Grouped-query attention with rotary embeddings, a SiLU-gated MLP, RMSNorm
before each, the output head tied to the embeddings or not. The Qwen 2 and 3
files (``qwen2.py``, ``qwen3.py``) are this model with a ``Variant``: query,
key and value biases, or per-head RMS norms of queries and keys.

Rotary layout: llama.cpp rotates adjacent pairs for this architecture, and
the GGUF converter permuted the rows of ``attn_q`` and ``attn_k`` within each
head to suit. Those rows are put back in the checkpoint's order here, once,
at load (whole rows of GGUF blocks: nothing is dequantized), so the one
half-split (NEOX) rotation serves every architecture. Queries and keys carry
the same permutation, so their dot products, and everything after, are
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from strata_kernels import QuantTensor, cpu_kernels, dequantize

from ..errors import ModelFileError
from ..files import Backend, ModelConfig
from ..state import KVCache
from .decoder import DecoderArgs, DecoderModel, embedding_table, output_head
from .fused_decode import FusedDecode
from .layers import (
    GatedMLP,
    Linear,
    Projections,
    RMSNorm,
    RopeCache,
    apply_rope,
    rope_inverse_frequencies,
    silu_mul,
    yarn_attention_factor,
    yarn_inverse_frequencies,
)


@dataclass(frozen=True)
class RopeScaling:
    """``rope.scaling.*`` as the file gives it: ``kind`` none, linear or yarn."""

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0  # yarn: the context the model was trained at
    attention_factor: float = 1.0  # yarn: times 1 + 0.1 ln(factor)
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inverse_frequencies(self, head_dim: int, base: float) -> torch.Tensor:
        if self.kind == "yarn":
            return yarn_inverse_frequencies(head_dim, base, self.factor, self.original_context, self.beta_fast,
                                            self.beta_slow)
        return rope_inverse_frequencies(head_dim, base, self.factor if self.kind == "linear" else 1.0)

    def score_scale(self) -> float:
        """What the rotation's scale of queries and keys does to their dot
        products (yarn scales cos and sin: both sides, so squared)."""
        return (self.attention_factor * yarn_attention_factor(self.factor)) ** 2 if self.kind == "yarn" else 1.0


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rope_scaling: RopeScaling

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        kind = config.arch_key("rope.scaling.type") or "none"
        if kind not in ("none", "linear", "yarn"):
            raise ModelFileError(f"{config.architecture}: rope scaling {kind!r} is not supported; "
                                 f"supported: none, linear, yarn (and llama3's rope_freqs tensor)")
        factor = float(config.arch_key("rope.scaling.factor", 1.0) or 1.0)
        scaling = RopeScaling(kind, factor)
        if kind == "yarn":
            original = config.arch_key("rope.scaling.original_context_length")
            if not original:
                raise ModelFileError(f"{config.architecture}: yarn rope scaling needs "
                                     f"{config.architecture}.rope.scaling.original_context_length")
            scaling = RopeScaling(kind, factor, int(original),
                                  float(config.arch_key("rope.scaling.attn_factor", 1.0) or 1.0),
                                  float(config.arch_key("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
                                  float(config.arch_key("rope.scaling.yarn_beta_slow", 1.0) or 1.0))
        rotary = int(config.arch_key("rope.dimension_count", config.key_length))
        if rotary != config.key_length:
            raise ModelFileError(f"{config.path}: {config.architecture}.rope.dimension_count says partial rotary "
                                 f"embeddings ({rotary} of {config.key_length} "
                                 f"dimensions) are not supported for this architecture")
        common = DecoderArgs.common(config, vocab_size)
        common["attention_scale"] *= scaling.score_scale()
        return cls(**common, rope_scaling=scaling)


@dataclass(frozen=True)
class Variant:
    """How a file of the Llama family differs from ``llama``."""

    permuted_rotary: bool = True  # attn_q/attn_k rows interleaved for llama.cpp's pair rotation
    qkv_bias: bool = False  # attn_q/k/v.bias (qwen2)
    qk_norm: bool = False  # attn_q_norm/attn_k_norm over each head, before the rotation (qwen3)


def unpermute_rotary_rows(weight: QuantTensor, heads: int) -> QuantTensor:
    """Undo the GGUF converter's per-head row order (pairs interleaved) of a
    query or key projection: row ``2i + h`` of each head goes back to ``h * d/2 + i``."""
    d = weight.rows // heads
    within = torch.arange(d).view(d // 2, 2).t().reshape(-1)  # [0, 2, 4, ..., 1, 3, 5, ...]
    order = (torch.arange(heads)[:, None] * d + within[None, :]).reshape(-1).to(weight.device)
    return QuantTensor(weight.data.index_select(0, order), weight.qtype, weight.shape)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, variant: Variant, layer: int, w, backend: Backend, rope: RopeCache,
                 inv_freq: torch.Tensor):
        super().__init__()
        p = f"blk.{layer}."
        self.layer = layer
        self.args = args
        self.rope = rope
        q, k = w(p + "attn_q.weight"), w(p + "attn_k.weight")
        if variant.permuted_rotary:
            q, k = unpermute_rotary_rows(q, args.n_heads), unpermute_rotary_rows(k, args.n_kv_heads)
        bias = (lambda name: w(p + name)) if variant.qkv_bias else (lambda name: None)
        self.q_proj = Linear(q, backend, bias("attn_q.bias"))
        self.k_proj = Linear(k, backend, bias("attn_k.bias"))
        self.v_proj = Linear(w(p + "attn_v.weight"), backend, bias("attn_v.bias"))
        self.o_proj = Linear(w(p + "attn_output.weight"), backend)
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = self.k_norm = None
        if variant.qk_norm:
            self.q_norm = RMSNorm(w(p + "attn_q_norm.weight"), args.rms_eps, backend)
            self.k_norm = RMSNorm(w(p + "attn_k_norm.weight"), args.rms_eps, backend)
        self.attention_backend = backend.attention
        self.cpu_kernels = backend.cpu_kernels
        self.register_buffer("inv_freq", inv_freq.to(backend.device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = self.qkv(x)
        q, k = q.view(t, a.n_heads, a.head_dim), k.view(t, a.n_kv_heads, a.head_dim)
        if self.q_norm is not None:  # the norm and the rotation in one call (one kernel on the CPU fast path)
            rope = self.rope.tables(positions, self.inv_freq, torch.float32 if self.q_norm.cpu_kernel else q.dtype)
            q, k = self.q_norm(q, rope=rope), self.k_norm(k, rope=rope)
        elif self.cpu_kernels:  # the rotation in float32, rounded once: one kernel call each
            cos, sin = self.rope.tables(positions, self.inv_freq, torch.float32)
            q, k = cpu_kernels.rope(q, cos, sin), cpu_kernels.rope(k, cos, sin)
        else:  # the rotation in float32, whatever the activations
            cos, sin = self.rope.tables(positions, self.inv_freq, torch.float32)
            q = apply_rope(q.float(), cos, sin).to(x.dtype)
            k = apply_rope(k.float(), cos, sin).to(x.dtype)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        out = cache.write_and_attend(self.layer, q, k, v, a.attention_scale, self.attention_backend)
        return self.o_proj(out.to(x.dtype).reshape(t, a.n_heads * a.head_dim))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, variant: Variant, layer: int, w, rope: RopeCache, inv_freq: torch.Tensor):
        super().__init__()
        p = f"blk.{layer}."
        backend = w.layer_backend(layer)
        self.attn_norm = RMSNorm(w(p + "attn_norm.weight"), args.rms_eps, backend)
        self.attn = Attention(args, variant, layer, w, backend, rope, inv_freq)
        self.ffn_norm = RMSNorm(w(p + "ffn_norm.weight"), args.rms_eps, backend)
        self.mlp = self.feed_forward(args, layer, w, backend)
        self.fused_decode = None
        if isinstance(self.mlp, GatedMLP):
            self.fused_decode = FusedDecode.for_block(self.attn_norm, self.attn, self.ffn_norm, self.mlp, "silu")

    def feed_forward(self, args: ModelArgs, layer: int, w, backend: Backend) -> nn.Module:
        """The layer's feed-forward: a SiLU-gated MLP (a subclass may route to experts)."""
        return GatedMLP(layer, w, backend, silu_mul)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self.fused_decode is not None:  # a decode step on the CPU kernels: two compiled calls, the same bits
            fused = self.fused_decode(x, positions, cache)
            if fused is not None:
                return fused
        x = x + self.attn(self.attn_norm(x), positions, cache).to(x.dtype)
        return x + self.mlp(self.ffn_norm(x)).to(x.dtype)


class Model(DecoderModel):
    variant = Variant()
    block = Block  # the layer class (qwen3moe's routes its feed-forward to experts)

    def __init__(self, args: ModelArgs, weights):
        super().__init__()
        self.args = args
        self.embedding = embedding_table(weights)
        inv_freq = args.rope_scaling.inverse_frequencies(args.head_dim, args.rope_base)
        if weights.has("rope_freqs.weight"):  # llama3's per-frequency scaling, read by every stage
            inv_freq = inv_freq / dequantize(weights.on_host("rope_freqs.weight")).reshape(-1)
        rope = RopeCache()
        self.layers = nn.ModuleList(self.block(args, self.variant, i, weights, rope, inv_freq)
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(weights("output_norm.weight"), args.rms_eps, weights.backend("output_norm.weight"))
        self.output = output_head(weights, self.embedding)

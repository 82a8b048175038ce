"""Gemma 3, as its GGUF describes it.

Grouped-query attention with RMS-normed queries and keys; five sliding-window
layers to each global one, with their own RoPE bases; a gated tanh-GELU MLP;
norms after attention and after the MLP as well as before; embeddings scaled
by sqrt(hidden); the output head tied to the embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..files import Backend, ModelConfig
from ..state import KVCache
from .decoder import DecoderArgs, DecoderModel, embedding_table, output_head
from .fused_decode import FusedDecode
from .layers import GatedMLP, Linear, Projections, RMSNorm, RopeCache, gelu_tanh_mul, rope_inverse_frequencies


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rope_base_local: float  # sliding-window layers (rope_base: global layers)
    rope_linear_scale: float  # global layers only
    sliding_window: int
    sliding_window_pattern: int  # every n-th layer is global

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        scaling = config.arch_key("rope.scaling.type")
        factor = float(config.arch_key("rope.scaling.factor", 1.0) or 1.0)
        # query_pre_attn_scalar is head_dim for the sizes llama.cpp knows, except 27B
        # (the common attention_scale, 1/sqrt(head_dim)).
        return cls(
            **DecoderArgs.common(config, vocab_size),
            # Gemma 3 files store only the global base; the local one is fixed by the architecture.
            rope_base_local=float(config.arch_key("rope.freq_base_swa", 10000.0)),
            rope_linear_scale=factor if scaling == "linear" else 1.0,
            sliding_window=int(config.sliding_window or config.context_length),
            sliding_window_pattern=config.arch_whole("attention.sliding_window_pattern", 6),
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern != 0

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, backend: Backend, rope: RopeCache):
        super().__init__()
        p = f"blk.{layer}."
        self.layer = layer
        self.args = args
        self.rope = rope
        self.q_proj = Linear(w(p + "attn_q.weight"), backend)
        self.k_proj = Linear(w(p + "attn_k.weight"), backend)
        self.v_proj = Linear(w(p + "attn_v.weight"), backend)
        self.o_proj = Linear(w(p + "attn_output.weight"), backend)
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = RMSNorm(w(p + "attn_q_norm.weight"), args.rms_eps, backend)
        self.k_norm = RMSNorm(w(p + "attn_k_norm.weight"), args.rms_eps, backend)
        self.attention_backend = backend.attention
        sliding = args.is_sliding(layer)
        inv_freq = (
            rope_inverse_frequencies(args.head_dim, args.rope_base_local)
            if sliding
            else rope_inverse_frequencies(args.head_dim, args.rope_base, args.rope_linear_scale)
        )
        self.register_buffer("inv_freq", inv_freq.to(backend.device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = self.qkv(x)
        # The CPU kernel's norm takes float32 tables (and applies them in float32).
        rope = self.rope.tables(positions, self.inv_freq, torch.float32 if self.q_norm.cpu_kernel else q.dtype)
        q = self.q_norm(q.view(t, a.n_heads, a.head_dim), rope=rope)
        k = self.k_norm(k.view(t, a.n_kv_heads, a.head_dim), rope=rope)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        out = cache.write_and_attend(self.layer, q, k, v, a.attention_scale, self.attention_backend)
        return self.o_proj(out.to(x.dtype).reshape(t, a.n_heads * a.head_dim))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, rope: RopeCache):
        super().__init__()
        p = f"blk.{layer}."
        backend = w.layer_backend(layer)
        self.attn_norm = RMSNorm(w(p + "attn_norm.weight"), args.rms_eps, backend)
        self.attn = Attention(args, layer, w, backend, rope)
        self.post_attn_norm = RMSNorm(w(p + "post_attention_norm.weight"), args.rms_eps, backend)
        self.ffn_norm = RMSNorm(w(p + "ffn_norm.weight"), args.rms_eps, backend)
        self.mlp = GatedMLP(layer, w, backend, gelu_tanh_mul)
        self.post_ffn_norm = RMSNorm(w(p + "post_ffw_norm.weight"), args.rms_eps, backend)
        self.fused_decode = FusedDecode.for_block(self.attn_norm, self.attn, self.ffn_norm, self.mlp, "gelu_tanh",
                                                  self.post_attn_norm, self.post_ffn_norm)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self.fused_decode is not None:  # a decode step on the CPU kernels: two compiled calls, the same bits
            fused = self.fused_decode(x, positions, cache)
            if fused is not None:
                return fused
        x = self.post_attn_norm(self.attn(self.attn_norm(x), positions, cache), residual=x)
        return self.post_ffn_norm(self.mlp(self.ffn_norm(x)), residual=x)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs, weights):
        super().__init__()
        self.args = args
        self.embedding = embedding_table(weights)
        # sqrt(hidden) as the activations hold it (Gemma's checkpoints round it to their dtype).
        self.embed_scale = float(torch.tensor(math.sqrt(args.hidden_size), dtype=weights.activations))
        # One table cache for the sliding layers, one for the global ones.
        ropes = {True: RopeCache(), False: RopeCache()}
        self.layers = nn.ModuleList(Block(args, i, weights, ropes[args.is_sliding(i)]) for i in range(args.n_layers))
        self.norm = RMSNorm(weights("output_norm.weight"), args.rms_eps, weights.backend("output_norm.weight"))
        self.output = output_head(weights, self.embedding)

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

from ..gguf_file import ModelConfig
from ..kv_cache import KVCache
from ..layers import Linear, RMSNorm, RopeCache, TiedEmbedding, gelu_tanh_mul, linears, rope_inverse_frequencies


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_eps: float
    rope_base: float  # global layers
    rope_base_local: float  # sliding-window layers
    rope_linear_scale: float  # global layers only
    sliding_window: int
    sliding_window_pattern: int  # every n-th layer is global
    attention_scale: float

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        scaling = config.arch_key("rope.scaling.type")
        factor = float(config.arch_key("rope.scaling.factor", 1.0) or 1.0)
        head_dim = config.key_length
        return cls(
            vocab_size=vocab_size,
            hidden_size=config.embedding_length,
            n_layers=config.block_count,
            n_heads=config.head_count,
            n_kv_heads=config.head_count_kv,
            head_dim=head_dim,
            ffn_dim=config.feed_forward_length,
            rms_eps=config.rms_norm_eps,
            rope_base=config.rope_freq_base,
            # Gemma 3 files store only the global base; the local one is fixed by the architecture.
            rope_base_local=float(config.arch_key("rope.freq_base_swa", 10000.0)),
            rope_linear_scale=factor if scaling == "linear" else 1.0,
            sliding_window=int(config.sliding_window or config.context_length),
            sliding_window_pattern=int(config.arch_key("attention.sliding_window_pattern", 6)),
            # query_pre_attn_scalar is head_dim for the sizes llama.cpp knows, except 27B.
            attention_scale=1.0 / math.sqrt(head_dim),
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern != 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, dtype: torch.dtype, rope: RopeCache):
        super().__init__()
        p = f"blk.{layer}."
        self.layer = layer
        self.args = args
        self.rope = rope
        self.q_proj = Linear(w(p + "attn_q.weight"), dtype)
        self.k_proj = Linear(w(p + "attn_k.weight"), dtype)
        self.v_proj = Linear(w(p + "attn_v.weight"), dtype)
        self.o_proj = Linear(w(p + "attn_output.weight"), dtype)
        self.q_norm = RMSNorm(w(p + "attn_q_norm.weight"), args.rms_eps, dtype)
        self.k_norm = RMSNorm(w(p + "attn_k_norm.weight"), args.rms_eps, dtype)
        # On the CPU fast path, the cache's attention by the CPU kernels too.
        self.attention_backend = "cpu" if self.q_norm.cpu_kernel else "auto"
        sliding = args.is_sliding(layer)
        self.window = args.sliding_window if sliding else None
        inv_freq = (
            rope_inverse_frequencies(args.head_dim, args.rope_base_local)
            if sliding
            else rope_inverse_frequencies(args.head_dim, args.rope_base, args.rope_linear_scale)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        # The CPU kernel's norm takes float32 tables (and applies them in float32).
        rope = self.rope.tables(positions, self.inv_freq, torch.float32 if self.q_norm.cpu_kernel else q.dtype)
        q = self.q_norm(q.view(t, a.n_heads, a.head_dim), rope=rope)
        k = self.k_norm(k.view(t, a.n_kv_heads, a.head_dim), rope=rope)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        out = cache.write_and_attend(self.layer, q, k, v, int(positions[0]), a.attention_scale, self.attention_backend)
        return self.o_proj(out.to(x.dtype).reshape(t, a.n_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, layer: int, w, dtype: torch.dtype):
        super().__init__()
        p = f"blk.{layer}."
        self.gate = Linear(w(p + "ffn_gate.weight"), dtype)
        self.up = Linear(w(p + "ffn_up.weight"), dtype)
        self.down = Linear(w(p + "ffn_down.weight"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, self.gate, self.up)
        return self.down(gelu_tanh_mul(gate, up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, dtype: torch.dtype, rope: RopeCache):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = RMSNorm(w(p + "attn_norm.weight"), args.rms_eps, dtype)
        self.attn = Attention(args, layer, w, dtype, rope)
        self.post_attn_norm = RMSNorm(w(p + "post_attention_norm.weight"), args.rms_eps, dtype)
        self.ffn_norm = RMSNorm(w(p + "ffn_norm.weight"), args.rms_eps, dtype)
        self.mlp = MLP(layer, w, dtype)
        self.post_ffn_norm = RMSNorm(w(p + "post_ffw_norm.weight"), args.rms_eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = self.post_attn_norm(self.attn(self.attn_norm(x), positions, cache), residual=x)
        return self.post_ffn_norm(self.mlp(self.ffn_norm(x)), residual=x)


class Model(nn.Module):
    """``forward(tokens, positions, cache)``: tokens ``[T]`` at consecutive
    ``positions`` starting at ``cache.length``; returns logits ``[T, vocab]``
    (or ``[1, vocab]`` for the last position when ``last_only``)."""

    def __init__(self, args: ModelArgs, weights, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
        self.embedding = TiedEmbedding(weights("token_embd.weight"), dtype)
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(args.hidden_size), dtype=dtype), persistent=False)
        # One table cache for the sliding layers, one for the global ones.
        ropes = {True: RopeCache(), False: RopeCache()}
        self.layers = nn.ModuleList(Block(args, i, weights, dtype, ropes[args.is_sliding(i)])
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(weights("output_norm.weight"), args.rms_eps, dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        x = self.embedding(tokens) * self.embed_scale
        for block in self.layers:
            x = block(x, positions, cache)
        cache.advance(tokens.shape[0])
        if last_only:
            x = x[-1:]
        return self.embedding.logits(self.norm(x))

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def attention_windows(self) -> list[int | None]:
        """Per layer: the sliding window, or None for full attention."""
        return [block.attn.window for block in self.layers]

    def new_cache(self, max_tokens: int, kv: str = "f16") -> KVCache:
        a = self.args
        # On the CPU fast path keys and values are bfloat16 values already, so
        # f16-format storage in bfloat16 is lossless and half of float32's bytes.
        fast = self.layers[0].attn.attention_backend == "cpu"
        return KVCache(kv, self.attention_windows(), a.n_kv_heads, a.head_dim, max_tokens, self.device,
                       float_dtype=torch.bfloat16 if fast else None)

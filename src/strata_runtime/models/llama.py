"""Llama (Llama 2 and 3, SmolLM, Mistral files that say ``llama``), as its GGUF describes it.

Grouped-query attention with rotary embeddings, a SiLU-gated MLP, RMSNorm
before each, the output head tied to the embeddings or not.

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

from strata_kernels import QuantTensor, dequantize

from ..errors import ModelFileError
from ..gguf_file import ModelConfig
from ..kv_cache import KVCache
from ..layers import (GatedMLP, Linear, RMSNorm, RopeCache, TiedEmbedding, apply_rope, linears,
                      rope_inverse_frequencies, silu_mul)
from .decoder import DecoderArgs, DecoderModel


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rope_linear_scale: float
    sliding_window: int | None = None  # no sliding layers (read by the split planner)

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        scaling = config.arch_key("rope.scaling.type") or "none"
        if scaling not in ("none", "linear"):
            raise ModelFileError(f"{config.architecture}: rope scaling {scaling!r} is not supported yet; "
                                 f"supported: none, linear (and llama3's rope_freqs tensor)")
        factor = float(config.arch_key("rope.scaling.factor", 1.0) or 1.0)
        rotary = int(config.arch_key("rope.dimension_count", config.key_length))
        if rotary != config.key_length:
            raise ModelFileError(f"{config.architecture}: partial rotary embeddings ({rotary} of {config.key_length} "
                                 f"dimensions) are not supported for this architecture")
        return cls(**DecoderArgs.common(config, vocab_size), rope_linear_scale=factor if scaling == "linear" else 1.0)

    def is_sliding(self, layer: int) -> bool:
        return False


def unpermute_rotary_rows(weight: QuantTensor, heads: int) -> QuantTensor:
    """Undo the GGUF converter's per-head row order (pairs interleaved) of a
    query or key projection: row ``2i + h`` of each head goes back to ``h * d/2 + i``."""
    d = weight.rows // heads
    within = torch.arange(d).view(d // 2, 2).t().reshape(-1)  # [0, 2, 4, ..., 1, 3, 5, ...]
    order = (torch.arange(heads)[:, None] * d + within[None, :]).reshape(-1).to(weight.device)
    return QuantTensor(weight.data.index_select(0, order), weight.qtype, weight.shape)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, dtype: torch.dtype, rope: RopeCache,
                 inv_freq: torch.Tensor, cpu_kernels: bool):
        super().__init__()
        p = f"blk.{layer}."
        self.layer = layer
        self.args = args
        self.rope = rope
        self.q_proj = Linear(unpermute_rotary_rows(w(p + "attn_q.weight"), args.n_heads), dtype)
        self.k_proj = Linear(unpermute_rotary_rows(w(p + "attn_k.weight"), args.n_kv_heads), dtype)
        self.v_proj = Linear(w(p + "attn_v.weight"), dtype)
        self.o_proj = Linear(w(p + "attn_output.weight"), dtype)
        self.window = None
        # On the CPU fast path, the cache's attention by the CPU kernels too.
        self.attention_backend = "cpu" if cpu_kernels else "auto"
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        cos, sin = self.rope.tables(positions, self.inv_freq, torch.float32)
        q = apply_rope(q.view(t, a.n_heads, a.head_dim).float(), cos, sin).to(x.dtype)
        k = apply_rope(k.view(t, a.n_kv_heads, a.head_dim).float(), cos, sin).to(x.dtype)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        out = cache.write_and_attend(self.layer, q, k, v, int(positions[0]), a.attention_scale, self.attention_backend)
        return self.o_proj(out.to(x.dtype).reshape(t, a.n_heads * a.head_dim))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, dtype: torch.dtype, rope: RopeCache,
                 inv_freq: torch.Tensor):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = RMSNorm(w(p + "attn_norm.weight"), args.rms_eps, dtype)
        self.attn = Attention(args, layer, w, dtype, rope, inv_freq, self.attn_norm.cpu_kernel)
        self.ffn_norm = RMSNorm(w(p + "ffn_norm.weight"), args.rms_eps, dtype)
        self.mlp = GatedMLP(layer, w, dtype, silu_mul)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache).to(x.dtype)
        return x + self.mlp(self.ffn_norm(x)).to(x.dtype)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs, weights, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
        self.embedding = TiedEmbedding(weights("token_embd.weight"), dtype)
        self.register_buffer("embed_scale", torch.tensor(1.0, dtype=dtype), persistent=False)
        inv_freq = rope_inverse_frequencies(args.head_dim, args.rope_base, args.rope_linear_scale)
        factors = _optional(weights, "rope_freqs.weight")  # llama3's per-frequency scaling
        if factors is not None:
            inv_freq = inv_freq / dequantize(factors).reshape(-1).cpu()
        rope = RopeCache()
        self.layers = nn.ModuleList(Block(args, i, weights, dtype, rope, inv_freq) for i in range(args.n_layers))
        self.norm = RMSNorm(weights("output_norm.weight"), args.rms_eps, dtype)
        output = _optional(weights, "output.weight")
        self._head = None if output is None else TiedEmbedding(output, dtype)

    @property
    def head(self) -> TiedEmbedding:
        return self.embedding if self._head is None else self._head


def _optional(weights, name: str):
    try:
        return weights(name)
    except ModelFileError:
        return None

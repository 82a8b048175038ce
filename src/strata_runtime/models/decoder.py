"""What every decoder-only architecture shares: embed, the blocks, the final
norm and the head, over one KV cache.

A model file subclasses ``DecoderModel`` and sets, in its constructor:
``args`` (its ``ModelArgs``), ``embedding`` (a ``TiedEmbedding``: the token
table), ``embed_scale`` (a buffer the embeddings are multiplied by),
``layers`` (blocks with ``forward(x, positions, cache)`` and an ``attn`` that
has ``window`` and ``attention_backend``), ``norm`` and ``output`` (the
output projection, a ``TiedEmbedding`` over ``output.weight``, or None when
the head is tied to the token table). The layer-split pipelines read those
names; ``head`` is whichever scores the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..gguf_file import ModelConfig
from ..kv_cache import KVCache, f16_storage_dtype


@dataclass(frozen=True)
class DecoderArgs:
    """The sizes every decoder-only architecture has; a model file's
    ``ModelArgs`` extends it with its own."""

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_eps: float
    rope_base: float
    attention_scale: float

    @staticmethod
    def common(config: ModelConfig, vocab_size: int) -> dict:
        """The shared fields as the GGUF metadata gives them (keyword arguments)."""
        return dict(vocab_size=vocab_size, hidden_size=config.embedding_length, n_layers=config.block_count,
                    n_heads=config.head_count, n_kv_heads=config.head_count_kv, head_dim=config.key_length,
                    ffn_dim=config.feed_forward_length, rms_eps=config.rms_norm_eps,
                    rope_base=config.rope_freq_base, attention_scale=1.0 / math.sqrt(config.key_length))


class DecoderModel(nn.Module):
    """``forward(tokens, positions, cache)``: tokens ``[T]`` at consecutive
    ``positions`` starting at ``cache.length``; returns float32 logits
    ``[T, vocab]`` (or ``[1, vocab]`` for the last position when ``last_only``)."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        x = self.embedding(tokens) * self.embed_scale
        for block in self.layers:
            x = block(x, positions, cache)
        cache.advance(tokens.shape[0])
        if last_only:
            x = x[-1:]
        return self.head.logits(self.norm(x))

    @property
    def head(self) -> nn.Module:
        """The output projection: ``output``, or the token table when tied (a
        split replaces ``embedding``, and a tied head goes with it)."""
        return self.embedding if self.output is None else self.output

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def attention_windows(self) -> list[int | None]:
        """Per layer: the sliding window, or None for full attention."""
        return [block.attn.window for block in self.layers]

    def new_cache(self, max_tokens: int, kv: str = "f16") -> KVCache:
        a = self.args
        # The CPU fast path's keys and values are bfloat16 values already (the
        # planner counts the same storage: f16_storage_dtype is the one rule).
        fast = self.layers[0].attn.attention_backend == "cpu"
        storage = f16_storage_dtype(self.device, torch.bfloat16 if fast else torch.float32)
        return KVCache(kv, self.attention_windows(), a.n_kv_heads, a.head_dim, max_tokens, self.device,
                       float_dtype=storage)

"""The model interface, and what every decoder-only architecture shares.

Everything outside ``models/`` (the engine, the layer-split pipelines in one
process and across ranks, the KV cache, the conversation cache, the planner,
``strata info``) uses a model through this interface only:

- ``embed(tokens)``: hidden states ``[T, hidden]`` for token ids ``[T]``
  (on the token table's device, ``device``);
- ``layers``: a ``ModuleList``; ``layers[i](x, positions, cache)`` runs
  layer ``i`` over hidden states ``x`` at ``positions``, reading and
  writing its state in ``cache``: one sequence's ``KVCache`` (consecutive
  positions from its length on) or a ``batch.Batch`` of several (each
  sequence's rows after the previous one's);
- ``head(x)``: float32 logits ``[T, vocab]`` (the final norm, then the
  output projection, tied to the token table or not; on the last stage);
- ``state_spec()``: per layer, the state it keeps (``state.spec.LayerState``);
  the same list ``ModelArgs.state_spec()`` gives before any weight is read;
- ``hidden_size``, ``vocab_size``;
- ``new_cache(max_tokens, kv)``: that state's storage, reserved once, on
  the loader's placement.

A model file subclasses ``DecoderModel``: its ``ModelArgs`` extends
``DecoderArgs`` (overriding ``window`` for sliding layers) and its
constructor, given ``(args, weights)`` (a ``loader.Weights``), sets
``args``, ``embedding`` (``embedding_table``), ``layers``, ``norm`` and
``output`` (``output_head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..files import EMBEDDING, EXACT, ComputePath, ModelConfig
from ..state import AttentionState, KVCache, LayerState
from ..testing import fault_point
from .layers import TiedEmbedding


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

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for full attention."""
        return None

    def tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The logical shapes the metadata gives layer ``layer``'s tensors (by
        name after ``blk.{layer}.``); the loader checks those a file has, so
        a head count or width that disagrees with the tensors is named at load."""
        h, d = self.hidden_size, self.head_dim
        shapes = {"attn_q.weight": (self.n_heads * d, h), "attn_k.weight": (self.n_kv_heads * d, h),
                  "attn_v.weight": (self.n_kv_heads * d, h), "attn_output.weight": (h, self.n_heads * d),
                  "attn_norm.weight": (h,)}
        if self.ffn_dim:
            shapes |= {"ffn_gate.weight": (self.ffn_dim, h), "ffn_up.weight": (self.ffn_dim, h),
                       "ffn_down.weight": (h, self.ffn_dim)}
        return shapes

    def state_spec(self) -> list[LayerState]:
        return [AttentionState(self.n_kv_heads, self.head_dim, self.window(i)) for i in range(self.n_layers)]


def embedding_table(weights) -> TiedEmbedding:
    """The token table, on the first stage."""
    return TiedEmbedding(weights(EMBEDDING), weights.backend(EMBEDDING))


def output_head(weights, embedding: TiedEmbedding) -> TiedEmbedding:
    """``output.weight``, or the token table when the file ties the head to
    it: ``embedding`` itself where the head shares its device (one copy),
    else the table read again onto the last stage."""
    if weights.has("output.weight"):
        return TiedEmbedding(weights("output.weight", head=True), weights.backend("output.weight", head=True))
    if weights.placement.device_of(EMBEDDING, head=True) == weights.placement.device_of(EMBEDDING):
        return embedding
    return TiedEmbedding(weights(EMBEDDING, head=True), weights.backend(EMBEDDING, head=True))


class DecoderModel(nn.Module):
    """``forward(tokens, positions, cache)``: tokens ``[T]`` at consecutive
    ``positions`` starting at ``cache.length``, every layer on one device;
    returns float32 logits ``[T, vocab]`` (or ``[1, vocab]`` for the last
    position when ``last_only``). A split runs the same interface from
    outside (``pipeline.Pipeline``, ``ranks``)."""

    embed_scale: float = 1.0  # the embeddings are multiplied by this (Gemma: sqrt(hidden))
    # Set by the loader: where each tensor lives, the activations' dtype, and
    # the compute path that chose it.
    placement = None
    activations: torch.dtype = torch.float32
    compute_path: ComputePath = EXACT
    backends: list = []  # one per device this process holds a part on

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output.logits(self.norm(x))

    def state_spec(self) -> list[LayerState]:
        return self.args.state_spec()

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def device(self) -> torch.device:
        """Where token ids go in (the token table's device)."""
        return self.embedding.device

    def new_cache(self, max_tokens: int, kv: str) -> KVCache:
        """An empty cache for ``max_tokens`` positions in KV format ``kv``,
        laid out by ``state_spec()`` on the loader's placement."""
        return KVCache.for_placement(kv, self.state_spec(), self.placement, max_tokens,
                                      self.compute_path.kv_float)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            fault_point("layer", i)
            x = layer(x, positions, cache)
        return finish(self, x, cache, last_only)


def finish(model, x: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
    """After the last layer: the cache (or every sequence of a ``Batch``)
    now holds the step's positions; the logits of every position, or of the
    last (of each sequence)."""
    cache.advance(x.shape[0])
    return model.head(cache.last_rows(x) if last_only else x)

"""Qwen3-MoE: Qwen 3's attention (per-head query and key norms, half-split
rotation) with a routed mixture-of-experts feed-forward in every layer
(``moe.MoEFeedForward``): ``{arch}.expert_count`` experts, of which
``expert_used_count`` serve each token, each a SiLU-gated MLP of
``expert_feed_forward_length``; the router's top-k weights renormalized to
sum to 1, as llama.cpp always does for this architecture (transformers:
``norm_topk_prob``, true in the released checkpoints). Models with dense
layers between the sparse ones (``decoder_sparse_step`` above 1) have no
GGUF metadata for it and are refused by the missing expert tensors."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ModelFileError
from ..gguf_file import ModelConfig
from ..layers import silu_mul
from ..moe import MoEFeedForward
from . import llama
from .llama import Variant

__all__ = ["Model", "ModelArgs"]


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = True

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        base = llama.ModelArgs.from_config.__func__(llama.ModelArgs, config, vocab_size)
        experts = int(config.arch_key("expert_count", 0) or 0)
        used = int(config.arch_key("expert_used_count", 0) or 0)
        if experts < 1 or not 1 <= used <= experts:
            raise ModelFileError(f"{config.architecture}: needs {config.architecture}.expert_count >= 1 and "
                                 f"1 <= expert_used_count <= expert_count, got {experts} and {used}")
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, n_experts=experts,
                   experts_per_token=used,
                   expert_ffn_dim=int(config.arch_key("expert_feed_forward_length", 0) or 0),
                   norm_topk=bool(config.arch_key("expert_weights_norm", True)))


class Block(llama.Block):
    def feed_forward(self, args: ModelArgs, layer: int, w, backend):
        return MoEFeedForward(layer, w, backend, args.experts_per_token, args.norm_topk, silu_mul)


class Model(llama.Model):
    variant = Variant(permuted_rotary=False, qk_norm=True)
    block = Block

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
from ..files import ModelConfig
from . import llama
from .layers import silu_mul
from .llama import Variant
from .moe import MoEFeedForward

__all__ = ["Model", "ModelArgs"]


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    n_experts: int = 0
    experts_per_token: int = 0
    norm_topk: bool = True

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        base = llama.ModelArgs.from_config(config, vocab_size)
        experts = config.experts()
        if experts is None or not 1 <= experts.per_token <= experts.count:
            got = (0, 0) if experts is None else (experts.count, experts.per_token)
            raise ModelFileError(f"{config.architecture}: needs {config.architecture}.expert_count >= 1 and "
                                 f"1 <= expert_used_count <= expert_count, got {got[0]} and {got[1]}")
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, n_experts=experts.count,
                   experts_per_token=experts.per_token,
                   norm_topk=bool(config.arch_key("expert_weights_norm", True)))


class Block(llama.Block):
    def feed_forward(self, args: ModelArgs, layer: int, w, backend):
        return MoEFeedForward(layer, w, backend, args.n_experts, args.experts_per_token, args.norm_topk, silu_mul)


class Model(llama.Model):
    variant = Variant(permuted_rotary=False, qk_norm=True)
    block = Block

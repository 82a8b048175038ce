"""Qwen3-Next (``qwen3next``), as llama.cpp reads it: a hybrid of recurrent
Gated DeltaNet layers (``delta_net.GatedDeltaNet``) and gated full attention.

- Which layers attend: ``{arch}.attention.recurrent_layers`` (per layer,
  true where recurrent) when the file has it, else every
  ``full_attention_interval``-th layer (default 4: layers 3, 7, ...).
- Gated attention: ``attn_q`` gives, per head, the query then a gate
  (``2 * head_dim`` rows); per-head RMS norms of queries and keys; the
  rotation (half-split) on the first ``rope.dimension_count`` dimensions of
  each head only; the attention's output times ``sigmoid(gate)``.
- The feed-forward: routed experts (``moe.MoEFeedForward``, top-k weights
  renormalized) plus a shared expert (``*_shexp``) scaled by
  ``sigmoid(ffn_gate_inp_shexp . x)``; a dense MLP where the file has no router.
- Norms: ``attn_norm`` before the mixer, ``post_attention_norm`` before the
  feed-forward; stored with the converter's ``+ 1`` folded in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from strata_kernels import dequantize

from ..errors import ModelFileError
from ..files import Backend, ModelConfig
from ..state import AttentionState, LayerState, RecurrentState
from .decoder import DecoderArgs, DecoderModel, embedding_table, output_head
from .delta_net import DeltaNetShape, GatedDeltaNet
from .layers import GatedMLP, Linear, Projections, RMSNorm, RopeCache, apply_rope, rope_inverse_frequencies, silu_mul
from .moe import MoEFeedForward

__all__ = ["Model", "ModelArgs"]


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rotary_dim: int = 0
    recurrent: tuple[bool, ...] = ()  # per layer
    delta_net: DeltaNetShape | None = None
    n_experts: int = 0
    experts_per_token: int = 0


    def tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().tensor_shapes(layer)
        shapes["attn_q.weight"] = (2 * self.n_heads * self.head_dim, self.hidden_size)  # per head: query, then gate
        return shapes
    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> "ModelArgs":
        arch = config.architecture
        common = DecoderArgs.common(config, vocab_size)
        n = common["n_layers"]
        listed = config.arch_key("attention.recurrent_layers")
        if listed is not None:
            listed = [bool(v) for v in (listed if isinstance(listed, (list, tuple)) else [listed] * n)]
            if len(listed) < n:
                raise ModelFileError(f"{arch}.attention.recurrent_layers lists {len(listed)} layers; the model has {n}")
            recurrent = tuple(listed[:n])
        else:
            interval = int(config.arch_key("full_attention_interval", 4) or 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n))
        keys = {key: config.arch_key(f"ssm.{key}") for key in
                ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
        missing = [f"{arch}.ssm.{key}" for key, v in keys.items() if not v]
        if any(recurrent) and missing:
            raise ModelFileError(f"{arch}: the recurrent layers need {', '.join(missing)} in the metadata")
        shape = None
        if any(recurrent):
            v_heads = int(keys["time_step_rank"])
            shape = DeltaNetShape(k_heads=int(keys["group_count"]), v_heads=v_heads, d_k=int(keys["state_size"]),
                                  d_v=int(keys["inner_size"]) // v_heads, conv_kernel=int(keys["conv_kernel"]))
        rotary = int(config.arch_key("rope.dimension_count", config.key_length))
        if rotary % 2 or not 0 < rotary <= config.key_length:
            raise ModelFileError(f"{arch}.rope.dimension_count is {rotary}; it must be even and at most the head "
                                 f"dimension {config.key_length}")
        experts = config.experts()
        return cls(**common, rotary_dim=rotary, recurrent=recurrent, delta_net=shape,
                   n_experts=experts.count if experts else 0, experts_per_token=experts.per_token if experts else 0)

    def state_spec(self) -> list[LayerState]:
        s = self.delta_net
        return [RecurrentState(s.conv_kernel - 1, s.channels, s.v_heads, s.d_k, s.d_v) if recurrent
                else AttentionState(self.n_kv_heads, self.head_dim) for recurrent in self.recurrent]


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by ``sigmoid`` of a
    second half of the query projection, with partial rotary embeddings."""

    def __init__(self, args: ModelArgs, layer: int, w, backend: Backend, rope: RopeCache, inv_freq: torch.Tensor):
        super().__init__()
        p = f"blk.{layer}."
        self.layer = layer
        self.args = args
        self.rope = rope
        self.q_proj = Linear(w(p + "attn_q.weight"), backend)  # per head: query, then gate
        self.k_proj = Linear(w(p + "attn_k.weight"), backend)
        self.v_proj = Linear(w(p + "attn_v.weight"), backend)
        self.o_proj = Linear(w(p + "attn_output.weight"), backend)
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = RMSNorm(w(p + "attn_q_norm.weight"), args.rms_eps, backend)
        self.k_norm = RMSNorm(w(p + "attn_k_norm.weight"), args.rms_eps, backend)
        self.attention_backend = backend.attention
        self.register_buffer("inv_freq", inv_freq.to(backend.device), persistent=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The half-split rotation of the first ``rotary_dim`` dimensions of each head, in float32."""
        r = self.args.rotary_dim
        cos, sin = self.rope.tables(positions, self.inv_freq, torch.float32)
        if r == x.shape[-1]:
            return apply_rope(x.float(), cos, sin).to(x.dtype)
        return torch.cat([apply_rope(x[..., :r].float(), cos, sin).to(x.dtype), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        qg, k, v = self.qkv(x)
        qg = qg.view(t, a.n_heads, 2, a.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1].reshape(t, a.n_heads * a.head_dim)
        q = self.rotate(self.q_norm(q.contiguous()), positions)
        k = self.rotate(self.k_norm(k.view(t, a.n_kv_heads, a.head_dim)), positions)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        out = cache.write_and_attend(self.layer, q, k, v, a.attention_scale, self.attention_backend)
        out = out.reshape(t, a.n_heads * a.head_dim) * torch.sigmoid(gate.float())
        return self.o_proj(out.to(x.dtype))


class SharedExpertMoE(nn.Module):
    """Routed experts plus one shared expert, gated per row by ``sigmoid(ffn_gate_inp_shexp . x)``."""

    def __init__(self, args: ModelArgs, layer: int, w, backend: Backend):
        super().__init__()
        p = f"blk.{layer}."
        self.routed = MoEFeedForward(layer, w, backend, args.n_experts, args.experts_per_token, True, silu_mul)
        self.shared = GatedMLP(layer, w, backend, silu_mul, suffix="_shexp")
        gate = dequantize(w(p + "ffn_gate_inp_shexp.weight")).reshape(1, -1)
        self.register_buffer("shared_gate", gate, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x.float() @ self.shared_gate.t())
        return (self.routed(x).float() + gate * self.shared(x).float()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w, rope: RopeCache, inv_freq: torch.Tensor):
        super().__init__()
        p = f"blk.{layer}."
        backend = w.layer_backend(layer)
        self.attn_norm = RMSNorm(w(p + "attn_norm.weight"), args.rms_eps, backend)
        self.recurrent = args.recurrent[layer]
        if self.recurrent:
            self.mixer = GatedDeltaNet(layer, w, backend, args.delta_net, args.rms_eps)
        else:
            self.mixer = GatedAttention(args, layer, w, backend, rope, inv_freq)
        self.ffn_norm = RMSNorm(w(p + "post_attention_norm.weight"), args.rms_eps, backend)
        if w.has(p + "ffn_gate_inp.weight"):
            if not args.n_experts:
                raise ModelFileError(f"layer {layer} has a router (ffn_gate_inp) but the file says no expert_count")
            self.mlp = SharedExpertMoE(args, layer, w, backend)
        else:
            self.mlp = GatedMLP(layer, w, backend, silu_mul)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        h = self.attn_norm(x)
        mixed = self.mixer(h, cache) if self.recurrent else self.mixer(h, positions, cache)
        x = x + mixed.to(x.dtype)
        return x + self.mlp(self.ffn_norm(x)).to(x.dtype)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs, weights):
        super().__init__()
        self.args = args
        self.embedding = embedding_table(weights)
        inv_freq = rope_inverse_frequencies(args.rotary_dim, args.rope_base)
        rope = RopeCache()
        self.layers = nn.ModuleList(Block(args, i, weights, rope, inv_freq) for i in range(args.n_layers))
        self.norm = RMSNorm(weights("output_norm.weight"), args.rms_eps, weights.backend("output_norm.weight"))
        self.output = output_head(weights, self.embedding)

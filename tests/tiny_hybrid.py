"""Tiny random-weight Qwen3-Next (``qwen3next``) GGUFs, written as llama.cpp's
converter lays the architecture out, and the float32 oracle: transformers'
own Qwen3-Next modules with the GGUF's tensors loaded into them, undoing the
converter's transforms (transformers cannot load this architecture from a
GGUF). The mapping lives here, in the tests only:

- stored RMSNorm weights are ``1 + w`` (transformers keeps ``w``), except the
  DeltaNet's own gated norm (``ssm_norm``), stored as is;
- ``ssm_a`` is ``-exp(A_log)``; ``ssm_dt.bias`` is ``dt_bias``;
- ``in_proj_qkvz`` (per key head: q, k, v, z) is stored split: ``attn_qkv``
  (all q, all k, all v) and ``attn_gate`` (z); ``in_proj_ba`` is ``ssm_ba``;
- ``ssm_conv1d`` is the depthwise kernel squeezed to ``[channels, K]``;
- the experts' gate and up are separate tensors (transformers fuses them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tiny_models import RandomTensors, finish_writer, new_writer


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class HybridShape:
    hidden: int = 64
    layers: int = 4
    interval: int = 4  # every interval-th layer attends (layer 3 of 4)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rotary_dim: int = 4  # a quarter of the head, as the released models
    k_heads: int = 2  # DeltaNet query/key heads
    v_heads: int = 4  # and value heads (two per key head)
    d_k: int = 16
    d_v: int = 16
    conv_kernel: int = 4
    experts: int = 4
    experts_per_token: int = 2
    expert_ffn: int = 32
    shared_ffn: int = 64
    ffn: int = 96
    recurrent_list: tuple[bool, ...] | None = None  # written as attention.recurrent_layers when given
    told_state_size: int | None = None  # an ssm.state_size that disagrees with the tensors (a broken file)

    def recurrent(self) -> list[bool]:
        if self.recurrent_list is not None:
            return list(self.recurrent_list)
        return [(i + 1) % self.interval != 0 for i in range(self.layers)]


def write_hybrid_model(path: Path, shape: HybridShape, seed: int,
                       qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """A ``qwen3next`` GGUF with random weights scaled so the logits are
    peaked; the projections stored as ``qtype``, the rest as F32."""
    s = shape
    w, vocab = new_writer(path, "qwen3next", s, 512, s.rotary_dim)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_per_token)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_shared_feed_forward_length(s.shared_ffn)
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_state_size(s.d_k if s.told_state_size is None else s.told_state_size)
    w.add_ssm_group_count(s.k_heads)
    w.add_ssm_time_step_rank(s.v_heads)
    w.add_ssm_inner_size(s.v_heads * s.d_v)
    if s.recurrent_list is not None:
        w.add_array("qwen3next.attention.recurrent_layers", list(s.recurrent_list))
    else:
        w.add_full_attention_interval(s.interval)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    t = RandomTensors(w, rng, qtype)
    weight, vector = t.weight, t.vector

    h = s.hidden
    kd, vd = s.k_heads * s.d_k, s.v_heads * s.d_v
    weight("token_embd.weight", vocab, h, 1.0, quantized=False)
    for i, recurrent in enumerate(s.recurrent()):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h, 1.0, 0.1)
        vector(p + "post_attention_norm.weight", h, 1.0, 0.1)
        if recurrent:
            weight(p + "attn_qkv.weight", 2 * kd + vd, h, h ** -0.5)
            weight(p + "attn_gate.weight", vd, h, h ** -0.5)
            weight(p + "ssm_ba.weight", 2 * s.v_heads, h, h ** -0.5, quantized=False)
            weight(p + "ssm_conv1d.weight", 2 * kd + vd, s.conv_kernel, 0.5, quantized=False)
            w.add_tensor(p + "ssm_a", (-np.exp(rng.uniform(-2.0, 0.5, s.v_heads))).astype(np.float32))
            vector(p + "ssm_dt.bias", s.v_heads, 0.0, 0.5)
            vector(p + "ssm_norm.weight", s.d_v, 1.0, 0.1)
            weight(p + "ssm_out.weight", h, vd, vd ** -0.5)
        else:
            q = s.heads * s.head_dim
            weight(p + "attn_q.weight", 2 * q, h, h ** -0.5)
            weight(p + "attn_k.weight", s.kv_heads * s.head_dim, h, h ** -0.5)
            weight(p + "attn_v.weight", s.kv_heads * s.head_dim, h, h ** -0.5)
            weight(p + "attn_output.weight", h, q, q ** -0.5)
            vector(p + "attn_q_norm.weight", s.head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", s.head_dim, 1.0, 0.1)
        weight(p + "ffn_gate_inp.weight", s.experts, h, 3 * h ** -0.5, quantized=False)
        weight(p + "ffn_gate_exps.weight", s.expert_ffn, h, h ** -0.5, experts=s.experts)
        weight(p + "ffn_up_exps.weight", s.expert_ffn, h, h ** -0.5, experts=s.experts)
        weight(p + "ffn_down_exps.weight", h, s.expert_ffn, s.expert_ffn ** -0.5, experts=s.experts)
        vector(p + "ffn_gate_inp_shexp.weight", h, 0.0, h ** -0.5)
        weight(p + "ffn_gate_shexp.weight", s.shared_ffn, h, h ** -0.5)
        weight(p + "ffn_up_shexp.weight", s.shared_ffn, h, h ** -0.5)
        weight(p + "ffn_down_shexp.weight", h, s.shared_ffn, s.shared_ffn ** -0.5)
    vector("output_norm.weight", h, 1.0, 0.1)
    weight("output.weight", vocab, h, 4 * h ** -0.5)
    finish_writer(w)
    return path


def oracle_model(path: Path, shape: HybridShape):
    """transformers' ``Qwen3NextForCausalLM`` (float32, eager) holding the
    GGUF's weights (dequantized), the converter's transforms undone."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from strata_runtime.files.gguf_file import GGUFFile
    from strata_kernels import dequantize

    s = shape
    gguf = GGUFFile.open(path)
    vocab = gguf.tensor("token_embd.weight").shape[0]
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        partial_rotary_factor=s.rotary_dim / s.head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                          "partial_rotary_factor": s.rotary_dim / s.head_dim},
        rms_norm_eps=1e-6, linear_conv_kernel_dim=s.conv_kernel, linear_key_head_dim=s.d_k,
        linear_value_head_dim=s.d_v, linear_num_key_heads=s.k_heads, linear_num_value_heads=s.v_heads,
        num_experts=s.experts, num_experts_per_tok=s.experts_per_token, moe_intermediate_size=s.expert_ffn,
        shared_expert_intermediate_size=s.shared_ffn, norm_topk_prob=True, decoder_sparse_step=1,
        layer_types=["linear_attention" if r else "full_attention" for r in s.recurrent()],
        tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32)
    model = Qwen3NextForCausalLM(config).float().eval()

    def t(name: str) -> torch.Tensor:
        return dequantize(gguf.tensor(name)).float()

    def norm(name: str) -> torch.Tensor:
        return t(name).reshape(-1) - 1.0

    state = {"model.embed_tokens.weight": t("token_embd.weight"), "lm_head.weight": t("output.weight"),
             "model.norm.weight": norm("output_norm.weight")}
    kd, r = s.d_k, s.v_heads // s.k_heads
    for i, recurrent in enumerate(s.recurrent()):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        state[m + "input_layernorm.weight"] = norm(p + "attn_norm.weight")
        state[m + "post_attention_layernorm.weight"] = norm(p + "post_attention_norm.weight")
        if recurrent:
            a = m + "linear_attn."
            qkv, z = t(p + "attn_qkv.weight"), t(p + "attn_gate.weight")
            q_all, k_all, v_all = qkv.split([s.k_heads * kd, s.k_heads * kd, s.v_heads * s.d_v])
            per_head = [torch.cat([q_all.view(s.k_heads, kd, -1)[j], k_all.view(s.k_heads, kd, -1)[j],
                                   v_all.view(s.k_heads, r * s.d_v, -1)[j], z.view(s.k_heads, r * s.d_v, -1)[j]])
                        for j in range(s.k_heads)]
            state[a + "in_proj_qkvz.weight"] = torch.cat(per_head)
            state[a + "in_proj_ba.weight"] = t(p + "ssm_ba.weight")
            state[a + "conv1d.weight"] = t(p + "ssm_conv1d.weight")[:, None, :]
            state[a + "A_log"] = torch.log(-t(p + "ssm_a").reshape(-1))
            state[a + "dt_bias"] = t(p + "ssm_dt.bias").reshape(-1)
            state[a + "norm.weight"] = t(p + "ssm_norm.weight").reshape(-1)
            state[a + "out_proj.weight"] = t(p + "ssm_out.weight")
        else:
            a = m + "self_attn."
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                 ("attn_output", "o_proj")):
                state[a + theirs + ".weight"] = t(p + ours + ".weight")
            state[a + "q_norm.weight"] = norm(p + "attn_q_norm.weight")
            state[a + "k_norm.weight"] = norm(p + "attn_k_norm.weight")
        f = m + "mlp."
        state[f + "gate.weight"] = t(p + "ffn_gate_inp.weight")
        state[f + "experts.gate_up_proj"] = torch.cat([t(p + "ffn_gate_exps.weight"), t(p + "ffn_up_exps.weight")], 1)
        state[f + "experts.down_proj"] = t(p + "ffn_down_exps.weight")
        state[f + "shared_expert_gate.weight"] = t(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            state[f + f"shared_expert.{theirs}.weight"] = t(p + f"ffn_{ours}_shexp.weight")
    missing, unexpected = model.load_state_dict(state, strict=False)
    leftover = [k for k in missing if "rotary" not in k]
    if leftover or unexpected:
        raise AssertionError(f"oracle weights: missing {leftover}, unexpected {unexpected}")
    return model


def oracle_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[T, vocab]`` of one forward over ``token_ids`` (no cache)."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()

"""A decoder layer's decode step on the CPU kernels as two compiled calls
(``attention_block`` and ``mlp_block`` in ``csrc/decode_block_cpu.cpp``)
instead of about a dozen kernel calls with Python between them: at decode
sizes that Python cost as much as the attention itself (SmolLM2 at 2,000
tokens of context: about 110 us of a layer's 500).

The compiled blocks call the same kernels in the same order as the model
files' modules do, so a step gives the same bits either way
(``tests/test_dense_families.py`` checks it for every family). A model file
builds one per layer with ``FusedDecode.for_block``, which says None where
the layer is not wholly on the CPU kernels; ``__call__`` says None for a
step the blocks do not cover (more than one position, KV storage the decode
kernel does not read), and the layer runs its modules.
"""

from __future__ import annotations

import torch
from torch import nn

from strata_kernels import cpu_kernels

from ..state import KVCache
from .layers import GatedMLP, Linear, RMSNorm

ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}  # gated_mul's codes


class FusedDecode:
    """One layer's arguments for the two compiled calls, gathered at load.

    Invariant: every projection of the layer holds GGUF blocks the CPU
    kernels read (its ``Projections.blocks``, made at load, are what the
    calls take); the attention module has the fields every model file's does
    (``args``, ``layer``, ``rope``, ``inv_freq``, ``qkv``, ``q_norm``/``k_norm``).
    """

    def __init__(self, attn_norm: RMSNorm, attention: nn.Module, ffn_norm: RMSNorm, mlp: GatedMLP, act: str,
                 post_attn_norm: RMSNorm | None, post_ffn_norm: RMSNorm | None):
        a = attention.args
        self.layer, self.rope, self.inv_freq = attention.layer, attention.rope, attention.inv_freq
        self.scale = a.attention_scale
        # The GEMV arguments the layer's Projections made at load.
        (gate, up), (gate_type, up_type) = mlp.gate_up.blocks
        biases = [p.bias for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
        self.attention_args = (attn_norm.weight, attn_norm.eps, *attention.qkv.blocks,
                               biases if biases[0] is not None else [], _weight(attention.q_norm),
                               _weight(attention.k_norm), a.n_heads, a.n_kv_heads, a.head_dim)
        self.o_proj = (*_single(attention.o_proj), _weight(post_attn_norm))
        self.mlp_args = (ffn_norm.weight, ffn_norm.eps, gate, gate_type, up, up_type, *_single(mlp.down),
                         ACTIVATIONS[act], _weight(post_ffn_norm))

    @classmethod
    def for_block(cls, attn_norm: RMSNorm, attention: nn.Module, ffn_norm: RMSNorm, mlp: GatedMLP, act: str,
                  post_attn_norm: RMSNorm | None = None, post_ffn_norm: RMSNorm | None = None) -> "FusedDecode | None":
        """The fused step of a layer made of these modules, or None where any
        part is off the CPU kernels (another backend, a weight type they do
        not read, biases on some projections only)."""
        projections = [attention.qkv, attention.o_proj.projection, mlp.gate_up, mlp.down.projection]
        norms = [n for n in (attn_norm, ffn_norm, post_attn_norm, post_ffn_norm, attention.q_norm, attention.k_norm)
                 if n is not None]
        if any(p.blocks is None for p in projections) or not all(n.cpu_kernel for n in norms):
            return None
        if len({n.eps for n in norms}) > 1:  # the blocks take one eps
            return None
        if len({attention.q_proj.bias is None, attention.k_proj.bias is None, attention.v_proj.bias is None}) > 1:
            return None
        if attention.o_proj.bias is not None or any(m.bias is not None for m in (mlp.gate, mlp.up, mlp.down)):
            return None
        return cls(attn_norm, attention, ffn_norm, mlp, act, post_attn_norm, post_ffn_norm)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """The layer's output for one position of each sequence (a ``KVCache``:
        one; a ``batch.Batch`` of decode steps: up to the GEMV's rows), or
        None where the step is not one the compiled blocks cover."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[0] > cpu_kernels.built().max_m:
            return None
        view = cache.decode_view(self.layer, positions)
        if view is None:
            return None
        store, window, tables = view
        cos, sin = self.rope.tables(positions, self.inv_freq, torch.float32)
        kernels = cpu_kernels.built()
        o, o_type, post_attn_norm = self.o_proj
        x = kernels.attention_block(x, *self.attention_args, cos, sin, store.k, store.v, positions, window,
                                    self.scale, tables.tables, tables.lengths, tables.block_size, o, o_type,
                                    post_attn_norm)
        return kernels.mlp_block(x, *self.mlp_args)


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _single(layer: Linear) -> tuple[torch.Tensor, int]:
    """A one-weight layer's blocks and type id, from its ``Projections``."""
    (blocks,), (qtype,) = layer.projection.blocks
    return blocks, qtype

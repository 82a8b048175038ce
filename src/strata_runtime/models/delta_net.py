"""The Gated DeltaNet token mixer (Qwen3-Next's recurrent layers), over GGUF
weights as llama.cpp's converter writes them.

Per token: ``attn_qkv`` projects the input to queries, keys and values
(all query heads, then all key heads, then all value heads: the short
convolution's channels), ``attn_gate`` to the output gate ``z``, ``ssm_ba``
to per-value-head ``b`` and ``a`` (grouped per key head: that head's ``b``s,
then its ``a``s). The channels go through the causal depthwise convolution
``ssm_conv1d`` (its window carried in the sequence's state) and SiLU; q and
k are L2-normalized; ``beta = sigmoid(b)`` and the decay ``g = ssm_a *
softplus(a + ssm_dt)`` (``ssm_a`` stored as ``-exp(A_log)``) drive the gated
delta rule (``strata_kernels.recurrent``); its output, RMS-normed per head by
``ssm_norm`` and gated by ``silu(z)``, goes through ``ssm_out``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from strata_kernels import dequantize
from strata_kernels.recurrent import causal_conv, causal_conv_step, delta_rule_prefill, delta_rule_step

from ..errors import ModelFileError
from ..files import Backend
from ..testing import armed, fault_point
from .layers import Linear, Projections


@dataclass(frozen=True)
class DeltaNetShape:
    """``k_heads`` query/key heads of ``d_k``, ``v_heads`` value heads of
    ``d_v`` (a multiple of ``k_heads``), a convolution of ``conv_kernel`` taps."""

    k_heads: int
    v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int

    @property
    def channels(self) -> int:
        """The convolution's channels: queries, keys and values."""
        return 2 * self.k_heads * self.d_k + self.v_heads * self.d_v


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (float32), as
    transformers and the FLA kernels normalize DeltaNet's queries and keys."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Layer ``layer``'s recurrent mixer: ``forward(x, cache)`` reads and
    updates each sequence's state (``cache.recurrent_runs``) and returns
    ``[T, hidden]`` in ``x``'s dtype.

    Invariant: ``conv_weight`` is ``[channels, conv_kernel]`` float32 (tap
    ``K - 1`` on the newest input); ``decay_scale`` (``ssm_a``) and
    ``dt_bias`` are ``[v_heads]`` float32; ``norm_weight`` ``[d_v]``.
    """

    def __init__(self, layer: int, w, backend: Backend, shape: DeltaNetShape, eps: float):
        super().__init__()
        p = f"blk.{layer}."
        s = self.shape = shape
        if s.v_heads % s.k_heads:
            raise ModelFileError(f"layer {layer}: {s.v_heads} value heads cannot be shared by {s.k_heads} key heads "
                                 f"(ssm.time_step_rank must be a multiple of ssm.group_count)")
        self.layer = layer
        qkv, z, ba = (w(p + name) for name in ("attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight"))
        conv = dequantize(w(p + "ssm_conv1d.weight")).float()
        expected = {"attn_qkv": s.channels, "attn_gate": s.v_heads * s.d_v, "ssm_ba": 2 * s.v_heads,
                    "ssm_conv1d": (s.channels, s.conv_kernel)}
        got = {"attn_qkv": qkv.shape[0], "attn_gate": z.shape[0], "ssm_ba": ba.shape[0],
               "ssm_conv1d": tuple(conv.shape)}
        if got != expected:
            raise ModelFileError(f"layer {layer}: the recurrent layer's tensors have shapes {got}, but the ssm.* "
                                 f"metadata says {expected}")
        self.qkv, self.z, self.ba = Linear(qkv, backend), Linear(z, backend), Linear(ba, backend)
        self.out = Linear(w(p + "ssm_out.weight"), backend)
        self.projections = Projections(self.qkv, self.z, self.ba)
        self.register_buffer("conv_weight", conv, persistent=False)
        self.register_buffer("decay_scale", dequantize(w(p + "ssm_a")).float().reshape(-1), persistent=False)
        self.register_buffer("dt_bias", dequantize(w(p + "ssm_dt.bias")).float().reshape(-1), persistent=False)
        self.register_buffer("norm_weight", dequantize(w(p + "ssm_norm.weight")).float().reshape(-1),
                             persistent=False)
        self.eps = eps
        self.kernels = backend.attention  # the decode step's: compiled CPU kernels, Triton on CUDA, else torch

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        s = self.shape
        t = x.shape[0]
        qkv, z, ba = self.projections(x)
        runs = cache.recurrent_runs(self.layer, t)
        mixed = torch.empty((t, s.channels), dtype=torch.float32, device=x.device)
        d = 0 if runs.decode is None else runs.decode.shape[0]
        if d:
            mixed[:d] = causal_conv_step(qkv[:d], self.conv_weight, runs.store.conv, runs.decode, self.kernels)
        conv = runs.store.conv
        # A chain's slots as an index on the store's device, made once for both halves of the layer.
        chain_slots = [torch.tensor(slots, device=conv.device) for _, _, _, slots in runs.chains]
        for (first, n, source, slots), index in zip(runs.chains, chain_slots):  # row by row, each from the last
            for j, slot in enumerate(slots):
                conv[slot] = conv[source if j == 0 else slots[j - 1]]
                mixed[first + j:first + j + 1] = causal_conv_step(qkv[first + j:first + j + 1], self.conv_weight,
                                                                  conv, index[j:j + 1], self.kernels)
        for source, slot in runs.copies:
            conv[slot] = conv[source]
        for first, n, slot in runs.prefill:
            mixed[first:first + n] = causal_conv(qkv[first:first + n], self.conv_weight, runs.store.conv[slot])
        mixed = F.silu(mixed)
        kd = s.k_heads * s.d_k
        q = l2_normalize(mixed[:, :kd].view(t, s.k_heads, s.d_k)) * s.d_k ** -0.5
        k = l2_normalize(mixed[:, kd:2 * kd].view(t, s.k_heads, s.d_k))
        v = mixed[:, 2 * kd:].view(t, s.v_heads, s.d_v)
        per_group = s.v_heads // s.k_heads
        ba = ba.float().view(t, s.k_heads, 2, per_group)
        beta = torch.sigmoid(ba[:, :, 0].reshape(t, s.v_heads))
        g = self.decay_scale * F.softplus(ba[:, :, 1].reshape(t, s.v_heads) + self.dt_bias)
        out = torch.empty((t, s.v_heads, s.d_v), dtype=torch.float32, device=x.device)
        if d:
            out[:d] = delta_rule_step(q[:d], k[:d], v[:d], g[:d], beta[:d], runs.store.state, runs.decode,
                                      self.kernels)
        state = runs.store.state
        for (first, n, source, slots), index in zip(runs.chains, chain_slots):
            if armed("verify_copy"):
                fault_point("verify_copy", subject=slots)
            for j, slot in enumerate(slots):
                state[slot] = state[source if j == 0 else slots[j - 1]]
                row = slice(first + j, first + j + 1)
                out[row] = delta_rule_step(q[row], k[row], v[row], g[row], beta[row], state, index[j:j + 1],
                                           self.kernels)
        for source, slot in runs.copies:
            state[slot] = state[source]
        for first, n, slot in runs.prefill:
            rows = slice(first, first + n)
            out[rows] = delta_rule_prefill(q[rows], k[rows], v[rows], g[rows], beta[rows], runs.store.state[slot],
                                           self.kernels)
        out = F.rms_norm(out, (s.d_v,), self.norm_weight, self.eps) * F.silu(z.float().view(t, s.v_heads, s.d_v))
        return self.out(out.reshape(t, s.v_heads * s.d_v).to(x.dtype))

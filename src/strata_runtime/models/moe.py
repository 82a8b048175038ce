"""The routed mixture-of-experts feed-forward (Qwen3-MoE): a router picks
``k`` experts per row, each a SiLU-gated MLP of its own, and the row's
output is their outputs weighted by the router's probabilities."""

from __future__ import annotations

import torch
from torch import nn

from strata_kernels import (
    ExpertGroups,
    QuantTensor,
    WordPlanes,
    expert_matmul,
    expert_matrix,
    expert_planes,
    expert_planes_matmul,
    has_word_layout,
)

from ..errors import ModelFileError
from ..files import Backend
from .layers import Linear


class MoEFeedForward(nn.Module):
    """``sum_j w_j * down_e(act_mul(gate_e(x), up_e(x)))`` over the ``top_k``
    experts ``e`` of each row, ``w`` the router's softmax over all experts
    taken at those ``k`` (renormalized to sum to 1 when ``norm_topk``, as
    llama.cpp and transformers' ``norm_topk_prob`` do for Qwen3-MoE).

    Invariant: ``gate_exps``/``up_exps`` are ``[E, F, hidden]`` and
    ``down_exps`` ``[E, hidden, F]`` GGUF blocks, kept as blocks on every
    path but the GPU's, which holds the types with a word layout in
    ``planes`` instead (one ``WordPlanes`` of ``E * F`` or ``E * hidden`` rows
    per tensor; the blocks then dropped): the kernels read the experts a
    step uses, and the exact path
    (torch) dequantizes those, per call, in float32 (at most ``rows * k``
    experts' three matrices at a time: ``3 * F * hidden * 4`` bytes each),
    never all of them. The router (``ffn_gate_inp``, ``[E, hidden]``) is a
    plain ``Linear``.
    """

    def __init__(self, layer: int, w, backend: Backend, n_experts: int, top_k: int, norm_topk: bool, act_mul):
        super().__init__()
        p = f"blk.{layer}."
        router = w(p + "ffn_gate_inp.weight")
        self.router = Linear(router, backend)
        self.gate_exps: QuantTensor = w(p + "ffn_gate_exps.weight")
        self.up_exps: QuantTensor = w(p + "ffn_up_exps.weight")
        self.down_exps: QuantTensor = w(p + "ffn_down_exps.weight")
        tensors = (router, self.gate_exps, self.up_exps, self.down_exps)
        if [t.shape[0] for t in tensors] != [n_experts] * 4 or [len(t.shape) for t in tensors] != [2, 3, 3, 3]:
            raise ModelFileError(f"layer {layer}: the file says {n_experts} experts, but its router and gate, up "
                                 f"and down expert tensors have shapes {[t.shape for t in tensors]}")
        self.n_experts = n_experts
        self.top_k = top_k
        self.norm_topk = norm_topk
        self.act_mul = act_mul
        self.cpu_kernel = backend.cpu_kernels
        # Per expert tensor: the kernels where they read its type, else the
        # torch reference (dequantizing the experts a step uses).
        self.kernel = {name: ("cpu" if backend.cpu_kernels else "auto") if backend.keeps_blocks(expert_matrix(t, 0))
                       else "torch"
                       for name, t in (("gate", self.gate_exps), ("up", self.up_exps), ("down", self.down_exps))}
        self.planes: dict[str, WordPlanes] = {}
        if backend.kernels == "triton":
            for name in ("gate", "up", "down"):
                tensor = getattr(self, f"{name}_exps")
                if has_word_layout(expert_matrix(tensor, 0)):
                    self.planes[name] = expert_planes(tensor)
                    setattr(self, f"{name}_exps", None)

    def _matmul(self, name: str, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        if name in self.planes:
            return expert_planes_matmul(x, self.planes[name], self.n_experts, groups)
        return expert_matmul(x, getattr(self, f"{name}_exps"), groups, self.kernel[name])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts ``[T, k]`` (int64) and their weights ``[T, k]`` (float32)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        groups = ExpertGroups.of(ids, self.n_experts)
        rows = x[groups.rows]  # one row per routed pair, grouped by expert
        gate = self._matmul("gate", rows, groups)
        up = self._matmul("up", rows, groups)
        out = self._matmul("down", self.act_mul(gate, up, self.cpu_kernel), groups)
        out = out.float() * weights.reshape(-1)[groups.order][:, None]
        return torch.zeros((x.shape[0], out.shape[1]), dtype=torch.float32, device=x.device) \
            .index_add_(0, groups.rows, out).to(x.dtype)

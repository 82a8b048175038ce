"""Mixture-of-experts matmuls over a 3-D GGUF expert tensor, reading only the
experts a call routes rows to.

A GGUF expert tensor (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``)
holds one ``[N, K]`` matrix per expert: logical shape ``[E, N, K]``, stored
as ``E * N`` rows of blocks, expert ``e``'s matrix in rows ``e*N ..
(e+1)*N`` (``expert_matrix``: a view, nothing copied). A step's rows are
routed to ``k`` experts each; ``ExpertGroups`` sorts those (row, slot)
pairs by expert once per layer, and ``expert_matmul`` multiplies each
expert's rows by its matrix: a GEMV for an expert with a decode step's few
rows (each expert's weights read once for all its rows; on the CPU kernels
all of them in one call, ``cpu_kernels.gemv_experts``) and a GEMM for one
with a prompt's many. No path touches an expert that receives
none; the torch reference dequantizes the ones it uses, per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import resolve_backend
from .launch import CPU_GEMV_MAX_M, GEMV_MAX_M
from .qmatmul import planes_matmul, qmatmul
from .quant_tensor import QuantTensor
from .word_planes import WordPlanes


def expert_matrix(experts: QuantTensor, e: int) -> QuantTensor:
    """Expert ``e``'s ``[N, K]`` matrix of an ``[E, N, K]`` expert tensor (a view)."""
    if len(experts.shape) != 3:
        raise ValueError(f"an expert tensor is 3-D [experts, N, K], got shape {experts.shape}")
    n_experts, n, k = experts.shape
    if not 0 <= e < n_experts:
        raise IndexError(f"expert {e} of {n_experts}")
    return QuantTensor(experts.data[e * n:(e + 1) * n], experts.qtype, (n, k))


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (row, slot) routing pairs, sorted by expert.

    Invariant: for ``ids`` ``[T, k]`` (row ``t``'s ``k`` experts), pair ``j``
    of the sorted order is flat pair ``order[j]`` (``= t * k + slot``) and
    reads row ``rows[j] = order[j] // k``; ``experts`` are the experts that
    receive pairs, ascending, and ``offsets`` (one longer) bound their runs:
    pairs ``offsets[i]:offsets[i + 1]`` go to ``experts[i]``. Sorting is
    stable, so within an expert the pairs keep row order.
    """

    order: torch.Tensor
    rows: torch.Tensor
    experts: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, ids: torch.Tensor, n_experts: int) -> "ExpertGroups":
        if ids.dim() != 2:
            raise ValueError(f"routing ids must be [rows, k], got shape {tuple(ids.shape)}")
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts).tolist()  # the step's one host sync
        if len(counts) > n_experts:
            raise ValueError(f"routing names expert {len(counts) - 1} of {n_experts}")
        experts, offsets = [], [0]
        for e, c in enumerate(counts):
            if c:
                experts.append(e)
                offsets.append(offsets[-1] + c)
        return cls(order, order // ids.shape[1], tuple(experts), tuple(offsets))

    @property
    def pairs(self) -> int:
        return self.offsets[-1]


def expert_matmul(x: torch.Tensor, experts: QuantTensor, groups: ExpertGroups,
                  backend: str = "auto") -> torch.Tensor:
    """``y[j] = x[j] @ W[e].T`` for ``x`` ``[P, K]`` holding the pairs in
    ``groups``' order (pair ``j`` routed to expert ``e``) and ``experts``
    ``[E, N, K]``; ``[P, N]`` in ``x``'s dtype. ``backend`` as ``qmatmul``'s:
    each expert that receives pairs is one ``qmatmul`` over its run of rows."""
    if x.dim() != 2 or x.shape[0] != groups.pairs:
        raise ValueError(f"x must be [{groups.pairs}, K] (one row per routed pair), got {tuple(x.shape)}")
    n = experts.shape[1]
    runs = [(e, groups.offsets[i], groups.offsets[i + 1] - groups.offsets[i]) for i, e in enumerate(groups.experts)]
    chosen = resolve_backend(x.device, backend)
    if chosen == "triton":  # one GEMV launch for the experts with few rows, one GEMM launch for the rest
        from ._triton_qmatmul import expert_matmul_triton

        return expert_matmul_triton(x, experts, runs)
    if chosen == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        # The CPU kernels: every expert with a decode step's few rows in one
        # GEMV call (one parallel region), the others one GEMM each.
        from . import cpu_kernels

        small = [r for r in runs if r[2] <= CPU_GEMV_MAX_M]
        out = cpu_kernels.gemv_experts(x, experts, small) if small else torch.empty((x.shape[0], n))
        out = out.to(x.dtype)
        runs = [r for r in runs if r[2] > CPU_GEMV_MAX_M]
    else:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for e, start, count in runs:
        out[start:start + count] = qmatmul(x[start:start + count], expert_matrix(experts, e), backend)
    return out


def expert_planes(experts: QuantTensor) -> WordPlanes:
    """An ``[E, N, K]`` expert tensor in the GPU word layout: ``E * N`` rows,
    expert ``e``'s matrix in rows ``e*N ..`` (``word_planes``)."""
    n_experts, n, k = experts.shape
    return WordPlanes.of(QuantTensor(experts.data, experts.qtype, (n_experts * n, k)))


def expert_planes_matmul(x: torch.Tensor, planes: WordPlanes, n_experts: int, groups: ExpertGroups) -> torch.Tensor:
    """``expert_matmul`` over experts in word planes (``expert_planes``): the
    experts with a decode step's few rows in one grouped GEMV launch, each of
    the others its rows of the planes (a copy of one expert's) times its
    routed rows as ``planes_matmul`` does a prompt's."""
    if x.dim() != 2 or x.shape[0] != groups.pairs:
        raise ValueError(f"x must be [{groups.pairs}, K] (one row per routed pair), got {tuple(x.shape)}")
    n = planes.rows // n_experts
    runs = [(e, groups.offsets[i], groups.offsets[i + 1] - groups.offsets[i]) for i, e in enumerate(groups.experts)]
    small = [r for r in runs if r[2] <= GEMV_MAX_M]
    if small:
        from ._triton_gemv_words import gemv_words_grouped

        out = gemv_words_grouped(x, planes, n_experts, small)
    else:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for e, start, count in runs:
        if count > GEMV_MAX_M:
            rows = planes.select_rows(torch.arange(e * n, (e + 1) * n, device=planes.device))
            out[start:start + count] = planes_matmul(x[start:start + count], rows)
    return out

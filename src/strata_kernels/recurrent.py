"""Recurrent layers' state and kernels (Gated DeltaNet, as in Qwen3-Next).

A recurrent layer keeps, per sequence, a fixed-size state instead of one
entry per token: the last ``K - 1`` inputs of its short causal convolution
(``conv``) and one ``[d_k, d_v]`` matrix per value head (``state``), the
memory the gated delta rule reads and corrects at every token:

    S = exp(g_t) * S                      (decay)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T   (the delta rule: write the error)
    o_t = S^T q_t

``q`` and ``k`` come in L2-normalized, ``q`` already scaled by ``d_k ** -0.5``;
``Hk`` key heads serve ``Hv`` value heads (value head ``h`` reads key head
``h // (Hv // Hk)``). Two forms compute the same thing: one step per token
(decode: many sequences at once, each in its slot of the store) and chunks
of ``CHUNK`` tokens (prefill: the within-chunk part as matrix products, the
state carried from chunk to chunk), the form transformers and llama.cpp use
for long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backends import resolve_backend

CHUNK = 64  # tokens per chunk of the chunked delta rule


@dataclass
class RecurrentStore:
    """One recurrent layer's state for every slot of a pool.

    Invariant: ``conv`` is ``[slots, K - 1, channels]`` and ``state``
    ``[slots, v_heads, d_k, d_v]``, both float32 (the recurrence compounds
    rounding, so it is kept in float32 on every path); slot ``s`` holds one
    sequence's state after its last token (zeros before its first).
    """

    conv: torch.Tensor
    state: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, conv_window: int, channels: int, v_heads: int, d_k: int, d_v: int,
                 device: torch.device | str = "cpu") -> "RecurrentStore":
        return cls(torch.zeros((slots, conv_window, channels), dtype=torch.float32, device=device),
                   torch.zeros((slots, v_heads, d_k, d_v), dtype=torch.float32, device=device))

    @staticmethod
    def slot_bytes(conv_window: int, channels: int, v_heads: int, d_k: int, d_v: int) -> int:
        return 4 * (conv_window * channels + v_heads * d_k * d_v)

    def bytes_per_slot(self) -> int:
        return self.conv[0].numel() * 4 + self.state[0].numel() * 4

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.state.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.state.device

    def fields(self) -> dict[str, torch.Tensor]:
        return {"conv": self.conv, "state": self.state}

    def clear(self, slot: int) -> None:
        """Slot ``slot`` back to the state before any token."""
        self.conv[slot].zero_()
        self.state[slot].zero_()


# --- the short causal convolution ---------------------------------------------------------


def causal_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution of one sequence's ``x`` ``[T, C]`` with
    ``weight`` ``[C, K]`` (tap ``K - 1`` on the newest input), continuing
    from ``window`` ``[K - 1, C]`` (the inputs before ``x``), which is
    updated in place to the last ``K - 1`` inputs. Returns ``[T, C]``
    float32, before the activation."""
    k = weight.shape[1]
    full = torch.cat([window, x.float()])  # [K - 1 + T, C]
    if k > 1:
        window.copy_(full[-(k - 1):])
    out = F.conv1d(full.t()[None], weight.float()[:, None, :], groups=weight.shape[0])
    return out[0].t()


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                     backend: str = "torch") -> torch.Tensor:
    """One input per sequence: ``x`` ``[B, C]``, sequence ``i``'s window in
    ``conv[slots[i]]`` (updated in place). Returns ``[B, C]`` float32.
    ``backend``: as ``strata_kernels.attention``'s (``auto``: Triton on CUDA)."""
    backend = resolve_backend(conv.device, backend)
    if backend == "cpu":
        from . import cpu_kernels

        return cpu_kernels.conv_step(x, weight, conv, slots)
    if backend == "triton":
        from ._triton_recurrent import conv_step_triton

        return conv_step_triton(x, weight, conv, slots)
    full = torch.cat([conv[slots], x.float()[:, None, :]], dim=1)  # [B, K, C]
    conv[slots] = full[:, 1:]
    return torch.einsum("bkc,ck->bc", full, weight.float())


# --- the gated delta rule ---------------------------------------------------------------------


def _expand_heads(t: torch.Tensor, v_heads: int) -> torch.Tensor:
    """Key heads ``[..., Hk, d]`` repeated to serve ``v_heads`` value heads."""
    return t if t.shape[-2] == v_heads else t.repeat_interleave(v_heads // t.shape[-2], dim=-2)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slots: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """One token per sequence (decode): ``q``/``k`` ``[B, Hk, dk]``, ``v``
    ``[B, Hv, dv]``, ``g``/``beta`` ``[B, Hv]``; sequence ``i``'s state is
    ``state[slots[i]]``, updated in place. Returns ``[B, Hv, dv]`` float32.
    ``backend``: torch (this reference), cpu (one compiled call: each state
    read twice from memory and cache and written once), triton, or auto."""
    backend = resolve_backend(state.device, backend)
    if backend == "cpu":
        from . import cpu_kernels

        return cpu_kernels.delta_rule_step(q, k, v, g, beta, state, slots)
    if backend == "triton":
        from ._triton_recurrent import delta_rule_step_triton

        return delta_rule_step_triton(q, k, v, g, beta, state, slots)
    hv = v.shape[1]
    q, k = _expand_heads(q.float(), hv), _expand_heads(k.float(), hv)
    s = state[slots] * g.float().exp()[..., None, None]  # [B, Hv, dk, dv]
    error = v.float() - (k[..., None, :] @ s).squeeze(-2)
    s = s + k[..., :, None] * (beta.float()[..., None] * error)[..., None, :]
    state[slots] = s
    return (q[..., None, :] @ s).squeeze(-2)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
    """One sequence, token by token: ``q``/``k`` ``[T, Hk, dk]``, ``v``
    ``[T, Hv, dv]``, ``g``/``beta`` ``[T, Hv]``, ``state`` ``[Hv, dk, dv]``
    (updated in place). The step-by-step form the chunked one is checked against."""
    slot = torch.zeros(1, dtype=torch.long, device=state.device)
    view = state[None]
    out = [delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], view, slot)
           for t in range(q.shape[0])]
    return torch.cat(out)


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """One sequence's prompt rows (``delta_rule_recurrent``'s arguments),
    ``state`` ``[Hv, dk, dv]`` (contiguous) updated in place: the chunked
    form (torch; Triton: one kernel, chunks of 32, whose matrix products
    carry the parallelism a token-by-token scan lacks on a GPU), or on the
    compiled CPU kernels the scan (each head's state kept
    in cache for every token: on a CPU that beats the chunked form, which
    does more arithmetic; ``bench/recurrent.py``)."""
    backend = resolve_backend(state.device, backend)
    if backend == "cpu":
        from . import cpu_kernels

        return cpu_kernels.delta_rule_scan(q, k, v, g, beta, state)
    if backend == "triton":
        from ._triton_recurrent import delta_rule_chunked_triton

        return delta_rule_chunked_triton(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """``delta_rule_recurrent``, computed ``chunk`` tokens at a time.

    Within a chunk, with ``G_t`` the decay accumulated since the chunk's
    start and ``S`` the state at its start, the corrections ``u_t`` the delta
    rule writes solve a unit lower-triangular system
    ``(I + A) u = beta * (v - G * K S)`` with ``A[t, j] = beta_t (k_t . k_j)
    G_t / G_j`` for ``j < t``; outputs and the next state are then matrix
    products over the chunk (the WY form of DeltaNet). float32 throughout.
    """
    t_total, hv = q.shape[0], v.shape[1]
    q = _expand_heads(q.float(), hv).transpose(0, 1)  # [Hv, T, dk]
    k = _expand_heads(k.float(), hv).transpose(0, 1)
    v = v.float().transpose(0, 1)  # [Hv, T, dv]
    g, beta = g.float().t(), beta.float().t()  # [Hv, T]
    pad = (-t_total) % chunk
    if pad:  # padded tokens: no decay, no write, outputs dropped
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = q.shape[1] // chunk
    q, k, v = (x.reshape(hv, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(hv, n, chunk), beta.reshape(hv, n, chunk)
    log_decay = g.cumsum(-1)  # [Hv, n, C]: log G_t
    # exp(log G_t - log G_j) for j <= t; 0 above the diagonal (masked before exp: no overflow)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = torch.eye(chunk, device=q.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * pair.tril(-1)
    decay = log_decay.exp()[..., None]  # G_t
    # u = U v_beta - U (beta G K) S: the two right-hand sides solved once per chunk.
    rhs_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    rhs_s = torch.linalg.solve_triangular(system, beta[..., None] * decay * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair  # [Hv, n, C, C], causal with decay
    last = log_decay[..., -1:]  # log G at the chunk's end
    k_to_end = k * (last - log_decay).exp()[..., None]  # k_j carried to the chunk's end
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        u = rhs_v[:, i] - rhs_s[:, i] @ s  # [Hv, C, dv]
        out[:, i] = (q[:, i] * decay[:, i]) @ s + scores[:, i] @ u
        s = s * last[:, i, :, None].exp() + k_to_end[:, i].transpose(-1, -2) @ u
    state.copy_(s)
    return out.reshape(hv, n * chunk, -1)[:, :t_total].transpose(0, 1)

"""Triton decode steps of the recurrent layers (imported only when the Triton
backend runs): the gated delta rule and the short causal convolution, one
token per sequence, each sequence's state in its slot of a layer's store."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import _pow2_at_least

BLOCK_V = 32  # value columns of the state per program
BLOCK_C = 256  # channels of the convolution per program


@triton.jit
def _delta_rule_step_kernel(q, k, v, g, beta, state, slots, out, HK, HV, DK, DV,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # q, k:   [B, HK, DK] float32     v, out: [B, HV, DV] float32     g, beta: [B, HV] float32
    # state:  [S, HV, DK, DV] float32, updated in place     slots: [B] int64
    # grid:   (B, HV, cdiv(DV, BLOCK_V)); program (b, h, j) owns columns j*BLOCK_V.. of
    #         sequence b's state of value head h (key head h // (HV // HK)): M = exp(g) M,
    #         u = beta (v - M^T k), M += k u^T, o = M^T q. Columns are independent, so each
    #         program reads and writes its [DK, BLOCK_V] tile of M once.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, BLOCK_K)
    kh = h // (HV // HK)
    in_k, in_v = i < DK, j < DV
    slot = tl.load(slots + b)
    kk = tl.load(k + (b * HK + kh) * DK + i, mask=in_k, other=0.0)
    qq = tl.load(q + (b * HK + kh) * DK + i, mask=in_k, other=0.0)
    vv = tl.load(v + (b * HV + h) * DV + j, mask=in_v, other=0.0)
    decay = tl.exp(tl.load(g + b * HV + h))
    rate = tl.load(beta + b * HV + h)
    tile = state + (slot * HV + h) * DK * DV + i[:, None] * DV + j[None, :]
    mask = in_k[:, None] & in_v[None, :]
    m = tl.load(tile, mask=mask, other=0.0) * decay
    u = rate * (vv - tl.sum(m * kk[:, None], axis=0))
    m = m + kk[:, None] * u[None, :]
    tl.store(tile, m, mask=mask)
    tl.store(out + (b * HV + h) * DV + j, tl.sum(m * qq[:, None], axis=0), mask=in_v)


@triton.jit
def _conv_step_kernel(x, taps, conv, slots, out, C, W: tl.constexpr, BLOCK_C: tl.constexpr):
    # x, out: [B, C] float32     taps: [W + 1, C] float32 (the weight transposed: tap W on x)
    # conv:   [S, W, C] float32, sequence b's window in conv[slots[b]], oldest first, shifted in place
    # grid:   (B, cdiv(C, BLOCK_C))
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < C
    window = conv + tl.load(slots + b) * W * C
    xb = tl.load(x + b * C + c, mask=in_c, other=0.0)
    acc = xb * tl.load(taps + W * C + c, mask=in_c, other=0.0)
    for t in tl.static_range(W):
        w_t = tl.load(window + t * C + c, mask=in_c, other=0.0)
        acc += w_t * tl.load(taps + t * C + c, mask=in_c, other=0.0)
        if t > 0:
            tl.store(window + (t - 1) * C + c, w_t, mask=in_c)
    if W > 0:
        tl.store(window + (W - 1) * C + c, xb, mask=in_c)
    tl.store(out + b * C + c, acc, mask=in_c)


def delta_rule_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty((b, hv, dv), dtype=torch.float32, device=v.device)
    grid = (b, hv, triton.cdiv(dv, BLOCK_V))
    _delta_rule_step_kernel[grid](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                  g.float().contiguous(), beta.float().contiguous(), state, slots, out, hk, hv, dk,
                                  dv, BLOCK_K=_pow2_at_least(dk), BLOCK_V=BLOCK_V)
    return out


def conv_step_triton(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    b, c = x.shape
    out = torch.empty((b, c), dtype=torch.float32, device=x.device)
    taps = weight.float().t().contiguous()
    _conv_step_kernel[(b, triton.cdiv(c, BLOCK_C))](x.float().contiguous(), taps, conv, slots, out, c,
                                                      W=conv.shape[1], BLOCK_C=BLOCK_C)
    return out

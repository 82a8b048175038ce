"""Triton kernels of the recurrent layers (imported only when the Triton
backend runs): the decode steps of the gated delta rule and of the short
causal convolution (one token per sequence, each sequence's state in its slot
of a layer's store), and the chunked delta rule over one sequence's prompt."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_plans import conv_step_launch, delta_rule_chunk_launch, delta_rule_step_launch


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


@triton.jit
def _delta_rule_chunk_kernel(q, k, v, g, beta, state, out, T, HK, HV, DK, DV,
                             CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # q, k:   [T, HK, DK] float32     v, out: [T, HV, DV] float32     g, beta: [T, HV] float32
    # state:  [HV, DK, DV] float32, one sequence's, updated in place
    # grid:   (HV, cdiv(DV, BLOCK_V)); program (h, j) carries columns j*BLOCK_V.. of head h's
    #         state S through the prompt, CHUNK tokens at a time. Within a chunk, with G the
    #         decay accumulated since its start, the corrections U solve (I + A) U = R,
    #         A[t, s] = beta_t (k_t . k_s) G_t / G_s for s < t, R = beta (V - G * K S), by
    #         forward substitution, row by row (stable where keys are alike and beta near 1:
    #         a product of powers of A, tried first, lost every digit there). Then
    #         O = (G Q) S + (causal decayed Q K^T) U
    #         and S = G_end S + (K G_end / G)^T U. Padded tokens (past T) have g = beta = 0:
    #         no decay, no write. float32 products throughout (ieee: no tf32 rounding).
    h = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, BLOCK_K)
    r = tl.arange(0, CHUNK)
    kh = h // (HV // HK)
    in_k, in_v = i < DK, j < DV
    tile = state + h * DK * DV + i[:, None] * DV + j[None, :]
    s = tl.load(tile, mask=in_k[:, None] & in_v[None, :], other=0.0)
    strictly_lower = r[:, None] > r[None, :]
    lower = r[:, None] >= r[None, :]
    for c0 in range(0, T, CHUNK):
        t = c0 + r
        in_t = t < T
        kq_mask = in_t[:, None] & in_k[None, :]
        keys = tl.load(k + (t[:, None] * HK + kh) * DK + i[None, :], mask=kq_mask, other=0.0)
        queries = tl.load(q + (t[:, None] * HK + kh) * DK + i[None, :], mask=kq_mask, other=0.0)
        v_mask = in_t[:, None] & in_v[None, :]
        values = tl.load(v + (t[:, None] * HV + h) * DV + j[None, :], mask=v_mask, other=0.0)
        decay = tl.load(g + t * HV + h, mask=in_t, other=0.0)
        rate = tl.load(beta + t * HV + h, mask=in_t, other=0.0)
        log_g = tl.cumsum(decay, 0)  # log G_t
        log_end = tl.sum(decay, 0)
        pair = tl.exp(tl.where(lower, log_g[:, None] - log_g[None, :], float("-inf")))  # G_t / G_s, s <= t
        a = tl.where(strictly_lower, rate[:, None] * tl.dot(keys, tl.trans(keys), input_precision="ieee") * pair, 0.0)
        growth = tl.exp(log_g)
        u = rate[:, None] * (values - growth[:, None] * tl.dot(keys, s, input_precision="ieee"))
        for row in range(1, CHUNK):  # u_t -= sum_{s<t} A[t, s] u_s, rows before t final
            at_row = r == row
            a_row = tl.sum(tl.where(at_row[:, None], a, 0.0), 0)  # A[row, :]
            update = tl.sum(a_row[:, None] * u, 0)
            u = tl.where(at_row[:, None], u - update[None, :], u)
        scores = tl.where(lower, tl.dot(queries, tl.trans(keys), input_precision="ieee") * pair, 0.0)
        o = tl.dot(queries * growth[:, None], s, input_precision="ieee") + tl.dot(scores, u, input_precision="ieee")
        tl.store(out + (t[:, None] * HV + h) * DV + j[None, :], o, mask=v_mask)
        carried = keys * tl.exp(log_end - log_g)[:, None]
        s = s * tl.exp(log_end) + tl.dot(tl.trans(carried), u, input_precision="ieee")
    tl.store(tile, s, mask=in_k[:, None] & in_v[None, :])


def delta_rule_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    launch = delta_rule_chunk_launch(dk, dv)
    grid = (hv, triton.cdiv(dv, launch.constexprs["BLOCK_V"]))
    _delta_rule_chunk_kernel[grid](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                   g.float().contiguous(), beta.float().contiguous(), state, out, t, hk, hv, dk, dv,
                                   **launch.constexprs, num_warps=launch.num_warps)
    return out


def delta_rule_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty((b, hv, dv), dtype=torch.float32, device=v.device)
    launch = delta_rule_step_launch(dk)
    grid = (b, hv, triton.cdiv(dv, launch.constexprs["BLOCK_V"]))
    _delta_rule_step_kernel[grid](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                  g.float().contiguous(), beta.float().contiguous(), state, slots, out, hk, hv, dk,
                                  dv, **launch.constexprs, num_warps=launch.num_warps)
    return out


def conv_step_triton(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    b, c = x.shape
    out = torch.empty((b, c), dtype=torch.float32, device=x.device)
    taps = weight.float().t().contiguous()
    launch = conv_step_launch(conv.shape[1])
    _conv_step_kernel[(b, triton.cdiv(c, launch.constexprs["BLOCK_C"]))](
        x.float().contiguous(), taps, conv, slots, out, c, **launch.constexprs, num_warps=launch.num_warps)
    return out

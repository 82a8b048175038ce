"""Triton ``x @ W.T`` reading W's GGUF blocks directly (imported only when the
Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_dequant import table_args
from ._triton_unpack import sub_block_scales, weight_codes, weight_tile
from .launch import GEMV_MAX_M
from .launch_plans import gemm_launch, gemv_launch, triton_dtype
from .quant_tensor import QuantTensor


@triton.jit
def _k_step(x, blocks, M, K, stride_xm, row_bytes, m, n_safe, k0, grid_ptr, signs_ptr, values_ptr,
            QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """One GEMM K step: activations ``[BLOCK_M, BLOCK_K]`` (x's dtype) and
    weights ``[BLOCK_N, BLOCK_K]`` (float32), zero beyond K and beyond M."""
    k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    k_in = k < K
    w = weight_tile(blocks, row_bytes, n_safe, tl.minimum(k, K - 1)[None, :],
                    grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS, OFFSET)
    w = tl.where(k_in[None, :], w, 0.0)
    xs = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_in[None, :], other=0.0)
    return xs, w


@triton.jit
def _gemv_kernel(
    x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om,
    grid_ptr, signs_ptr, values_ptr,
    QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # x:      [M, K] activations, row stride stride_xm, unit column stride; M <= BLOCK_M
    # blocks: uint8 [N, row_bytes], the GGUF rows of W (logical [N, K])
    # out:    [M, N], row stride stride_om
    # grid:   (cdiv(N, BLOCK_N),); each program reads its BLOCK_N weight rows
    #         once, unpacks the codes in registers, sums x * code over each
    #         sub-block of SUB weights and applies that sub-block's scale (and
    #         offset, times the sum of x) once, for all M rows of x
    _gemv_tile(x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om, tl.program_id(0).to(tl.int64),
               grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS, OFFSET, SUB, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _expert_gemv_kernel(
    x, blocks, out, experts, starts, counts, N, K, stride_xm, row_bytes, stride_om,
    grid_ptr, signs_ptr, values_ptr,
    QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # x:       [P, K] routed rows, grouped by expert; out: [P, N]
    # blocks:  uint8 [E * N, row_bytes], expert e's matrix in rows e*N..(e+1)*N
    # experts, starts, counts: [G] int32; group g is rows starts[g]..+counts[g] (<= BLOCK_M) of x,
    #          all routed to expert experts[g]
    # grid:    (cdiv(N, BLOCK_N), G); program (pn, g) is the GEMV's program pn on group g's rows
    g = tl.program_id(1)
    e = tl.load(experts + g).to(tl.int64)
    start = tl.load(starts + g).to(tl.int64)
    _gemv_tile(x + start * stride_xm, blocks + e * N * row_bytes, out + start * stride_om, tl.load(counts + g), N, K,
               stride_xm, row_bytes, stride_om, tl.program_id(0).to(tl.int64), grid_ptr, signs_ptr, values_ptr,
               QTYPE, BS, TS, OFFSET, SUB, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_tile(x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om, pn, grid_ptr, signs_ptr, values_ptr,
               QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr, SUB: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV's program ``pn``: output columns ``pn * BLOCK_N..`` for all M (<= BLOCK_M) rows."""
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    m = tl.arange(0, BLOCK_M).to(tl.int64)
    n_safe = tl.minimum(n, N - 1)
    sub = tl.arange(0, BLOCK_K // SUB).to(tl.int64)
    e = tl.arange(0, SUB).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        first = k0 + sub * SUB  # [S]: each sub-block's first column
        k = first[:, None] + e[None, :]  # [S, SUB]
        # x beyond K or M loads as 0, so the clamped weights there add nothing.
        xs = tl.load(x + m[:, None, None] * stride_xm + k[None, :, :],
                     mask=(m[:, None, None] < M) & (k[None, :, :] < K), other=0.0).to(tl.float32)  # [M, S, SUB]
        code = weight_codes(blocks, row_bytes, n_safe[:, None, None], tl.minimum(k, K - 1)[None, :, :],
                            grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS)  # [N, S, SUB]
        scale, offset = sub_block_scales(blocks, row_bytes, n_safe[:, None], tl.minimum(first, K - 1)[None, :],
                                         QTYPE, BS, TS)  # [N, S]
        dots = tl.sum(xs[:, None, :, :] * code[None, :, :, :], axis=3)  # [M, N, S]
        acc += tl.sum(dots * scale[None, :, :], axis=2)
        if OFFSET:
            acc += tl.sum(tl.sum(xs, axis=2)[:, None, :] * offset[None, :, :], axis=2)
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out + m[:, None] * stride_om + n[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om,
    grid_ptr, signs_ptr, values_ptr,
    QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # x:      [M, K] activations, row stride stride_xm, unit column stride
    # blocks: uint8 [N, row_bytes], the GGUF rows of W (logical [N, K])
    # out:    [M, N], row stride stride_om
    # grid:   (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); program (pm, pn) owns one
    #         output tile; each K step dequantizes a [BLOCK_N, BLOCK_K] weight
    #         tile in registers (in x's dtype) and feeds it to tl.dot
    _gemm_tile(x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om, tl.program_id(0).to(tl.int64),
               tl.program_id(1).to(tl.int64), grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS, OFFSET,
               BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)


@triton.jit
def _expert_gemm_kernel(
    x, blocks, out, tile_experts, tile_starts, tile_counts, N, K, stride_xm, row_bytes, stride_om,
    grid_ptr, signs_ptr, values_ptr,
    QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # x:       [P, K] routed rows, grouped by expert; out: [P, N]
    # blocks:  uint8 [E * N, row_bytes], expert e's matrix in rows e*N..(e+1)*N
    # tile_*:  [T] int32; tile t is rows tile_starts[t]..+tile_counts[t] (<= BLOCK_M) of x, all routed
    #          to expert tile_experts[t] (an expert's run of rows cut into BLOCK_M tiles)
    # grid:    (T, cdiv(N, BLOCK_N)); program (t, pn) is the GEMM's output tile (0, pn) of tile t's rows
    t = tl.program_id(0)
    e = tl.load(tile_experts + t).to(tl.int64)
    start = tl.load(tile_starts + t).to(tl.int64)
    _gemm_tile(x + start * stride_xm, blocks + e * N * row_bytes, out + start * stride_om, tl.load(tile_counts + t),
               N, K, stride_xm, row_bytes, stride_om, 0, tl.program_id(1).to(tl.int64), grid_ptr, signs_ptr,
               values_ptr, QTYPE, BS, TS, OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)


@triton.jit
def _gemm_tile(x, blocks, out, M, N, K, stride_xm, row_bytes, stride_om, pm, pn, grid_ptr, signs_ptr, values_ptr,
               QTYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, OFFSET: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The GEMM's output tile ``(pm, pn)``."""
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_safe = tl.minimum(n, N - 1)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xs, w = _k_step(x, blocks, M, K, stride_xm, row_bytes, m, n_safe, k0,
                        grid_ptr, signs_ptr, values_ptr, QTYPE, BS, TS, OFFSET, BLOCK_K)
        acc = tl.dot(xs, tl.trans(w.to(x.dtype.element_ty)), acc, input_precision=DOT_PRECISION)
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out + m[:, None] * stride_om + n[None, :], acc.to(out.dtype.element_ty), mask=mask)


def qmatmul_triton(x: torch.Tensor, qt: QuantTensor, path: str | None = None) -> torch.Tensor:
    """``path``: None picks GEMV for at most ``GEMV_MAX_M`` rows, else GEMM;
    "gemv" or "gemm" forces one (the benchmark times both)."""
    x = x.contiguous()
    m, k = x.shape
    n = qt.rows
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    common = (x, qt.data, out, m, n, k, x.stride(0), qt.data.stride(0), out.stride(0), *table_args(qt))
    if path is None:
        path = "gemv" if m <= GEMV_MAX_M else "gemm"
    if path == "gemv":
        launch = gemv_launch(qt.qtype, m, n, k)
        c = launch.constexprs
        _gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](*common, **c, num_warps=launch.num_warps)
    else:
        launch = gemm_launch(qt.qtype, m, n, k, triton_dtype(x.dtype))
        c = launch.constexprs
        _gemm_kernel[(triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]))](*common, **c,
                                                                                  num_warps=launch.num_warps)
    return out


def expert_matmul_triton(x: torch.Tensor, experts: QuantTensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """``runs`` of ``(expert, start, count)``: rows ``start..start+count-1`` of
    ``x`` ``[P, K]`` times that expert's matrix of ``experts`` ``[E, N, K]``,
    into the same rows of the result ``[P, N]`` (x's dtype). Two launches at
    most: one GEMV program grid over every run of at most ``GEMV_MAX_M`` rows,
    one GEMM grid over the others' rows cut into tiles."""
    x = x.contiguous()
    p, k = x.shape
    n = experts.shape[1]
    out = torch.empty((p, n), dtype=x.dtype, device=x.device)
    small = [r for r in runs if r[2] <= GEMV_MAX_M]
    large = [r for r in runs if r[2] > GEMV_MAX_M]
    common = (experts.data, out)
    tail = (n, k, x.stride(0), experts.data.stride(0), out.stride(0), *table_args(experts))

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=x.device)

    if small:
        launch = gemv_launch(experts.qtype, max(c for _, _, c in small), n, k)
        c = launch.constexprs
        e, st, counts = zip(*small)
        _expert_gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]), len(small))](
            x, *common, ints(e), ints(st), ints(counts), *tail, **c, num_warps=launch.num_warps)
    if large:
        launch = gemm_launch(experts.qtype, max(c for _, _, c in large), n, k, triton_dtype(x.dtype))
        c = launch.constexprs
        block_m = c["BLOCK_M"]
        tiles = [(e, st + i, min(block_m, cnt - i)) for e, st, cnt in large for i in range(0, cnt, block_m)]
        e, st, counts = zip(*tiles)
        _expert_gemm_kernel[(len(tiles), triton.cdiv(n, c["BLOCK_N"]))](
            x, *common, ints(e), ints(st), ints(counts), *tail, **c, num_warps=launch.num_warps)
    return out

"""torch's packed CPU matmuls against the kernels that read GGUF blocks, on
the default model's own weights: would a repack at load time win?

    python bench/cpu_repack.py [--threads 2] [--rows 1,512]

For each kind of weight (each layer matrix taken from all 18 layers in turn,
so that it is read from memory, as in a decode step), milliseconds per
matmul with bfloat16 activations of:

- ``gguf``: what the fast path runs: the GEMV on the GGUF blocks for
  M <= CPU_GEMV_MAX_M, else slabs dequantized to bfloat16 for torch's GEMM;
- ``int8pack``: ``torch._weight_int8pack_mm`` on a per-channel int8 repack
  (one scale per output row: lossy, since GGUF scales are per 16 or 32 weights);
- ``int4pack``: ``torch._weight_int4pack_mm_for_cpu`` (groups of 32, a scale
  and a zero each) on a repack of the Q4_K layers only: Q4_K's sub-blocks map
  onto it exactly but for the scales and zeros, which it keeps in bfloat16.

Each repack's error is its weights' RMS difference from the GGUF values,
relative to their RMS.
"""

from __future__ import annotations

import argparse
import platform

import torch
from gguf import GGMLQuantizationType as T

from cpu_matmul import KINDS, open_default_model, timed
from strata_kernels import QuantTensor, cpu_kernels
from strata_kernels.launch import CPU_GEMV_MAX_M
from strata_kernels.reference import q4_k_parts


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale.bfloat16()


def int4_pack(qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's int4 layout, w = (q - 8) * scale + zero, so zero = 8 * scale - min."""
    codes, scale, minv = (t.reshape(qt.rows, -1) for t in q4_k_parts(qt.data.reshape(-1, 144)))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scale_zeros = torch.stack([scale, 8 * scale - minv], -1).transpose(0, 1).contiguous().bfloat16()  # [K/32, N, 2]
    s, z = (scale_zeros[..., i].T.float()[..., None] for i in (0, 1))
    w = (codes.float().reshape(qt.rows, -1, 32) - 8) * s + z
    return packed, scale_zeros, w.reshape(qt.rows, qt.cols)


def relative_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,512")
    args = ap.parse_args()
    gguf = open_default_model(args.threads)
    print(f"# {platform.machine()}, torch {torch.__version__}, {args.threads} threads; ms per matmul, "
          "bfloat16 activations; repack error = RMS(w - w_gguf) / RMS(w_gguf)")
    print("| weight | types | M | gguf | int8pack | int8 error | int4pack (Q4_K layers) | int4 error |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        weights = [gguf.tensor(f"blk.{i}.{kind}.weight") for i in range(gguf.config.block_count)]
        exact = [cpu_kernels.dequantize_cpu(w, torch.float32) for w in weights]
        int8 = [int8_per_channel(w) for w in exact]
        int8_error = sum(relative_rms(c.float() * s.float()[:, None], w) for (c, s), w in zip(int8, exact)) / len(exact)
        q4 = [i for i, w in enumerate(weights) if w.qtype == T.Q4_K]
        int4 = {i: int4_pack(weights[i]) for i in q4}
        int4_error = sum(relative_rms(int4[i][2], exact[i]) for i in q4) / len(q4) if q4 else float("nan")
        types = "/".join(sorted({w.qtype.name for w in weights}))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, weights[0].cols, generator=g).bfloat16()

            def ms_each(fn, which) -> float:
                """Milliseconds per matmul of ``fn(i)`` over the layers ``which``."""
                return timed(lambda: [fn(i) for i in which]) / len(which) if which else float("nan")

            everyone = range(len(weights))
            gguf_ms = ms_each(lambda i: cpu_kernels.qmatmul_cpu(x, weights[i]), everyone)
            int8_ms = ms_each(lambda i: torch._weight_int8pack_mm(x, *int8[i]), everyone)
            int4_ms = ms_each(lambda i: torch._weight_int4pack_mm_for_cpu(x, int4[i][0], 32, int4[i][1]), q4)
            q4_gguf = f" (gguf on the same layers {ms_each(lambda i: cpu_kernels.qmatmul_cpu(x, weights[i]), q4):.3f})"
            q4_gguf = q4_gguf if q4 else ""
            print(f"| {kind} {weights[0].rows}x{weights[0].cols} | {types} | {m} | {gguf_ms:.3f} | {int8_ms:.3f} | "
                  f"{int8_error:.4f} | {int4_ms:.3f}{q4_gguf} | {int4_error:.4f} |")
    print(f"(gguf: the GEMV up to M={CPU_GEMV_MAX_M}, slabs of bfloat16 for torch's GEMM above)")


if __name__ == "__main__":
    main()

"""Expert matmuls (a mixture-of-experts layer's projections over a 3-D GGUF
expert tensor) against the memory bound.

    python bench/experts.py [--types Q4_K,Q8_0] [--experts 128] [--shape 768x2048]
                            [--top-k 8] [--m 1,8,512] [--device cpu] [--threads 2]

For M tokens each routed to ``--top-k`` of ``--experts`` experts (a seeded
random routing, every expert equally likely: the routing a load-balanced
router aims at), times ``expert_matmul`` on the routed rows as a layer runs
it (``ExpertGroups`` once, then each expert's rows: on the CPU kernels one
GEMV call for every expert with a few rows, one GEMM per expert with more);
on a GPU also ``expert_planes_matmul``, the experts in word planes as the
runtime holds them there (one grouped GEMV launch for a decode step).
Prints the experts a step reads, the bytes of their blocks over the time
(GB/s) and that against this device's copy bandwidth (read + write of a
large buffer), the bound a decode step's weight-reading kernel approaches
from below, and the multiply-adds per second (GFLOP/s), the measure of a
prompt's step.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels_test"))
from helpers import random_quant_tensor  # noqa: E402  (test helper: random GGUF blocks)
from kernels import copy_bandwidth, device_name, time_call  # noqa: E402

from gguf import GGMLQuantizationType as T  # noqa: E402
from strata_kernels import (  # noqa: E402
    ExpertGroups,
    QuantTensor,
    block_format,
    expert_matmul,
    expert_planes,
    expert_planes_matmul,
    has_word_layout,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--shape", default="768x2048", help="one expert's matrix, NxK")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--m", default="1,8,512", help="tokens per step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backend = "cpu" if device.type == "cpu" else "auto"
    n, k = (int(v) for v in args.shape.split("x"))
    bound = copy_bandwidth(device)
    print(f"# {device_name(device)}, torch {torch.__version__}, {platform.machine()}; {args.experts} experts of "
          f"{n}x{k}, top-{args.top_k}; copy bandwidth {bound / 1e9:.1f} GB/s (read + write)")
    print("| type | path | M | experts read | MB read | ms | GB/s | of copy bw | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.types.split(","):
        qtype = T[name]
        flat = random_quant_tensor(qtype, args.experts * n, k // block_format(qtype).block_size, seed=0)
        experts = QuantTensor(flat.data, qtype, (args.experts, n, k)).to(device)
        # On a GPU the runtime holds experts of a type with a word layout as planes (word_planes).
        planes = expert_planes(experts) if device.type == "cuda" and has_word_layout(flat) else None
        for m in (int(v) for v in args.m.split(",")):
            g = torch.Generator().manual_seed(m)
            ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(m)]).to(device)
            x = torch.randn(m, k, generator=g).to(device)
            groups = ExpertGroups.of(ids, args.experts)
            rows = x[groups.rows]
            paths = [("blocks", experts.nbytes, lambda: expert_matmul(rows, experts, groups, backend))]
            if planes is not None:
                paths.append(("planes", planes.nbytes,
                              lambda: expert_planes_matmul(rows, planes, args.experts, groups)))
            for path, nbytes, fn in paths:
                seconds = time_call(fn, device, args.reps)
                read = nbytes / args.experts * len(groups.experts)
                flops = 2 * groups.pairs * n * k
                print(f"| {name} | {path} | {m} | {len(groups.experts)} | {read / 1e6:.1f} | {seconds * 1e3:.2f} | "
                      f"{read / seconds / 1e9:.1f} | {read / seconds / bound:.0%} | {flops / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()

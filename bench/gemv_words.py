"""The word-layout GEMV against today's GEMV and a dense bf16 matmul, each
call timed alone: captured in a CUDA graph and replayed (no Python between
launches), at the decode shapes of an 8B model.

For each type with a word layout (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, IQ4_XS),
weight shape and M: at a decode step's 1-8 rows the time of the word GEMV
(activations prepared in the same graph); at a prompt's 512 rows that of the
planes dequantized into the scratch and a dense matmul (the goal: within 1.3x
of the dense bf16 matmul); beside them ``qmatmul`` on the GGUF blocks (the
older kernels) and ``torch.matmul`` on a bf16 weight of the same shape (the
practical roof: it reads 2 bytes a weight where these read ~1 or ~0.56); the
weight bytes each reads over its time in GB/s and as a share of this
device's copy bandwidth.

    python bench/gemv_words.py [--shapes 4096x14336,14336x4096] [--m 1,2,4,8] [--prompt-m 512] [--csv FILE]

On a CPU it runs the word GEMV once under the Triton interpreter at a small
shape against float64 products, every type: a smoke run, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels_test"))
from helpers import random_quant_tensor  # noqa: E402  (test helper: random GGUF blocks)

from strata_kernels.word_planes import WORD_TYPES, WordPlanes, dequantize_planes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import graph_seconds  # noqa: E402


def block_size(qtype) -> int:
    return 256 if WORD_TYPES[qtype].superblocks else 32


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / graph_seconds(lambda: b.copy_(a), reps=10)


def smoke() -> int:
    from strata_kernels._triton_gemv_words import gemv_words

    for qtype in WORD_TYPES:
        planes = WordPlanes.of(random_quant_tensor(qtype, 64, 256 // block_size(qtype), seed=1))
        x = torch.randn(2, planes.cols)
        ref = x.double() @ dequantize_planes(planes).double().T
        err = (gemv_words(x, planes, block_c=8).double() - ref).abs().max() / ref.abs().max()
        print(f"{qtype.name}: interpreter smoke run at 64x256, M=2: max |error| / max |product| {err.item():.1e} "
              "(no GPU here: not a measurement)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x14336,14336x4096", help="N x K weight shapes")
    parser.add_argument("--m", default="1,2,4,8", help="rows of x (a decode step's)")
    parser.add_argument("--prompt-m", default="512", help="rows of x of a prompt (the planes dequantized + matmul)")
    parser.add_argument("--csv", default=None, help="append one row per case here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        return smoke()
    from strata_kernels import planes_matmul, qmatmul
    from strata_kernels._triton_gemv_words import gemv_words

    bandwidth = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"device {name}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; each call in a CUDA graph, median")
    print(f"{'type':<6} {'N x K':>11} {'M':>2} {'path':<8} {'time us':>9} {'GB/s':>8} {'of copy':>8}")
    rows = []
    for qtype in WORD_TYPES:
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            qt = random_quant_tensor(qtype, n, k // block_size(qtype), seed=n).to("cuda")
            planes = WordPlanes.of(qt)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            decode = [int(v) for v in args.m.split(",")]
            for m in decode + [int(v) for v in args.prompt_m.split(",") if v]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                words = (lambda: gemv_words(x, planes)) if m in decode else (lambda: planes_matmul(x, planes))
                cases = [("words", planes.nbytes, words),
                         ("blocks", qt.nbytes, lambda: qmatmul(x, qt)),
                         ("bf16", dense.numel() * 2, lambda: x @ dense.T)]
                for path, nbytes, fn in cases:
                    seconds = graph_seconds(fn)
                    gbs = nbytes / seconds / 1e9
                    print(f"{qtype.name:<6} {shape:>11} {m:>2} {path:<8} {seconds * 1e6:>9.1f} {gbs:>8.1f} "
                          f"{gbs * 1e9 / bandwidth:>8.1%}")
                    rows.append(dict(device=name, type=qtype.name, shape=shape, m=m, path=path,
                                     seconds=seconds, gbs=gbs, of_copy=gbs * 1e9 / bandwidth))
    if args.csv:
        path = Path(args.csv)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU matmul choices for the fast path, on the default model's shapes.

    python bench/cpu_matmul.py [--threads 2]

For each weight shape and activation rows M: float32 and bfloat16 dense
``F.linear`` against the grouped int8 weight (``Int8Groups``) through torch's
int8 kernel (one call per column group) and through a bf16 slab. The int8
kernel wins only for small M; ``INT8_MATVEC_MAX_ROWS`` is where it stops.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from strata_runtime.layers import INT8_GROUP, INT8_MATVEC_MAX_ROWS, Int8Groups

# (rows, columns) of the default model (Gemma 3 270M): head, gate/up, down, q, o.
SHAPES = [(262144, 640), (2048, 640), (640, 2048), (1024, 640), (640, 1024)]


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,64,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.machine()}, torch {torch.__version__}, {args.threads} threads, int8 group {INT8_GROUP}, "
          f"int8 kernel used up to M={INT8_MATVEC_MAX_ROWS}; milliseconds per matmul")
    print("| weight | M | float32 | bfloat16 | int8 kernel | int8 via bf16 slab | best |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        dense = torch.randn(n, k, generator=g) * 0.02
        w32, w16, w8 = dense, dense.bfloat16(), Int8Groups.from_dense(dense)
        repeats = 5 if n > 100000 else 50
        for m in map(int, args.rows.split(",")):
            if n > 100000 and m > 64:
                continue  # the head only ever sees the last position, except in logits()
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            times = {
                "float32": timed(lambda: F.linear(x, w32), repeats),
                "bfloat16": timed(lambda: F.linear(xb, w16), repeats),
                "int8 kernel": timed(lambda: w8.int8_kernel_matmul(xb), repeats),
                "int8 slab": timed(lambda: w8.slab_matmul(xb), repeats),
            }
            best = min(times, key=times.get)
            print(f"| {n}x{k} | {m} | {times['float32']:.3f} | {times['bfloat16']:.3f} | "
                  f"{times['int8 kernel']:.3f} | {times['int8 slab']:.3f} | {best} |")


if __name__ == "__main__":
    main()

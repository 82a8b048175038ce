"""CPU matmul choices for the fast path, on the default model's own weights.

    python bench/cpu_matmul.py [--threads 2] [--rows 1,2,4,8,16,64,512]

For each kind of weight (the output head, and each layer matrix taken from
all 18 layers in turn, so that it is read from memory, as in a decode step,
not from cache) and activation rows M, milliseconds per matmul of:

- ``bf16 dense``: ``F.linear`` on a dense bfloat16 copy (the old fast path);
- ``gemv``: the CPU kernel reading the GGUF blocks (M <= CPU_GEMV_MAX_M);
- ``slab``: the kernel dequantizing slabs of rows to bfloat16 for torch's GEMM.

The GEMV's GB/s (GGUF bytes read / time) is printed against this machine's
read bandwidth, measured in the same run (summing a 400 MB float32 tensor).
``CPU_GEMV_MAX_M`` is set from where ``slab`` overtakes ``gemv``.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from strata_kernels import cpu_kernels, dequantize
from strata_kernels.launch import CPU_GEMV_MAX_M
from strata_runtime.files import default_model_path
from strata_runtime.files import GGUFFile

KINDS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def timed(fn, repeats: int = 5) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def open_default_model(threads: int) -> GGUFFile:
    """Both CPU benches' start: the thread count, the built kernels, the default model."""
    torch.set_num_threads(threads)
    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels did not build: {cpu_kernels.build_error()}")
    return GGUFFile.open(default_model_path())


def read_bandwidth_gbs() -> float:
    big = torch.ones(100_000_000)
    ms = timed(lambda: big.sum(), 5)
    return big.numel() * 4 / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64,512")
    args = ap.parse_args()
    gguf = open_default_model(args.threads)
    bandwidth = read_bandwidth_gbs()
    print(f"# {platform.machine()}, torch {torch.__version__}, {args.threads} threads; "
          f"read bandwidth {bandwidth:.1f} GB/s; GEMV used up to M={CPU_GEMV_MAX_M}; ms per matmul")
    print("| weight | type | M | bf16 dense | gemv | gemv GB/s (of bound) | slab | best |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [("token_embd", [gguf.tensor("token_embd.weight")])]
    groups += [(kind, [gguf.tensor(f"blk.{i}.{kind}.weight") for i in range(gguf.config.block_count)]) for kind in KINDS]
    g = torch.Generator().manual_seed(0)
    for kind, weights in groups:
        dense = [dequantize(w, torch.bfloat16, backend="cpu") for w in weights]
        nbytes = sum(w.nbytes for w in weights) / len(weights)
        types = "/".join(sorted({w.qtype.name for w in weights}))
        repeats = 3 if kind == "token_embd" else 5
        for m in map(int, args.rows.split(",")):
            if kind == "token_embd" and m > 64:
                continue  # the head sees one position per step, all of them only in logits()
            x = torch.randn(m, weights[0].cols, generator=g).bfloat16()

            def each(fn):
                return lambda: [fn(i) for i in range(len(weights))]

            per = len(weights)
            times = {"bf16 dense": timed(each(lambda i: F.linear(x, dense[i])), repeats) / per}
            if m <= CPU_GEMV_MAX_M:
                times["gemv"] = timed(each(lambda i: cpu_kernels.gemv(x, weights[i])), repeats) / per
            slab = torch.empty(weights[0].rows, weights[0].cols, dtype=torch.bfloat16)
            times["slab"] = timed(each(lambda i: F.linear(x, cpu_kernels.dequantize_into(weights[i], slab))),
                                  repeats) / per if kind != "token_embd" else float("nan")
            gemv = times.get("gemv")
            gbs = f"{nbytes / gemv / 1e6:.1f} ({nbytes / gemv / 1e6 / bandwidth:.0%})" if gemv else "-"
            best = min((k for k in times if times[k] == times[k]), key=times.get)
            print(f"| {kind} {weights[0].rows}x{weights[0].cols} | {types} | {m} | {times['bf16 dense']:.3f} | "
                  f"{gemv if gemv else float('nan'):.3f} | {gbs} | {times['slab']:.3f} | {best} |")


if __name__ == "__main__":
    main()

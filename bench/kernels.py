"""qmatmul and dequantize speed per GGUF type, against the memory bound.

For each type, weight shape [N, K] and M rows of activations: the time of
``qmatmul``, the weight bytes it must read over that time (GB/s) and that as a
fraction of this device's measured copy bandwidth; for M >= 64 also TFLOP/s
against a torch bf16 (GPU) or float32 (CPU) matmul of the same shape. On a GPU
both qmatmul paths (GEMV and GEMM) are timed for M <= 8 so the crossover in
``strata_kernels/launch.py`` can be set from the figures. On a CPU it times the
torch path (dequantize per call, then matmul).

    python bench/kernels.py [--types Q4_K,Q8_0] [--shapes 4096x4096,...] [--m 1,8,64,512] [--csv FILE]
    python bench/kernels.py --crossover [--types ...] [--shapes 4096x14336]

Prints a table; appends one CSV row per case carrying the device and versions.
``--crossover`` times only the two Triton paths at M = 1, 2, 4, 8 and prints,
per type and shape, the largest M at which the GEMV is still the faster,
then the value for ``GEMV_MAX_M`` that follows (the least of them). On a CPU
it needs the interpreter (``TRITON_INTERPRET=1``), which makes it a smoke
run, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels_test"))
from helpers import random_quant_tensor  # noqa: E402  (test helper: random GGUF blocks)

from strata_kernels import block_format, dequantize, qmatmul  # noqa: E402
from strata_kernels._triton_unpack import TRITON_TABLES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

LARGE_SHAPES = ["4096x4096", "14336x4096", "4096x14336"]
# The default model's own matmuls: q, k/v, o, gate/up, down, output head.
MODEL_SHAPES = ["1024x640", "256x640", "640x1024", "2048x640", "640x2048", "262144x640"]


def time_call(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        # do_bench returns a list for several quantiles and a float for one (Triton 3.6).
        median = triton.testing.do_bench(fn, quantiles=[0.5], warmup=10, rep=100)
        return (median[0] if isinstance(median, (list, tuple)) else median) / 1e3
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def graph_seconds(fn, reps: int = 50) -> float:
    """Median seconds per call of ``fn`` captured in a CUDA graph and
    replayed: the kernels alone, no Python or launch overhead between them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10 / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, reps=5)
    return 2 * src.numel() / seconds


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--types", default=",".join(T(q).name for q in TRITON_TABLES))
    ap.add_argument("--shapes", default=None, help="default: the large and model shapes on a GPU, three on a CPU; "
                                                   "4096x14336 with --crossover")
    ap.add_argument("--m", default="1,8,64,512" if cuda else "1,8,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--csv", default=None, help="append rows here (default: bench/results/kernels-<device>.csv)")
    ap.add_argument("--crossover", action="store_true", help="time GEMV against GEMM at M = 1, 2, 4, 8 only")
    args = ap.parse_args()
    if args.crossover:
        crossover(torch.device(args.device), args.types.split(","), (args.shapes or "4096x14336").split(","), args.reps)
        return
    args.shapes = args.shapes or (",".join(LARGE_SHAPES + MODEL_SHAPES) if cuda else "4096x4096,2048x640,640x2048")

    device = torch.device(args.device)
    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = device_name(device)
    bandwidth = copy_bandwidth(device)
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    print(f"device {name}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; {versions}; activations {act_dtype}")
    header = f"{'type':<8} {'N x K':>12} {'M':>4} {'path':<5} {'time us':>10} {'GB/s':>8} {'of copy':>8} {'TFLOP/s':>8} {'vs dense':>9}"
    print(header)
    out = Path(args.csv) if args.csv else Path(__file__).parent / "results" / f"kernels-{device.type}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(["date", "device", "versions", "type", "n", "k", "m", "path", "seconds", "gb_per_s",
                             "fraction_of_copy", "tflops", "dense_ratio"])
        for type_name in args.types.split(","):
            qtype = T[type_name]
            block = block_format(qtype).block_size
            for shape in args.shapes.split(","):
                n, k = (int(v) for v in shape.split("x"))
                if k % block:
                    continue
                qt = random_quant_tensor(qtype, n, k // block, seed=0).to(device)
                for m in (int(v) for v in args.m.split(",")):
                    x = torch.randn(m, k, device=device).to(act_dtype)
                    dense = None
                    if m >= 64:
                        w = dequantize(qt, act_dtype)
                        dense = time_call(lambda: x @ w.T, device, args.reps)
                        del w
                    paths = ["gemv", "gemm"] if (device.type == "cuda" and m <= 8) else ["auto"]
                    for path in paths:
                        fn = _path_call(x, qt, path)
                        seconds = time_call(fn, device, args.reps)
                        gbps = qt.nbytes / seconds / 1e9
                        tflops = 2 * m * n * k / seconds / 1e12
                        ratio = (seconds / dense) if dense else float("nan")
                        print(f"{type_name:<8} {shape:>12} {m:>4} {path:<5} {seconds * 1e6:>10.1f} {gbps:>8.1f} "
                              f"{gbps * 1e9 / bandwidth:>8.1%} {tflops:>8.3f} {ratio:>8.2f}x")
                        writer.writerow([datetime.date.today().isoformat(), name, versions, type_name, n, k, m, path,
                                         f"{seconds:.6e}", f"{gbps:.2f}", f"{gbps * 1e9 / bandwidth:.3f}",
                                         f"{tflops:.4f}", f"{ratio:.3f}"])
    print(f"rows appended to {out}")


def crossover(device: torch.device, types: list[str], shapes: list[str], reps: int) -> None:
    """For each type and shape, the largest M in 1, 2, 4, 8 up to which the
    GEMV path beats the GEMM path; the suggested GEMV_MAX_M is the least."""
    from strata_kernels.launch import GEMV_MAX_M

    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device_name(device)}; activations {act_dtype}; GEMV_MAX_M now {GEMV_MAX_M}")
    print(f"{'type':<8} {'N x K':>12} " + " ".join(f"{'M=' + str(m) + ' gemv/gemm':>16}" for m in (1, 2, 4, 8))
          + f" {'GEMV up to':>11}")
    limits = []
    for type_name in types:
        qtype = T[type_name]
        block = block_format(qtype).block_size
        for shape in shapes:
            n, k = (int(v) for v in shape.split("x"))
            if k % block:
                continue
            qt = random_quant_tensor(qtype, n, k // block, seed=0).to(device)
            ratios, limit = [], 0
            for m in (1, 2, 4, 8):
                x = torch.randn(m, k, device=device).to(act_dtype)
                gemv = time_call(_path_call(x, qt, "gemv"), device, reps)
                gemm = time_call(_path_call(x, qt, "gemm"), device, reps)
                ratios.append(gemv / gemm)
                if gemv < gemm and limit == m // 2:  # the GEMV has won at every M so far
                    limit = m
            limits.append(limit)
            print(f"{type_name:<8} {shape:>12} " + " ".join(f"{r:>16.2f}" for r in ratios) + f" {limit:>11}")
    print(f"suggested GEMV_MAX_M = {min(limits)} (the GEMV takes at most 8 rows: 8 means it still wins there)")


def _path_call(x, qt, path):
    if path == "auto":
        return lambda: qmatmul(x, qt)
    from strata_kernels._triton_qmatmul import qmatmul_triton

    return lambda: qmatmul_triton(x, qt, path=path)


if __name__ == "__main__":
    main()

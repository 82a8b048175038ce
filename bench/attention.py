"""Decode attention over the KV cache, per format: time and achieved GB/s
(cache bytes read / time) at contexts of 4K, 32K and 128K tokens, against the
device's measured copy bandwidth. On a GPU it times the Triton kernels alone
(the attention and the splits' merge, captured in a CUDA graph: no host work
in the figure; the goal is 60% of the copy bandwidth at 32K); on a CPU the
torch path.

    python bench/attention.py [--contexts 4096,32768,131072] [--shapes 1x4x256,8x4x128]

A shape is KV heads x query heads per KV head x head dim (1x4x256 is the
default model's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import copy_bandwidth, device_name, graph_seconds, time_call  # noqa: E402

from strata_kernels import KVStore, attention, kv_write  # noqa: E402
from strata_kernels.paging import BlockTables  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--shapes", default="1x4x256,8x4x128")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    print(f"device {device_name(device)}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}")
    print(f"{'shape':>9} {'context':>8} {'format':>6} {'time us':>10} {'MB read':>9} {'GB/s':>8} {'of copy':>8}")
    for shape in args.shapes.split(","):
        hkv, group, d = (int(v) for v in shape.split("x"))
        for context in (int(c) for c in args.contexts.split(",")):
            for fmt in ("f16", "int8", "k8v4"):
                store = KVStore.allocate(fmt, context, hkv, d, device=device)
                for c0 in range(0, context, 8192):  # fill in slices to bound the temporaries
                    n = min(8192, context - c0)
                    x = torch.randn(n, hkv, d, device=device)
                    kv_write(store, torch.arange(c0, c0 + n, device=device), x, x)
                q = torch.randn(1, hkv * group, d, device=device)
                if device.type == "cuda":
                    seconds = graph_seconds(_kernels_alone(q, store, context))
                else:
                    seconds = time_call(lambda: attention(q, store, context - 1, None, d**-0.5), device, args.reps)
                read = store.nbytes
                print(f"{shape:>9} {context:>8} {fmt:>6} {seconds * 1e6:>10.1f} {read / 1e6:>9.1f} "
                      f"{read / seconds / 1e9:>8.1f} {read / seconds / bandwidth:>8.1%}")
                store = None  # free it before the next format allocates


def _kernels_alone(q: torch.Tensor, store: KVStore, context: int):
    """The Triton decode attention of ``q`` at position ``context - 1``, its
    tables and start already on the device (what a graph can replay)."""
    from strata_kernels._triton_attention import attention_triton
    from strata_kernels.kv_quant import hadamard

    tables = BlockTables.contiguous(context, q.device)
    start = torch.tensor([context - 1], dtype=torch.int64, device=q.device)
    rotated = (q @ hadamard(q.shape[-1], q.device).to(q.dtype) if store.rotated else q)[None]
    return lambda: attention_triton(rotated, store, [context - 1], None, q.shape[-1] ** -0.5, tables,
                                    starts_on_device=start)


if __name__ == "__main__":
    main()

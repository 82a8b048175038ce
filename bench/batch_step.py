"""A decode step of several sequences at once, against one: what batching
buys on this machine, below the server.

    python bench/batch_step.py [--model PATH] [--dtype auto] [--threads 2]
                               [--batch 1,2,4,8] [--context 256] [--steps 32]

For each batch size B, prefills B sequences of about ``--context`` tokens
(each a different length) on one KV pool, then times ``--steps`` decode
steps of all of them together through the model (``Batch``: one row per
sequence, as the scheduler runs them), and separately the output head's
GEMV on B rows, the part of a step that reads the most weights. Prints per
B: the step (median), aggregate tokens/s and its ratio to B=1 measured in
the same run, and the head GEMV with its ratio to one row.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import long_prompt_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,2,4,8", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch.split(",")]

    import strata_runtime
    from strata_kernels import cpu_kernels
    from strata_runtime.scheduling import Batch
    from strata_runtime.models import prefill
    from strata_runtime.state import KVCache

    length = args.context + args.steps + 16
    engine = strata_runtime.load(args.model, dtype=args.dtype, progress=False, conversation_cache_mib=0,
                                 context_length=length, parallel=max(sizes))
    props = engine.props()
    print(f"# {platform.machine()}, torch {torch.__version__}, {args.threads} threads; {props['model']}; "
          f"{props['compute_path']['reason']}; CPU kernels: {cpu_kernels.describe()}")
    print(f"# decode steps of B sequences of about {args.context} tokens (median of {args.steps}); "
          f"the head GEMV on B rows (median of 20)")
    print("| B | step | tokens/s | vs B=1 | head GEMV | vs 1 row |")
    print("|---|---|---|---|---|---|")
    base_rate = base_head = None
    for b in sizes:
        caches = [KVCache.on_pool(engine.scheduler.pool, length) for _ in range(b)]
        times = []
        with torch.inference_mode():
            for i, cache in enumerate(caches):
                prefill(engine.model, cache, long_prompt_ids(engine, args.context - 7 * i, i))
            tokens = torch.full((b,), 100, dtype=torch.long)
            for step in range(args.steps + 2):
                t0 = time.perf_counter()
                state = caches[0] if b == 1 else Batch(caches, [1] * b)
                positions = torch.tensor([caches[0].length]) if b == 1 else state.positions
                engine.model(tokens, positions, state, last_only=True)
                if step >= 2:  # two warm-up steps
                    times.append(time.perf_counter() - t0)
            x = torch.randn(b, engine.model.hidden_size)
            head_times = []
            for _ in range(22):
                t0 = time.perf_counter()
                engine.model.head(x)
                head_times.append(time.perf_counter() - t0)
        for cache in caches:
            cache.release()
        step = statistics.median(times)
        head = statistics.median(head_times[2:])
        rate = b / step
        base_rate = base_rate or rate
        base_head = base_head or head
        print(f"| {b} | {step * 1e3:.2f} ms | {rate:.1f} | {rate / base_rate:.2f}x | {head * 1e3:.2f} ms | "
              f"{head / base_head:.2f}x |")


if __name__ == "__main__":
    main()

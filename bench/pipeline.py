"""Decode speed of a layer split against one stage, and what a hand-off costs.

    python bench/pipeline.py [--devices cpu,cpu] [--layer-split 9] [--tokens 64] [--threads 2]

Loads the default model once as one stage and once split over ``--devices``,
then decodes the same tokens with each, alternating. The per-token hand-off
cost is the split's extra time per token over one stage. (Two processes over
gloo are not measured yet: that path is not built.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import strata_runtime
from strata_runtime.generation import decode_step, prefill


def decode_seconds_per_token(engine, prompt: list[int], tokens: int) -> float:
    cache = engine.new_cache(len(prompt) + tokens + 1)
    with torch.inference_mode():
        prefill(engine.model, cache, prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            decode_step(engine.model, cache, 100)
        return (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--layer-split", default="9")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(progress=False, context_length=1024, conversation_cache_mib=0)
    engines = {
        "1 stage": strata_runtime.load(**common),
        f"{len(args.devices.split(','))} stages": strata_runtime.load(
            devices=args.devices, layer_split=args.layer_split, **common),
    }
    prompt = next(iter(engines.values())).tokenize("The history of the printing press begins")
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # alternate so drift hits both alike
        for name, engine in engines.items():
            runs[name].append(decode_seconds_per_token(engine, prompt, args.tokens))
    base = statistics.median(runs["1 stage"])
    print(f"# torch {torch.__version__}, {args.threads} threads, devices {args.devices}, "
          f"layer split {args.layer_split}, {args.tokens} decode tokens, median of {args.repeats}")
    print("| layout | decode tok/s | ms per token | hand-off per token |")
    print("|---|---|---|---|")
    for name, times in runs.items():
        t = statistics.median(times)
        extra = "" if name == "1 stage" else f"{(t - base) * 1e3:+.2f} ms"
        print(f"| {name} | {1 / t:.1f} | {t * 1e3:.1f} | {extra} |")


if __name__ == "__main__":
    main()

"""Accuracy of the quantized KV formats against the engine's own f16 cache,
on the default model (exact float32 path): top-1 agreement and mean KL
divergence over every teacher-forced position.

    python bench/kv_accuracy.py [--formats int8,k8v4] [--nudges 8]

- "reference texts": the two texts of ``tests/data`` (the issue's yardstick),
  plainly and as the mean over ``--nudges`` nudged runs (embeddings times
  1 + 1e-6 N(0,1), seeded; see ``strata_runtime.quality``): a single run of
  this sensitive model is one draw of the quantization noise.
- "other texts": six Python standard library sources, 400 tokens each, as a
  check that a change helps beyond the two texts.
The f16 row nudged is the control: the nudge alone must not move the f16 cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import strata_runtime
from strata_runtime.files import default_model_path
from strata_runtime.quality import agreement, logits_of, plain_and_nudged

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.float32.json"
OTHER_MODULES = ("textwrap", "json", "heapq", "argparse", "string", "fractions")


def other_texts(engine, n_tokens: int = 400) -> list[list[int]]:
    import importlib

    texts = []
    for name in OTHER_MODULES:
        source = Path(importlib.import_module(name).__file__).read_text()[:8000]
        texts.append(engine.tokenizer.encode(source)[:n_tokens])  # BOS first
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int8,k8v4")
    ap.add_argument("--nudges", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = default_model_path()
    reference = [case["tokens"] for case in json.loads(DATA.read_text())["teacher_forced"]]
    base = strata_runtime.load(path, dtype="float32", progress=False, context_length=2048)
    others = other_texts(base)
    base_ref, base_other = logits_of(base, reference), logits_of(base, others)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{sum(map(len, reference))} reference positions, {sum(map(len, others))} other positions")
    print(f"{'format':>6} | {'reference texts, plain':>22} | {'nudged: mean KL (sd, min-max)':>34} {'top-1':>6} "
          f"| {'other texts':>18}")
    for fmt in ["f16"] + args.formats.split(","):
        engine = base if fmt == "f16" else strata_runtime.load(path, kv=fmt, progress=False, context_length=512)
        plain, runs = plain_and_nudged(engine, base_ref, reference, args.nudges)
        other = agreement(base_other, logits_of(engine, others))
        kls = [r.kl for r in runs]
        spread = f"{statistics.mean(kls):.4f} ({statistics.stdev(kls):.4f}, {min(kls):.4f}-{max(kls):.4f})"
        print(f"{fmt:>6} | top-1 {plain.top1:6.1%} KL {plain.kl:.4f} | {spread:>34} "
              f"{statistics.mean(r.top1 for r in runs):6.1%} | top-1 {other.top1:5.1%} KL {other.kl:.4f}", flush=True)

if __name__ == "__main__":
    main()

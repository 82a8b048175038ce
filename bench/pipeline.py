"""Decode speed of a layer split against one stage, and what a hand-off costs.

    python bench/pipeline.py [--devices cpu,cpu] [--layer-split 9] [--tokens 64] [--threads 2] [--no-ranks]

Loads the default model once as one stage and once split over ``--devices``
in this process, and decodes the same tokens with each, alternating. Then
(unless ``--no-ranks``) it starts two gloo ranks on 127.0.0.1, one stage
each, and times the same decode on rank 0. A split does not parallelize
one sequence (the stages run in turn), so each layout is compared with one
stage at the same threads per computing process: the difference is the
hand-off cost per token (in one process: moving the hidden state; across
ranks: a command, the hidden state and the logits over TCP).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

import strata_runtime
from strata_runtime.models import decode_step, prefill

PROMPT = "The history of the printing press begins"
COMMON = dict(progress=False, context_length=1024, conversation_cache_mib=0)


def decode_seconds_per_token(engine, prompt: list[int], tokens: int) -> float:
    cache = engine.new_cache(len(prompt) + tokens + 1)
    with torch.inference_mode():
        prefill(engine.model, cache, prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            decode_step(engine.model, cache, 100)
        return (time.perf_counter() - t0) / tokens


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of the two-rank run; rank 0 prints its timings as JSON."""
    from strata_runtime.split import ranks

    options = dict(COMMON, devices=["cpu", "cpu"], layer_split=[int(args.layer_split.split(",")[0])],
                   threads=args.rank_threads)
    if ranks.this_rank() != 0:
        sys.exit(ranks.follow(**options))
    engine = strata_runtime.load(distributed=True, **options)
    prompt = engine.tokenize(PROMPT)
    times = [decode_seconds_per_token(engine, prompt, args.tokens) for _ in range(args.repeats)]
    engine.close()
    print(json.dumps(times))


def two_ranks(args: argparse.Namespace) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--rank-worker", "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--layer-split", args.layer_split, "--rank-threads", str(args.rank_threads)]
    procs = []
    for rank in (1, 0):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    out, _ = procs[1].communicate()
    procs[0].wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--layer-split", default="9")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank-threads", type=int, default=1, help="threads per rank in the two-rank run")
    ap.add_argument("--no-ranks", action="store_true", help="skip the two-rank run")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        return rank_worker(args)
    torch.set_num_threads(args.threads)
    stages = len(args.devices.split(","))
    engines = {
        "1 stage": strata_runtime.load(**COMMON),
        f"{stages} stages, one process": strata_runtime.load(devices=args.devices, layer_split=args.layer_split,
                                                             **COMMON),
    }
    prompt = next(iter(engines.values())).tokenize(PROMPT)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # alternate so drift hits both alike
        for name, engine in engines.items():
            runs[name].append(decode_seconds_per_token(engine, prompt, args.tokens))
    rows = [(name, statistics.median(t), "1 stage") for name, t in runs.items()]
    if not args.no_ranks:
        torch.set_num_threads(args.rank_threads)
        base = f"1 stage, {args.rank_threads} thread{'s' if args.rank_threads > 1 else ''}"
        one = engines["1 stage"]
        single = statistics.median(decode_seconds_per_token(one, prompt, args.tokens) for _ in range(args.repeats))
        ranked = statistics.median(two_ranks(args))
        rows += [(base, single, base),
                 (f"2 ranks (gloo, 127.0.0.1), {args.rank_threads} thread each", ranked, base)]
    times = {name: t for name, t, _ in rows}
    print(f"# torch {torch.__version__}, {args.threads} threads ({args.rank_threads} per rank), devices "
          f"{args.devices}, layer split {args.layer_split}, {args.tokens} decode tokens, median of {args.repeats}")
    print("| layout | decode tok/s | ms per token | hand-off per token (against) |")
    print("|---|---|---|---|")
    for name, t, against in rows:
        extra = "" if name == against else f"{(t - times[against]) * 1e3:+.2f} ms ({against})"
        print(f"| {name} | {1 / t:.1f} | {t * 1e3:.1f} | {extra} |")


if __name__ == "__main__":
    main()

"""Speculative decoding's speed: decode tokens/s with the suffix drafter
against without it, on the same model in the same run.

    python bench/spec.py [--model PATH] [--draft-model PATH] [--max-tokens 200] [--spec-tokens 7] [--clients 1 4]

Workloads (``draft_replay.workloads``): a file rewritten whole with one
rename; a chat whose second turn asks for the first answer again; free prose.
Each runs greedy on engines of the model with ``spec="off"``, ``"suffix"``
and, with ``--draft-model``, ``"draft"`` (the model's own file is a valid
draft: every draft right, at a draft forward per token), one client (one request) and four (four requests decoded
together), after a warm-up run of the same prompts so that prefill is a
cached prefix and the timed run is decode. Prints per workload and client
count: decode tokens/s without speculation, and per drafter its ratio to that, the
tokens a verify yields (1 + accepted / drafts), the share of sequence steps
that verified a draft, and whether the outputs were equal (they must be).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import strata_runtime  # noqa: E402
from draft_replay import workloads  # noqa: E402


def _decode(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``prompts`` decoded together, and their decode tokens/s
    (every token after each request's first, over the time from the first
    request's first token to the end)."""
    runs = [engine.submit(p, temperature=0, max_tokens=max_tokens) for p in prompts]
    scheduler = engine.scheduler
    while any(r.completion is None for r in runs):
        for r in runs:
            r.pump()
        if any(r.completion is None for r in runs):
            scheduler.step()
    end = time.perf_counter()
    first = min(r.seq.first_token_at for r in runs)
    tokens = sum(len(r.completion.tokens) - 1 for r in runs)
    return [r.completion.tokens for r in runs], tokens / (end - first)


def _counters(engine) -> dict:
    c = engine.scheduler.counters
    return {k: c[k] for k in ("spec_drafts", "spec_accepted_tokens", "generated_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--draft-model", default=None, help="a GGUF of the model's vocabulary: adds the draft drafter")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--spec-tokens", type=int, default=7)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    options = dict(progress=False, conversation_cache_mib=0, parallel=max(args.clients), context_length=4096)
    engines = {"off": strata_runtime.load(args.model, spec="off", **options),
               "suffix": strata_runtime.load(args.model, spec="suffix", spec_tokens=args.spec_tokens, **options)}
    if args.draft_model:
        engines["draft"] = strata_runtime.load(args.model, spec="draft", draft_model=args.draft_model,
                                               spec_tokens=args.spec_tokens, **options)
    plain = engines["off"]
    print(f"model: {plain.props()['model']} ({plain.props()['architecture']}); path {plain.props()['dtype']}; "
          f"{torch.get_num_threads()} threads; {platform.processor() or platform.machine()}"
          + (f"; draft model {args.draft_model}" if args.draft_model else ""))
    print(f"greedy, {args.max_tokens} tokens at most, drafts of up to {args.spec_tokens} tokens\n")
    drafters = [name for name in engines if name != "off"]
    print(f"{'workload':<9} {'clients':>7} {'off tok/s':>10} "
          + " ".join(f"{name + ' tok/s':>13} {'ratio':>6} {'tok/verify':>10} {'verified':>8}" for name in drafters)
          + f" {'equal':>6}")
    # Every engine answers the workloads' first chat, so that each holds the
    # same resident sequences (a prompt's prefix reuse decides how its rows
    # are chunked, and the default path's prefill GEMM rounds by chunk).
    chats = workloads(plain)
    for name in drafters:
        workloads(engines[name])
    for name, messages in chats.items():
        prompt = plain.chat_prompt(messages)
        for clients in args.clients:
            prompts = [prompt] * clients
            results = {}
            for label, engine in engines.items():
                _decode(engine, prompts, args.max_tokens)  # warm-up: the prompts become resident prefixes
                before = _counters(engine)
                outputs, rate = _decode(engine, prompts, args.max_tokens)
                after = _counters(engine)
                results[label] = (outputs, rate, {k: after[k] - before[k] for k in after})
            off_out, off_rate, _ = results["off"]
            cells = []
            for label in drafters:
                _, rate, d = results[label]
                per_verify = 1 + d["spec_accepted_tokens"] / d["spec_drafts"] if d["spec_drafts"] else 0.0
                # Sequence steps: each generated token not accepted from a draft took one.
                seq_steps = d["generated_tokens"] - d["spec_accepted_tokens"]
                verified = d["spec_drafts"] / seq_steps if seq_steps else 0.0
                cells.append(f"{rate:>13.1f} {rate / off_rate:>5.2f}x {per_verify:>10.2f} {verified:>8.0%}")
            equal = all(results[label][0] == off_out for label in drafters)
            print(f"{name:<9} {clients:>7} {off_rate:>10.1f} " + " ".join(cells) + f" {str(equal):>6}", flush=True)


if __name__ == "__main__":
    main()

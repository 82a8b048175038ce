"""A returning conversation: time to first token from the conversation cache
against a cold prefill, and park/restore bandwidth against a plain copy of the
same bytes.

    python bench/conversation_cache.py [--lengths 2048,8192] [--kv f16]

For each length: conversation A is prefilled, B displaces it (A is parked),
then A returns with a new question: TTFT cached (restore + suffix prefill)
versus cold (whole prompt). The goal is 20x or better.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import strata_runtime
from strata_runtime.memory import MiB

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.llamacpp.json"


def conversation(engine, n_tokens: int, offset: int) -> list[int]:
    texts = [case["text"] for case in json.loads(REFERENCE.read_text())["teacher_forced"]]
    words = " ".join(texts).split()
    ids = [engine.tokenizer.bos_id]
    i = offset
    while len(ids) < n_tokens:
        ids += engine.tokenize(" ".join(words[i % len(words):i % len(words) + 40]) + "\n", add_bos=False)
        i += 17
    return ids[:n_tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    engine = strata_runtime.load(args.model, kv=args.kv, progress=False, context_length=max(lengths) + 64,
                                 conversation_cache_mib=4096, min_free_mib=512)
    cc = engine.conversations
    print(f"model {engine.props()['model']}, kv {args.kv}, threads {torch.get_num_threads()}, "
          f"pool {cc.pool.total_bytes // MiB} MiB")
    print(f"{'tokens':>7} {'cold TTFT s':>12} {'cached TTFT s':>14} {'speedup':>8} "
          f"{'park GB/s':>10} {'restore GB/s':>13} {'memcpy GB/s':>12}")
    for n in lengths:
        a = conversation(engine, n, 0)
        b = conversation(engine, 256, 1000)
        question = engine.tokenize(" And what does that mean?", add_bos=False)
        engine.generate(a, max_tokens=1, temperature=0)
        engine.generate(b, max_tokens=1, temperature=0)  # parks A
        cached = engine.generate(a + question, max_tokens=1, temperature=0)  # restores A
        cold = _cold_ttft(engine, a + question)
        nbytes, park_gbps, restore_gbps = _copy_rates(engine, a)
        print(f"{n:>7} {cold:>12.3f} {cached.prefill_seconds:>14.3f} {cold / cached.prefill_seconds:>7.1f}x "
              f"{park_gbps:>10.2f} {restore_gbps:>13.2f} {_memcpy_gbps(nbytes):>12.2f}")
        assert cached.cached_tokens >= n - 1, "the returning conversation was not restored"


def _memcpy_gbps(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # both touched: page faults are not what is measured
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _cold_ttft(engine, prompt: list[int]) -> float:
    cache = engine.new_cache(len(prompt) + 1)
    from strata_runtime.generation import prefill

    with torch.inference_mode():
        t0 = time.perf_counter()
        prefill(engine.model, cache, prompt)
        return time.perf_counter() - t0


def _copy_rates(engine, tokens: list[int]) -> tuple[int, float, float]:
    """Park and restore of ``tokens`` alone, in a pool of their own: the
    snapshot's bytes and GB/s each way."""
    from strata_runtime.conversation_cache import ConversationCache, Parked
    from strata_runtime.generation import prefill
    from strata_runtime.staging import StagingPool

    cache = engine.new_cache(len(tokens) + 1)
    with torch.inference_mode():
        prefill(engine.model, cache, tokens)
    need = sum(store.bytes_per_slot() * min(store.capacity, len(tokens)) for store in cache.stores)
    cc = ConversationCache(StagingPool(need // MiB + 2, MiB), slots=1)
    parked = cc.park(cache, tokens)
    assert isinstance(parked, Parked), parked
    cache.reset()
    t0 = time.perf_counter()
    cc.restore(cache, [], tokens + [0])
    restore_s = time.perf_counter() - t0
    return parked.bytes, parked.bytes / parked.seconds / 1e9, parked.bytes / restore_s / 1e9


if __name__ == "__main__":
    main()

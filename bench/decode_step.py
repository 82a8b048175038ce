"""Where a CPU decode step's time goes, on the default model's fast path.

    python bench/decode_step.py [--model PATH] [--dtype auto] [--threads 2]
                                [--context 2000] [--steps 64]

Prefills ``--context`` tokens, then times ``--steps`` decode steps twice:
as the model runs them (on the CPU kernels each layer is two compiled calls,
``fused_decode``, timed as one part), then layer by layer, with each kind of
compiled-kernel call timed as it happens: the output head's GEMV, the
layers' GEMVs, attention, and the norms (RMSNorm with its RoPE and residual
add). What is left is Python and torch glue (embedding lookup, reshapes,
residual adds, the gated activation). Then the sampler on the last step's
logits, for each kind of sampling setting, and the argmax a greedy step
costs.
"""

from __future__ import annotations

import argparse
import collections
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
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import strata_runtime
    from strata_kernels import cpu_kernels
    from strata_runtime.models import decode_step, prefill
    from strata_runtime.scheduling import Sampler, SamplingParams

    engine = strata_runtime.load(args.model, dtype=args.dtype, progress=False, conversation_cache_mib=0,
                                 context_length=args.context + args.steps + 8)
    head = engine.model.embedding.out.qweight
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(name_of, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            name = name_of(*a)
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return out
        return wrapper

    # The module's functions are looked up at call time, so wrapping them here
    # times every call the model makes.
    cpu_kernels.gemv_blocks = timed(lambda x, blocks, types: "head GEMV" if blocks[0] is head.data else "layer GEMVs",
                                    cpu_kernels.gemv_blocks)
    cpu_kernels.attention_decode = timed(lambda *a: "attention", cpu_kernels.attention_decode)
    cpu_kernels.rms_norm = timed(lambda *a: "norms (+RoPE, residual)", cpu_kernels.rms_norm)

    from strata_runtime.models import FusedDecode

    FusedDecode.__call__ = timed(lambda *a: "layers, fused (2 calls)", FusedDecode.__call__)
    blocks = list(engine.model.layers)
    fused = [block.fused_decode for block in blocks]
    prompt = long_prompt_ids(engine, args.context, 0)
    print(engine.props()["compute_path"]["reason"])
    for on in (True, False):
        for block, f in zip(blocks, fused):
            block.fused_decode = f if on else None
        how = ("each layer as two compiled calls (fused_decode)" if on and any(fused)
               else "layer by layer (each kernel called from Python)")
        cache = engine.new_cache(len(prompt) + args.steps + 8)  # 4 warm-up steps too
        with torch.inference_mode():
            logits = prefill(engine.model, cache, prompt)
            token = int(logits.argmax())
            for _ in range(4):  # warm-up
                token = int(decode_step(engine.model, cache, token).argmax())
            spent.clear()
            calls.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                logits = decode_step(engine.model, cache, token)
                token = int(logits.argmax())
            total = (time.perf_counter() - t0) / args.steps
        print(f"\n{how}: decode step at {args.context} tokens of context, {args.threads} threads, "
              f"mean of {args.steps} steps: {total * 1e3:.2f} ms ({1 / total:.1f} tokens/s)")
        print(f"{'part':<26} {'ms/token':>9} {'calls/token':>12} {'share':>6}")
        for name, seconds in spent.most_common():
            per = seconds / args.steps
            print(f"{name:<26} {per * 1e3:>9.2f} {calls[name] / args.steps:>12.0f} {per / total:>6.0%}")
        rest = total - sum(spent.values()) / args.steps
        print(f"{'the rest (Python, glue)':<26} {rest * 1e3:>9.2f} {'':>12} {rest / total:>6.0%}")

    print(f"\nsampling from the last step's logits ({logits.numel():,} of them), ms per token:")
    history = prompt[-64:]
    settings = {
        "greedy (temperature 0)": SamplingParams(temperature=0),
        "defaults (top-k 40, top-p 0.95, min-p 0.05)": SamplingParams(seed=0),
        "top-k off, top-p 0.95, min-p 0.05": SamplingParams(seed=0, top_k=0),
        "top-k off, top-p 0.9 only": SamplingParams(seed=0, top_k=0, min_p=0.0, top_p=0.9),
        "top-k off, no filter": SamplingParams(seed=0, top_k=0, min_p=0.0, top_p=1.0),
        "defaults + repetition/presence penalties": SamplingParams(seed=0, repetition_penalty=1.1,
                                                                   presence_penalty=0.5),
    }
    for name, params in settings.items():
        sampler = Sampler(params)
        sampler(logits, history)
        t0 = time.perf_counter()
        for _ in range(20):
            sampler(logits, history)
        print(f"  {name:<45} {(time.perf_counter() - t0) / 20 * 1e3:.2f}")


if __name__ == "__main__":
    main()

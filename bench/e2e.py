"""End-to-end speed on a model (the default one unless ``--model``): load time, prefill and decode
tokens/s, peak RSS; with llama.cpp side by side when ``llama_cpp`` is
importable (same file, same thread count, runs alternating).

    python bench/e2e.py [--model PATH] [--threads N] [--dtypes float32,bfloat16]
                        [--prompt-tokens 2000] [--decode-tokens 128] [--repeats 2]

Each Strata dtype is loaded in turn (its load time and the peak RSS after
loading it are printed), then all engines run alternating.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.llamacpp.json"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def long_prompt_ids(engine, n_tokens: int) -> list[int]:
    texts = [case["text"] for case in json.loads(REFERENCE.read_text())["teacher_forced"]]
    ids = engine.tokenize("")  # the BOS token, where the vocabulary adds one
    while len(ids) < n_tokens:
        for text in texts:
            ids += engine.tokenize(text, add_bos=False)
    return ids[:n_tokens]


def bench_strata(engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    from strata_runtime.generation import decode_step, prefill

    cache = engine.new_cache(len(prompt) + decode_tokens + 1)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = prefill(engine.model, cache, prompt)
        t1 = time.perf_counter()
        token = int(logits.argmax())
        for _ in range(decode_tokens):
            token = int(decode_step(engine.model, cache, token).argmax())
        t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), decode_tokens / (t2 - t1)


def bench_llamacpp(llm, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(llm.sample(temp=0.0))
        llm.eval([token])
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), decode_tokens / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="Strata compute paths to measure")
    args = ap.parse_args()

    import strata_runtime

    torch.set_num_threads(args.threads)
    engines, loads = {}, []
    if "bfloat16" in args.dtypes.split(","):
        # The fast path's kernels compile on first use (then torch caches
        # them): timed apart, so that the load time below is a load's.
        from strata_kernels import cpu_kernels

        t0 = time.perf_counter()
        built = cpu_kernels.kernels()
        what = f"{built.simd}{', bf16 dot product' if built.bf16_dot else ''}" if built else "not built"
        loads.append(f"CPU kernels for -march={cpu_kernels.target()} ({what}): {time.perf_counter() - t0:.1f} s "
                     "(a compile on first use, then torch's cache; STRATA_CPU_MARCH picks another target)")
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        engines[f"strata {dtype}"] = strata_runtime.load(
            args.model, dtype=dtype, context_length=args.prompt_tokens + args.decode_tokens + 8,
            conversation_cache_mib=0, progress=False)
        loads.append(f"{dtype}: load {time.perf_counter() - t0:.1f} s, peak RSS after it {peak_rss_mib():.0f} MiB")
    engine = next(iter(engines.values()))
    prompt = long_prompt_ids(engine, args.prompt_tokens)

    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
    llm = None
    if Llama is not None:
        llm = Llama(model_path=engine.props()["path"], n_ctx=len(prompt) + args.decode_tokens + 8,
                    n_threads=args.threads, n_batch=512, verbose=False)

    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines} | {"llama.cpp": []}
    for _ in range(args.repeats):  # alternate so drift hits all alike
        for name, e in engines.items():
            rows[name].append(bench_strata(e, prompt, args.decode_tokens))
        if llm is not None:
            rows["llama.cpp"].append(bench_llamacpp(llm, prompt, args.decode_tokens))

    print(f"model {engine.props()['model']}, threads {args.threads}, "
          f"prompt {len(prompt)} tokens, decode {args.decode_tokens} tokens, median of {args.repeats}")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"{'engine':<17} {'prefill tok/s':>14} {'decode tok/s':>13}")
    medians = {}
    for name, runs in rows.items():
        if not runs:
            continue
        pre = statistics.median(r[0] for r in runs)
        dec = statistics.median(r[1] for r in runs)
        medians[name] = (pre, dec)
        print(f"{name:<17} {pre:>14.1f} {dec:>13.2f}")
    if "llama.cpp" in medians:
        lp, ld = medians["llama.cpp"]
        for name in engines:
            sp, sd = medians[name]
            print(f"{name + ' / llama.cpp':<30} prefill {sp / lp:.2f}x, decode {sd / ld:.2f}x")
    else:
        print("llama.cpp: not measured (pip install llama-cpp-python to compare side by side)")
    for line in loads:
        print(line)


if __name__ == "__main__":
    main()

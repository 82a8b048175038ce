"""End-to-end speed on a model (the default one unless ``--model``): load time, prefill and decode
tokens/s, peak RSS; with llama.cpp side by side when ``llama_cpp`` is
importable (same file, same thread count, runs alternating).

    python bench/e2e.py [--model PATH] [--threads N] [--dtypes auto,float32]
                        [--prompt-tokens 2000] [--decode-tokens 128] [--repeats 2]
                        [--isa avx2 --llama-lib DIR]

Each Strata dtype is loaded in turn (its load time and the peak RSS after
loading it are printed), then all engines run alternating; every run's
prompt starts differently from the run before it (no shared prefix for
either side to reuse).

``--isa avx2`` shows what an AVX2-only CPU sees from an AVX-512 one: the
script re-runs itself with torch capped at AVX2 (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``) and the kernels' avx2 build (``STRATA_CPU_ISA``);
``--llama-lib`` points llama-cpp-python at a llama.cpp built without
AVX-512 (``LLAMA_CPP_LIB_PATH``). Both sides print the ISA they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.llamacpp.json"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def long_prompt_ids(engine, n_tokens: int, start: int) -> list[int]:
    """About n_tokens of the reference texts, beginning with text ``start``
    (mod their count): each run's prompt differs from the last one's from
    its first text on."""
    texts = [case["text"] for case in json.loads(REFERENCE.read_text())["teacher_forced"]]
    ids = engine.tokenize("")  # the BOS token, where the vocabulary adds one
    i = start
    while len(ids) < n_tokens:
        ids += engine.tokenize(texts[i % len(texts)], add_bos=False)
        i += 1
    return ids[:n_tokens]


ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "STRATA_CPU_ISA": "avx2"}}


def reexec_for_isa(args) -> None:
    """Run this script again under ``--isa``'s environment (torch reads its
    switches at import, so they must be set before the process starts)."""
    env = dict(os.environ, **ISA_ENV[args.isa], STRATA_E2E_ISA=args.isa)
    if args.llama_lib:
        env["LLAMA_CPP_LIB_PATH"] = args.llama_lib
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def llama_isa() -> str:
    from llama_cpp import llama_print_system_info

    info = llama_print_system_info().decode()
    return " ".join(part.strip() for part in info.split("|") if "AVX" in part or "BF16" in part) or info


def bench_strata(engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    from strata_runtime.models import decode_step, prefill

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
    ap.add_argument("--dtypes", default="auto,float32", help="Strata compute paths to measure")
    ap.add_argument("--isa", choices=sorted(ISA_ENV), default=None, help="emulate a CPU with this ISA only")
    ap.add_argument("--llama-lib", default=None, help="llama.cpp's lib directory for llama-cpp-python")
    args = ap.parse_args()
    if args.isa and os.environ.get("STRATA_E2E_ISA") != args.isa:
        reexec_for_isa(args)

    import strata_runtime

    torch.set_num_threads(args.threads)
    engines, loads = {}, []
    # The kernels compile on first use (then torch caches them): timed
    # apart, so that the load time below is a load's.
    from strata_kernels import cpu_kernels

    t0 = time.perf_counter()
    cpu_kernels.kernels()
    loads.append(f"CPU kernels {cpu_kernels.describe()}: ready in {time.perf_counter() - t0:.1f} s "
                 "(a compile on first use per machine, then torch's cache)")
    for dtype in args.dtypes.split(","):
        before = peak_rss_mib()
        t0 = time.perf_counter()
        engine = engines[f"strata {dtype}"] = strata_runtime.load(
            args.model, dtype=dtype, context_length=args.prompt_tokens + args.decode_tokens + 8,
            conversation_cache_mib=0, progress=False)
        file_mib = os.path.getsize(engine.props()["path"]) / 2**20
        kv_mib = engine.props()["kv_bytes"] / 2**20
        loads.append(f"{dtype}: load {time.perf_counter() - t0:.1f} s, peak RSS after it {peak_rss_mib():.0f} MiB "
                     f"(before it {before:.0f} MiB: the interpreter, torch and the kernels; the load added "
                     f"{peak_rss_mib() - before:.0f} MiB against file {file_mib:.0f} + KV pool {kv_mib:.0f} MiB)")
    engine = next(iter(engines.values()))
    prompts = [long_prompt_ids(engine, args.prompt_tokens, start) for start in range(args.repeats * (len(engines) + 1))]

    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
    llm = None
    if Llama is not None:
        llm = Llama(model_path=engine.props()["path"], n_ctx=args.prompt_tokens + args.decode_tokens + 8,
                    n_threads=args.threads, n_batch=512, verbose=False)

    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines} | {"llama.cpp": []}
    runs = iter(prompts)
    for _ in range(args.repeats):  # alternate so drift hits all alike
        for name, e in engines.items():
            rows[name].append(bench_strata(e, next(runs), args.decode_tokens))
        if llm is not None:
            rows["llama.cpp"].append(bench_llamacpp(llm, next(runs), args.decode_tokens))

    print(f"model {engine.props()['model']}, threads {args.threads}, "
          f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, median of {args.repeats}")
    print(f"CPU {cpu_model()}; emulating: {args.isa or 'no (native)'}")
    print(f"torch {torch.__version__} (ISA {torch.backends.cpu.get_cpu_capability()}), python {sys.version.split()[0]}")
    for name, e in engines.items():
        print(f"{name}: {e.props()['compute_path']['reason']}")
    if llm is not None:
        print(f"llama.cpp: {llama_isa()}")
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

"""What one hostile or careless request costs the server, and the tokenizer's speed.

    python bench/edge.py [--model PATH] [--repeats 3]

Prints, against a real ``strata serve`` on 127.0.0.1 (context 4096, 8 MiB body limit):
- the time to the 400 for a body at the size limit, for ``/v1/completions``
  (one prompt) and ``/v1/chat/completions`` (41 messages): refused by its
  character count before anything is tokenized;
- the time to the 400 for the longest prompt the character bound lets
  through (it must be tokenized to learn that it does not fit);
- the time until a plain request is answered after a client abandons a
  long prefill (the engine stops between prefill chunks);
then, in this process: the tokenizer's tokens/s on a long prompt (the
Python SentencePiece merge, the ``tokenizers`` model, and llama.cpp's
tokenizer when ``llama_cpp`` is importable), and the cost per token of the
longest stop list allowed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server import start_server  # noqa: E402

BODY_LIMIT = 8 << 20


def timed_post(client: httpx.Client, path: str, body: dict, timeout: float = 600) -> tuple[float, int, str]:
    raw = json.dumps(body).encode()
    t0 = time.perf_counter()
    r = client.post(path, content=raw, headers={"content-type": "application/json"}, timeout=timeout)
    return time.perf_counter() - t0, r.status_code, r.text[:100]


def median_of(repeats: int, fn) -> tuple[float, int, str]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), runs[-1][1], runs[-1][2]


def server_figures(model: str | None, repeats: int) -> None:
    proc, base = start_server(model, ["--context-length", "4096", "--conversation-cache-mib", "64",
                                      "--min-free-mib", "0"])
    try:
        client = httpx.Client(base_url=base)
        limit = client.get("/props").json()["max_prompt_chars"]
        print(f"server: context 4096, body limit {BODY_LIMIT >> 20} MiB, prompts refused past {limit} characters")
        prompt = "word " * ((BODY_LIMIT - 200) // 5)
        seconds, status, _ = median_of(repeats, lambda: timed_post(client, "/v1/completions",
                                                                   {"prompt": prompt, "max_tokens": 2}))
        print(f"  /v1/completions, {len(prompt) / 2**20:.1f} MiB prompt:        {status} in {seconds * 1e3:8.1f} ms")
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * ((BODY_LIMIT - 8000) // 205)}
                    for i in range(41)]
        seconds, status, _ = median_of(repeats, lambda: timed_post(client, "/v1/chat/completions",
                                                                   {"messages": messages, "max_tokens": 2}))
        size = sum(len(m["content"]) for m in messages)
        print(f"  /v1/chat/completions, 41 messages, {size / 2**20:.1f} MiB: {status} in {seconds * 1e3:8.1f} ms")
        near = "word " * (limit // 5)
        seconds, status, text = median_of(repeats, lambda: timed_post(client, "/v1/completions",
                                                                      {"prompt": near, "max_tokens": 2}))
        print(f"  /v1/completions, {len(near)} characters (tokenized):  {status} in {seconds * 1e3:8.1f} ms")
        # A client that leaves during a long prefill, then a plain request.
        long_prompt = "Some words of a long document. " * 550  # ~3,900 tokens
        t0 = time.perf_counter()
        try:
            client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 8}, timeout=0.5)
        except httpx.TimeoutException:
            pass
        seconds, status, _ = timed_post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        print(f"  a plain request after a client left a ~4K-token prefill: {status} after "
              f"{time.perf_counter() - t0:.2f} s (its own time {seconds:.2f} s)")
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}, timeout=600)
        r.raise_for_status()
        print(f"     (that prefill of {r.json()['usage']['prompt_tokens']} tokens, run to the end: "
              f"{time.perf_counter() - t0:.2f} s)")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def long_text() -> str:
    """About 1 MB of mixed prose and code from the standard library."""
    import argparse as a
    import dataclasses as d
    import json as j
    import typing as t

    text = "".join(inspect.getsource(m) for m in (t, a, d, j))
    return (text * (1 + 1_000_000 // len(text)))[:1_000_000]


def tokenizer_figures(model: str | None, repeats: int) -> None:
    from strata_runtime.files import default_model_path
    from strata_runtime.files import GGUFFile
    from strata_runtime.text import Tokenizer

    path = model or str(default_model_path(progress=False))
    text = long_text()
    tok = Tokenizer.from_gguf(GGUFFile.open(path))
    t0 = time.perf_counter()
    tok.prepare()
    built = time.perf_counter() - t0

    def timed(fn) -> tuple[float, int]:
        times, n = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = len(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times), n

    print(f"tokenizer on {len(text) / 1e6:.1f} M characters of Python source and docstrings "
          f"({'SentencePiece' if tok._bpe is None else 'BPE'}; fast model built in {built:.1f} s):")
    strata_seconds, n = timed(lambda: tok.encode(text))
    print(f"  Strata, tokenizers model:      {n / strata_seconds:>12,.0f} tokens/s ({strata_seconds:.2f} s, {n} tokens)")
    if tok._bpe is None:
        fast, tok._fast_spm = tok._fast_spm, None  # the Python merge, llama.cpp's algorithm as written
        seconds, _ = timed(lambda: tok.encode(text))
        print(f"  Strata, Python merge:          {n / seconds:>12,.0f} tokens/s ({seconds:.2f} s)")
        tok._fast_spm = fast
        special_seconds, _ = timed(lambda: tok.encode(text, special=True))
        print(f"  Strata, special tokens parsed: {n / special_seconds:>12,.0f} tokens/s ({special_seconds:.2f} s)")
    try:
        import llama_cpp
    except ImportError:
        print("  llama.cpp: llama_cpp is not importable here (pip install llama-cpp-python to compare)")
        return
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    data = text.encode()
    seconds, m = timed(lambda: llm.tokenize(data, add_bos=True, special=False))
    print(f"  llama.cpp {llama_cpp.__version__}:             {m / seconds:>12,.0f} tokens/s ({seconds:.2f} s, {m} tokens); "
          f"Strata takes {strata_seconds / seconds:.2f}x llama.cpp's time")
    same = llm.tokenize(data, add_bos=True, special=False) == tok.encode(text)
    print(f"  same ids as llama.cpp: {same}")


def stop_figures() -> None:
    from strata_runtime.scheduling import SamplingParams
    from strata_runtime.text import StopTextStream

    class Pieces:
        def push(self, token: int) -> str:
            return "z"

        def flush(self) -> str:
            return ""

    n = SamplingParams.MAX_STOP_STRINGS
    stops = tuple("z" * (SamplingParams.MAX_STOP_CHARS - 1) + str(i % 10) for i in range(n))
    stream = StopTextStream(Pieces(), stops)
    t0 = time.perf_counter()
    for i in range(5000):
        stream.push(i)
    print(f"stop strings: {n} of {SamplingParams.MAX_STOP_CHARS} characters (the most allowed), every prefix "
          f"matching: {(time.perf_counter() - t0) / 5000 * 1e6:.0f} us per generated token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    server_figures(args.model, args.repeats)
    tokenizer_figures(args.model, args.repeats)
    stop_figures()


if __name__ == "__main__":
    main()

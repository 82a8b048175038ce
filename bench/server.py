"""Concurrent streaming clients against a local ``strata serve``: aggregate
decode rate, time to first token and inter-token latency.

    python bench/server.py [--model PATH] [--clients 1,2,4,8] [--requests 2]
                           [--max-tokens 64] [--servers "--parallel 1" ""] [-- ENGINE OPTIONS]

For each server setting of ``--servers`` (default: ``--parallel 1`` beside
the default, which decodes the requests in flight together), starts a real
server on 127.0.0.1 with the engine options given after ``--``, then for
each client count runs that many concurrent clients, each sending
``--requests`` streamed completions of ``--max-tokens`` tokens (distinct
prompts, no shared prefix). Prints one table row per setting and client
count: generated tokens per second over all clients (and against one
client of the same setting), time to first token and the time between
streamed pieces (p50, p95; and p95 against one client).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

WORDS = ("river", "mountain", "harbour", "library", "garden", "comet", "violin", "lantern", "orchard", "glacier",
         "market", "festival", "bridge", "desert", "island", "forest")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "strata_server.cli", "serve", "--port", str(port), "--max-queue", "64", *extra]
    if model:
        command += ["--model", model]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(command)}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy within 300 s")


def one_request(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first text, gaps between later pieces, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    first = arrivals[0] - t0 if arrivals else 0.0
    return first, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens


def run(base: str, clients: int, requests: int, max_tokens: int, seed: int) -> dict:
    results: list[tuple[float, list[float], int]] = []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=base, timeout=600) as client:
            for i in range(requests):
                words = " ".join(WORDS[(seed + c * 7 + i * 3 + k) % len(WORDS)] for k in range(4))
                prompt = f"Request {seed}-{c}-{i}. Write a long story about a {words}:"
                out = one_request(client, prompt, max_tokens)
                with lock:
                    results.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    gaps = sorted(g for r in results for g in r[1])
    tokens = sum(r[2] for r in results)
    return {"clients": clients, "requests": len(results), "tokens_per_s": tokens / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "itl_p50": percentile(gaps, 50), "itl_p95": percentile(gaps, 95)}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--servers", nargs="+", default=["--parallel 1", ""],
                    help="server settings to compare, each a quoted option string ('' : the default)")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    print(f"# strata serve, {platform.machine()}, python {platform.python_version()}, streamed completions of "
          f"{args.max_tokens} tokens, {args.requests} per client, engine options: {' '.join(extra) or '(none)'}")
    print("| server | clients | requests | gen tok/s | vs 1 client | TTFT p50 | TTFT p95 | ITL p50 | ITL p95 "
          "| ITL p95 vs 1 client |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.servers:
        proc, base = start_server(args.model, [*extra, *shlex.split(setting)])
        try:
            run(base, 1, 1, 8, seed=999)  # warm: the first request pays one-time costs
            one = None
            for n in counts:
                r = run(base, n, args.requests, args.max_tokens, seed=n)
                one = one or r
                print(f"| {setting or 'default'} | {n} | {r['requests']} | {r['tokens_per_s']:.1f} "
                      f"| {r['tokens_per_s'] / one['tokens_per_s']:.2f}x | {r['ttft_p50'] * 1e3:.0f} ms "
                      f"| {r['ttft_p95'] * 1e3:.0f} ms | {r['itl_p50'] * 1e3:.1f} ms | {r['itl_p95'] * 1e3:.1f} ms "
                      f"| {r['itl_p95'] / one['itl_p95']:.2f}x |", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()

"""Requests per second and time to first token through a local ``strata serve``.

    python bench/server.py [--model PATH] [--requests 8] [--max-tokens 16] [--clients 1,4]

Starts a real server on 127.0.0.1 (engine options as given after ``--``),
then for each client count runs that many concurrent clients, each sending
``--requests`` short streamed completions. One engine serves requests in
arrival order, so with 4 clients the time to first token includes the wait
behind the others: the figures show what the queue costs.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "strata_server.cli", "serve", "--port", str(port), *extra]
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
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy within 300 s")


def one_request(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first text, total time, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    tokens = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if "usage" in chunk:
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, time.perf_counter() - t0, tokens


def run(base: str, clients: int, requests: int, max_tokens: int) -> dict:
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=base, timeout=600) as client:
            for i in range(requests):
                # Distinct prompts: no request extends the live sequence of the previous one.
                out = one_request(client, f"Client {c}, question {i}: name a colour and", max_tokens)
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
    return {
        "clients": clients,
        "requests": len(results),
        "req_per_s": len(results) / wall,
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "tokens_per_s": sum(r[2] for r in results) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("server_args", nargs="*", help="engine options for strata serve (after --)")
    args = ap.parse_args()
    proc, base = start_server(args.model, args.server_args)
    try:
        with httpx.Client(base_url=base, timeout=600) as client:
            one_request(client, "Warm up:", 4)
        rows = [run(base, int(c), args.requests, args.max_tokens) for c in args.clients.split(",")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"# strata serve, {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"streamed completions of {args.max_tokens} tokens, short prompts")
    print("| clients | requests | requests/s | TTFT p50 | TTFT p95 | generated tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['req_per_s']:.2f} | {r['ttft_p50'] * 1e3:.0f} ms | "
              f"{r['ttft_p95'] * 1e3:.0f} ms | {r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()

"""A returning conversation: time to first token from the conversation cache
against a cold prefill, and park/restore bandwidth against a plain copy of the
same bytes.

    python bench/conversation_cache.py [--lengths 2048,8192] [--kv f16] [--restart-lengths 2048,16384]

For each length: conversation A is prefilled, B displaces it (A is parked),
then A returns with a new question: TTFT cached (restore + suffix prefill)
versus cold (whole prompt). The goal is 20x or better.

Then, against real ``strata serve`` processes (``--restart-lengths``; empty
to skip): A is parked, the engine child is killed with SIGKILL and A returns
to the new engine (restored from the server's shared staging pool: goal 20x
over cold); the server is stopped with SIGTERM and started again on the
same ``--conversation-cache-dir`` and A returns (restored from disk, its
files dropped from the page cache first: goal 5x). Each against a cold prefill of the same prompt on the same engine
(another ``cache_salt``: nothing cached), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import strata_runtime
from strata_runtime.conversations import MiB

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
    ap.add_argument("--restart-lengths", default="2048,16384",
                    help="conversation lengths for the crash and restart table ('' : skip it)")
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
    if args.restart_lengths:
        restart_table(engine, args.model, [int(n) for n in args.restart_lengths.split(",")], args.kv)


# --- after an engine crash and a server restart -----------------------------------------

def restart_table(engine, model: str | None, lengths: list[int], kv: str) -> None:
    model = model or engine.props()["path"]
    print(f"\nreturning conversation after a crash / a restart (strata serve --parallel 1, kv {kv}; "
          f"TTFT = a 1-token completion's latency, cold = the same prompt with another cache_salt)")
    print(f"{'tokens':>7} {'cold s':>8} {'RAM after kill -9 s':>20} {'speedup':>8} {'cold s':>8} "
          f"{'disk after restart s':>21} {'speedup':>8}")
    for n in lengths:
        a = conversation(engine, n, 0)
        b = conversation(engine, 128, 1000)
        question = engine.tokenize(" And what does that mean?", add_bos=False)
        again = engine.tokenize(" Say it in other words.", add_bos=False)
        with tempfile.TemporaryDirectory(prefix="strata-bench-") as directory:
            options = ["--model", model, "--parallel", "1", "--kv", kv, "--context-length", str(n + 256),
                       "--conversation-cache-mib", "2048", "--min-free-mib", "512",
                       "--conversation-cache-dir", directory, "--restart-backoff", "0.1"]
            server = _Server(options)
            try:
                server.complete(a)
                server.complete(b)  # A is parked (the shared pool, and written through to disk)
                server.kill_engine()
                ram_s, cached = server.complete(a + question)
                assert cached >= n - 1, f"after the crash only {cached} of {n} tokens came back"
                cold_ram_s, cached = server.complete(a + question, salt="cold-after-crash")
                assert cached == 0
            finally:
                server.stop()  # SIGTERM: what is on the device is parked and written to disk
            _drop_from_page_cache(Path(directory))  # read back from the disk, not from the kernel's cache of it
            server = _Server(options)
            try:
                disk_s, cached = server.complete(a + again)
                assert cached >= n - 1, f"after the restart only {cached} of {n} tokens came back"
                cold_disk_s, cached = server.complete(a + again, salt="cold-after-restart")
                assert cached == 0
            finally:
                server.stop()
        print(f"{n:>7} {cold_ram_s:>8.3f} {ram_s:>20.3f} {cold_ram_s / ram_s:>7.1f}x {cold_disk_s:>8.3f} "
              f"{disk_s:>21.3f} {cold_disk_s / disk_s:>7.1f}x", flush=True)


def _drop_from_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the files' cached pages (written and fsynced:
    clean, so it can), so the restart reads them from the device."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Server:
    """One ``strata serve`` process on a free port, healthy once constructed."""

    def __init__(self, options: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="strata-bench-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_server.cli", "serve", "--port", str(port),
                                      *options], stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        self.pid = self._healthy(None)

    def _healthy(self, not_pid: int | None) -> int:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; its log: {self.log.name}")
            try:
                if self.http.get("/health").status_code == 200:
                    pid = self.http.get("/props").json().get("engine_pid")  # None: between engines
                    if pid is not None and pid != not_pid:
                        return pid
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"no healthy engine within 600 s; the server's log: {self.log.name}")

    def kill_engine(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.pid = self._healthy(self.pid)

    def complete(self, prompt: list[int], salt: str | None = None) -> tuple[float, int]:
        """(seconds, cached prompt tokens) of a one-token completion of ``prompt``."""
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        t0 = time.perf_counter()
        r = self.http.post("/v1/completions", json=body)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        return seconds, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.http.close()


def _memcpy_gbps(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # both touched: page faults are not what is measured
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _cold_ttft(engine, prompt: list[int]) -> float:
    cache = engine.new_cache(len(prompt) + 1)
    from strata_runtime.models import prefill

    with torch.inference_mode():
        t0 = time.perf_counter()
        prefill(engine.model, cache, prompt)
        return time.perf_counter() - t0


def _copy_rates(engine, tokens: list[int]) -> tuple[int, float, float]:
    """Park and restore of ``tokens`` alone, in a pool of their own: the
    snapshot's bytes and GB/s each way."""
    from strata_runtime.conversations import ConversationCache, Parked
    from strata_runtime.models import prefill
    from strata_runtime.conversations import StagingPool

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

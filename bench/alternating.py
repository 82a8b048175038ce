"""Two conversations alternating through a staging pool that holds one of
them, on a real ``strata serve`` with a disk tier (issue 38's scenario):
every returning turn should come back from RAM or disk, no spill abandoned,
no engine exit.

    python bench/alternating.py [--requests 20] [--system-tokens 1700] [--slow-disk]

Prints, per request, the prompt and cached tokens and its seconds, then the
restores by tier, spills written / skipped or abandoned, the pool's waits for
the disk writer, and engine restarts (from the server's /metrics).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from prometheus_client.parser import text_string_to_metric_families

from conversation_cache import _Server  # bench/: run as python bench/alternating.py


def _metrics(server: _Server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _system(name: str, tokens: int) -> str:
    rules = " ".join(f"Rule {i} of {name}: answer question {i} in one short sentence." for i in range(tokens // 14))
    return f"You are {name}. {rules}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=1700, help="about this many tokens of system prompt each")
    p.add_argument("--pool-mib", type=int, default=32)
    p.add_argument("--slow-disk", action="store_true", help="each file write takes 4 s longer (disk_write:1:slow)")
    args = p.parse_args()

    directory = tempfile.mkdtemp(prefix="strata-bench-alternating-")
    options = [*(["--model", args.model] if args.model else []), "--parallel", "1", "--context-length", "4096",
               "--conversation-cache-mib", str(args.pool_mib), "--min-free-mib", "16",
               "--conversation-cache-dir", directory, *(["--inject-fault", "disk_write:1:slow"] if args.slow_disk else [])]
    server = _Server(options)
    try:
        history = {name: [{"role": "system", "content": _system(name, args.system_tokens)}] for name in ("Ada", "Bob")}
        print("request conversation prompt_tokens cached_tokens seconds")
        for i in range(args.requests):
            name = ("Ada", "Bob")[i % 2]
            messages = history[name]
            messages.append({"role": "user", "content": f"Question {i // 2}?"})
            t0 = time.perf_counter()
            r = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                 "temperature": 0})
            r.raise_for_status()
            usage = r.json()["usage"]
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            print(f"{i + 1} {name} {usage['prompt_tokens']} {usage['prompt_tokens_details']['cached_tokens']} "
                  f"{time.perf_counter() - t0:.2f}")
        m = _metrics(server)
        disk = m.get("strata_conversation_cache_restored_from_disk_total", 0)
        spill_skips = sum(v for k, v in m.items() if k.startswith('strata_conversation_cache_skipped_total{kind="spill"'))
        print(f"restores: {m['strata_conversation_cache_restored_total'] - disk:.0f} from RAM, {disk:.0f} from disk; "
              f"disk reads {m.get('strata_conversation_cache_disk_reads_total', 0):.0f}; "
              f"spills written {m.get('strata_conversation_cache_disk_spills_total', 0):.0f}, "
              f"skipped or abandoned {spill_skips:.0f}; waits for the writer "
              f"{m.get('strata_conversation_cache_spill_waits_total', 0):.0f} "
              f"({m.get('strata_conversation_cache_spill_wait_seconds_total', 0):.1f} s); "
              f"engine restarts {m['strata_engine_restarts_total']:.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()

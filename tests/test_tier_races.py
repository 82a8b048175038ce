"""The conversation tiers and the supervisor under the races of issue 38,
against real ``strata serve`` processes on 127.0.0.1.

- Two conversations alternating through a staging pool that holds one, with
  a slow disk (``disk_write:1:slow``): every returning turn restores from RAM
  or disk, no spill is abandoned, no engine exits (M1).
- An engine killed from outside (the OOM killer, an operator): no request is
  sent to the dead child, and no request is banned for a crash it did not
  cause (M5).
- An engine start that hangs (a hung mount under the cache directory) is
  killed at the start deadline and counted as a crash (M3).
- ``/slots`` lists each API key its own sequences only (L4); a client that
  leaves in the middle of its body is counted, not logged as an error (L2).
"""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import openai
import pytest
from live_server import LiveServer

pytestmark = pytest.mark.slow


def _system(name: str, n: int = 40) -> dict:
    """A system prompt of about 500 tokens, different per conversation."""
    rules = " ".join(f"Rule {i} of {name}: answer question {i} in one short sentence." for i in range(n))
    return {"role": "system", "content": f"You are {name}. {rules}"}


def _client(server: LiveServer, key: str = "none") -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, timeout=180, max_retries=0)
    return client, client.models.list().data[0].id


SPILL_SKIPS = 'strata_conversation_cache_skipped_total{kind="spill"'  # skipped and abandoned spills, by reason


def _metric_sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def test_two_conversations_alternating_through_a_pool_that_holds_one_lose_nothing(model_file, tmp_path):
    server = LiveServer("--model", str(model_file), "--dtype", "float32", "--context-length", "1024",
                        "--parallel", "1", "--conversation-cache-mib", "32", "--min-free-mib", "16",
                        "--conversation-cache-dir", str(tmp_path / "conversations"),
                        "--inject-fault", "disk_write:1:slow", "--restart-backoff", "0.2")
    try:
        server.wait_for_health(200)
        client, model = _client(server)
        history = {name: [_system(name)] for name in ("Ada", "Bob")}
        turns = []  # (round, name, prompt tokens, cached tokens, seconds)
        for round_ in range(3):
            for name, messages in history.items():
                messages.append({"role": "user", "content": f"Question {round_}?"})
                t0 = time.perf_counter()
                r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
                turns.append((round_, name, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens,
                              time.perf_counter() - t0))
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
        metrics = server.metrics()
        print("\nround name prompt cached seconds")
        for t in turns:
            print(f"{t[0]} {t[1]} {t[2]} {t[3]} {t[4]:.2f}")
        restored_ram = metrics["strata_conversation_cache_restored_total"] - \
            metrics["strata_conversation_cache_restored_from_disk_total"]
        spill_skips = _metric_sum(metrics, SPILL_SKIPS)
        print(f"restored from RAM {restored_ram:.0f}, from disk "
              f"{metrics['strata_conversation_cache_restored_from_disk_total']:.0f}, spills "
              f"{metrics['strata_conversation_cache_disk_spills_total']:.0f}, spills skipped or abandoned "
              f"{spill_skips:.0f}, "
              f"waits for the writer {metrics['strata_conversation_cache_spill_waits_total']:.0f}, "
              f"engine restarts {metrics['strata_engine_restarts_total']:.0f}")
        # Every returning turn restores at least all of the turn before it (system prompt included).
        previous = {}
        for round_, name, prompt, cached, _ in turns:
            if round_ > 0:
                assert cached >= previous[name] - 1, (name, round_, cached, previous[name], server.log()[-4000:])
            previous[name] = prompt
        assert metrics["strata_conversation_cache_restored_from_disk_total"] >= 4
        assert spill_skips == 0
        assert metrics["strata_engine_restarts_total"] == 0
        assert "restore from disk skipped" not in server.log()
    finally:
        server.stop()


def test_an_engine_killed_from_outside_gets_no_request_and_bans_none(model_file):
    server = LiveServer("--model", str(model_file), "--context-length", "512", "--conversation-cache-mib", "0",
                        "--restart-backoff", "0.5")
    try:
        server.wait_for_health(200)
        client, model = _client(server)
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}

        # Idle, killed: the request right after is not sent to the dead child (503 to retry, or served).
        os.kill(server.engine_pid(), signal.SIGKILL)
        r = server.post("/v1/completions", body)
        assert r.status_code in (200, 503), r.text
        server.wait_for_health(200, timeout=120)
        assert server.post("/v1/completions", body).status_code == 200

        # Killed while serving a request: that request fails, but nothing says it caused the kill.
        long = {**body, "prompt": "Once upon a time", "max_tokens": 400}
        with httpx.Client(base_url=server.base, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                os.kill(server.engine_pid(), signal.SIGKILL)
                rest = "\n".join(lines)
        assert "engine_crashed" in rest, rest
        server.wait_for_health(200, timeout=120)
        again = server.post("/v1/completions", {**long, "stream": True})
        assert again.status_code == 200, again.text  # not 422: one unexplained SIGKILL bans nothing
        assert server.metrics()["strata_requests_refused_after_crash_total"] == 0
    finally:
        server.stop()


def test_an_engine_start_past_its_deadline_is_a_crash(model_file, tmp_path):
    server = LiveServer("--model", str(model_file), "--context-length", "512", "--conversation-cache-mib", "16",
                        "--min-free-mib", "0", "--conversation-cache-dir", str(tmp_path / "c"),
                        "--inject-fault", "disk_index:1:hang", "--start-timeout", "3", "--max-restarts", "2",
                        "--restart-backoff", "0.2")
    try:
        assert _listening(server)
        code, body = server.health()
        assert code == 503 and body["status"] in ("starting", "restarting"), body
        assert server.proc.wait(timeout=120) == 3
        log = server.log()
        assert log.count("not ready 3 s after it started") == 2, log[-3000:]
        assert "within the start deadline of 3 s" in log
    finally:
        server.stop()


def _listening(server: LiveServer, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            server.health()
            return True
        except httpx.TransportError:
            time.sleep(0.1)
    return False


def test_slots_list_each_key_its_own_and_a_client_gone_mid_body_is_counted(model_file):
    server = LiveServer("--model", str(model_file), "--context-length", "512", "--conversation-cache-mib", "16",
                        "--min-free-mib", "0", "--api-key", "key-b", api_key="key-a")
    try:
        server.wait_for_health(200)
        a, model = _client(server, "key-a")
        a.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=3)
        a.chat.completions.create(model=model, messages=[{"role": "user", "content": "Another one"}], max_tokens=3,
                                  extra_body={"cache_salt": "s1"})

        def slots(key):
            return httpx.get(f"{server.base}/slots", headers={"Authorization": f"Bearer {key}"}).json()["slots"]

        deadline = time.monotonic() + 10
        while len(slots("key-a")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(slots("key-a")) >= 2 and all("owner" not in s for s in slots("key-a"))
        assert slots("key-b") == []

        # A body cut off by the client: no error logged, a counter.
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-a\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"Hel")
        deadline = time.monotonic() + 10
        while server.metrics().get("strata_client_disconnects_in_body_total", 0) < 1:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
        log = server.log()
        assert "unexpected error" not in log and "Traceback" not in log, log[-3000:]
    finally:
        server.stop()

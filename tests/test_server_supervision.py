"""The engine child killed with real signals: the server notices at once,
fails what it held with a 503, restarts it without waiting for traffic, and
gives up (exiting non-zero) when it crashes at every start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
from live_server import LiveServer


def _engine_options(model_file) -> list[str]:
    return ["--model", str(model_file), "--context-length", "512", "--conversation-cache-mib", "16",
            "--min-free-mib", "0"]


def _see_503_then_200(server: LiveServer) -> dict:
    """Only /health is polled in between: the restart needs no traffic. The
    200 after a restart says how the last engine ended (a poll may come later
    than the whole restart on a loaded machine, so the 503s in between may or
    may not have carried it yet)."""
    body = server.wait_for_health(503, timeout=10)
    assert body["status"] == "restarting"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        code, body = server.health()
        if code == 200:
            break
        assert body["status"] == "restarting", body
        time.sleep(0.05)
    assert code == 200, body
    assert body["restarts"] >= 1 and body["last_exit"] is not None, body
    return body


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_while_idle_then_a_hang(model_file):
    server = LiveServer(*_engine_options(model_file), "--restart-backoff", "0.2", "--hang-timeout", "3")
    try:
        server.wait_for_health(200)
        first = server.kill_engine(signal.SIGKILL)
        body = _see_503_then_200(server)
        assert body["last_exit"]["signal"] == "SIGKILL" and body["last_exit"]["code"] == -9
        assert server.metrics()["strata_engine_restarts_total"] == 1
        assert server.engine_pid() != first
        ok = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert "engine exited on signal SIGKILL (exit code -9); last error:" in server.log()

        # A child that stops answering (SIGSTOP) is killed after the hang timeout and replaced.
        stopped = server.kill_engine(signal.SIGSTOP)
        body = server.wait_for_health(503, timeout=30)
        server.wait_for_health(200)
        assert server.metrics()["strata_engine_restarts_total"] == 2
        assert "has not answered for" in server.log()
        assert "engine exited after it stopped answering" in server.log()
        assert "task ended" not in server.log()  # killing a hung child is no failure of the ping task
        assert not _alive(stopped)
    finally:
        server.stop()


def test_sigkill_while_streaming(model_file):
    server = LiveServer(*_engine_options(model_file), "--restart-backoff", "0.2")
    try:
        server.wait_for_health(200)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="A very long story begins:", max_tokens=400, temperature=0,
                                           stream=True)
        chunks = iter(stream)
        next(chunks)
        server.kill_engine(signal.SIGKILL)
        with pytest.raises(openai.APIError) as caught:
            for _ in chunks:
                pass
        assert "engine process exited" in str(caught.value)
        _see_503_then_200(server)
        assert server.metrics()["strata_engine_restarts_total"] == 1
        again = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
        assert again.usage.completion_tokens == 2

        # The server itself killed: its engine child notices stdin closing and exits.
        child = server.engine_pid()
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + 20
        while _alive(child):
            assert time.monotonic() < deadline, "the engine outlived its server"
            time.sleep(0.1)
    finally:
        server.stop()


def test_an_engine_that_crashes_at_every_start_makes_the_server_exit_non_zero(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4000))  # passes the magic check, fails to load
    server = LiveServer("--model", str(broken), "--max-restarts", "3", "--restart-backoff", "0.1")
    try:
        seen = []

        def watch():
            while server.proc.poll() is None:
                try:
                    seen.append(server.health()[1]["status"])
                except Exception:
                    pass
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        code = server.proc.wait(timeout=180)
        watcher.join()
        log = server.log()
        assert code == 3, log
        assert "ok" not in seen
        assert "3 crashes in 600 s: giving up" in log
        assert "engine exited with exit code 1; last error: ModelFileError:" in log, log
        assert "Fatal Python error" not in log  # the child exits cleanly, with its own error
    finally:
        server.stop()


def test_bad_options_fail_before_any_engine_starts(tmp_path, model_file):
    r = subprocess.run([sys.executable, "-m", "strata_server.cli", "serve", "--model", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata_server.cli", "serve", "--model", str(model_file),
                        "--kv", "int8", "--device", "tpu"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "device must be" in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata_server.cli", "serve", "--model", str(model_file),
                        "--conversation-cache-slots", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "conversation_cache_slots must be at least 1" in r.stderr

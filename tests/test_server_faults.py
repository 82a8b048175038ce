"""Engine faults against a real ``strata serve``: each either skips an
optimization or ends the engine, which the supervisor restarts; never a
zombie that answers errors while /health says ok (issue 23).

Faults are injected with ``--inject-fault POINT[:RATE[:KIND]][@TEXT]``:
a device error that is not out-of-memory (what torch raises after an illegal
memory access), a main thread stuck in a forward, each limited to requests
whose prompt carries a marker so that other requests are served.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from live_server import LiveServer

POISON = "Xylophone quartz poison"
STUCK = "Zebra lantern stuck"
HEALTH_BOUND_S = 5.0  # a crash is seen at once: the child's exit wakes the supervisor


def _options(model_file) -> list[str]:
    return ["--model", str(model_file), "--context-length", "512", "--conversation-cache-mib", "16",
            "--min-free-mib", "0", "--restart-backoff", "0.2"]


def _seconds_until_health_leaves_200(server: LiveServer, since: float, timeout: float) -> float:
    deadline = since + timeout
    while time.monotonic() < deadline:
        if server.health()[0] != 200:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"/health still 200 {timeout} s after the fault:\n{server.log()[-3000:]}")


def test_poison_and_stuck_requests_restart_the_engine_and_are_not_retried(model_file):
    server = LiveServer(*_options(model_file), "--stall-timeout", "2",
                        "--inject-fault", f"forward:1:device_error@{POISON}",
                        "--inject-fault", f"forward:1:hang@{STUCK}")
    try:
        server.wait_for_health(200)
        # The client retries 5xx by default (max_retries=2): "x-should-retry: false" must stop it.
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id
        first_engine = server.engine_pid()

        # 1. A device error in a forward: the engine ends itself, the request gets a 500 it is not retried on.
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=model, prompt=POISON, max_tokens=4, temperature=0)
        assert caught.value.status_code == 500 and caught.value.code == "engine_crashed"
        assert "illegal memory access" in str(caught.value), str(caught.value)
        server.wait_for_health(200)
        assert server.engine_pid() != first_engine
        assert time.monotonic() - t0 < 60
        log = server.log()
        assert "the engine cannot go on after" in log and "illegal memory access" in log
        # Sent twice more: refused with a 422 naming why, the engine untouched.
        for _ in range(2):
            with pytest.raises(openai.UnprocessableEntityError) as refused:
                client.completions.create(model=model, prompt=POISON, max_tokens=4, temperature=0)
            assert refused.value.code == "request_crashed_engine" and "crashed" in str(refused.value)
        metrics = server.metrics()
        assert metrics["strata_engine_restarts_total"] == 1  # one crash, not three (nor nine with retries)
        assert metrics["strata_requests_refused_after_crash_total"] == 2
        ok = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3

        # 2. A forward that never returns: the pings are still answered (the
        # reader thread), but the step's age passes its bound and the engine is killed.
        done: dict = {}

        def stuck_request():
            try:
                client.completions.create(model=model, prompt=STUCK, max_tokens=4, temperature=0)
            except openai.APIError as e:
                done["error"] = e

        thread = threading.Thread(target=stuck_request)
        t0 = time.monotonic()
        thread.start()
        # Bound: the stall timeout scaled by the step's tokens (a few here: 2 * (1 + 8/256) s), a ping, a margin.
        seen = _seconds_until_health_leaves_200(server, t0, timeout=2 * (1 + 8 / 256) + 1 + 2)
        print(f"stuck forward: /health left 200 after {seen:.1f} s (stall timeout 2 s)")
        thread.join(timeout=60)
        assert isinstance(done.get("error"), openai.InternalServerError), done
        assert done["error"].code == "engine_crashed" and "one piece of its work ran" in str(done["error"])
        server.wait_for_health(200)
        assert "is stuck: one piece of its work has run" in server.log()
        assert server.metrics()["strata_engine_restarts_total"] == 2
        ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            temperature=0)
        assert ok.usage.completion_tokens == 3
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_device_error_in_a_copy_restarts_the_engine_and_out_of_memory_only_skips(model_file):
    """A device error in the conversation cache's copy is no skipped
    optimization: the device is in an unknown state, so the engine ends.
    Out-of-memory in the same copy is skipped and counted, and the request served."""
    server = LiveServer(*_options(model_file), "--inject-fault", "checkpoint_copy:1:device_error")
    try:
        server.wait_for_health(200)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "Name a colour."}]
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        assert caught.value.code == "engine_crashed"
        assert _seconds_until_health_leaves_200(server, t0, HEALTH_BOUND_S) < HEALTH_BOUND_S
        server.wait_for_health(200)
        assert server.metrics()["strata_engine_restarts_total"] == 1
        ok = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3
    finally:
        server.stop()
    oom = LiveServer(*_options(model_file), "--inject-fault", "checkpoint_copy:1:oom")
    try:
        oom.wait_for_health(200)
        client = openai.OpenAI(base_url=f"{oom.base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        ok = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")
        metrics = oom.metrics()
        assert metrics.get('strata_conversation_cache_skipped_total{kind="checkpoint",reason="out_of_memory"}', 0) >= 1
        assert metrics["strata_engine_restarts_total"] == 0 and oom.health()[0] == 200
    finally:
        oom.stop()


def test_sigterm_to_the_process_group_drains_and_exits_zero(model_file):
    """As a service manager stops a service: SIGTERM to every process of the
    server's group. The engine child has its own session, so it is not hit;
    the request in flight finishes, new ones get 503, the server exits 0."""
    server = LiveServer(*_options(model_file), new_session=True)
    proc = server.proc
    try:
        server.wait_for_health(200)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=160, temperature=0,
                                           stream=True)
        chunks = iter(stream)
        first = next(chunks)
        os.killpg(proc.pid, signal.SIGTERM)
        # While the accepted stream runs, the listener stays: a request on a new connection gets a 503 to
        # retry, not a refused connection.
        server.wait_for_health(503, timeout=10)
        late = httpx.post(f"{server.base}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_stopping", late.text
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length", rest[-1]
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert len(text) > 0
        assert proc.wait(timeout=60) == 0, server.log()
        log = server.log()
        assert "SIGTERM: draining" in log
        assert "restarting" not in log and "engine exited" not in log, log
        # The engine was not signalled (its own session): it was stopped by the server, not drained by SIGTERM.
        assert "SIGTERM: the requests in flight have finished" not in log, log
    finally:
        server.stop()


def test_verifies_that_run_out_of_memory_are_skipped_and_every_request_served(model_file):
    """``--spec suffix`` with out-of-memory injected at both verify points at
    random: concurrent requests are served with the text the engine gives
    without speculation, the skips show in /metrics by reason, /health stays
    200 and the engine is never restarted."""
    import strata_runtime

    server = LiveServer(*_options(model_file), "--spec", "suffix", "--parallel", "2",
                        "--inject-fault", "verify_forward:0.5", "--inject-fault", "verify:0.3")
    code = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(6))
    conversations = [[{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}],
                     [{"role": "user", "content": f"Copy this, then say done:\n\n{code}"}]]
    try:
        server.wait_for_health(200)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            reply = client.chat.completions.create(model=model, messages=conversations[i], max_tokens=48,
                                                   temperature=0)
            answers[i] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        plain = strata_runtime.load(model_file, progress=False, conversation_cache_mib=0, context_length=512)
        assert answers == {i: plain.chat(m, temperature=0, max_tokens=48).text for i, m in enumerate(conversations)}
        metrics = server.metrics()
        skipped = metrics['strata:spec_decode_skipped_total{reason="out_of_memory"}']
        assert skipped > 0 and metrics["strata:spec_decode_num_drafts_total"] > 0, metrics
        assert metrics["strata:spec_decode_num_accepted_tokens_total"] > 0
        assert server.health()[0] == 200 and metrics["strata_engine_restarts_total"] == 0
        assert server.http.get("/props").json()["speculative"]["mode"] == "suffix"
    finally:
        server.stop()

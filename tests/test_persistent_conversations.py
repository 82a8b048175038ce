"""Parked conversations survive the engine (issue 26), against a real
``strata serve`` whose engine child is killed with SIGKILL: while idle, in
the middle of a park and in the middle of a restore (``--inject-fault
POINT:1:slow`` makes that copy take seconds, long enough to be killed in).
The next engine takes back every committed entry from the server's shared
staging pool and answers the returning conversations as a cold engine
does; the entry whose copy was cut off is discarded and counted.
"""

from __future__ import annotations

import signal
import time

import openai
import pytest
from live_server import LiveServer

import strata_runtime

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
QUESTIONS = ["Name a river in Europe and say where it flows.", "What is a prime number? Give an example.",
             "Which planet is the largest?"]
OPTIONS = ["--context-length", "512", "--parallel", "1", "--dtype", "float32", "--conversation-cache-mib", "32",
           "--min-free-mib", "0", "--restart-backoff", "0.2"]


def _first(question):
    return [SYSTEM, {"role": "user", "content": question}]


def _second(question, answer):
    return _first(question) + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]


class _Client:
    def __init__(self, server: LiveServer):
        self.server = server
        self.openai = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=120, max_retries=0)
        self.model = self.openai.models.list().data[0].id

    def chat(self, messages, max_tokens=8):
        r = self.openai.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def cold(model_file):
    engine = strata_runtime.load(model_file, dtype="float32", context_length=512, parallel=1,
                                 conversation_cache_mib=0, progress=False)
    return lambda messages, max_tokens=8: engine.chat(messages, max_tokens=max_tokens, temperature=0).text


def _wait_for_log(server: LiveServer, text: str, seen: int = 0, timeout: float = 60) -> None:
    """Until ``text`` has been logged more than ``seen`` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.log().count(text) > seen:
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged within {timeout} s:\n{server.log()[-3000:]}")


def _wait_for(condition, what: str, timeout: float = 10) -> None:
    """The engine's state reaches the server just after a request's answer: poll it."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _kill_and_wait(server: LiveServer) -> int:
    killed = server.kill_engine(signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # Just after the kill /health may still say 200 (the supervisor has not seen the exit yet) and /props
        # then answer 503 without a pid: only a 200 from /props names the engine that answers.
        props = server.http.get("/props")
        if props.status_code == 200 and props.json()["engine_pid"] != killed:
            return killed
        time.sleep(0.1)
    raise AssertionError(f"no new engine after killing {killed}:\n{server.log()[-3000:]}")


def _recovered(server: LiveServer) -> tuple[float, dict[str, float]]:
    m = server.metrics()
    rejected = {k.split('"')[1]: v for k, v in m.items() if k.startswith("strata_conversation_cache_rejected_total{")}
    return m['strata_conversation_cache_recovered_total{kind="snapshot"}'], rejected


def test_killed_while_idle_every_parked_conversation_comes_back(model_file, cold):
    server = LiveServer("--model", str(model_file), *OPTIONS)
    try:
        server.wait_for_health(200)
        client = _Client(server)
        answers = [client.chat(_first(q))[0] for q in QUESTIONS]  # each parks the one before (parallel 1)
        _wait_for(lambda: sum(s.get("where") == "ram" and s["state"] == "parked"
                              for s in server.http.get("/slots").json()["slots"]) == 2, "two conversations in RAM")
        _kill_and_wait(server)
        recovered, rejected = _recovered(server)
        assert recovered == 2 and not any(rejected.values()), (recovered, rejected)
        assert "took back 2 parked conversations" in server.log()
        for question, answer in zip(QUESTIONS[:2], answers[:2]):
            text, cached = client.chat(_second(question, answer))
            assert cached > 20, cached  # restored, not prefilled
            assert text == cold(_second(question, answer))
    finally:
        server.stop()


def test_killed_in_the_middle_of_a_park_the_cut_off_entry_is_discarded(model_file, cold):
    server = LiveServer("--model", str(model_file), *OPTIONS, "--inject-fault", "park_copy:1:slow")
    try:
        server.wait_for_health(200)
        client = _Client(server)
        first = client.chat(_first(QUESTIONS[0]))[0]
        client.chat(_first(QUESTIONS[1]))  # parks the first conversation (slowly, committed)
        before = server.log().count("park_copy slowed down")
        # The third parks the second: killed while that copy is under way.
        caller = _Background(lambda: client.chat(_first(QUESTIONS[2])))
        _wait_for_log(server, "park_copy slowed down", seen=before)
        _kill_and_wait(server)
        assert isinstance(caller.result(), openai.APIStatusError)  # the request in the crash fails; nothing else
        recovered, rejected = _recovered(server)
        assert recovered == 1 and rejected.get("cut_off") == 1, (recovered, rejected)
        text, cached = client.chat(_second(QUESTIONS[0], first))
        assert cached > 20 and text == cold(_second(QUESTIONS[0], first))
    finally:
        server.stop()


def test_killed_in_the_middle_of_a_restore_the_entry_is_still_there(model_file, cold):
    server = LiveServer("--model", str(model_file), *OPTIONS, "--inject-fault", "restore_copy:1:slow")
    try:
        server.wait_for_health(200)
        client = _Client(server)
        first = client.chat(_first(QUESTIONS[0]))[0]
        client.chat(_first(QUESTIONS[1]))  # parks the first conversation
        caller = _Background(lambda: client.chat(_second(QUESTIONS[0], first)))
        _wait_for_log(server, "restore_copy slowed down")
        _kill_and_wait(server)
        assert isinstance(caller.result(), openai.APIStatusError)
        recovered, rejected = _recovered(server)
        assert recovered == 1 and not any(rejected.values()), (recovered, rejected)
        # The same request is refused for a while (it was in a crash): the conversation returns with another.
        text, cached = client.chat(_second(QUESTIONS[0], first), max_tokens=9)
        assert cached > 20 and text == cold(_second(QUESTIONS[0], first), max_tokens=9)
    finally:
        server.stop()


class _Background:
    """A call run on a thread; ``result()`` is its return value or the exception it raised."""

    def __init__(self, call):
        import threading

        self._out = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call):
        try:
            self._out = call()
        except Exception as e:  # noqa: BLE001 - handed to the test
            self._out = e

    def result(self, timeout: float = 120):
        self._thread.join(timeout)
        return self._out


def test_a_server_restarted_on_its_directory_restores_and_another_model_or_format_leaves_it_alone(
        model_file, smollm2_file, cold, tmp_path):
    directory = tmp_path / "conversations"
    disk = ["--conversation-cache-dir", str(directory)]
    server = LiveServer("--model", str(model_file), *OPTIONS, *disk)
    try:
        server.wait_for_health(200)
        client = _Client(server)
        answers = [client.chat(_first(q))[0] for q in QUESTIONS[:2]]
    finally:
        server.stop()  # SIGTERM: drains, parks what is on the device, writes it to disk
    assert server.proc.returncode == 0
    assert len(list(directory.glob("*/*.entry"))) == 2, server.log()[-3000:]

    # Another KV format, then another model file: the first's files are another model's, left alone.
    for other in (["--model", str(model_file), "--kv", "int8"], ["--model", str(smollm2_file)]):
        server = LiveServer(*other, *OPTIONS, *disk)
        try:
            server.wait_for_health(200)
            assert not any(_recovered(server)[1].values())
            assert server.http.get("/props").json()["conversation_cache"]["disk_foreign_entries"] >= 2
            assert _Client(server).chat(_second(QUESTIONS[0], answers[0]))[1] == 0
        finally:
            server.stop()
    assert len(list(directory.glob("*/*.entry"))) >= 3  # the first model's two, and what the others parked

    server = LiveServer("--model", str(model_file), *OPTIONS, *disk)
    try:
        server.wait_for_health(200)
        client = _Client(server)
        _wait_for(lambda: sum(s.get("where") == "disk" for s in server.http.get("/slots").json()["slots"]) == 2,
                  "two conversations on disk")
        for question, answer in zip(QUESTIONS[:2], answers):
            text, cached = client.chat(_second(question, answer))
            assert cached > 20 and text == cold(_second(question, answer))
        m = server.metrics()
        assert m["strata_conversation_cache_restored_from_disk_total"] == 2
        assert m["strata_conversation_cache_disk_reads_total"] == 2 and m["strata_conversation_cache_disk_read_bytes_total"] > 0
    finally:
        server.stop()

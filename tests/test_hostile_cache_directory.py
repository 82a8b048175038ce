"""Real ``strata serve`` processes on a conversation cache directory that
someone else has been at (issue 38): things that are not files of the disk
tier, a file swapped for another tenant's while the server runs, a second
server on the same directory, a directory of another user. Each server
serves, ``/health`` tells the truth within the start deadline, and nothing of
another tenant is ever loaded.
"""

from __future__ import annotations

import os
import time

import openai
import pytest
from live_server import LiveServer
from test_disk_tier import _first, _second

import strata_runtime

pytestmark = pytest.mark.slow

OPTIONS = ["--context-length", "512", "--parallel", "1", "--dtype", "float32", "--conversation-cache-mib", "32",
           "--min-free-mib", "0", "--restart-backoff", "0.2", "--start-timeout", "60"]
START_DEADLINE_S = 60


@pytest.fixture(scope="module")
def cold(model_file):
    engine = strata_runtime.load(model_file, dtype="float32", context_length=512, parallel=1,
                                 conversation_cache_mib=0, progress=False)
    return lambda messages: engine.chat(messages, max_tokens=8, temperature=0).text


def _chat(server: LiveServer, key: str, messages):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, timeout=120, max_retries=0)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=8,
                                       temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def _serve(*args: str) -> LiveServer:
    server = LiveServer(*args, "--api-key", "key-b", api_key="key-a")
    server.wait_for_health(200, timeout=START_DEADLINE_S + 30)
    return server


QUESTIONS = {"a1": "Name a river in Europe.", "b1": "What is a prime number?", "a2": "Which planet is largest?"}
KEYS = {"a1": "key-a", "b1": "key-b", "a2": "key-a"}


def test_a_tampered_directory_is_served_around_and_no_tenant_gets_another_ones_state(model_file, cold, tmp_path):
    directory = tmp_path / "conversations"
    disk = ["--model", str(model_file), *OPTIONS, "--conversation-cache-dir", str(directory)]
    server = _serve(*disk)
    try:
        answers = {}
        for name, question in QUESTIONS.items():
            answers[name] = _chat(server, KEYS[name], _first(question))[0]
            time.sleep(0.2)  # each parked (by the next request) and written in turn: mtimes in this order
    finally:
        server.stop()  # parks the last one and writes it
    files = sorted(directory.glob("*/*.entry"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 3, server.log()[-3000:]
    by_name = dict(zip(QUESTIONS, files))  # parked in the order asked
    model_dir = files[0].parent

    # Things that are not files of the tier, under names it reads.
    (model_dir / "x.entry").mkdir()
    (model_dir / "y.tmp").mkdir()
    os.mkfifo(model_dir / "old.entry")
    os.mkfifo(tmp_path / "pipe")
    os.symlink(tmp_path / "pipe", model_dir / "link.entry")

    t0 = time.monotonic()
    server = _serve(*disk)
    try:
        assert time.monotonic() - t0 < START_DEADLINE_S
        stats = server.http.get("/props").json()["conversation_cache"]
        assert stats["disk_entries"] == 3 and stats["rejected_by_reason"] == {"not_a_file": 3, "cut_off": 1}, stats
        assert stats["skipped_by_reason"].get("remove:failed") == 1, stats

        # Tenant B's file put in place of tenant A's first conversation while the server runs.
        os.replace(by_name["b1"], by_name["a1"])
        text, cached = _chat(server, "key-a", _second(QUESTIONS["a1"], answers["a1"]))
        # Not restored (its own would give > 20 tokens): at most the system prompt tenant A's a2 shares.
        assert cached < 20 and text == cold(_second(QUESTIONS["a1"], answers["a1"]))
        text, cached = _chat(server, "key-a", _second(QUESTIONS["a2"], answers["a2"]))  # untouched: restored
        assert cached > 20 and text == cold(_second(QUESTIONS["a2"], answers["a2"]))
        m = server.metrics()
        assert m['strata_conversation_cache_rejected_total{reason="changed"}'] == 1
        assert m["strata_conversation_cache_restored_from_disk_total"] == 1
        assert m["strata_engine_restarts_total"] == 0

        # A second server on the same directory: it serves, without a disk tier, saying why.
        second = _serve("--model", str(model_file), *OPTIONS, "--conversation-cache-dir", str(directory))
        try:
            refused = second.http.get("/props").json()["conversation_cache"].get("disk_refused", "")
            assert "in use by another server" in refused, refused
            assert _chat(second, "key-a", _first("Hello"))[0]
        finally:
            second.stop()
        assert (model_dir / "x.entry").is_dir() and (model_dir / "old.entry").exists()  # nobody deleted them
        assert server.health()[0] == 200
    finally:
        server.stop()


def test_a_directory_of_another_user_is_refused_and_the_server_serves(model_file, tmp_path):
    if os.getuid() != 0:
        pytest.skip("making a directory of another user needs root (this run is not root)")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 12345, 12345)
    server = _serve("--model", str(model_file), *OPTIONS, "--conversation-cache-dir", str(directory))
    try:
        refused = server.http.get("/props").json()["conversation_cache"].get("disk_refused", "")
        assert "owned by uid 12345" in refused, refused
        assert _chat(server, "key-a", _first("Hello"))[0]
        assert list(directory.iterdir()) == []  # nothing written there
        assert "running without a disk tier" in server.log()
    finally:
        server.stop()

"""The supervisor's own tasks, in process, around a real engine child: a job
that cannot be sent fails alone, a dead helper task restarts the engine
instead of leaving requests waiting, and a dead supervisor ends the server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from strata_server.config import ServerConfig
from strata_server.metrics import Metrics
from strata_server.supervisor import Supervisor

OPTIONS = {"context_length": 128, "conversation_cache_mib": 0}


def _command(prompt: str) -> dict:
    return {"kind": "completion", "prompt": prompt, "sampling": {"max_tokens": 2, "temperature": 0},
            "cache_scope": ""}


async def _events(job, timeout: float = 60) -> list:
    out = []
    while True:
        kind, value = await asyncio.wait_for(job.events.get(), timeout)
        out.append((kind, value))
        if kind != "piece":
            return out


async def _until(predicate, timeout: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _run(model_file, scenario) -> None:
    config = ServerConfig(model=str(model_file), engine_options=OPTIONS, restart_backoff_s=0.1, hang_timeout_s=60)
    failed = []

    async def main() -> None:
        sup = Supervisor(config, Metrics(), on_failed=lambda: failed.append(1))
        sup.start()
        try:
            await _until(lambda: sup.answering)
            await scenario(sup, failed)
        finally:
            await sup.stop()

    asyncio.run(main())


def test_a_job_that_cannot_be_sent_fails_alone(model_file):
    async def scenario(sup, failed):
        bad = sup.submit(_command("\ud800"))  # past the HTTP edge's check, as a bug would be
        good = sup.submit(_command("Hello"))
        (kind, error), = await _events(bad)
        assert kind == "error" and error.status == 500 and "could not be sent" in error.message
        assert (await _events(good))[-1][0] == "done"
        assert sup.restarts == 0 and sup.answering

    _run(model_file, scenario)


def test_a_dead_dispatcher_restarts_the_engine_instead_of_stalling(model_file):
    async def scenario(sup, failed):
        first = sup.engine_pid
        dispatcher = next(t for t in asyncio.all_tasks() if t.get_name() == "dispatcher")
        dispatcher.cancel()
        await _until(lambda: sup.engine_pid not in (None, first) and sup.answering)
        assert sup.restarts == 1 and "dispatcher task failed" in sup.last_exit["error"]
        assert (await _events(sup.submit(_command("Hello"))))[-1][0] == "done"
        assert not failed

    _run(model_file, scenario)


def test_a_dead_supervisor_ends_the_server(model_file):
    async def scenario(sup, failed):
        waiting = sup.submit(_command("Hello " * 50))
        await _until(lambda: waiting.taken)  # the engine has it: a suspect of the crash to come
        sup._crashes = None  # a broken invariant: the next crash's bookkeeping raises
        os.kill(sup.engine_pid, signal.SIGKILL)
        await _until(lambda: failed)
        assert sup.state == "failed" and sup.health()[0] == 503
        kind, error = (await _events(waiting))[-1]
        # It was in the engine at a hard crash: a suspect, answered not to be retried.
        assert kind == "error" and error.status == 500 and error.code == "engine_crashed"
        assert error.headers == {"x-should-retry": "false"}

    _run(model_file, scenario)


def test_an_engine_reaped_before_the_event_loop_hears_is_not_answering(model_file):
    """Killed from outside, the child is reaped by asyncio's child-watcher
    thread at once, but its exit code reaches the event loop only on the
    loop's next turn: between the two, ``/proc`` no longer has the process
    and a health probe answered in that turn must not say 200 (a client
    that saw 200 sent its request to an engine restarting). The loop is held
    here (a blocking wait in the loop's own thread) until the process is
    gone from ``/proc``."""
    async def scenario(sup, failed):
        pid = sup._proc.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)  # blocks the loop: the exit code cannot arrive meanwhile
        assert sup._proc.returncode is None  # the loop has not heard
        assert not sup.answering and sup.health()[0] == 503
        await _until(lambda: sup.restarts == 1 and sup.answering)
        assert (await _events(sup.submit(_command("Hello"))))[-1][0] == "done"

    _run(model_file, scenario)

"""The engine process and its keeper.

The engine runs in a child process (``worker.py``). The supervisor starts
it, feeds it requests in arrival order, as many at once as the engine runs
together (its ``parallel``; the rest wait here, a bounded queue), pings it,
and when it
exits or stops answering: logs one line with the exit code and the child's
last error, fails the requests it held with a 503 at once, and starts a new
child straight away (after a backoff of 1 s, 2 s, 4 s, ... capped), not on
the next request. Too many crashes within the window and it gives up, so the
server exits non-zero and a service manager sees the failure.

A crash is answered by cause: the requests that were in the failed work
(the engine names them in its ``fatal`` report or its stuck pong; after a
hard crash, all in flight) get a 500 that clients do not retry, and an
identical request is refused for the restart window (``crash_suspects``);
other requests in flight get a 503 to retry, and requests still waiting here
stay queued for the next engine. Pongs also say how long the engine's main
thread has been in one piece of work: past its bound the engine is stuck
(a kernel, a deadlock) and is killed like a silent one.

The staging pool for parked conversations is the server's: a shared
segment reserved once at start (``strata_runtime.conversations.staging_segment``) and
handed to every engine child, so a crashed engine's parked conversations
are taken back by the next one.

On SIGTERM the server drains (``begin_drain``): new requests get 503, those
accepted are served, and the engine is not restarted if it ends.

Its own tasks are watched too: a task that dies (a bug, not the child)
restarts the child through the same path, so no request waits forever on a
dispatcher that is gone; if the supervising task itself dies, the server
exits loudly instead of answering 503s for ever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from strata_runtime.conversations import MiB, StagingSegment, lock_for_server

from .config import ServerConfig
from .crash_suspects import CrashSuspects
from .engine_exits import ExitAccounting
from .errors import ApiError, unavailable
from .metrics import Metrics
from .protocol import decode, encode

log = logging.getLogger("strata_server.supervisor")
engine_log = logging.getLogger("strata_server.engine")

_LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}


@dataclass
class Job:
    """One request from arrival to its last event.

    Invariant: a job is in the waiting queue, or is in flight (sent to the
    engine), or is finished; ``events`` gets ``("piece", text)`` items (a chat's each after its
    ``("deltas", [...])``: content, reasoning and tool calls read so far) and then exactly one
    ``("done", message)`` or ``("error", ApiError)``."""

    id: int
    command: dict[str, Any]
    arrived: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    cancelled: bool = False
    taken: bool = False  # the engine said it has the request (a dead one cannot: a job it never took is no suspect)


class Supervisor(ExitAccounting):
    """Keeps one engine process alive and serves jobs through it.

    Invariant: at most one job is in flight (sent to the child); ``state`` is
    ``starting`` until the first child is ready, ``ready`` while one is,
    ``restarting`` between a crash and the next ready, ``failed`` after too
    many crashes, ``stopped`` after shutdown."""

    def __init__(self, config: ServerConfig, metrics: Metrics, on_failed: Callable[[], None] = lambda: None):
        self.config = config
        self.metrics = metrics
        self.on_failed = on_failed
        self.state = "starting"
        self.restarts = 0
        self.last_exit: dict[str, Any] | None = None
        self.props: dict[str, Any] | None = None
        self.stats: dict[str, Any] = {}
        self.scheduler: dict[str, Any] = {}  # the engine's latest scheduler counters and figures
        self.slots: list[dict[str, Any]] = []  # and the sequences it holds state for
        self.engine_pid: int | None = None
        self.ready_at: float | None = None
        self._waiting: deque[Job] = deque()
        self._in_flight: dict[int, Job] = {}
        self._next_id = 0
        self._crashes: deque[float] = deque()
        self._proc: asyncio.subprocess.Process | None = None
        self._last_heard = self._started_at = time.monotonic()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._last_error: str | None = None
        self._hung = False
        self._stuck: str | None = None  # how the engine was stuck, when a pong showed it
        # The requests the engine named as in its failed work (None: not named, all in flight are suspects).
        self._suspects: list[int] | None = None
        self.crash_suspects = CrashSuspects(config.restart_window_s)
        self.draining = False
        self.staging: StagingSegment | None = None  # the shared staging pool, reserved at start
        self.disk_lock: int | None = None  # the conversation cache directory's lock, held for every engine
        self._ready_child = False  # whether the current child has said it is ready
        self._start_timed_out = False

    # --- what the HTTP side asks ------------------------------------------

    @property
    def answering(self) -> bool:
        return (self.state == "ready" and time.monotonic() - self._last_heard < self.config.hang_timeout_s
                and self._child_alive())

    def _child_alive(self) -> bool:
        """Whether the engine process still runs: killed from outside (the OOM
        killer, an operator), it is dead before the event loop hears its exit
        code, and no request may be sent to it meanwhile. Dead is a zombie in
        ``/proc``, or no entry there at all: asyncio's child-watcher thread
        reaps the child at once and the exit code reaches the loop a turn
        later (a health probe answered in between said 200)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return False
        try:
            with open(f"/proc/{proc.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except FileNotFoundError:
            return not os.path.isdir("/proc/self")  # reaped; or no /proc here, and the exit code is the word
        except (OSError, IndexError):
            return True
        return state not in (b"Z", b"X")

    def health(self) -> tuple[int, dict[str, Any]]:
        history = {"restarts": self.restarts, "last_exit": self.last_exit}
        if self.draining:
            return 503, {"status": "stopping", **history}
        if self.answering:
            # After a restart, an operator (and a test polling slower than the restart) still sees why.
            return 200, {"status": "ok"} if self.restarts == 0 else {"status": "ok", **history}
        status = "restarting" if self.state == "ready" else self.state
        return 503, {"status": status, **history}

    def submit(self, command: dict[str, Any]) -> Job:
        """Queue a request; a 503 when no engine is answering or the queue is
        full, a 422 when an identical request was in a crash of the engine."""
        refusal = self.crash_suspects.refusal(command)
        if refusal is not None:
            self.metrics.crash_refusals.inc()
            raise ApiError(422, refusal, "invalid_request_error", "request_crashed_engine")
        if self.draining:
            raise unavailable("the server is shutting down; retry shortly", "server_stopping")
        if not self.answering:
            raise unavailable(f"the engine is {self.health()[1]['status']}; retry shortly", "engine_unavailable")
        if len(self._in_flight) >= self.parallel and len(self._waiting) >= self.config.max_queue:
            raise unavailable(f"the server is busy ({len(self._in_flight)} requests in flight, "
                              f"{len(self._waiting)} waiting); retry shortly", "queue_full")
        self._next_id += 1
        job = Job(self._next_id, {**command, "op": "generate", "id": self._next_id})
        self._waiting.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it if it runs."""
        if job.finished or job.cancelled:
            return
        job.cancelled = True
        self.metrics.cancelled.inc()
        if job in self._waiting:
            self._waiting.remove(job)
            self.metrics.queue_depth.set(len(self._waiting))
            job.finished = True
        elif job.id in self._in_flight:
            self._send({"op": "cancel", "id": job.id})

    @property
    def parallel(self) -> int:
        """Requests the engine runs together (its ``props``), 1 before it has said."""
        return int((self.props or {}).get("parallel", 1))

    @property
    def idle(self) -> bool:
        """No request in flight or waiting: a drain is over."""
        return not self._in_flight and not self._waiting

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queue_length(self) -> int:
        """Requests waiting here for the engine to take them."""
        return len(self._waiting)

    # --- life cycle ------------------------------------------------------------

    def start(self) -> None:
        self._reserve_staging()
        self._lock_cache_directory()
        self._task = asyncio.create_task(self._supervise(), name="supervisor")
        self._task.add_done_callback(self._supervisor_ended)

    def _reserve_staging(self) -> None:
        """The staging pool, reserved here once for every engine this server
        starts (admitted against the host as the engine would have)."""
        options = self.config.engine_options
        mib = options.get("conversation_cache_mib", 1024)
        if not mib or self.staging is not None:
            return
        self.staging, decision = StagingSegment.reserve(
            mib * MiB, min_free_bytes=options.get("min_free_mib", 1024) * MiB,
            strict=bool(options.get("strict_conversation_cache", False)))
        log.info("%s", decision.message)

    def _lock_cache_directory(self) -> None:
        """The disk tier's directory, locked here once for every engine this
        server starts (a second server on it is refused; engines between
        restarts keep it). Refused here, each engine runs without a disk tier."""
        directory = self.config.engine_options.get("conversation_cache_dir")
        if directory is None or not self.config.engine_options.get("conversation_cache_mib", 1024):
            return
        self.disk_lock, refusal = lock_for_server(directory)
        if refusal is not None:
            log.warning("conversation cache: no disk tier: %s", refusal)

    def _supervisor_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.critical("the supervisor task died (%s: %s); the server exits so its service manager restarts it",
                     type(error).__name__, error, exc_info=error)
        self.state = "failed"
        self._fail_jobs(unavailable("the server is shutting down after an internal error; retry shortly",
                                    "server_failed"))
        self.on_failed()

    def begin_drain(self) -> None:
        """SIGTERM: take no new requests, serve the accepted ones, restart nothing."""
        if not self.draining:
            log.warning("SIGTERM: draining (new requests get 503; %d in flight and %d waiting are served for up to "
                        "%.0f s)", len(self._in_flight), len(self._waiting), self.config.shutdown_grace_s)
        self.draining = True

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._send({"op": "shutdown"})
            try:
                # It parks what is on the device and finishes its disk writes first (worker.PERSIST_TIMEOUT_S).
                await asyncio.wait_for(proc.wait(), timeout=30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self.staging is not None:
            self.staging.close()  # the last descriptor: the memory goes back to the host
            self.staging = None
        if self.disk_lock is not None:
            os.close(self.disk_lock)
            self.disk_lock = None
        if self.state != "failed":
            self.state = "stopped"

    async def _supervise(self) -> None:
        while not self._stopping:
            code = await self._run_child()
            self.last_exit = self._describe_exit(code)
            if self._stopping or self.draining:
                if self._suspects:
                    # The engine named requests in a failure before it ended: the crash, not the stop, ended
                    # them (a stop that came with the crash, as torchrun stops every rank when one dies).
                    others = {i: j for i, j in self._in_flight.items() if i not in self._suspects}
                    self._in_flight = {i: j for i, j in self._in_flight.items() if i in self._suspects}
                    self._settle_in_flight()
                    self._in_flight = others
                self._fail_jobs(unavailable("the server is shutting down; retry shortly", "server_stopping"))
                return
            self._settle_in_flight()
            now = time.monotonic()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > self.config.restart_window_s:
                self._crashes.popleft()
            if len(self._crashes) >= self.config.max_restarts:
                self.state = "failed"
                self._fail_jobs(unavailable("the server is shutting down after repeated engine crashes",
                                            "server_failed"))
                log.error("engine exited %s; last error: %s; that is %d crashes in %.0f s: giving up, "
                          "the server exits so its service manager sees the failure",
                          self.last_exit["reason"], self.last_exit["error"],
                          len(self._crashes), self.config.restart_window_s)
                self.on_failed()
                return
            delay = min(self.config.restart_backoff_s * 2 ** (len(self._crashes) - 1), self.config.restart_backoff_max_s)
            self.state = "restarting"
            self.restarts += 1
            self.metrics.restarts.inc()
            log.error("engine exited %s; last error: %s; restarting in %.1f s (crash %d of %d allowed in %.0f s)",
                      self.last_exit["reason"], self.last_exit["error"], delay,
                      len(self._crashes), self.config.max_restarts, self.config.restart_window_s)
            await asyncio.sleep(delay)

    async def _run_child(self) -> int:
        """Start one engine process, serve through it until it exits; its exit code."""
        staging = self.staging
        spec = json.dumps({"model": self.config.model, "options": self.config.engine_options,
                           "faults": list(self.config.faults), "stall_timeout_s": self.config.stall_timeout_s,
                           "staging": None if staging is None else staging.describe(), "disk_lock": self.disk_lock})
        self._last_error, self._hung, self._stuck, self._suspects = None, False, None, None
        self._ready_child, self._start_timed_out = False, False
        fds = () if staging is None or staging.refused else (staging.fd,)
        # Its own session: a signal to the server's process group (Ctrl-C, a
        # service manager) reaches the server, which stops the engine in order.
        self._proc = proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "strata_server.worker", spec,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            limit=64 << 20, start_new_session=True,
            pass_fds=fds + (() if self.disk_lock is None else (self.disk_lock,)),
        )
        self._last_heard = self._started_at = time.monotonic()
        log.info("engine process %d started", proc.pid)
        readers = [asyncio.create_task(self._read_events(proc.stdout), name="engine events"),
                   asyncio.create_task(self._read_log(proc.stderr, proc.pid), name="engine log")]
        helpers = [asyncio.create_task(self._ping(proc), name="ping"),
                   asyncio.create_task(self._dispatch(), name="dispatcher")]
        code = await self._wait_watching(proc, readers + helpers)
        self.state = "restarting" if self.state == "ready" else self.state
        self.engine_pid = None
        self.metrics.engine_up.set(0)
        await asyncio.wait(readers, timeout=2)  # what it wrote before dying still counts
        for task in readers + helpers:
            task.cancel()
        return code

    async def _wait_watching(self, proc: asyncio.subprocess.Process, tasks: list[asyncio.Task]) -> int:
        """The child's exit code. A task of ours that fails before then kills
        the child, so its jobs are failed and everything starts afresh."""
        exited = asyncio.ensure_future(proc.wait())
        watched = set(tasks)
        while True:
            done, _ = await asyncio.wait({exited, *watched}, return_when=asyncio.FIRST_COMPLETED)
            if exited in done:
                return exited.result()
            for task in done:
                watched.discard(task)
                error = None if task.cancelled() else task.exception()
                if not task.cancelled() and error is None and task.get_name() != "dispatcher":
                    continue  # a pipe closed, or ping killed a hung child: the child is exiting
                log.error("the server's %r task ended (%s); restarting engine process %d so no request waits on it",
                          task.get_name(), "no error" if error is None else f"{type(error).__name__}: {error}",
                          proc.pid, exc_info=error)
                self._last_error = f"the server's {task.get_name()} task failed"
                if proc.returncode is None:
                    proc.kill()

    # --- talking to the child ----------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        """Write one message to the child. A message that cannot be encoded raises."""
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return
        data = encode(message)
        try:
            proc.stdin.write(data)
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass  # it is exiting; the exit path fails its jobs

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.state == "ready" and len(self._in_flight) < self.parallel and self._waiting:
                job = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
                self._in_flight[job.id] = job
                try:
                    self._send(job.command)
                except Exception as e:  # this job cannot be sent: fail it, serve the next
                    log.exception("request %d could not be sent to the engine", job.id)
                    del self._in_flight[job.id]
                    job.finished = True
                    job.events.put_nowait(("error", ApiError(
                        500, f"internal error: the request could not be sent to the engine ({type(e).__name__})",
                        "server_error")))

    async def _ping(self, proc: asyncio.subprocess.Process) -> None:
        seq = 0
        while proc.returncode is None:
            await asyncio.sleep(self.config.ping_interval_s)
            if not self._ready_child and time.monotonic() - self._started_at > self.config.start_timeout_s:
                log.error("engine process %d is not ready %.0f s after it started (a hung mount, a stuck device?); "
                          "killing it", proc.pid, self.config.start_timeout_s)
                self._start_timed_out = True
                proc.kill()
                return
            silent = time.monotonic() - self._last_heard
            if silent > self.config.hang_timeout_s:
                log.error("engine process %d has not answered for %.1f s; killing it", proc.pid, silent)
                self._hung = True
                proc.kill()
                return
            seq += 1
            self._send({"op": "ping", "seq": seq})

    async def _read_events(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            self._last_heard = time.monotonic()
            try:
                event = decode(line)
            except ValueError:
                log.error("engine sent a malformed line: %r", line[:200])
                continue
            self._on_event(event)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        if kind == "ready":
            self.props, self.engine_pid, self.stats = event["props"], event["pid"], event["stats"]
            self.scheduler, self.slots = {}, []
            self.ready_at = time.time()
            self._ready_child = True
            self.state = "ready"
            self.metrics.engine_up.set(1)
            log.info("engine process %d ready (%s, restarts so far %d)", self.engine_pid, self.props.get("model"),
                     self.restarts)
            self._wake.set()
        elif kind == "fatal":
            self._last_error = event.get("message")
            self._suspects = event.get("suspects")
        elif kind == "taken":
            job = self._in_flight.get(event.get("id"))
            if job is not None:
                job.taken = True
        elif kind == "pong":
            busy, bound = event.get("busy_s", 0.0), event.get("bound_s", 0.0)
            if bound > 0 and busy > bound and self._stuck is None:
                self._kill_stuck(busy, bound, event.get("requests") or [])
        elif kind == "state":
            self.scheduler, self.slots = event.get("scheduler") or {}, event.get("slots") or []
            self.stats = event.get("stats") or self.stats
        elif kind in ("piece", "done", "error"):
            job = self._in_flight.get(event.get("id"))
            if job is None:
                return
            if kind == "piece":
                if event.get("deltas"):  # a chat's reply read so far, ahead of the text it came with
                    job.events.put_nowait(("deltas", event["deltas"]))
                job.events.put_nowait(("piece", event["text"]))
                if event.get("logprobs"):  # its tokens' log-probabilities, where the request asked
                    job.events.put_nowait(("logprobs", event["logprobs"]))
                return
            if kind == "done":
                self.stats = event.get("stats") or self.stats
                self.scheduler = event.get("scheduler") or self.scheduler
                job.events.put_nowait(("done", event))
            else:
                headers = {"x-should-retry": "false"} if event.get("retry") is False else None
                job.events.put_nowait(("error", ApiError(event["status"], event["message"], event["type"],
                                                         event.get("code"), headers)))
            job.finished = True
            del self._in_flight[job.id]
            self._wake.set()

    async def _read_log(self, stream: asyncio.StreamReader, pid: int) -> None:
        """Re-log the child's stderr as ours, remembering its last error."""
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            level = _LEVELS.get(line.split(" ", 1)[0], logging.INFO)
            if level >= logging.ERROR or _looks_like_exception(line):
                self._last_error = line
            engine_log.log(level, "engine[%d] %s", pid, line)

def _looks_like_exception(line: str) -> bool:
    head = line.split(":", 1)[0]
    return head.endswith(("Error", "Exception")) and " " not in head

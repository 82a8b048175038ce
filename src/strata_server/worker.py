"""The engine process: one ``Engine``, requests in on stdin, events out.

Run by the supervisor as ``python -m strata_server.worker SPEC`` (SPEC: a
JSON object with ``model`` and ``options`` for ``strata_runtime.load``). A
reader thread answers pings and takes cancels at once, even while the main
thread is generating; the main thread starts each request as it arrives and
steps the engine's scheduler, every request in flight advancing together,
sending each one's text as it comes and the scheduler's state after each
step (for ``/slots`` and the metrics). When stdin closes (the supervisor is
gone) the process exits.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from typing import Any, BinaryIO

from .protocol import decode, encode

log = logging.getLogger("strata_server.worker")


class Channel:
    """The event pipe to the supervisor. Both threads write, so writes are locked."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self._lock = threading.Lock()

    def send(self, **message: Any) -> None:
        data = encode(message)
        with self._lock:
            self._out.write(data)
            self._out.flush()


def _claim_stdout() -> BinaryIO:
    """Keep the original stdout for events; send fd 1 (and ``print``) to stderr."""
    events = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return events


def _read_commands(stdin: BinaryIO, channel: Channel, inbox: "queue.Queue[dict | None]", cancelled: set) -> None:
    for line in stdin:
        try:
            command = decode(line)
        except ValueError:
            log.error("ignoring a malformed command: %r", line[:200])
            continue
        op = command.get("op")
        if op == "ping":
            channel.send(ev="pong", seq=command.get("seq"))
        elif op == "cancel":
            cancelled.add(command["id"])
        elif op == "generate":
            inbox.put(command)
        elif op == "shutdown":
            inbox.put(None)
            return
    # stdin closed: the supervisor is gone, nobody is left to serve.
    os._exit(0)


class Requests:
    """The requests in flight: each a ``Run`` of the engine, by request id.

    Invariant: every id in ``active`` has had no ``done`` or ``error`` event
    yet; its run's sequence is in the engine's scheduler."""

    STATE_EVERY_S = 0.25  # the scheduler's state is sent at most this often while busy

    def __init__(self, engine, channel: Channel, cancelled: set):
        self.engine = engine
        self.channel = channel
        self.cancelled = cancelled
        self.active: dict[int, Any] = {}
        self._state_sent = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.active) or self.engine.scheduler.busy

    def start(self, command: dict[str, Any]) -> None:
        """Tokenize and queue one request, or answer its error."""
        from strata_runtime import (Cancelled, ChatTemplateError, ContextLengthError, QueueFull,
                                    StrataError)

        rid = command["id"]
        if rid in self.cancelled:  # cancelled before it started
            self.cancelled.discard(rid)
            _send_done(self.channel, rid, self.engine, None)
            return
        # Asked between chunks of tokenizing, so a client that left stops costing engine time.
        options = {"abort": lambda: rid in self.cancelled, "cache_scope": command.get("cache_scope", ""),
                   **command["sampling"]}
        try:
            if command["kind"] == "chat":
                run = self.engine.submit(messages=command["messages"], **options)
            else:
                run = self.engine.submit(command["prompt"], **options)
        except Cancelled as e:
            log.info("request %s stopped: %s", rid, e)
            self.cancelled.discard(rid)
            _send_done(self.channel, rid, self.engine, None)
            return
        except QueueFull as e:
            self.channel.send(ev="error", id=rid, status=503, type="server_error", code="queue_full", message=str(e))
            return
        except ContextLengthError as e:
            self.channel.send(ev="error", id=rid, status=400, type="invalid_request_error",
                              code="context_length_exceeded", message=str(e))
            return
        except (StrataError, ChatTemplateError, ValueError, TypeError) as e:
            self.channel.send(ev="error", id=rid, status=400, type="invalid_request_error", code=None, message=str(e))
            return
        self.active[rid] = run

    def step(self) -> None:
        """One scheduler step, then each request's new text; ``done`` for those that ended."""
        for rid, run in self.active.items():
            if rid in self.cancelled and not run.seq.done:
                log.info("request %s stopped: %s", rid, run.seq.progress())
                run.seq.cancel("cancelled")
        scheduler = self.engine.scheduler
        try:
            scheduler.step()
        except Exception as e:  # the step's requests get a 500; the engine goes on with the next ones
            log.exception("a scheduler step failed")
            for rid, run in list(self.active.items()):
                if run.seq.state != "waiting":
                    run.seq.cancel("error")
                    self.channel.send(ev="error", id=rid, status=500, type="server_error", code=None,
                                      message=f"the engine failed on this request ({type(e).__name__}: {e})")
                    del self.active[rid]
                    self.cancelled.discard(rid)
            scheduler.retire()
        for rid, run in list(self.active.items()):
            piece = run.pump()
            if piece:
                self.channel.send(ev="piece", id=rid, text=piece)
            if run.completion is not None:
                del self.active[rid]
                self.cancelled.discard(rid)
                _send_done(self.channel, rid, self.engine, run.completion)
        now = time.monotonic()
        if now - self._state_sent >= self.STATE_EVERY_S or not self.busy:
            self.send_state()

    def send_state(self) -> None:
        self._state_sent = time.monotonic()
        self.channel.send(ev="state", scheduler=self.engine.scheduler.stats(), slots=self.engine.scheduler.slots())


def _send_done(channel: Channel, rid: int, engine, completion) -> None:
    """``completion`` None: the request was cancelled before it started."""
    c = completion
    channel.send(ev="done", id=rid, finish_reason="cancelled" if c is None else c.finish_reason,
                 prompt_tokens=0 if c is None else c.prompt_tokens,
                 completion_tokens=0 if c is None else c.completion_tokens,
                 cached_tokens=0 if c is None else c.cached_tokens, stats=engine.stats(),
                 scheduler=engine.scheduler.stats())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    channel = Channel(_claim_stdout())
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    inbox: queue.Queue[dict | None] = queue.Queue()
    cancelled: set = set()
    threading.Thread(target=_read_commands, args=(sys.stdin.buffer, channel, inbox, cancelled),
                     name="commands", daemon=True).start()
    for fault in spec.get("faults", ()):
        _arm(fault)
    try:
        from strata_runtime import load

        engine = load(spec["model"], progress=False, **spec["options"])
        engine.tokenizer.prepare()  # not on the first long request
    except Exception as e:
        log.error("the engine could not start: %s: %s", type(e).__name__, e)
        channel.send(ev="fatal", message=f"{type(e).__name__}: {e}")
        return 1
    channel.send(ev="ready", pid=os.getpid(), props=engine.props(), stats=engine.stats())
    requests = Requests(engine, channel, cancelled)
    requests.send_state()
    while True:
        # Wait for work when there is none; otherwise take what has arrived and step.
        try:
            command = inbox.get(block=not requests.busy)
        except queue.Empty:
            command = _NOTHING
        while command is not _NOTHING:
            if command is None:
                return 0
            requests.start(command)
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                command = _NOTHING
        if requests.busy:
            requests.step()


_NOTHING = object()  # no command waiting


_ARMED: list = []


def _arm(fault: str) -> None:
    """``--inject-fault POINT[:RATE]``, armed for the life of this process."""
    from strata_runtime.testing import inject_fault

    point, _, rate = fault.partition(":")
    armed = inject_fault(point, rate=float(rate or 1.0), seed=os.getpid())
    armed.__enter__()
    _ARMED.append(armed)  # held: a collected context manager would disarm it
    log.warning("fault injection: %s fails with out-of-memory on %s of its calls", point,
                f"{float(rate):.0%}" if rate else "all")


if __name__ == "__main__":
    code = main()
    # The command thread may be blocked reading stdin; a normal interpreter
    # shutdown would abort on its lock. Everything worth keeping is flushed.
    sys.stderr.flush()
    os._exit(code)

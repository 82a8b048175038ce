"""The engine process: one ``Engine``, requests in on stdin, events out.

Run by the supervisor as ``python -m strata_server.worker SPEC`` (SPEC: a
JSON object with ``model`` and ``options`` for ``strata_runtime.load``, and
``staging``: the shared staging segment the server holds, its descriptor
passed open). A
reader thread answers pings and takes cancels at once, even while the main
thread is generating; the main thread starts each request as it arrives and
steps the engine's scheduler, every request in flight advancing together,
sending each one's text as it comes and the scheduler's state after each
step (for ``/slots`` and the metrics). When stdin closes (the supervisor is
gone) the process exits.

Failures (``strata_runtime.faults``): a request's bad arguments are its 400;
a step that ran out of memory fails that step's requests and the engine goes
on; anything else (a device error, a lost rank, a broken invariant) is
reported as ``fatal`` with the requests that were in it, and the process
exits ``EXIT_FATAL`` so the supervisor starts a fresh engine. Pongs say how
long the main thread has been in its current piece of work, so a stuck one
is seen though the reader thread still answers.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
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


def _read_commands(stdin: BinaryIO, channel: Channel, inbox: "queue.Queue[dict | None]", cancelled: set,
                   progress: "Progress") -> None:
    for line in stdin:
        try:
            command = decode(line)
        except ValueError:
            log.error("ignoring a malformed command: %r", line[:200])
            continue
        op = command.get("op")
        if op == "ping":
            channel.send(ev="pong", seq=command.get("seq"), **progress.report())
        elif op == "cancel":
            cancelled.add(command["id"])
        elif op == "generate":
            channel.send(ev="taken", id=command.get("id"))  # from here on, this engine has it
            inbox.put(command)
        elif op == "shutdown":
            inbox.put(None)
            return
    # stdin closed: the supervisor is gone, nobody is left to serve.
    os._exit(0)


class Fatal(Exception):
    """A failure the engine must not outlive: its state may be half-written or
    a part of it (a device, a rank) is gone. ``suspects``: the requests in
    flight in the failed work (the supervisor answers them as the likely cause)."""

    def __init__(self, cause: BaseException, suspects: list[int]):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.suspects = suspects


class Progress:
    """What the main thread is working on, for the reader thread's pongs (the
    supervisor's watchdog: a main thread stuck in a kernel, a deadlock or a
    runaway loop still answers pings from the reader thread).

    Invariant: ``since`` is None while the main thread waits for commands;
    otherwise it is when the current piece of work began (one request's
    tokenizing, or one scheduler step), which may take ``bound_s`` (scaled by
    the tokens or characters it handles, and by the slowest seconds per token
    seen so far: a large model on a small CPU is slow, not stuck), serving
    ``requests``."""

    UNITS = 256  # each this many tokens (or 4x as many characters) of work allow one more ``stall_s``
    MEASURED_FROM = 16  # steps of at least this many tokens measure the engine's pace
    MARGIN = 4  # a step may run this many times the slowest pace seen

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self.since: float | None = None
        self.bound_s = 0.0
        self.requests: list[int] = []
        self._tokens = 0
        self.slowest_s_per_token = 0.0

    def begin(self, tokens: int, requests: list[int]) -> None:
        with self._lock:
            self.since = time.monotonic()
            self._tokens = tokens
            self.bound_s = (self.stall_s * (1 + tokens / self.UNITS)
                            + self.MARGIN * self.slowest_s_per_token * tokens)
            self.requests = requests

    def end(self) -> None:
        with self._lock:
            if self.since is not None and self._tokens >= self.MEASURED_FROM:
                pace = (time.monotonic() - self.since) / self._tokens
                self.slowest_s_per_token = max(self.slowest_s_per_token, pace)
            self.since = None

    def report(self) -> dict[str, Any]:
        with self._lock:
            busy = 0.0 if self.since is None else time.monotonic() - self.since
            return {"busy_s": round(busy, 3), "bound_s": round(self.bound_s, 3), "requests": list(self.requests)}


class Requests:
    """The requests in flight: each a ``Run`` of the engine, by request id.

    Invariant: every id in ``active`` has had no ``done`` or ``error`` event
    yet; its run's sequence is in the engine's scheduler."""

    STATE_EVERY_S = 0.25  # the scheduler's state is sent at most this often while busy

    def __init__(self, engine, channel: Channel, cancelled: set, progress: Progress):
        self.engine = engine
        self.channel = channel
        self.cancelled = cancelled
        self.progress = progress
        self.active: dict[int, Any] = {}
        self.choice_groups: dict[str, Any] = {}  # a request's first choice's run, while its other choices start
        self._state_sent = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.active) or self.engine.scheduler.busy

    def start(self, command: dict[str, Any]) -> None:
        """Tokenize and queue one request, or answer its error. Only argument
        checks are the client's fault (400); anything else is logged with its
        traceback and answered 500 (tokenizing touches no engine state)."""
        from strata_runtime import Cancelled, QueueFull

        rid = command["id"]
        if rid in self.cancelled:  # cancelled before it started
            self.cancelled.discard(rid)
            _send_done(self.channel, rid, self.engine, None)
            return
        if command["kind"] in ("tokenize", "detokenize"):
            self._tokens(rid, command)
            return
        # Asked between chunks of tokenizing, so a client that left stops costing engine time.
        options = {"abort": lambda: rid in self.cancelled, "cache_scope": command.get("cache_scope", ""),
                   **command["sampling"]}
        text = command["messages"] if command["kind"] == "chat" else command["prompt"]
        self.progress.begin(len(json.dumps(text)) // 4, [rid])
        try:
            group = command.get("choice_group")
            if group is not None and command.get("choice", 0):  # a later choice copies the first's prompt state
                options["sibling_of"] = self.choice_groups.get(group)
            if command["kind"] == "chat":
                tools = {k: command[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
                         if k in command}
                run = self.engine.submit(messages=command["messages"], **options, **tools)
            else:
                run = self.engine.submit(command["prompt"], **options)
            if group is not None:
                if command.get("choice", 0) == 0:
                    self.choice_groups[group] = run
                if command.get("choice", 0) >= command.get("choices", 1) - 1:
                    self.choice_groups.pop(group, None)
        except Cancelled as e:
            log.info("request %s stopped: %s", rid, e)
            self.cancelled.discard(rid)
            _send_done(self.channel, rid, self.engine, None)
            return
        except QueueFull as e:
            self.channel.send(ev="error", id=rid, status=503, type="server_error", code="queue_full", message=str(e))
            return
        except Exception as e:
            self._refuse(rid, e, "failed before it was queued")
            return
        finally:
            self.progress.end()
        self.active[rid] = run

    def _tokens(self, rid: int, command: dict[str, Any]) -> None:
        """Answer a ``tokenize`` (a prompt's ids, or a chat's prompt as ``chat``
        would read it) or ``detokenize`` command at once, as a ``done`` event
        with ``tokens`` / ``text``; argument errors are its 400."""
        from strata_runtime.errors import RequestError

        engine = self.engine
        try:
            if command["kind"] == "detokenize":
                ids = command["tokens"]
                vocab = engine.tokenizer.vocab.size
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"token id {bad[0]} is out of range; the vocabulary has {vocab} tokens")
                answer = {"text": engine.tokenizer.decode(ids, special=True), "tokens": ids}
            elif "messages" in command:
                ids, _ = engine.chat_request_prompt(command["messages"], command.get("tools"),
                                                    command.get("tool_choice"), command.get("parallel_tool_calls", True),
                                                    command.get("chat_template_kwargs"))
                answer = {"tokens": ids}
            else:
                ids = engine.tokenize(command["prompt"], add_bos=command.get("add_special_tokens", True))
                answer = {"tokens": ids}
        except Exception as e:
            self._refuse(rid, e, "could not be tokenized")
            return
        self.channel.send(ev="done", id=rid, finish_reason="stop", prompt_tokens=len(answer["tokens"]),
                          completion_tokens=0, cached_tokens=0, stats=engine.stats(),
                          scheduler=engine.scheduler.stats(), **answer)

    def step(self) -> None:
        """One scheduler step, then each request's new text; ``done`` for
        those that ended. A step that ran out of memory fails its requests
        (503, retry) and the engine goes on: their state was dropped, the rest
        is whole. Any other failure raises ``Fatal``."""
        from strata_runtime.faults import StepFailed

        for rid, run in self.active.items():
            if rid in self.cancelled and not run.seq.done:
                log.info("request %s stopped: %s", rid, run.seq.progress())
                run.seq.cancel("cancelled")
        scheduler = self.engine.scheduler
        stepping = [rid for rid, run in self.active.items() if run.seq.state != "waiting"]
        self.progress.begin(_step_tokens(scheduler), stepping or list(self.active))
        try:
            scheduler.step()
        except StepFailed as e:
            failed = [rid for rid, run in self.active.items() if run.seq.id in e.sequences]
            if not e.out_of_memory:
                raise Fatal(e.__cause__ or e, failed) from e
            log.warning("a step ran out of memory (%s); its requests %s fail, the engine goes on", e, failed)
            for rid in failed:
                self.channel.send(ev="error", id=rid, status=503, type="server_error", code="out_of_memory",
                                  message=f"the engine ran out of memory on this request's step ({e.__cause__}); "
                                          "retry shortly, or with a shorter prompt")
                del self.active[rid]
                self.cancelled.discard(rid)
        except Exception as e:  # outside any one step's forward: the scheduler itself is broken
            raise Fatal(e, stepping or list(self.active)) from e
        finally:
            self.progress.end()
        for rid, run in list(self.active.items()):
            try:
                piece = run.pump()
            except Exception as e:  # this request's text (a bug): it ends, the engine's state is whole
                log.exception("request %s: its text could not be made", rid)
                run.seq.cancel("error")
                del self.active[rid]
                self._internal_error(rid, e)
                continue
            deltas, logprobs = run.take_deltas(), run.take_logprobs()
            if piece or deltas or logprobs:
                # A chat's pieces carry its reply read so far (content, reasoning, tool calls), and each piece the
                # log-probabilities of its tokens where the request asked.
                extra = {"deltas": deltas} if deltas else {}
                if logprobs:
                    extra["logprobs"] = [self._token_logprobs(*entry) for entry in logprobs]
                self.channel.send(ev="piece", id=rid, text=piece, **extra)
            if run.completion is not None:
                del self.active[rid]
                self.cancelled.discard(rid)
                _send_done(self.channel, rid, self.engine, run.completion)
        now = time.monotonic()
        if now - self._state_sent >= self.STATE_EVERY_S or not self.busy:
            self.send_state()

    def _token_logprobs(self, token: int, logprob: float, alternatives: list) -> dict[str, Any]:
        """One token's entry as OpenAI's chat logprobs write it (its text, UTF-8 bytes, the likeliest alternatives)."""
        def spelled(t: int) -> dict[str, Any]:
            data = self.engine.tokenizer.token_bytes(t, special=True)
            return {"token": data.decode("utf-8", errors="replace"), "bytes": list(data)}

        return {**spelled(token), "logprob": logprob,
                "top_logprobs": [{**spelled(t), "logprob": lp} for t, lp in alternatives]}

    def _refuse(self, rid: int, e: BaseException, what: str) -> None:
        """A request that failed before it ran: its own error (``RequestError``) is
        its 400 (the context's code where it is that); anything else is ours, a 500, logged."""
        from strata_runtime.errors import ContextLengthError, RequestError

        if not isinstance(e, RequestError):
            log.exception("request %s %s (an internal error, not the request's)", rid, what)
            self._internal_error(rid, e)
            return
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        self.channel.send(ev="error", id=rid, status=400, type="invalid_request_error", code=code, message=str(e))

    def _internal_error(self, rid: int, e: BaseException) -> None:
        """A 500 the client should not retry as is: the same request would fail the same way."""
        self.cancelled.discard(rid)
        self.channel.send(ev="error", id=rid, status=500, type="server_error", code="internal_error", retry=False,
                          message=f"internal error while serving this request ({type(e).__name__}: {e}); "
                                  "the server log has the traceback")

    def refuse_stopping(self, rid: int) -> None:
        self.channel.send(ev="error", id=rid, status=503, type="server_error", code="engine_stopping",
                          message="the engine is shutting down; retry shortly")

    def send_state(self) -> None:
        self._state_sent = time.monotonic()
        self.channel.send(ev="state", scheduler=self.engine.scheduler.stats(), slots=self.engine.scheduler.slots(),
                          stats=self.engine.stats())


def _step_tokens(scheduler) -> int:
    """At most how many tokens the next step reads: a row per decoding
    sequence, and up to a chunk of the prompts still to read."""
    decoding = sum(s.state == "decoding" for s in scheduler.running)
    unread = sum(len(s.tokens) - (s.cache.length if s.cache is not None else 0)
                 for s in (*scheduler.running, *scheduler.waiting) if s.state != "decoding")
    return decoding + min(unread, scheduler.chunk_tokens)


def _send_done(channel: Channel, rid: int, engine, completion) -> None:
    """``completion`` None: the request was cancelled before it started."""
    c = completion
    reply = None
    if c is not None and c.reply is not None:
        r = c.reply
        reply = {"content": r.content, "reasoning_content": r.reasoning,
                 "tool_calls": [call.as_openai() for call in r.tool_calls]}
    channel.send(ev="done", id=rid, finish_reason="cancelled" if c is None else c.finish_reason, reply=reply,
                 prompt_tokens=0 if c is None else c.prompt_tokens,
                 completion_tokens=0 if c is None else c.completion_tokens,
                 cached_tokens=0 if c is None else c.cached_tokens, stats=engine.stats(),
                 scheduler=engine.scheduler.stats())


EXIT_FATAL = 70  # EX_SOFTWARE: the engine ended itself after a failure it must not outlive
IDLE_POLL_S = 0.2
PERSIST_TIMEOUT_S = 20.0  # how long a stopping engine waits for the disk tier's writes (the supervisor waits longer)  # how often an idle main thread looks at the SIGTERM flag


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    channel = Channel(_claim_stdout())
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (a service manager stopping everything in the server's cgroup)
    # drains: requests in flight finish, new ones are turned away, then exit 0.
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    inbox: queue.Queue[dict | None] = queue.Queue()
    cancelled: set = set()
    progress = Progress(float(spec.get("stall_timeout_s", 60.0)))
    threading.Thread(target=_read_commands, args=(sys.stdin.buffer, channel, inbox, cancelled, progress),
                     name="commands", daemon=True).start()
    faults = [_parse_fault(f) for f in spec.get("faults", ())]
    for point, rate, kind, marker in faults:
        if marker is None:
            _arm(point, rate, kind)
    try:
        from strata_runtime import load
        from strata_runtime.conversations import StagingSegment

        # The staging pool the server holds for every engine it starts: what an earlier one parked is taken back.
        staging = StagingSegment.attach(spec["staging"]) if spec.get("staging") else None
        # The disk tier's directory lock, held by the server for every engine it starts.
        engine = load(spec["model"], progress=False, staging=staging, disk_lock=spec.get("disk_lock"),
                      **spec["options"])
        engine.tokenizer.prepare()  # not on the first long request
    except Exception as e:
        log.error("the engine could not start: %s: %s", type(e).__name__, e)
        channel.send(ev="fatal", message=f"{type(e).__name__}: {e}", suspects=[])
        return 1
    for point, rate, kind, marker in faults:
        if marker is not None:
            _arm(point, rate, kind, _contains(engine.tokenizer.encode(marker, add_bos=False)), marker)
    channel.send(ev="ready", pid=os.getpid(), props=engine.props(), stats=engine.stats())
    requests = Requests(engine, channel, cancelled, progress)
    requests.send_state()
    try:
        code = _serve(inbox, requests, stopping)
    except Fatal as e:
        log.critical("the engine cannot go on after %s (requests %s were in it); exiting so that the supervisor "
                     "starts a fresh one", e, e.suspects, exc_info=e.cause)
        channel.send(ev="fatal", message=str(e)[:500], suspects=e.suspects)
        return EXIT_FATAL
    # Stopping on purpose: what is resident on the device is parked, and the disk tier finishes its writes.
    try:
        done = engine.persist(timeout=PERSIST_TIMEOUT_S)
    except Exception:  # stopping anyway: what is already parked and written stays
        log.exception("engine stopping: parking the conversations on the device failed")
        return code
    if engine.conversations is not None and engine.conversations.disk is not None:
        log.info("engine stopping: conversations parked and %s", "written to disk" if done else
                 f"not all written to disk within {PERSIST_TIMEOUT_S:.0f} s")
    return code


def _serve(inbox: "queue.Queue[dict | None]", requests: Requests, stopping: threading.Event) -> int:
    """Take commands and step until told to shut down (0), or until SIGTERM
    and the requests in flight have finished (0)."""
    while True:
        if stopping.is_set() and not requests.busy:
            log.info("SIGTERM: the requests in flight have finished; exiting")
            return 0
        # Wait for work when there is none; otherwise take what has arrived and step.
        try:
            command = inbox.get(timeout=IDLE_POLL_S) if not requests.busy else inbox.get_nowait()
        except queue.Empty:
            command = _NOTHING
        while command is not _NOTHING:
            if command is None:
                return 0
            if stopping.is_set():
                requests.refuse_stopping(command["id"])
            else:
                requests.start(command)
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                command = _NOTHING
        if requests.busy:
            requests.step()


_NOTHING = object()  # no command waiting


_ARMED: list = []


def _parse_fault(text: str) -> tuple[str, float, str, str | None]:
    """``POINT[:RATE[:KIND]][@TEXT]`` (checked by the CLI): TEXT limits a
    ``forward`` fault to steps carrying a prompt that contains it."""
    head, at, marker = text.partition("@")
    point, _, rest = head.partition(":")
    rate, _, kind = rest.partition(":")
    return point, float(rate or 1.0), kind or "oom", marker if at else None


def _contains(needle: list[int]):
    """A ``match`` for the ``forward`` point: a step one of whose sequences holds ``needle``."""
    n = len(needle)

    def match(token_lists) -> bool:
        return any(tokens[i:i + n] == needle for tokens in token_lists for i in range(len(tokens) - n + 1))
    return match


def _arm(point: str, rate: float, kind: str, match=None, marker: str | None = None) -> None:
    """One ``--inject-fault``, armed for the life of this process."""
    from strata_runtime.testing import inject_fault

    armed = inject_fault(point, rate=rate, seed=os.getpid(), kind=kind, match=match)
    armed.__enter__()
    _ARMED.append(armed)  # held: a collected context manager would disarm it
    log.warning("fault injection: %s fails (%s) on %s of its calls%s", point, kind,
                "all" if rate >= 1 else f"{rate:.0%}", "" if marker is None else f" carrying {marker!r}")


if __name__ == "__main__":
    code = main()
    # The command thread may be blocked reading stdin; a normal interpreter
    # shutdown would abort on its lock. Everything worth keeping is flushed.
    sys.stderr.flush()
    os._exit(code)

"""The engine process: one ``Engine``, requests in on stdin, events out.

Run by the supervisor as ``python -m strata_server.worker SPEC`` (SPEC: a
JSON object with ``model`` and ``options`` for ``strata_runtime.load``). A
reader thread answers pings and takes cancels at once, even while the main
thread is generating; the main thread serves one request at a time. When
stdin closes (the supervisor is gone) the process exits.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
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


def serve_one(engine, command: dict[str, Any], channel: Channel, cancelled: set) -> None:
    """Run one request, sending its pieces and then ``done`` or ``error``."""
    from strata_runtime import Cancelled, ChatTemplateError, ContextLengthError, StrataError

    rid = command["id"]
    engine.last_completion = None
    # Asked between chunks of tokenizing and prefilling, so a client that left
    # stops costing engine time within one chunk.
    options = {"abort": lambda: rid in cancelled, "cache_scope": command.get("cache_scope", ""),
               **command["sampling"]}
    try:
        if command["kind"] == "chat":
            pieces = engine.chat(command["messages"], stream=True, **options)
        else:
            pieces = engine.stream(command["prompt"], **options)
        for piece in pieces:
            channel.send(ev="piece", id=rid, text=piece)
            if rid in cancelled:
                pieces.close()  # the run's cleanup keeps the live cache consistent
                break
    except Cancelled as e:
        log.info("request %s stopped: %s", rid, e)
        _send_done(channel, rid, engine, engine.last_completion)
        return
    except ContextLengthError as e:
        channel.send(ev="error", id=rid, status=400, type="invalid_request_error",
                     code="context_length_exceeded", message=str(e))
        return
    except (StrataError, ChatTemplateError, ValueError, TypeError) as e:
        channel.send(ev="error", id=rid, status=400, type="invalid_request_error", code=None, message=str(e))
        return
    except Exception as e:  # the engine stays up; the request gets a 500
        log.exception("request %s failed", rid)
        channel.send(ev="error", id=rid, status=500, type="server_error", code=None,
                     message=f"the engine failed on this request ({type(e).__name__}: {e})")
        return
    finally:
        cancelled.discard(rid)
    _send_done(channel, rid, engine, engine.last_completion)


def _send_done(channel: Channel, rid: int, engine, completion) -> None:
    """``completion`` None: the request was cancelled before it started."""
    c = completion
    channel.send(ev="done", id=rid, finish_reason="cancelled" if c is None else c.finish_reason,
                 prompt_tokens=0 if c is None else c.prompt_tokens,
                 completion_tokens=0 if c is None else c.completion_tokens,
                 cached_tokens=0 if c is None else c.cached_tokens, stats=engine.stats())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    channel = Channel(_claim_stdout())
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    inbox: queue.Queue[dict | None] = queue.Queue()
    cancelled: set = set()
    threading.Thread(target=_read_commands, args=(sys.stdin.buffer, channel, inbox, cancelled),
                     name="commands", daemon=True).start()
    try:
        from strata_runtime import load

        engine = load(spec["model"], progress=False, **spec["options"])
        engine.tokenizer.prepare()  # not on the first long request
    except Exception as e:
        log.error("the engine could not start: %s: %s", type(e).__name__, e)
        channel.send(ev="fatal", message=f"{type(e).__name__}: {e}")
        return 1
    channel.send(ev="ready", pid=os.getpid(), props=engine.props(), stats=engine.stats())
    while (command := inbox.get()) is not None:
        if command["id"] in cancelled:
            cancelled.discard(command["id"])
            _send_done(channel, command["id"], engine, None)
            continue
        serve_one(engine, command, channel, cancelled)
    return 0


if __name__ == "__main__":
    code = main()
    # The command thread may be blocked reading stdin; a normal interpreter
    # shutdown would abort on its lock. Everything worth keeping is flushed.
    sys.stderr.flush()
    os._exit(code)

"""A chat reply read as it is generated: reasoning, content and tool calls
as deltas, the same reading ``ToolCalling.parse`` gives the whole reply.

Text arrives in pieces with control tokens spelled out. Text that could
still turn out to begin a marker (``<think>``, ``</think>``, the format's
call trigger) is held back until it cannot, then released as what it is;
whitespace that the whole reading trims (before a trigger, around
reasoning) is held until text follows it. A call's name goes out once, when
it is complete; its arguments go out as the model writes them, raw (never a
re-serialized partial parse), from an incremental scan of its JSON.

Deltas: ``{"reasoning_content": text}``, ``{"content": text}``,
``{"tool_call": {"index", "id", "name"}}``, ``{"tool_arguments": {"index", "text"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from .json_scan import JsonScan, Path
from .tool_calls import ToolCalling, call_id

THINK, UNTHINK = "<think>", "</think>"
TRIGGERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReplyStream:
    """Deltas of one reply. Invariant: ``_mode`` says what the held text
    ``_held`` is: "lead" (nothing but whitespace yet: reasoning may open),
    "reasoning", "text" (content, or the start of a call), "call" (inside a
    call's JSON: ``_scan`` reads it), "between" (after a call: markers and
    whitespace until the next call), "json" (the generic format's reply
    object), or "ignored" (after the last call)."""

    def __init__(self, calling: ToolCalling | None, reasoning_opened: bool = False):
        self.calling = calling if calling is not None and calling.grammar() is not None else None
        self.format = self.calling.format if self.calling is not None else None
        self._mode = "reasoning" if reasoning_opened else "lead"
        self._held = ""
        self._started_reasoning = False
        self._content_started = False
        self._scan: JsonScan | None = None
        self._calls = 0  # calls begun
        self._response_raw = ""  # the generic format's {"response": ...} string as written so far
        self._response_out = 0  # characters of it decoded and sent
        self.deltas: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._held += text
        self._run(final=False)
        out, self.deltas = self.deltas, []
        return out

    def finish(self) -> list[dict[str, Any]]:
        self._run(final=True)
        out, self.deltas = self.deltas, []
        return out

    # --- modes ----------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            before = (self._mode, len(self._held))
            getattr(self, f"_{self._mode}")(final)
            if (self._mode, len(self._held)) == before:
                return

    def _lead(self, final: bool) -> None:
        body = self._held.lstrip()
        if body.startswith(THINK):
            self._held, self._mode = body[len(THINK):], "reasoning"
        elif body and not THINK.startswith(body):
            self._mode = self._after_reasoning()
        elif final:
            self._mode = self._after_reasoning()

    def _reasoning(self, final: bool) -> None:
        held = self._held
        end = held.find(UNTHINK)
        if end >= 0:
            self._reason(held[:end].rstrip("\n"))
            self._held, self._mode = held[end + len(UNTHINK):], self._after_reasoning()
            return
        keep = _partial_suffix(held, UNTHINK)
        text = held[:len(held) - keep]
        if not final:  # newlines before </think> are trimmed: hold them until text follows
            trailing = len(text) - len(text.rstrip("\n"))
            text, keep = text[:len(text) - trailing], keep + trailing
        self._reason(text)
        self._held = held[len(held) - keep:] if keep else ""
        if final:
            self._held = ""

    def _reason(self, text: str) -> None:
        if not self._started_reasoning:
            text = text.lstrip("\n")
        if text:
            self._started_reasoning = True
            self.deltas.append({"reasoning_content": text})

    def _after_reasoning(self) -> str:
        if self.format == "generic":
            self._scan = JsonScan(watch=self._generic_watch)
            return "json"
        if self.format == "llama3":
            return "llama3_lead"
        return "text"

    def _text(self, final: bool) -> None:
        trigger = TRIGGERS.get(self.format) if self.calling is not None else None
        held = self._held
        at = held.find(trigger) if trigger else -1
        if at >= 0:
            self._content(held[:at].rstrip(), final=True)
            self._held, self._mode = held[at + len(trigger):], "call"
            self._new_call_scan()
            return
        keep = _partial_suffix(held, trigger) if trigger else 0
        text = held[:len(held) - keep]
        if trigger and not final:  # whitespace before a trigger is trimmed: hold it until text follows
            stripped = text.rstrip()
            keep, text = keep + len(text) - len(stripped), stripped
        self._content(text, final)
        self._held = "" if final else held[len(held) - keep:]

    def _content(self, text: str, final: bool) -> None:
        if self._started_reasoning and not self._content_started:
            text = text.lstrip("\n")  # the newlines after </think> are not content
        if text:
            self._content_started = True
            self.deltas.append({"content": text})

    def _llama3_lead(self, final: bool) -> None:
        body = self._held.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        if body.startswith("{"):
            self._held, self._mode = body, "call"
            self._new_call_scan()
        elif body and not "<|python_tag|>".startswith(body):
            self._mode = "text"  # a reply that is not a call is all content
        elif final:
            self._mode = "text"

    # --- calls ----------------------------------------------------------------------

    def _new_call_scan(self) -> None:
        args = "parameters" if self.format == "llama3" else "arguments"
        if self.format == "mistral":  # an array of calls
            self._scan = JsonScan(watch=lambda p: len(p) == 2 and p[1] == args)
        else:
            self._scan = JsonScan(watch=lambda p: p == (args,))

    def _call(self, final: bool) -> None:
        text, self._held = self._held, ""
        for event in self._scan.feed(text):
            self._call_event(event)
        if self._scan.failed:
            self._mode = "ignored"
        elif self._scan.done:
            self._held = self._scan.rest
            self._mode = "between" if self.format == "hermes" else "ignored"

    def _call_event(self, event) -> None:
        path = event.path
        if event.kind == "end" and self._is_name(path) and isinstance(event.value, str):
            if not self._name_ok(event.value):
                return
            self.deltas.append({"tool_call": {"index": self._calls, "id": call_id(self.format),
                                              "name": event.value}})
            self._calls += 1
        elif event.kind == "text" and self._calls:
            self.deltas.append({"tool_arguments": {"index": self._calls - 1, "text": event.text}})

    def _is_name(self, path: Path) -> bool:
        """Whether ``path`` is a call's name (not a "name" inside its arguments)."""
        if self.format == "mistral":
            return len(path) == 2 and path[1] == "name"
        if self.format == "generic":
            return path == ("tool_call", "name") or (len(path) == 3 and path[0] == "tool_calls" and path[2] == "name")
        return path == ("name",)

    def _name_ok(self, name: str) -> bool:
        return any(t["function"]["name"] == name for t in self.calling.tools)

    def _between(self, final: bool) -> None:
        trigger = TRIGGERS["hermes"]
        held = self._held
        at = held.find(trigger)
        if at >= 0:
            self._held, self._mode = held[at + len(trigger):], "call"
            self._new_call_scan()
        elif final:
            self._held = ""
        else:
            keep = _partial_suffix(held, trigger)
            self._held = held[len(held) - keep:] if keep else ""

    def _ignored(self, final: bool) -> None:
        self._held = ""

    # --- the generic format -----------------------------------------------------------

    @staticmethod
    def _generic_watch(path: Path) -> bool:
        return path in (("response",), ("tool_call", "arguments")) or (
            len(path) == 3 and path[0] == "tool_calls" and path[2] == "arguments")

    def _json(self, final: bool) -> None:
        text, self._held = self._held, ""
        for event in self._scan.feed(text):
            if event.path == ("response",):
                if event.kind == "text":
                    self._response_raw += event.text
                    self._release_response()
            else:
                self._call_event(event)
        if self._scan.failed or self._scan.done:
            self._mode = "ignored"

    def _release_response(self) -> None:
        """The answer string's characters decoded so far (an escape sequence waits until it is whole)."""
        raw = self._response_raw
        if raw.endswith('"') and len(raw) > 1 and _escapes_closed(raw[:-1]):
            body = raw
        else:
            body = _cut_partial_escape(raw) + '"'
        try:
            decoded = json.loads(body)
        except ValueError:
            return
        if len(decoded) > self._response_out:
            self._content(decoded[self._response_out:], final=False)
            self._response_out = len(decoded)


def _escapes_closed(raw: str) -> bool:
    """Whether ``raw`` (a JSON string's text without its closing quote) ends outside an escape."""
    backslashes = len(raw) - len(raw.rstrip("\\"))
    return backslashes % 2 == 0


def _cut_partial_escape(raw: str) -> str:
    """``raw`` without a trailing escape sequence that is not yet whole."""
    if not _escapes_closed(raw):
        return raw[:-1]
    at = raw.rfind("\\u")
    if at >= 0 and _escapes_closed(raw[:at]) and len(raw) - at < 6:
        return raw[:at]
    return raw

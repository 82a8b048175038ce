"""An incremental scan of one JSON value's text, reporting where each value
starts and ends by its path, so a stream can pass a value's raw text on as
it arrives (a tool call's arguments) or decode a string as it grows (an
answer inside a JSON reply) without waiting for the whole document.

The scan is structural, not a validator: the text is held to its grammar
by the constraint; text that is not JSON stops the scan (``failed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

Path = tuple  # keys (str) and indices (int) from the root


@dataclass
class _Container:
    """An open object or array. Invariant: ``key`` is the key whose value is
    next (objects) once ``state`` is "value"; ``index`` counts the array's values so far."""

    kind: str  # "{" or "["
    state: str  # objects: "key", "colon", "value", "comma"; arrays: "value", "comma"
    key: str | None = None
    index: int = 0


@dataclass
class ScanEvent:
    """``kind``: "start" (a value at ``path`` begins), "text" (``text`` of the
    value at ``path``, raw, as it arrives: only for watched paths), "end" (the
    value at ``path`` is complete; ``value`` decoded where it is a scalar)."""

    kind: str
    path: Path
    text: str = ""
    value: object = None


@dataclass
class JsonScan:
    """Feed text; get ``ScanEvent`` s. Invariant: ``stack`` holds the open
    containers; a value whose path ``watch`` accepts (an object, array or
    string: a number's end is only seen at the character after it) reports
    its raw text as "text" events while it is open, the last before its
    "end"; ``done`` once the root value is complete."""

    watch: "callable[[Path], bool]" = field(default=lambda path: False)
    stack: list[_Container] = field(default_factory=list)
    done: bool = False
    failed: bool = False
    _scalar: list[str] | None = None  # the text of a string, number or literal being read
    _scalar_path: Path = ()
    _in_string: bool = False
    _escape: bool = False
    _key_text: list[str] | None = None  # an object key being read
    _watching: list[Path] = field(default_factory=list)  # open watched values, outermost first
    _rest: str = ""  # text after the root value completed
    _pending: list[str] = field(default_factory=list)  # a watched value's characters not yet reported
    _closed_watch: Path = ()
    _char: str = ""  # the character being scanned
    _char_taken: bool = False  # it was added to ``_pending`` already

    def _path(self) -> Path:
        return tuple(c.key if c.kind == "{" else c.index for c in self.stack)

    def feed(self, text: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        for i, c in enumerate(text):
            if self.done or self.failed:
                self._rest += text[i:]
                break
            self._char, self._char_taken = c, False
            watching = bool(self._watching)
            self._step(c, events)
            if (watching or self._watching) and not self._char_taken:  # inside a watched value, or its opening
                self._pending.append(c)
        self._flush(events)
        return events

    def _flush(self, events: list[ScanEvent]) -> None:
        if self._pending:
            path = self._watching[0] if self._watching else self._closed_watch
            events.append(ScanEvent("text", path, "".join(self._pending)))
            self._pending.clear()

    @property
    def rest(self) -> str:
        """Text fed after the root value completed."""
        return self._rest

    # --- one character --------------------------------------------------------------

    def _step(self, c: str, events: list[ScanEvent]) -> bool:
        """Consume ``c``."""
        if self._key_text is not None:  # inside an object's key
            self._string_char(c, self._key_text, key=True, events=events)
            return False
        if self._scalar is not None:
            if self._in_string:
                self._string_char(c, self._scalar, key=False, events=events)
                return False
            if c in ",}] \t\r\n":  # a number or literal ends at the next structural character
                self._end_scalar(events)
                return self._structural(c, events)
            self._scalar.append(c)
            return False
        return self._structural(c, events)

    def _string_char(self, c: str, buf: list[str], key: bool, events: list[ScanEvent]) -> None:
        buf.append(c)
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            if key:
                top = self.stack[-1]
                top.key = json.loads("".join(self._key_text))
                top.state = "colon"
                self._key_text = None
            else:
                self._end_scalar(events)

    def _structural(self, c: str, events: list[ScanEvent]) -> bool:
        if c in " \t\r\n":
            return False
        top = self.stack[-1] if self.stack else None
        if top is not None and top.kind == "{":
            if top.state == "key":
                if c == '"':
                    self._key_text = ['"']
                    return False
                if c == "}":
                    return self._close(events)
                return self._fail()
            if top.state == "colon":
                if c == ":":
                    top.state = "value"
                    return False
                return self._fail()
            if top.state == "comma":
                if c == ",":
                    top.state = "key"
                    return False
                if c == "}":
                    return self._close(events)
                return self._fail()
        if top is not None and top.kind == "[" and top.state == "comma":
            if c == ",":
                top.index += 1
                top.state = "value"
                return False
            if c == "]":
                return self._close(events)
            return self._fail()
        if top is not None and top.kind == "[" and c == "]" and top.index == 0:
            return self._close(events)  # an empty array
        return self._open_value(c, events)

    def _open_value(self, c: str, events: list[ScanEvent]) -> bool:
        path = self._path()
        events.append(ScanEvent("start", path))
        watched = self.watch(path)
        if watched:
            self._watching.append(path)
        if c in "{[":
            self.stack.append(_Container(c, "key" if c == "{" else "value"))
            return watched
        if c == '"':
            self._scalar, self._in_string = ['"'], True
        elif c in "-0123456789tfn":
            self._scalar, self._in_string = [c], False
        else:
            return self._fail()
        self._scalar_path = path
        return watched

    def _end_scalar(self, events: list[ScanEvent]) -> None:
        raw = "".join(self._scalar)
        self._scalar, self._in_string = None, False
        try:
            value = json.loads(raw)
        except ValueError:
            self._fail()
            return
        self._finish_value(self._scalar_path, events, value)

    def _close(self, events: list[ScanEvent]) -> bool:
        self.stack.pop()
        self._finish_value(self._path(), events, None)
        return False

    def _finish_value(self, path: Path, events: list[ScanEvent], value: object) -> None:
        if self._watching and self._watching[-1] == path:
            if len(self._watching) == 1:  # the outermost watched value is whole: its text goes before its end
                self._pending.append(self._char)  # its closing character (watched values are not numbers)
                self._char_taken = True
                self._closed_watch = path
                self._flush(events)
            self._watching.pop()
        events.append(ScanEvent("end", path, value=value))
        if not self.stack:
            self.done = True
        else:
            self.stack[-1].state = "comma"

    def _fail(self) -> bool:
        self.failed = True
        return False

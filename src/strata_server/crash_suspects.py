"""Requests that were in the engine when it crashed, remembered for a while.

A request that crashes the engine would crash it again when its client
retries, and every crash costs every client a restart: a few such retries
would spend the whole crash budget and end the server. So the request in
flight at a crash is answered with an error clients do not retry, and an
identical request is refused (422, naming why) for the restart window.
Identical: the same body as the engine saw it (prompt or messages, sampling
options, cache scope), by its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Suspect:
    strikes: int  # crashes it was in flight for (a sure one counts ``CrashSuspects.REFUSE_AT``)
    last_at: float  # time.monotonic() of its last crash
    reason: str  # how the engine ended, for the refusal's message


class CrashSuspects:
    """Fingerprints of requests in flight at engine crashes.

    Invariant: every entry's last crash is within ``window_s``; one with
    ``strikes >= REFUSE_AT`` is refused. A crash with one request in it (or
    one the engine named) makes its request refused at once; one with
    several makes each a suspect, refused if it is in a second crash, so an
    innocent request beside a poison one is not refused for its company."""

    REFUSE_AT = 2

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._entries: dict[str, Suspect] = {}

    @staticmethod
    def fingerprint(command: dict[str, Any]) -> str:
        body = {k: v for k, v in command.items() if k not in ("id", "op")}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def record(self, command: dict[str, Any], sure: bool, reason: str) -> None:
        self._expire()
        key = self.fingerprint(command)
        entry = self._entries.setdefault(key, Suspect(0, 0.0, reason))
        entry.strikes += self.REFUSE_AT if sure else 1
        entry.last_at, entry.reason = time.monotonic(), reason

    def refusal(self, command: dict[str, Any]) -> str | None:
        """Why ``command`` is refused now, or None."""
        self._expire()
        entry = self._entries.get(self.fingerprint(command))
        if entry is None or entry.strikes < self.REFUSE_AT:
            return None
        left = self.window_s - (time.monotonic() - entry.last_at)
        return (f"an identical request was in the engine when it crashed ({entry.reason}); it is refused for "
                f"{left:.0f} s more so that it cannot crash the engine again. Change the request, or report the "
                "crash with the server's log")

    def __len__(self) -> int:
        self._expire()
        return sum(e.strikes >= self.REFUSE_AT for e in self._entries.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if now - e.last_at > self.window_s]:
            del self._entries[key]

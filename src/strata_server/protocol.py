"""Messages between the supervisor and the engine process: one JSON object a line.

Several requests may be in flight at once (up to the engine's ``parallel``);
their events interleave, each naming its request.

Supervisor to engine (the engine's stdin):
    {"op": "generate", "id": N, "kind": "chat", "messages": [...], "sampling": {...}, "cache_scope": "...",
     "tools": [...], "tool_choice": ..., "parallel_tool_calls": bool, "chat_template_kwargs": {...}}
     (the last four only where the request has them; sampling may hold a "grammar")
    {"op": "generate", "id": N, "kind": "completion", "prompt": "..." | [ids], "sampling": {...},
     "cache_scope": "..."}     (cache_scope: requests share cached prefixes only within one scope)
    {"op": "cancel", "id": N}          stop request N at the engine's next step
    {"op": "ping", "seq": N}           answered with "pong" even while generating
    {"op": "shutdown"}

Engine to supervisor (a private copy of the engine's original stdout; the
engine's fd 1 is pointed at stderr so a stray print cannot corrupt a line):
    {"ev": "ready", "pid": P, "props": {...}, "stats": {...}}
    {"ev": "pong", "seq": N}
    {"ev": "piece", "id": N, "text": "..."}
    {"ev": "done", "id": N, "finish_reason": "stop" | "tool_calls" | "length" | "cancelled",
     "prompt_tokens": n, "completion_tokens": n, "cached_tokens": n, "stats": {...}, "scheduler": {...},
     "reply": {"content": ..., "reasoning_content": ..., "tool_calls": [...]} | null}  (a chat's reply read back)
    {"ev": "state", "scheduler": {...}, "slots": [...]}   after steps (at most every 0.25 s while busy)
    {"ev": "error", "id": N, "status": 400, "type": "...", "code": "...", "message": "..."}
    {"ev": "fatal", "message": "..."}  the engine could not start; it exits next
"""

from __future__ import annotations

import json
from typing import Any


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {line[:80]!r}")
    return message

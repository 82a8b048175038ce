"""Reading a request body as JSON, refusing what would hurt later with a 4xx.

Each refusal names the fix: the wrong content type (415: a browser form or a
``text/plain`` POST from another site cannot reach the engine), a body over
the size limit (413) or too slow to arrive (408), bytes that are not UTF-8,
text that is not JSON, nesting deeper than ``MAX_DEPTH``, integers too long
to parse, and strings holding a lone surrogate (``"\\ud800"``: valid JSON,
but not Unicode text, so it could be neither tokenized nor sent on).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from .errors import ApiError

MAX_DEPTH = 32  # an OpenAI request nests 5 deep; Python's parser fails near 1,000


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The body of ``request`` as checked JSON (see the module docstring)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the request body must be sent as 'Content-Type: application/json' "
                            f"(got {kind or 'no content type'!r})", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; the limit is {limit} bytes",
                       code="request_too_large")
    try:
        raw = await asyncio.wait_for(_read(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s; send it in one go",
                       code="request_timeout") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start}); "
                            f"send JSON encoded as UTF-8") from None
    if not text.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from None
    except RecursionError:
        raise ApiError(400, f"the request body nests too deeply; at most {MAX_DEPTH} levels are accepted") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise ApiError(400, f"the request body has a number too long to read ({str(e).split(';')[0]})") from None
    check_values(body)
    return body


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def check_values(body: Any) -> None:
    """Depth and text checks over the whole parsed body, without recursion."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels at {_where(path)}; "
                                f"send a flatter object")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path + (key,), is_key=True)
            stack.append((item, path + (key,), depth + 1))


def _check_text(text: str, path: tuple, is_key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        what = "the key" if is_key else "the string"
        raise ApiError(400, f"{what} at {_where(path)} has a lone surrogate ({text[e.start]!r}) at character "
                            f"{e.start}; text must be valid Unicode: escape a character outside the Basic "
                            f"Multilingual Plane as a surrogate pair, or send it as UTF-8") from None


def _where(path: tuple) -> str:
    if not path:
        return "the top level"
    out = ""
    for part in path:
        # Keys are shown escaped: the error body itself must be valid UTF-8.
        out += f"[{part}]" if isinstance(part, int) else "." + part.encode("utf-8", "backslashreplace").decode()
    return out.lstrip(".")

"""What every front door does alike: check a body's fields and text parts, and turn a job's events into its stream."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from .errors import ApiError


def check_fields(body: Any, fields: set[str], endpoint: str) -> dict[str, Any]:
    """``body`` as an object with no field outside ``fields`` (a 400 naming them otherwise)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; {endpoint} accepts "
                            f"{', '.join(sorted(fields))}", code="unknown_parameter")
    return body


def text_of(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A ``content`` that must be text: a string, or parts of ``part_types`` with ``text``, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"),
                                                                                                   str):
                raise ApiError(400, f"{where}[{i}] must be a text part ({' or '.join(part_types)}); images, "
                                    "documents and files are not supported")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"{where} must be a string or a list of {part_types[0]} parts")


async def reply_events(first, events: AsyncIterator, on_delta: Callable[[dict], list[bytes]],
                       on_error: Callable[[Any], bytes], on_done: Callable[[dict], list[bytes]],
                       on_piece: Callable[[str], list[bytes]] = lambda text: [],
                       on_logprobs: Callable[[list], list[bytes]] = lambda entries: []) -> AsyncIterator[bytes]:
    """A job's events (``first``, then ``events``) as a front door's stream:
    each of a chat's deltas, its text pieces, its tokens' log-probabilities,
    then the end (its ``done``, or an error)."""
    event = first
    while event is not None:
        kind, value = event
        if kind == "deltas":
            for delta in value:
                for out in on_delta(delta):
                    yield out
        elif kind == "piece":
            for out in on_piece(value):
                yield out
        elif kind == "logprobs":
            for out in on_logprobs(value):
                yield out
        elif kind == "error":
            yield on_error(value)
            return
        else:
            for out in on_done(value):
                yield out
            return
        event = await events.__anext__()


def converted_tools(body: dict[str, Any], convert: Callable[[Any, str], dict], shape: str) -> list | None:
    """A front door's ``tools`` list in OpenAI's nested shape (``convert`` takes each and where it is), or None."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, f"'tools' must be a list of {shape}")
    return [convert(tool, f"tools[{i}]") for i, tool in enumerate(tools)]

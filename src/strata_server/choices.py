"""A request's ``n`` choices: one engine command each (the later ones copy
the first's prompt state), answered as one response, whole or with the
choices' chunks interleaved as they come."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

from .openai_api import Reply, sse_data, usage


def choice_commands(command: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The ``n`` engine commands of one request's choices: choice ``i`` draws
    with ``seed + i``, and all share a group (the engine copies the first's prompt state)."""
    group = uuid.uuid4().hex
    out = []
    for i in range(n):
        sampling = dict(command["sampling"])
        if sampling.get("seed") is not None:
            sampling["seed"] = sampling["seed"] + i
        out.append({**command, "sampling": sampling, "choice_group": group, "choice": i, "choices": n})
    return out


def merged_usage(dones: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's usage over its choices: the prompt once, every choice's tokens."""
    return {"prompt_tokens": dones[0]["prompt_tokens"], "cached_tokens": dones[0]["cached_tokens"],
            "completion_tokens": sum(d["completion_tokens"] for d in dones)}


def whole_choices(replies: list[Reply], results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    out = replies[0].whole(*results[0])
    out["choices"] = [r.whole(text, done)["choices"][0] for r, (text, done) in zip(replies, results)]
    out["usage"] = usage(merged_usage([done for _, done in results]))
    return out


async def sse_choices(replies: list[Reply], opened: list, include_usage: bool) -> AsyncIterator[bytes]:
    """The choices' streams interleaved as their chunks come, then the usage and ``[DONE]`` once."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(reply: Reply, events, first) -> None:
        try:
            async for out in reply.sse(first, events, include_usage, end=False):
                await queue.put(out)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(r, events, first)) for r, (events, first) in zip(replies, opened)]
    try:
        finished = 0
        while finished < len(tasks):
            out = await queue.get()
            if out is None:
                finished += 1
            else:
                yield out
    finally:
        for task in tasks:
            task.cancel()
    dones = [getattr(r, "done", None) for r in replies]
    if all(d is not None for d in dones):
        total = merged_usage(dones)
        if include_usage:
            yield sse_data({**replies[0]._envelope("chat.completion.chunk" if replies[0].kind == "chat"
                                                   else "text_completion", []), "usage": usage(total)})
        yield b"data: [DONE]\n\n"

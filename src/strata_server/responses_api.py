"""OpenAI's Responses API (``/v1/responses``), stateless, as a front door to
the same engine command as ``/v1/chat/completions``.

``input`` items become the chat the engine renders: ``message`` items
(``input_text``/``output_text`` parts), ``function_call`` items an
assistant's ``tool_calls``, ``function_call_output`` items ``tool``
messages, ``reasoning`` items the next assistant turn's
``reasoning_content``; ``instructions`` a system message; flat function
tools (``{"type": "function", "name", "parameters"}``) OpenAI's nested
ones; ``text.format`` a grammar. Nothing is stored: ``previous_response_id``
is refused (send the history as ``input``). Output is ``reasoning``,
``message`` and ``function_call`` items, whole or as the ``response.*`` events.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from .errors import ApiError
from .openai_api import PromptLimits, parse_chat_prompt, response_format_grammar, sampling_options
from .request_checks import check_fields, converted_tools, reply_events, text_of

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "stream", "text", "reasoning", "previous_response_id",
          # Accepted and without effect: nothing is stored, nothing else is included.
          "store", "metadata", "user", "truncation", "include", "service_tier", "prompt_cache_key"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text_parts(content: Any, where: str) -> str:
    return text_of(content, where, ("input_text", "output_text", "text"))


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The request's input, instructions, tools and tool choice in the chat completions' shapes."""
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "conversation so far as 'input' items (the cached prefix makes that cheap)")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string")
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items")
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer")
            message = {"role": role, "content": _text_parts(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise ApiError(400, f"{where}: a function_call item needs 'call_id', 'name' and 'arguments'")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last["content"] and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls are one assistant turn
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call_output item needs the 'call_id' it answers")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ApiError(400, f"{where}: item type {kind!r} is not supported (message, function_call, "
                                "function_call_output, reasoning are)")
    chat: dict[str, Any] = {"messages": messages}
    tools = converted_tools(body, _tool, "{'type': 'function', 'name', 'parameters'}")
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"{where}: only function tools are supported; {kind!r} is a hosted tool")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def parse_responses(body: Any, models: set[str], limits: PromptLimits) -> dict[str, Any]:
    """A ``/v1/responses`` body -> the engine's chat command."""
    body = check_fields(body, FIELDS, "/v1/responses")
    chat = parse_chat_prompt(to_chat(body), limits)
    openai_body = {k: body[k] for k in ("model", "temperature", "top_p", "stream") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        openai_body["max_tokens"] = body["max_output_tokens"]
    command = {"kind": "chat", **chat, **sampling_options(openai_body, models, limits)}
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        grammar = response_format_grammar(fmt)
        if grammar is not None:
            if chat.get("tools") and chat.get("tool_choice") != "none":
                raise ApiError(400, "give 'tools' or a text.format schema, not both")
            command["sampling"]["grammar"] = grammar
    command["echo"] = {k: body.get(k) for k in ("instructions", "tools", "tool_choice", "parallel_tool_calls",
                                                "temperature", "top_p", "max_output_tokens")}
    return command


class ResponseReply:
    """One response, whole or as ``response.*`` events."""

    kind = "chat"

    def __init__(self, model: str, echo: dict[str, Any]):
        self.model = model
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.echo = echo
        self.sequence = 0

    def _envelope(self, status: str, output: list, done: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = done is not None and done["finish_reason"] == "length"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if incomplete else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output, "parallel_tool_calls": self.echo.get("parallel_tool_calls", True) is not False,
                "tool_choice": self.echo.get("tool_choice") or "auto", "tools": self.echo.get("tools") or [],
                "instructions": self.echo.get("instructions"), "temperature": self.echo.get("temperature"),
                "top_p": self.echo.get("top_p"), "max_output_tokens": self.echo.get("max_output_tokens"),
                "text": {"format": {"type": "text"}}, "store": False, "metadata": {},
                "usage": None if done is None else usage(done)}

    def whole(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        reply = done.get("reply") or {"content": text}
        output = []
        if reply.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), reply["reasoning_content"]))
        if reply.get("content"):
            output.append(_message_item(_new_id("msg"), reply["content"]))
        for call in reply.get("tool_calls") or []:
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"]))
        return self._envelope("completed", output, done)

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence, **data}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    async def sse(self, first, events: AsyncIterator, include_usage: bool) -> AsyncIterator[bytes]:
        yield self._event("response.created", {"response": self._envelope("in_progress", [])})
        yield self._event("response.in_progress", {"response": self._envelope("in_progress", [])})
        items = _Items(self)

        def done(value: dict[str, Any]) -> list[bytes]:
            kind = "response.incomplete" if value["finish_reason"] == "length" else "response.completed"
            return items.close() + [self._event(kind, {"response": self._envelope("completed", items.output,
                                                                                  value)})]

        async for out in reply_events(first, events, items.add, lambda e: self._event(
                "error", {"code": e.code, "message": e.message, "param": None}), done):
            yield out


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _Items:
    """The output items of a streamed response. Invariant: at most one is open
    (``kind``, ``text`` so far); ``output`` holds the finished ones in order."""

    def __init__(self, reply: ResponseReply):
        self.reply = reply
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None
        self.item: dict[str, Any] = {}
        self.text = ""

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        if "tool_call" in delta:
            out = self.close()
            call = delta["tool_call"]
            self.kind, self.text = "function_call", ""
            self.item = _call_item(_new_id("fc"), call["id"], call["name"], "", "in_progress")
            out.append(self.reply._event("response.output_item.added", {"output_index": len(self.output),
                                                                        "item": self.item}))
            return out
        if "tool_arguments" in delta and self.kind == "function_call":
            self.text += delta["tool_arguments"]["text"]
            return [self.reply._event("response.function_call_arguments.delta", {
                "item_id": self.item["id"], "output_index": len(self.output),
                "delta": delta["tool_arguments"]["text"]})]
        return []

    def _text(self, kind: str, text: str) -> list[bytes]:
        out, event = [], self.reply._event
        where = {"output_index": len(self.output)}
        if self.kind != kind:
            out = self.close()
            where = {"output_index": len(self.output)}
            self.kind, self.text = kind, ""
            if kind == "message":
                self.item = _message_item(_new_id("msg"), "", "in_progress")
                out.append(event("response.output_item.added", {**where, "item": self.item}))
                out.append(event("response.content_part.added", {**where, "item_id": self.item["id"],
                                                                 "content_index": 0, "part": {
                                                                     "type": "output_text", "text": "",
                                                                     "annotations": []}}))
            else:
                self.item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
                out.append(event("response.output_item.added", {**where, "item": self.item}))
        self.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        out.append(event(name, {**where, "item_id": self.item["id"], "content_index": 0, "delta": text}))
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        event, where = self.reply._event, {"output_index": len(self.output)}
        out = []
        if self.kind == "message":
            item = _message_item(self.item["id"], self.text)
            part = item["content"][0]
            out.append(event("response.output_text.done", {**where, "item_id": item["id"], "content_index": 0,
                                                           "text": self.text}))
            out.append(event("response.content_part.done", {**where, "item_id": item["id"], "content_index": 0,
                                                            "part": part}))
        elif self.kind == "reasoning":
            item = _reasoning_item(self.item["id"], self.text)
            out.append(event("response.reasoning_text.done", {**where, "item_id": item["id"], "content_index": 0,
                                                              "text": self.text}))
        else:
            item = _call_item(self.item["id"], self.item["call_id"], self.item["name"], self.text)
            out.append(event("response.function_call_arguments.done", {**where, "item_id": item["id"],
                                                                       "arguments": self.text}))
        out.append(event("response.output_item.done", {**where, "item": item}))
        self.output.append(item)
        self.kind = None
        return out


def usage(done: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": done["prompt_tokens"], "input_tokens_details": {"cached_tokens": done["cached_tokens"]},
            "output_tokens": done["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}

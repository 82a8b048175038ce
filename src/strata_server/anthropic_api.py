"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)
as a front door to the same engine command as ``/v1/chat/completions``.

Requests become the OpenAI-shaped chat the engine renders: ``system`` a
system message; ``tool_use`` blocks an assistant's ``tool_calls`` (``input``
as the arguments), ``tool_result`` blocks ``tool`` messages, ``thinking``
blocks ``reasoning_content``; ``tool_choice`` auto/any/tool/none as
auto/required/named/none. Replies and streams go back as content blocks
(thinking, text, tool_use) and the ``message_start`` ... ``message_stop``
events, from the engine's reading of the reply (``deltas`` while streaming).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from .errors import ApiError
from .openai_api import PromptLimits, parse_chat_prompt, sampling_options
from .request_checks import check_fields, converted_tools, reply_events, text_of

FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
          "stop_sequences", "stream", "thinking", "output_config",
          # Accepted and without effect here: hints for Anthropic's own service (prompt caching is automatic).
          "metadata", "service_tier", "cache_control", "speed", "inference_geo", "user_profile_id", "workspace_id",
          "diagnostics"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    """An ``ApiError`` as Anthropic's clients read errors."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _text_of(blocks: Any, where: str) -> str:
    return text_of(blocks, where, ("text",))


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic request's messages, system, tools and tool choice in the
    chat completions' shapes (what ``parse_chat_prompt`` reads)."""
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content must be a string or a list of blocks")
        messages.extend(_user_blocks(content, where) if m["role"] == "user" else [_assistant_blocks(content, where)])
    chat: dict[str, Any] = {"messages": messages}
    tools = converted_tools(body, _tool, "{name, description, input_schema}")
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise ApiError(400, "'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'} ('tool' with a "
                                "'name')")
        kind = choice["type"]
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                               else {"any": "required"}.get(kind, kind))
        if choice.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise ApiError(400, "'thinking' must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return chat


def _user_blocks(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: each ``tool_result`` a tool message (in order), the text one user message."""
    out, text = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"{where}.content[{j}].tool_use_id must name the tool_use it answers")
            result = block.get("content", "")
            result = result if isinstance(result, str) else _text_of(result, f"{where}.content[{j}].content")
            if block.get("is_error"):
                result = "Error: " + result
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise ApiError(400, f"{where}.content[{j}]: a user turn takes text and tool_result blocks; "
                                f"{kind!r} is not supported")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_blocks(blocks: list, where: str) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # nothing readable to give back
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"{where}.content[{j}]: a tool_use block needs 'id', 'name' and an 'input' "
                                    "object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        else:
            raise ApiError(400, f"{where}.content[{j}]: an assistant turn takes text, thinking and tool_use "
                                f"blocks; {kind!r} is not supported")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"{where}: only client tools ({{name, description, input_schema}}) are supported; "
                            f"{kind!r} is a server tool")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema", {"type": "object"})}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def parse_messages(body: Any, models: set[str], limits: PromptLimits) -> dict[str, Any]:
    """A ``/v1/messages`` body -> the engine's chat command."""
    body = check_fields(body, FIELDS, "/v1/messages")
    if "max_tokens" not in body:
        raise ApiError(400, "'max_tokens' is required (the most tokens to generate)")
    chat = parse_chat_prompt(to_chat(body), limits)
    openai_body = {"model": body.get("model"), "max_tokens": body["max_tokens"], "stream": body.get("stream", False)}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            openai_body[name] = body[name]
    if body.get("stop_sequences") is not None:
        openai_body["stop"] = body["stop_sequences"]
    command = {"kind": "chat", **chat, **sampling_options(openai_body, models, limits)}
    output = body.get("output_config")
    if output is not None:
        if not isinstance(output, dict):
            raise ApiError(400, "'output_config' must be an object such as {'format': {'type': 'json_schema', "
                                "'schema': {...}}}")
        schema = _output_schema(output.get("format"))
        if schema is not None:
            if chat.get("tools") and chat.get("tool_choice") != "none":
                raise ApiError(400, "give 'tools' or an output_config format, not both")
            command["sampling"]["grammar"] = {"json_schema": schema}
    return command


def _output_schema(fmt: Any) -> Any:
    """``output_config.format`` (structured outputs): the JSON schema the answer is held to, or None."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}")
    return fmt["schema"]


def parse_count(body: Any, limits: PromptLimits) -> dict[str, Any]:
    """A ``/v1/messages/count_tokens`` body -> a tokenize command of the same chat."""
    body = check_fields(body, COUNT_FIELDS, "/v1/messages/count_tokens")
    return {"kind": "tokenize", **parse_chat_prompt(to_chat(body), limits)}


class MessageReply:
    """One ``/v1/messages`` answer, whole or as events."""

    kind = "chat"

    def __init__(self, model: str):
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def whole(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        reply = done.get("reply") or {"content": text}
        blocks: list[dict[str, Any]] = []
        if reply.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
        if reply.get("content"):
            blocks.append({"type": "text", "text": reply["content"]})
        for call in reply.get("tool_calls") or []:
            blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                           "input": json.loads(call["function"]["arguments"])})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": blocks,
                "stop_reason": STOP_REASONS.get(done["finish_reason"], "end_turn"), "stop_sequence": None,
                "usage": usage(done)}

    async def sse(self, first, events: AsyncIterator, include_usage: bool) -> AsyncIterator[bytes]:
        """``message_start``, a block per thinking / text / tool call with its
        deltas, ``message_delta`` (stop reason, usage) and ``message_stop``."""
        yield _event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
        blocks = _Blocks()

        def done(value: dict[str, Any]) -> list[bytes]:
            stop = {"stop_reason": STOP_REASONS.get(value["finish_reason"], "end_turn"), "stop_sequence": None}
            return blocks.close() + [_event("message_delta", {"delta": stop, "usage": usage(value)}),
                                     _event("message_stop", {})]

        async for out in reply_events(first, events, blocks.add, lambda e: _event("error", error_body(e)), done):
            yield out


class _Blocks:
    """The content blocks of a streamed message. Invariant: at most one is
    open (``kind``), at ``index``; each call is a block of its own."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.call: int | None = None

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        if "reasoning_content" in delta:
            return self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if "content" in delta:
            return self._into("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": delta["content"]})
        if "tool_call" in delta:
            call = delta["tool_call"]
            out = self.close()
            self.index, self.kind, self.call = self.index + 1, "tool_use", call["index"]
            out.append(_event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}}))
            return out
        if "tool_arguments" in delta and self.kind == "tool_use":
            return [_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": delta["tool_arguments"]["text"]}})]
        return []

    def _into(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        out = []
        if self.kind != kind:
            out = self.close()
            self.index, self.kind = self.index + 1, kind
            out.append(_event("content_block_start", {"index": self.index, "content_block": start}))
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]


def usage(done: dict[str, Any]) -> dict[str, Any]:
    cached = done["cached_tokens"]
    return {"input_tokens": done["prompt_tokens"] - cached, "output_tokens": done["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()

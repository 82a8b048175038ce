"""Chat messages and tools as a chat template reads them.

Clients send OpenAI-shaped messages: ``system``/``developer``/``user``/
``assistant``/``tool`` roles, text or a list of text parts, an assistant's
``tool_calls`` with ``arguments`` as a JSON string, ``reasoning_content``,
``name``. Templates expect what Hugging Face's ``apply_chat_template``
hands them: arguments as objects, no keys whose value is None, reasoning
under ``reasoning_content`` (and ``thinking``, which some templates read).
``normalize_messages`` checks a list and returns that form (an assistant's
null content as ""; a
``ChatTemplateError`` (a ``RequestError``) naming the message and the fix otherwise);
``normalize_tools`` does the same for a ``tools`` list.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .chat_template import ChatTemplateError  # a RequestError: messages the template cannot be given

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning",
                 "thinking", "refusal", "function_call", "audio",
                 "annotations"}  # the OpenAI client's own reply objects carry it: an agent sends them back as they are


def _text(content: Any, where: str, allow_none: bool = False) -> str | None:
    """A message's content as one string: a string, or text parts joined."""
    if content is None and allow_none:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{where}: only text parts are supported ({{'type': 'text', 'text': ...}}); "
                                   "images and audio are not")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatTemplateError(f"{where} must be a string{' or null' if allow_none else ''}, got {type(content).__name__}")


def _arguments(value: Any, where: str) -> Any:
    """A call's arguments as an object (a JSON string is parsed: templates write objects with ``tojson``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise ChatTemplateError(f"{where} must be a JSON object (as a string or an object): {e}") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatTemplateError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                           "'arguments': ...}}}")
    if call.get("type", "function") != "function":
        raise ChatTemplateError(f"{where}.type must be 'function', got {call.get('type')!r}")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatTemplateError(f"{where}.function.name must be a non-empty string")
    out = {"type": "function",
           "function": {"name": name, "arguments": _arguments(function.get("arguments", {}),
                                                              f"{where}.function.arguments")}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise ChatTemplateError(f"{where}.id must be a string")
        out["id"] = call["id"]
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-shaped ``messages`` as a template reads them (``developer`` becomes ``system``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        unknown = sorted(set(m) - _MESSAGE_KEYS)
        if unknown:
            raise ChatTemplateError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
        if m.get("function_call") is not None or m.get("audio") is not None:
            raise ChatTemplateError(f"{where}: 'function_call' and 'audio' are not supported; send 'tool_calls'")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ChatTemplateError(f"{where}: only assistant messages carry 'tool_calls'")
        if "content" not in m and role != "assistant":
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role}
        content = _text(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        if content is None and not calls and role == "assistant" and not m.get("refusal"):
            if "content" not in m and not m.get("reasoning_content"):
                raise ChatTemplateError(f"{where}: an assistant message needs 'content' or 'tool_calls'")
        if role == "assistant" and content is None and m.get("refusal"):
            content = _text(m["refusal"], f"{where}.refusal")
        # A tool-calling turn's null content is handed over as "": templates read it as text (Qwen's split it
        # for <think>), and transformers itself fails on such a template when the key is missing.
        message["content"] = "" if content is None else content
        if calls is not None:
            if not isinstance(calls, list):
                raise ChatTemplateError(f"{where}.tool_calls must be a list")
            message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ChatTemplateError(f"{where}: a tool message needs 'tool_call_id', the id of the call it answers")
            message["tool_call_id"] = call_id
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ChatTemplateError(f"{where}.name must be a string")
            message["name"] = m["name"]
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking") if m.get(k) is not None), None)
        if reasoning is not None:
            if role != "assistant":
                raise ChatTemplateError(f"{where}: only assistant messages carry reasoning")
            reasoning = _text(reasoning, f"{where}.reasoning_content")
            # As transformers hands it over: templates read reasoning_content, some (gpt-oss) thinking.
            message["thinking"] = message["reasoning_content"] = reasoning
        out.append(message)
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A ``tools`` list (OpenAI's ``{"type": "function", "function": {name, description, parameters}}``),
    checked; None for none."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise ChatTemplateError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                               "'parameters': {...}}}} (only function tools are supported)")
        function = dict(tool["function"])
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise ChatTemplateError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in names:
            raise ChatTemplateError(f"{where}: a second tool named {name!r}; tool names must be unique")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ChatTemplateError(f"{where}.function.parameters must be a JSON schema object")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ChatTemplateError(f"{where}.function.description must be a string")
        function["parameters"] = parameters
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out or None


def strings_of(value: Any) -> list[str]:
    """Every string inside ``value`` (keys too), for the control-text guard."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def map_strings(value: Any, f) -> Any:
    """``value`` with ``f`` applied to every string inside it (keys too)."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {map_strings(k, f): map_strings(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_strings(v, f) for v in value]
    return value


def contents_length(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of every string in the messages: the template never makes them shorter."""
    return sum(len(s) for m in messages for s in strings_of([v for k, v in m.items() if k not in ("role", "thinking")]))

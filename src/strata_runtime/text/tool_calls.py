"""Tool calls: how a model writes them (a format per template family), the
grammar that holds its reply to the tools' schemas, and the parse of the
reply into content, reasoning and calls.

Formats, chosen from the template's text (``detect_format``), or named:

- ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  after any text, one block a call.
- ``llama3`` (Llama 3.1-3.3): the whole reply is ``{"name": ..., "parameters": {...}}``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text.
- ``generic`` (a template that knows no tools, as Gemma 3's and SmolLM2's): the
  tools are described in the system message and the whole reply is one
  JSON object, ``{"tool_call": {"name": ..., "arguments": {...}}}`` (``"tool_calls": [...]``
  where calls may be parallel) or ``{"response": "..."}``; past tool calls
  and results are written into the history the same way.

``tool_choice`` ``auto`` leaves text free until the format's trigger (the
generic format's object is constrained from its first token), ``required``
and a named function constrain from the first token, ``none`` generates
text and parses no calls. A trigger that is one special token of the
vocabulary is matched as that token (text cannot spell it); otherwise as text.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import RequestError
from .grammar import JSON_FORMAT, Grammar
from .tokenizer import CONTROL, USER_DEFINED, Tokenizer

FORMATS = ("hermes", "llama3", "mistral", "generic")
CHOICES = ("auto", "required", "none")
_ID_CHARS = string.ascii_letters + string.digits


def detect_format(template_source: str | None) -> str:
    """The tool-call format a chat template was written for (``generic`` where it writes no tool calls)."""
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|start_header_id|>" in source and ("tool_calls" in source or "<|python_tag|>" in source):
        return "llama3"
    return "generic"


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's ``tool_choice``: ``mode`` is one of ``CHOICES`` or ``"named"`` (then ``name`` is the function)."""

    mode: str = "auto"
    name: str | None = None

    @classmethod
    def of(cls, value: Any, tool_names: Sequence[str]) -> "ToolChoice":
        if value is None:
            return cls("auto" if tool_names else "none")
        if isinstance(value, str):
            if value not in CHOICES:
                raise RequestError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                                   f"{{'type': 'function', 'function': {{'name': ...}}}}, got {value!r}")
            if value == "required" and not tool_names:
                raise RequestError("tool_choice is 'required' but the request has no tools")
            return cls(value)
        name = None
        if isinstance(value, dict):
            function = value.get("function")
            name = function.get("name") if isinstance(function, dict) else value.get("name")
        if not isinstance(name, str):
            raise RequestError("tool_choice must be 'auto', 'required', 'none' or "
                               f"{{'type': 'function', 'function': {{'name': ...}}}}, got {str(value)[:80]}")
        if name not in tool_names:
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the request's tools "
                               f"({', '.join(tool_names) or 'none'})")
        return cls("named", name)


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is the JSON text of the arguments as the model wrote it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class AssistantReply:
    """A reply read back: text, reasoning (``<think>`` ... ``</think>``) and calls, each possibly empty."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)


def call_id(fmt: str) -> str:
    # Mistral's template refuses ids that are not 9 letters and digits.
    if fmt == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _json_value_spans(text: str, start: int = 0) -> tuple[dict[str, tuple[int, int]], int]:
    """The top-level keys of the JSON object at ``text[start:]`` (after
    whitespace) with the span of each value's text, and where the object
    ends; ``ValueError`` if there is none."""
    decoder = json.JSONDecoder()
    i = _skip(text, start)
    if i >= len(text) or text[i] != "{":
        raise ValueError("no JSON object")
    i, spans = _skip(text, i + 1), {}
    if i < len(text) and text[i] == "}":
        return spans, i + 1
    while True:
        key, i = decoder.raw_decode(text, i)
        if not isinstance(key, str):
            raise ValueError("a key that is not a string")
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            raise ValueError("no ':' after a key")
        begin = _skip(text, i + 1)
        _, end = decoder.raw_decode(text, begin)
        spans[key] = (begin, end)
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
            continue
        if i < len(text) and text[i] == "}":
            return spans, i + 1
        raise ValueError("an object that does not close")


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """``(reasoning, rest)``: a leading ``<think>`` ... ``</think>`` taken off
    (``opened``: the prompt already opened it). Reasoning cut off by max_tokens is all reasoning."""
    body = text.lstrip() if not opened else text
    if not opened:
        if not body.startswith("<think>"):
            return None, text
        body = body[len("<think>"):]
    end = body.find("</think>")
    if end < 0:
        return body.strip("\n") or None, ""
    return body[:end].strip("\n") or None, body[end + len("</think>"):].lstrip("\n")


class ToolCalling:
    """One request's tools in one format: the prompt's view of them, the
    grammar of the reply, and the reply's parse.

    Invariant: ``tools`` are normalized (``messages.normalize_tools``) and
    non-empty unless ``choice.mode == "none"``; ``trigger``/``closer`` are
    the format's markers as grammar symbols (a special token by id, or a
    string literal)."""

    def __init__(self, fmt: str, tools: Sequence[dict[str, Any]] | None, choice: ToolChoice, parallel: bool,
                 tokenizer: Tokenizer):
        if fmt not in FORMATS:
            raise RequestError(f"tool-call format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.format = fmt
        self.tools = list(tools or [])
        self.choice = choice
        self.parallel = parallel and choice.mode != "named"
        self.tokenizer = tokenizer

    # --- the prompt --------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the template receives them (the generic format describes them in the system message)."""
        return None if self.format == "generic" or not self.tools else self.tools

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` for the template: as they are, but for the generic
        format, whose template knows no tools: calls become the assistant's
        JSON, results a user message, and the tools a system message."""
        if self.format != "generic":
            return messages
        out: list[dict[str, Any]] = []
        results = set()  # indices in ``out`` of user messages made of tool results
        for m in messages:
            from_tool = m["role"] == "tool"
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in m["tool_calls"]]
                # The shape the grammar has the model write, so a returning conversation's prefix stays cached.
                body = {"tool_calls": calls} if self.parallel or len(calls) > 1 else {"tool_call": calls[0]}
                m = {"role": "assistant", "content": json.dumps(body, ensure_ascii=False)}
            elif m["role"] == "assistant" and "content" in m and self.tools:
                m = {"role": "assistant", "content": json.dumps({"response": m["content"]}, ensure_ascii=False)}
            elif m["role"] == "tool":
                result = {"tool_call_id": m["tool_call_id"], "content": m.get("content", "")}
                if m.get("name"):
                    result["name"] = m["name"]
                m = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
            # Templates insist on alternating turns: results join the user turn beside them (two turns the
            # client wrote as users stay apart, for the template to refuse as it would).
            if out and out[-1]["role"] == m["role"] == "user" and (from_tool or len(out) - 1 in results):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + m["content"]}
            else:
                out.append(m)
            if from_tool:
                results.add(len(out) - 1)
        if not self.tools or self.choice.mode == "none":
            return out
        if out and out[0]["role"] == "system":
            return [{"role": "system", "content": out[0]["content"] + "\n\n" + self._generic_instructions()}] + out[1:]
        return [{"role": "system", "content": self._generic_instructions()}] + out

    def _generic_instructions(self) -> str:
        tools = [t["function"] for t in self.tools]
        shape = ('{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}, ...]}' if self.parallel
                 else '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}')
        return ("You can call these tools:\n" + json.dumps(tools, ensure_ascii=False, indent=2) +
                "\n\nAnswer with one JSON object: " + shape + ' to call tools, or {"response": <your answer>}. '
                "A tool's result comes back as a tool_response.")

    # --- the grammar -------------------------------------------------------------------

    def grammar(self) -> Grammar | None:
        """What the reply must match; None where it is free (``tool_choice`` none)."""
        if self.choice.mode == "none" or not self.tools:
            return None
        return Grammar.lark(getattr(self, f"_{self.format}_grammar")())

    def _chosen(self) -> list[dict[str, Any]]:
        if self.choice.mode == "named":
            return [t for t in self.tools if t["function"]["name"] == self.choice.name]
        return self.tools

    def _call_schema(self, args_key: str = "arguments", formatted: bool = True, id_key: bool = False) -> dict:
        variants = []
        for tool in self._chosen():
            properties = {"name": {"const": tool["function"]["name"]}, args_key: tool["function"]["parameters"]}
            if id_key:
                properties["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            variants.append({"type": "object", "properties": properties, "required": ["name", args_key],
                             "additionalProperties": False})
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        return {**schema, "x-guidance": JSON_FORMAT} if formatted else schema

    def _symbol(self, text: str) -> tuple[str, bool]:
        """``text`` as a grammar symbol: the special token that spells it (by id), else a string literal."""
        token = self.tokenizer.ids.get(text)
        if token is not None and self._special(token):
            return f"<[{token}]>", True
        return json.dumps(text), False

    def _special(self, token: int) -> bool:
        kind, text = self.tokenizer.vocab.types[token], self.tokenizer.vocab.tokens[token]
        return kind == CONTROL or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">"))

    def _hermes_grammar(self) -> str:
        opener, special = self._symbol("<tool_call>")
        closer, _ = self._symbol("</tool_call>")
        call = f'{opener} "\\n" %json {json.dumps(self._call_schema())} "\\n" {closer}'
        lines = ["TEXT: /(.|\\n)*/", f"call: {call}",
                 'calls: call ("\\n" call)*' if self.parallel else "calls: call"]
        if self.choice.mode != "auto":
            return "start: calls\n" + "\n".join(lines)
        if special:  # text cannot spell a special token: the text ends where the model writes it
            return "start: TEXT | TEXT calls\n" + "\n".join(lines)
        # The trigger is text: the text before it is lazy (it ends at the first trigger).
        rest = f'"\\n" %json {json.dumps(self._call_schema())} "\\n" {closer}'
        more = '("\\n" call)*' if self.parallel else ""
        return ("start: TEXT | head first " + more + "\n" + "\n".join(lines) +
                f"\nhead[lazy]: TEXT {opener}\nfirst: {rest}")

    def _llama3_grammar(self) -> str:
        call = f"call: %json {json.dumps(self._call_schema('parameters'))}"
        if self.choice.mode != "auto":
            return f"start: call\n{call}"
        # A reply that does not open with "{" is text; one that does is the call.
        return f"start: TEXT | call\nTEXT: /([^{{](.|\\n)*)?/\n{call}"

    def _mistral_grammar(self) -> str:
        opener, _ = self._symbol("[TOOL_CALLS]")
        array = {"type": "array", "items": self._call_schema(formatted=False, id_key=True), "minItems": 1,
                 **({} if self.parallel else {"maxItems": 1}), "x-guidance": JSON_FORMAT}
        calls = f"calls: {opener} %json {json.dumps(array)}"
        if self.choice.mode != "auto":
            return f"start: calls\n{calls}"
        return f"start: TEXT | TEXT calls\nTEXT: /(.|\\n)*/\n{calls}"

    def _generic_grammar(self) -> str:
        call = self._call_schema(formatted=False)
        if self.parallel:
            variant = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                       "required": ["tool_calls"], "additionalProperties": False}
        else:
            variant = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                       "additionalProperties": False}
        if self.choice.mode == "auto":
            text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
            variant = {"anyOf": [variant, text]}
        return f"start: reply\nreply: %json {json.dumps({**variant, 'x-guidance': JSON_FORMAT})}"

    # --- the reply ---------------------------------------------------------------------

    def parse(self, text: str, reasoning_opened: bool = False) -> AssistantReply:
        """The reply ``text`` (control tokens spelled out) as content, reasoning and calls."""
        reasoning, text = split_reasoning(text, reasoning_opened)
        if self.choice.mode == "none" or not self.tools:
            return AssistantReply(text, reasoning)
        content, calls = getattr(self, f"_parse_{self.format}")(text)
        return AssistantReply(content if content else None, reasoning, tuple(calls))

    def _call(self, obj_text: str, args_key: str) -> ToolCall | None:
        """A call from the text of one JSON object naming a known tool, else None."""
        try:
            spans, _ = _json_value_spans(obj_text)
            name = json.loads(obj_text[slice(*spans["name"])])
            begin, end = spans[args_key]
        except (ValueError, KeyError):
            return None
        known = {t["function"]["name"] for t in self.tools}
        if not isinstance(name, str) or name not in known or obj_text[begin] != "{":
            return None
        return ToolCall(call_id(self.format), name, obj_text[begin:end])

    def _parse_hermes(self, text: str) -> tuple[str, list[ToolCall]]:
        first = text.find("<tool_call>")
        if first < 0:
            return text, []
        calls, rest = [], text[first:]
        for block in rest.split("<tool_call>")[1:]:
            call = self._call(block.split("</tool_call>")[0], "arguments")
            if call is None:  # not a call after all: the reply is text
                return text, []
            calls.append(call)
        return text[:first].rstrip(), calls

    def _parse_llama3(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        call = self._call(body, "parameters") if body.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])

    def _parse_mistral(self, text: str) -> tuple[str, list[ToolCall]]:
        first = text.find("[TOOL_CALLS]")
        if first < 0:
            return text, []
        body = text[first + len("[TOOL_CALLS]"):].strip()
        try:
            items, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return text, []
        if not isinstance(items, list):
            return text, []
        calls = [self._call(json.dumps(item, ensure_ascii=False, separators=(", ", ": ")), "arguments")
                 for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:first].rstrip(), calls

    def _parse_generic(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            spans, _ = _json_value_spans(text)
        except ValueError:
            return text, []
        if "response" in spans:
            value = json.loads(text[slice(*spans["response"])])
            return (value if isinstance(value, str) else text), []
        if "tool_call" in spans:
            call = self._call(text[slice(*spans["tool_call"])], "arguments")
            return ("", [call]) if call is not None else (text, [])
        if "tool_calls" in spans:
            begin, end = spans["tool_calls"]
            calls, i, decoder = [], begin + 1, json.JSONDecoder()
            while True:
                i = _skip(text, i)
                if i >= end - 1:
                    break
                _, stop = decoder.raw_decode(text, i)
                calls.append(self._call(text[i:stop], "arguments"))
                i = _skip(text, stop)
                i += text[i] == ","
            if calls and all(c is not None for c in calls):
                return "", calls
        return text, []

"""The OpenAI request and response shapes: parsing at the edge, building replies.

Requests are checked here, before they reach the engine, with messages that
name the fix. Fields this server does not implement are refused with a 400
that says so, never silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .errors import ApiError
from .request_checks import reply_events

# Sampling fields and their engine names; checked by type here and by range
# in strata_runtime.SamplingParams (one place for the rules).
_FLOATS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "repetition_penalty": "repetition_penalty", "repeat_penalty": "repetition_penalty"}
_INTS = {"top_k": "top_k", "seed": "seed"}
_COMMON = {"model", "max_tokens", "stream", "stream_options", "stop", "n", "user", "cache_salt", "logit_bias", *_FLOATS,
           *_INTS}
# Harmless when present: they change nothing about what is generated.
_IGNORED = {"user", "metadata", "store"}
# Known OpenAI fields this server does not implement; "off" values are accepted.
_UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""),
}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
MAX_CACHE_SALT_CHARS = 256
MAX_CHOICES = 16  # n: each choice is a sequence of its own


@dataclass(frozen=True)
class PromptLimits:
    """What the loaded engine can take (None: not known yet): prompts that
    cannot fit are refused here, before they reach the engine."""

    context_length: int | None = None
    max_prompt_chars: int | None = None  # no text longer than this fits (context x longest token)

    @classmethod
    def of(cls, props: dict[str, Any] | None) -> "PromptLimits":
        props = props or {}
        return cls(props.get("context_length"), props.get("max_prompt_chars"))

    def check_chars(self, characters: int) -> None:
        if self.max_prompt_chars is not None and characters > self.max_prompt_chars:
            _too_long(None, self.context_length, characters=characters, max_characters=self.max_prompt_chars)

    def check_tokens(self, tokens: int) -> None:
        if self.context_length is not None and tokens >= self.context_length:
            _too_long(tokens, self.context_length)


def _too_long(tokens: int | None, context_length: int, **characters: int) -> None:
    """The engine's own refusal (one wording for both), as a 400."""
    from strata_runtime.errors import ContextLengthError

    raise ApiError(400, str(ContextLengthError(tokens, context_length, **characters)),
                   code="context_length_exceeded")


def parse_chat(body: Any, models: set[str], limits: PromptLimits) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body -> an engine command (``kind="chat"``)."""
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if "messages" not in body:
        raise ApiError(400, "the request has no 'messages'; send a list of {role, content} objects")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    if "max_completion_tokens" in body and "max_tokens" not in body:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    command = {"kind": "chat", **parse_chat_prompt(body, limits), **sampling_options(body, models, limits)}
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"'logprobs' must be true or false (top_logprobs says how many alternatives), "
                            f"got {_show(wanted)}")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise ApiError(400, f"'top_logprobs' must be a whole number in 0..20, got {_show(top)}")
    if top and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true")
    if wanted:
        command["sampling"]["logprobs"] = top or 0
    grammar = response_format_grammar(body.get("response_format"))
    if grammar is not None:
        if command.get("tools") and command.get("tool_choice") != "none":
            raise ApiError(400, "give 'tools' or a 'response_format' schema, not both (or set tool_choice to 'none')")
        command["sampling"]["grammar"] = grammar
    return command


def parse_chat_prompt(body: dict[str, Any], limits: PromptLimits) -> dict[str, Any]:
    """What makes a chat's prompt: messages, tools and how they are called,
    the template's variables (checked here; the engine renders them)."""
    from strata_runtime.errors import RequestError
    from strata_runtime.text import ToolChoice, normalize_messages, normalize_tools
    from strata_runtime.text.messages import contents_length

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    try:
        normalized = normalize_messages(messages)
        tools = normalize_tools(body.get("tools"))
        # Checked here: a bad choice is a 400 before the engine sees it.
        ToolChoice.of(body.get("tool_choice"), [t["function"]["name"] for t in tools or []])
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, f"'parallel_tool_calls' must be true or false, got {_show(parallel)}")
    variables = body.get("chat_template_kwargs")
    if variables is not None and (not isinstance(variables, dict) or not all(isinstance(k, str) for k in variables)):
        raise ApiError(400, "'chat_template_kwargs' must be an object of the template's variables, such as "
                            "{\"enable_thinking\": false}")
    # The template adds text; it never makes the contents (or the tools) shorter than they are.
    limits.check_chars(contents_length(normalized) + len(json.dumps(tools or [])))
    command: dict[str, Any] = {"messages": messages}
    if tools:
        command["tools"], command["tool_choice"] = tools, body.get("tool_choice")
        command["parallel_tool_calls"] = parallel
    if variables:
        command["chat_template_kwargs"] = variables
    return command


def response_format_grammar(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the engine's grammar (the JSON form
    ``strata_runtime.Grammar.of`` reads), or None for plain text. A schema
    the constraint cannot enforce is refused by the engine, naming the keyword."""
    if value is None:
        return None
    kinds = "'text', 'json_object' or 'json_schema'"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, f"'response_format' must be an object whose 'type' is {kinds}, got {_show(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be {kinds}, got {_show(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object such as "
                            "{\"name\": \"answer\", \"schema\": {...}, \"strict\": true}")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"response_format.json_schema.schema must be a JSON schema object, got {_show(schema)}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"response_format.json_schema.strict must be true or false, got {_show(strict)}")
    # strict or not, the answer is held to the schema: the decoder enforces it, it does not hope for it.
    return {"json_schema": schema}


def parse_completion(body: Any, models: set[str], limits: PromptLimits) -> dict[str, Any]:
    """A ``/v1/completions`` body -> an engine command (``kind="completion"``)."""
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise ApiError(400, "the request has no 'prompt'; send a string (or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        limits.check_tokens(len(prompt))
    elif isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be one string or one list of token ids; "
                            "batches of prompts are not supported, send one request per prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string")
    else:
        limits.check_chars(len(prompt))
    command = {"kind": "completion", "prompt": prompt, **sampling_options(body, models, limits)}
    wanted = body.get("logprobs")
    if wanted is not None and (not _is_int(wanted) or not 0 <= wanted <= 5):
        raise ApiError(400, f"'logprobs' (completions: how many alternatives a token) must be a whole number in "
                            f"0..5, got {_show(wanted)}")
    if wanted is not None:
        command["sampling"]["logprobs"] = wanted
    return command


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise ApiError(400, f"'{name}' is not supported by this server; remove it from the request",
                           code="unsupported_parameter")
    unknown = sorted(set(body) - allowed - set(_UNSUPPORTED) - _IGNORED)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; "
                            f"this endpoint accepts {', '.join(sorted(allowed))}", code="unknown_parameter")


def sampling_options(body: dict[str, Any], models: set[str], limits: PromptLimits) -> dict[str, Any]:
    """The fields every generating request shares (model, max_tokens, sampling, stop, stream, cache_salt), checked."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, one of: {', '.join(sorted(models))}; got {_show(model)}")
    if model is not None and model not in models:
        raise ApiError(404, f"model {_show(model)} is not served here; use one of: {', '.join(sorted(models))} "
                            f"(GET /v1/models lists them)", code="model_not_found")
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be a whole number in 1..{MAX_CHOICES}, got {_show(n)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {_show(stream)}")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ApiError(400, f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, "
                            f"got {_show(salt)}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}")
    sampling: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ApiError(400, f"'max_tokens' must be a whole number of at least 1, got {_show(max_tokens)}")
    context_length = limits.context_length
    if max_tokens is None:  # the default: as many as the context leaves room for, up to 256
        max_tokens = 256
    elif context_length is not None and max_tokens > context_length:
        raise ApiError(400, f"'max_tokens' is {_show(max_tokens)} but the context holds {context_length} tokens; "
                            f"ask for at most {context_length}")
    sampling["max_tokens"] = max_tokens
    for name, engine_name in _FLOATS.items():
        if name in body and body[name] is not None:
            value = _finite_float(body[name])
            if value is None:
                raise ApiError(400, f"'{name}' must be a finite number, got {_show(body[name])}")
            sampling[engine_name] = value
    for name, engine_name in _INTS.items():
        if name in body and body[name] is not None:
            if not _is_int(body[name]):
                raise ApiError(400, f"'{name}' must be a whole number, got {_show(body[name])}")
            sampling[engine_name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings")
        sampling["stop"] = stops
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers in [-100, 100]")
        if bias:
            sampling["logit_bias"] = bias
    _check_sampling(sampling)
    return {"sampling": sampling, "stream": stream, "cache_salt": salt, **({"n": n} if n > 1 else {}),
            "include_usage": bool(options and options.get("include_usage"))}


def _check_sampling(sampling: dict[str, Any]) -> None:
    from strata_runtime.scheduling import SamplingParams

    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_float(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, NaN, infinite, or an
    integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _show(value: Any, limit: int = 60) -> str:
    """A value as an error message quotes it: short, whatever the client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# --- replies ---------------------------------------------------------------------


class Reply:
    """The ids and shapes of one response, streamed or whole."""

    def __init__(self, kind: str, model: str, index: int = 0):
        self.kind = kind
        self.model = model
        self.index = index  # the choice this reply writes
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def choices(self, n: int) -> list["Reply"]:
        """This reply and ``n - 1`` more of the same response, one a choice."""
        out = [self]
        for i in range(1, n):
            other = Reply(self.kind, self.model, i)
            other.id, other.created = self.id, self.created
            out.append(other)
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": self.index, "message": message_of(text, done.get("reply")),
                      "finish_reason": done["finish_reason"], "logprobs": self.logprobs_of(done.get("logprobs"))}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": self.index, "text": text, "finish_reason": done["finish_reason"],
                      "logprobs": self.logprobs_of(done.get("logprobs"))}
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage(done)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            return self._envelope("chat.completion.chunk",
                                  [{"index": self.index, "delta": delta, "finish_reason": finish_reason,
                                    "logprobs": None}])
        return self._envelope("text_completion",
                              [{"index": self.index, "text": text or "", "finish_reason": finish_reason,
                                "logprobs": None}])

    def logprobs_of(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """Tokens' log-probabilities as this endpoint writes them: chat's ``content``
        list, or the completions' ``tokens``/``token_logprobs``/``top_logprobs`` lists."""
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
                "text_offset": None}

    def logprobs_chunk(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed piece's tokens' log-probabilities, in a chunk of their own."""
        if self.kind == "chat":
            return self._envelope("chat.completion.chunk", [{"index": self.index, "delta": {}, "finish_reason": None,
                                                             "logprobs": self.logprobs_of(entries)}])
        return self._envelope("text_completion", [{"index": self.index, "text": "", "finish_reason": None,
                                                   "logprobs": self.logprobs_of(entries)}])

    def delta_chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        """One delta of a chat's reply (``strata_runtime.text.reply_stream``) as a chunk: a call's
        id, type and name once, then its arguments' text as the model writes it, keyed by index."""
        if "tool_call" in delta:
            call = delta["tool_call"]
            body = {"tool_calls": [{"index": call["index"], "id": call["id"], "type": "function",
                                    "function": {"name": call["name"], "arguments": ""}}]}
        elif "tool_arguments" in delta:
            part = delta["tool_arguments"]
            body = {"tool_calls": [{"index": part["index"], "function": {"arguments": part["text"]}}]}
        else:
            body = delta  # {"content": ...} or {"reasoning_content": ...}
        return self._delta(body)

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", [{"index": self.index, "delta": delta, "finish_reason": None,
                                                         "logprobs": None}])

    async def sse(self, first, events: AsyncIterator, include_usage: bool, end: bool = True) -> AsyncIterator[bytes]:
        """A chat streams its reply as the engine reads it (``deltas``: content,
        reasoning, tool calls); a completion streams its text. ``end``: close
        the stream (usage, ``[DONE]``) after this choice's last chunk."""
        yield sse_data(self.chunk(first=True))

        def done(value: dict[str, Any]) -> list[bytes]:
            self.done = value
            final = self.chunk(finish_reason=value["finish_reason"])
            if not end:
                return [sse_data(final)]
            final["usage"] = usage(value)
            out = [sse_data(final)]
            if include_usage:
                out.append(sse_data(self.usage_chunk(value)))
            return out + [b"data: [DONE]\n\n"]

        # Headers are gone already: an error travels as an event.
        async for out in reply_events(first, events, lambda d: [sse_data(self.delta_chunk(d))],
                                      lambda e: sse_data(e.body()), done,
                                      lambda text: [] if self.kind == "chat" else [sse_data(self.chunk(text=text))],
                                      lambda entries: [sse_data(self.logprobs_chunk(entries))]):
            yield out

    def usage_chunk(self, done: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(done)}


def message_of(text: str, reply: dict[str, Any] | None) -> dict[str, Any]:
    """The assistant message: the engine's reading of the reply (content,
    reasoning, tool calls) where it made one, else the text."""
    if reply is None:
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("reasoning_content"):
        message["reasoning_content"] = reply["reasoning_content"]
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return message


def sse_data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(done: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": done["prompt_tokens"],
        "completion_tokens": done["completion_tokens"],
        "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]},
    }

"""``/tokenize`` and ``/detokenize`` (vLLM's shapes): request bodies to engine commands, answers to replies.

A prompt is tokenized as ``/v1/completions`` reads it; messages (with tools)
as ``/v1/chat/completions`` renders them, so ``count`` is the prompt tokens
a chat request's ``usage`` reports.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError
from .openai_api import PromptLimits, parse_chat_prompt
from .request_checks import check_fields

TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "messages", "tools", "tool_choice", "parallel_tool_calls",
                   "chat_template_kwargs", "add_generation_prompt"}
MAX_DETOKENIZE = 1 << 20


def parse_tokenize(body: Any, limits: PromptLimits) -> dict[str, Any]:
    body = check_fields(body, TOKENIZE_FIELDS, "/tokenize")
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "send 'prompt' (a string) or 'messages' (a chat), one of the two")
    if body.get("add_generation_prompt", True) is not True:
        raise ApiError(400, "'add_generation_prompt' can only be true: a chat is counted as it is sent to the model")
    if "messages" in body:
        return {"kind": "tokenize", **parse_chat_prompt(body, limits)}
    prompt, special = body["prompt"], body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string")
    if not isinstance(special, bool):
        raise ApiError(400, "'add_special_tokens' must be true or false")
    limits.check_chars(len(prompt))
    return {"kind": "tokenize", "prompt": prompt, "add_special_tokens": special}


def parse_detokenize(body: Any) -> dict[str, Any]:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "send {\"tokens\": [token ids]}")
    if len(tokens) > MAX_DETOKENIZE:
        raise ApiError(400, f"at most {MAX_DETOKENIZE} tokens a request")
    unknown = sorted(set(body) - {"tokens", "model"})
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; /detokenize accepts model, tokens",
                       code="unknown_parameter")
    return {"kind": "detokenize", "tokens": tokens}

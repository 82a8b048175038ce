"""Chat messages to a prompt, through the Jinja template stored in the GGUF."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Sequence

import json

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import RequestError

log = logging.getLogger(__name__)

# For files converted without ``tokenizer.chat_template``: the template each
# architecture's instruction-tuned checkpoints were trained with.
_GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
FALLBACK_TEMPLATES = {"gemma3": _GEMMA_TEMPLATE}

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(RequestError):
    """Messages the template cannot render (the message says why)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as Hugging Face's ``apply_chat_template`` writes it (the templates
    were written against it): Jinja's own filter escapes ``<``, ``>``, ``&``
    and ``'``, sorts keys and escapes non-ASCII text."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(Namespace):
    """Jinja's ``namespace()`` without attributes that start with ``_`` (no reaching Python's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"a chat template may not set {name!r} on a namespace (names starting with _)")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class ChatTemplate:
    """A compiled chat template. Invariant: rendering is pure; the template
    runs in Jinja's immutable sandbox, so a template from a file cannot
    reach Python objects or change state."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "file"):
        # The environment Hugging Face's apply_chat_template gives a template, which the templates were written for.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["namespace"] = _Namespace
        env.globals["dict"] = _Dict()
        self.template = env.from_string(source)
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_model(cls, source: str | None, architecture: str, bos_token: str, eos_token: str) -> "ChatTemplate | None":
        if source:
            return cls(source, bos_token, eos_token, origin="file")
        fallback = FALLBACK_TEMPLATES.get(architecture)
        if fallback is None:
            return None
        log.info("the model file has no tokenizer.chat_template; using the built-in %s template", architecture)
        return cls(fallback, bos_token, eos_token, origin=f"built-in {architecture}")

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt text of ``messages`` (as ``messages.normalize_messages``
        gives them), with ``tools`` and any other ``variables`` the template
        reads (``enable_thinking``), as ``apply_chat_template`` renders them."""
        validate_messages(messages)
        try:
            return self.template.render(
                messages=list(messages),
                tools=None if not tools else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content' (or 'tool_calls')")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if "content" in m and not isinstance(m["content"], str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")

"""Chat messages to a prompt, through the Jinja template stored in the GGUF."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

ROLES = ("system", "user", "assistant")


class ChatTemplateError(RequestError):
    """Messages the template cannot render (the message says why)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template. Invariant: rendering is pure; the template
    runs in Jinja's immutable sandbox, so a template from a file cannot
    reach Python objects or change state."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "file"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
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

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        try:
            return self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")

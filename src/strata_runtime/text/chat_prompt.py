"""Chat messages to prompt tokens: the template's control tokens, and only those.

A chat template writes control tokens (``<start_of_turn>``, ``<|im_end|>``)
around the messages, and the rendered text is tokenized with special-token
parsing on so that they become real control tokens. A message that contains
such a text itself must not forge a turn: before rendering, every control
token text in a message's content is swapped for a private-use character
that occurs nowhere else (``ControlTextGuard``); the plain stretches of the
tokenized prompt are swapped back and tokenized as plain text. Template
filters such as ``trim`` see ordinary non-space characters, so the prompt is
the same text as before, tokenized as llama.cpp would tokenize the contents
alone.

Turn boundaries (where a returning conversation is likely to diverge, and so
where running-state checkpoints pay) are read from the one tokenized prompt:
the positions of the token that opens a turn, which is the first control
token of the template's generation prompt (``TurnMarker``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .chat_template import ChatTemplate
from .messages import map_strings, strings_of
from .tokenizer import CONTROL, UNKNOWN, Tokenizer

log = logging.getLogger(__name__)

# Supplementary Private Use Area-A: never in real text a template writes.
_PRIVATE_USE = range(0xF0000, 0xFFFFE)


class ControlTextGuard:
    """Stand-ins for the control token texts found in one request's contents.

    Invariant: each stand-in is one private-use character that occurs in no
    content, not in the template, and in no special token's text; ``table``
    maps it back to the control token text it replaced."""

    def __init__(self, tokenizer: Tokenizer, contents: Sequence[str], template_source: str):
        self._tokenizer = tokenizer
        self._by_text: dict[str, str] = {}
        self.table: dict[int, str] = {}
        self._taken: set[str] | None = None
        self._contents = contents
        self._template_source = template_source

    def protect(self, content: str) -> str:
        """``content`` with each control token text it holds replaced by its stand-in."""
        pieces = self._tokenizer.split_special(content)
        if all(isinstance(p, str) or not self._is_control(p) for p in pieces):
            return content
        out = []
        for p in pieces:
            if isinstance(p, str):
                out.append(p)
            elif self._is_control(p):
                out.append(self._stand_in(self._tokenizer.vocab.tokens[p]))
            else:
                out.append(self._tokenizer.vocab.tokens[p])
        return "".join(out)

    def restore(self, text: str) -> str:
        """The text a plain stretch of the rendered prompt stands for."""
        return text.translate(self.table) if self.table else text

    def _is_control(self, token: int) -> bool:
        return self._tokenizer.vocab.types[token] in (CONTROL, UNKNOWN)

    def _stand_in(self, control_text: str) -> str:
        if control_text not in self._by_text:
            if self._taken is None:
                self._taken = set(self._template_source).union(*self._contents, self._tokenizer.special_chars)
            char = next(chr(c) for c in _PRIVATE_USE if chr(c) not in self._taken)
            self._taken.add(char)
            self._by_text[control_text] = char
            self.table[ord(char)] = control_text
        return self._by_text[control_text]


@dataclass(frozen=True)
class TurnMarker:
    """The token that opens a turn, and how many tokens the generation prompt takes."""

    token: int
    generation_prompt_tokens: int

    @classmethod
    def of(cls, template: ChatTemplate | None, tokenizer: Tokenizer) -> "TurnMarker | None":
        """Read from rendering one short conversation with and without the
        generation prompt; None when the template does not open turns with a
        control token (then only ``checkpoint_every`` places checkpoints)."""
        if template is None:
            return None
        probe = [{"role": "user", "content": "x"}]
        try:
            without = template.render(probe, add_generation_prompt=False)
            with_prompt = template.render(probe, add_generation_prompt=True)
        except Exception as e:  # a template that wants other messages: no boundaries, still a working engine
            log.info("no chat turn boundaries: the template did not render a one-message probe (%s)", e)
            return None
        if not with_prompt.startswith(without) or with_prompt == without:
            return None
        suffix = tokenizer.encode(with_prompt[len(without):], add_bos=False, special=True)
        opening = next((t for t in suffix if tokenizer.vocab.types[t] == CONTROL), None)
        return None if opening is None else cls(opening, len(suffix))

    def boundaries(self, prompt: Sequence[int]) -> list[int]:
        """Positions where a turn opens, after the first token and before the generation prompt."""
        end = len(prompt) - self.generation_prompt_tokens
        return [i for i in range(1, end) if prompt[i] == self.token]


def render_and_tokenize(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                        add_generation_prompt: bool, check_chars: Callable[[int], None],
                        abort: Callable[[], bool] | None = None, tools: Sequence[dict[str, Any]] | None = None,
                        variables: dict[str, Any] | None = None) -> list[int]:
    """The prompt tokens of ``messages`` (and ``tools``, and the template's
    other ``variables``): control tokens from the template only. Every
    string a client sent is guarded, contents and tool calls' arguments,
    tool results, reasoning and the tools' own descriptions alike.

    ``check_chars`` sees the rendered length before any tokenizing (it raises
    when the text cannot fit)."""
    sent = [messages, tools or []]
    guard = ControlTextGuard(tokenizer, strings_of(sent), template.source + template.bos_token + template.eos_token)
    messages, tools = map_strings(messages, guard.protect), map_strings(tools, guard.protect)
    text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **(variables or {}))
    check_chars(len(text))
    ids = tokenizer.encode(text, add_bos=False, special=True, unescape=guard.restore, abort=abort)
    bos = tokenizer.bos_id
    if tokenizer.vocab.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def chat_template_of(gguf, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The model's chat template (``tokenizer.chat_template``, else the
    architecture's built-in one, else None), given BOS and EOS as the
    vocabulary spells them."""
    def spelled(token: int | None) -> str:
        return "" if token is None else tokenizer.vocab.tokens[token]

    return ChatTemplate.for_model(gguf.get("tokenizer.chat_template"), gguf.architecture,
                                  spelled(tokenizer.bos_id), spelled(tokenizer.eos_id))

"""Grammars a generation must follow (a JSON schema, any JSON object, a Lark
grammar, a regular expression), compiled by ``llguidance`` against the
model's own vocabulary.

``Grammar`` is what a request asks for: plain data, hashable, JSON-able (it
crosses the server's process boundary as ``{"json_schema": {...}}``).
``GrammarCompiler`` turns it into an ``llguidance.LLMatcher`` for one
sequence; the vocabulary llguidance reads (each token's bytes, control
tokens spelled ``b"\\xff" + text`` as llguidance expects, so a grammar can
never produce one as text) is built once per tokenizer, on the first
constrained request (1.6 s at Gemma 3's 262,144 tokens, 0.25 s at 49,152).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from .tokenizer import CONTROL, USER_DEFINED, Tokenizer

log = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "lark", "regex")
# JSON as OpenAI's structured outputs write it: one line, ", " and ": ". A
# schema allowing any whitespace lets a weak model pad forever before max_tokens.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 200_000


class GrammarError(RequestError):
    """A grammar that cannot be compiled or enforced (the message names what and why)."""


@dataclass(frozen=True)
class Grammar:
    """What a generation's text must match. Invariant: ``kind`` is one of
    ``GRAMMAR_KINDS``; ``source`` is the grammar's text (a JSON schema as
    JSON text, its keys in the given order: properties are generated in it)."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> "Grammar":
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def of(cls, value: "Grammar | dict[str, Any] | None") -> "Grammar | None":
        """A ``Grammar`` from itself or its JSON form: ``{"json_schema": {...}}``,
        ``{"json_object": true}``, ``{"lark": "..."}`` or ``{"regex": "..."}``."""
        if value is None or isinstance(value, Grammar):
            return value
        if not isinstance(value, dict) or len(value) != 1:
            raise GrammarError("grammar must be a Grammar or one of {'json_schema': {...}}, {'json_object': true}, "
                               f"{{'lark': '...'}}, {{'regex': '...'}}; got {str(value)[:80]}")
        (kind, body), = value.items()
        if kind == "json_schema":
            return cls.json_schema(body)
        if kind == "json_object" and body is True:
            return cls.json_object()
        if kind in ("lark", "regex") and isinstance(body, str) and body:
            return getattr(cls, kind)(body)
        raise GrammarError(f"grammar {kind!r} must be given as {{'json_schema': {{...}}}}, {{'json_object': true}}, "
                           "{'lark': '<grammar text>'} or {'regex': '<pattern>'}")

    def as_dict(self) -> dict[str, Any]:
        """The JSON form ``of`` reads back."""
        return {self.kind: json.loads(self.source) if self.kind == "json_schema" else self.source}

    def llguidance_source(self) -> str:
        """The grammar as ``llguidance.LLMatcher`` takes it."""
        import llguidance

        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar has {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS} are "
                               "accepted")
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_FORMAT)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        return llguidance.LLMatcher.grammar_from_regex(self.source)


def grammar_token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes as llguidance reads them: control tokens (and
    user-defined ones that look like them, ``<...>``) behind a 0xFF byte, so
    a grammar matches them only where it names them as special tokens."""
    vocab, out = tokenizer.vocab, []
    for i, text in enumerate(vocab.tokens):
        kind = vocab.types[i]
        if kind == CONTROL or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">")):
            out.append(b"\xff" + text.encode("utf-8"))
        else:
            out.append(tokenizer.token_bytes(i))
    return out


class _TokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = grammar_token_bytes(tokenizer)
        self.special_token_ids: list[int] = []

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenizer.encode(data.decode("utf-8", errors="replace"), add_bos=False)


class GrammarCompiler:
    """Grammars to matchers for one tokenizer. Invariant: ``_compiled`` holds
    at most ``CACHE`` matchers fresh from compiling (never advanced: each
    sequence gets a deep copy), most recently used last."""

    CACHE = 64

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._vocabulary = None
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.Lock()  # a server's request thread and a notebook may both compile

    def vocabulary(self):
        """The ``llguidance.LLTokenizer`` of this tokenizer (built on first use)."""
        with self._lock:
            if self._vocabulary is None:
                import llguidance

                start = time.perf_counter()
                view = _TokenizerView(self.tokenizer)
                eos = sorted(self.tokenizer.end_of_generation) or None
                self._vocabulary = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), eos_token=eos)
                log.info("built the grammar vocabulary of %d tokens in %.1f s (once per engine)",
                         len(view.tokens), time.perf_counter() - start)
            return self._vocabulary

    def matcher(self, grammar: Grammar):
        """A fresh ``llguidance.LLMatcher`` for ``grammar``; ``GrammarError``
        naming what it cannot compile or enforce (a JSON schema keyword
        llguidance does not implement, a syntax error)."""
        import llguidance

        vocabulary = self.vocabulary()
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        source = grammar.llguidance_source()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, vocabulary)
        if failed:
            raise GrammarError(_explain(grammar, messages[0] if messages else "unknown error"))
        compiled = llguidance.LLMatcher(vocabulary, source, log_level=0)
        if compiled.is_error():
            raise GrammarError(_explain(grammar, compiled.get_error()))
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def _explain(grammar: Grammar, message: str) -> str:
    message = message.strip()
    if grammar.kind == "json_schema":
        if message.startswith("Unimplemented keys"):
            return (f"the JSON schema uses keywords the constrained decoder cannot enforce ({message[20:]}); "
                    "remove them, or check the value after generation")
        return f"the JSON schema cannot be used: {message}"
    return f"the {grammar.kind} grammar cannot be compiled: {message}"

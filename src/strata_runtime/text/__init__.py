"""The text side of a model, all from its GGUF: the tokenizer, the chat template, prompts rendered from
messages (the control-text guard: a message cannot forge a turn), and stop strings over the decoded text."""

from .chat_prompt import TurnMarker, chat_template_of, render_and_tokenize
from .chat_template import ChatTemplate, ChatTemplateError
from .stream import StopTextStream
from .tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "StopTextStream",
    "Tokenizer",
    "TurnMarker",
    "chat_template_of",
    "render_and_tokenize",
]

"""The text side of a model, all from its GGUF: the tokenizer, the chat template, prompts rendered from
messages (the control-text guard: a message cannot forge a turn), stop strings over the decoded text, and
grammars compiled against the vocabulary (constrained decoding)."""

from .chat_prompt import TurnMarker, chat_template_of, render_and_tokenize
from .chat_template import ChatTemplate, ChatTemplateError
from .grammar import Grammar, GrammarCompiler, GrammarError
from .messages import normalize_messages, normalize_tools
from .reply_stream import ReplyStream
from .tool_calls import FORMATS as TOOL_CALL_FORMATS
from .tool_calls import AssistantReply, ToolCall, ToolCalling, ToolChoice, detect_format, split_reasoning
from .stream import StopTextStream
from .tokenizer import Tokenizer

__all__ = [
    "AssistantReply",
    "ReplyStream",
    "TOOL_CALL_FORMATS",
    "ToolCall",
    "ToolCalling",
    "ToolChoice",
    "detect_format",
    "normalize_messages",
    "normalize_tools",
    "split_reasoning",
    "ChatTemplate",
    "ChatTemplateError",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "StopTextStream",
    "Tokenizer",
    "TurnMarker",
    "chat_template_of",
    "render_and_tokenize",
]

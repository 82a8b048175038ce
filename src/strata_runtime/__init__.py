"""strata_runtime: load a GGUF model and generate from it.

    import strata_runtime
    engine = strata_runtime.load()          # the embedded default model
    print(engine.generate("The capital of France is", temperature=0).text)

Importing this package does no work and loads none of its subpackages: the
names below are looked up on first use (``load`` brings in what a model
needs; a layer split's code only where one is asked for).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import Cancelled, ContextLengthError, ModelFileError, QueueFull, StrataError

if TYPE_CHECKING:  # for readers and type checkers: what the lazy names are
    from .config import EngineConfig
    from .engine import Engine, load
    from .scheduling import Completion, SamplingParams
    from .text import ChatTemplateError, Grammar, GrammarError

# name -> the module (under this package) that defines it
_LAZY = {"load": "engine", "Engine": "engine", "EngineConfig": "config", "Completion": "scheduling",
         "SamplingParams": "scheduling", "ChatTemplateError": "text", "Grammar": "text", "GrammarError": "text"}

__all__ = [
    "QueueFull",
    "Cancelled",
    "ChatTemplateError",
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "Grammar",
    "GrammarError",
    "ModelFileError",
    "SamplingParams",
    "StrataError",
    "load",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

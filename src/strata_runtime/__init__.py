"""strata_runtime: load a GGUF model and generate from it.

    import strata_runtime
    engine = strata_runtime.load()          # the embedded default model
    print(engine.generate("The capital of France is", temperature=0).text)

Importing this package does no work; ``load`` does.
"""

from .chat_template import ChatTemplateError
from .engine import Completion, Engine, EngineConfig, load
from .errors import Cancelled, ContextLengthError, ModelFileError, QueueFull, StrataError
from .sampling import SamplingParams

__all__ = [
    "QueueFull",
    "Cancelled",
    "ChatTemplateError",
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "ModelFileError",
    "SamplingParams",
    "StrataError",
    "load",
]

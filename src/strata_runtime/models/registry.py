"""One module per architecture; the loader picks it from ``general.architecture``.

Each module offers ``ModelArgs`` (``from_config(config, vocab_size)``, and
``state_spec()``: the state each layer keeps) and ``Model(args, weights)``,
a ``decoder.DecoderModel`` (the model interface).
"""

from __future__ import annotations

from importlib import import_module

from ..errors import ModelFileError

# general.architecture -> module under strata_runtime.models
ARCHITECTURES = {"gemma3": "gemma3", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3moe",
                 "qwen3next": "qwen3next"}


def model_module(architecture: str, path=None):
    name = ARCHITECTURES.get(architecture)
    if name is None:
        where = f"{path}: " if path else ""
        raise ModelFileError(
            f"{where}architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return import_module(f"{__package__}.{name}")

"""One module per architecture; the loader picks it from ``general.architecture``."""

from __future__ import annotations

from importlib import import_module
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..errors import ModelFileError

# general.architecture -> module under strata_runtime.models
ARCHITECTURES = {"gemma3": "gemma3", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def model_module(architecture: str, path=None):
    name = ARCHITECTURES.get(architecture)
    if name is None:
        where = f"{path}: " if path else ""
        raise ModelFileError(
            f"{where}architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return import_module(f"{__name__}.{name}")


def build_model(gguf, module, args, dtype: torch.dtype, place: Callable[[str], torch.device | str],
                progress: bool, desc: str):
    """``module.Model`` over ``gguf``'s tensors, each read onto ``place(name)``
    (a device, or ``"meta"`` for a tensor another process holds), with a
    progress bar."""
    names = gguf.tensor_names()
    with tqdm(total=len(names), desc=desc, unit="tensor", disable=not progress) as bar:

        def weights(name: str):
            bar.update(1)
            return gguf.tensor(name).to(place(name))

        with torch.inference_mode():
            return module.Model(args, weights, dtype)

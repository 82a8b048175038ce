"""The one way a model is built, in one pass: open the file, pick the
architecture module, place every tensor, choose each device's backend,
build the model.

``engine.load`` (one device, or a split in this process) and the ranks of a
split across processes (``ranks.join_stage``) both come through here; only
their ``Placement`` differs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch
from tqdm.auto import tqdm

from strata_kernels import QuantTensor

from ..errors import ModelFileError, StrataError
from ..faults import describe, is_out_of_memory
from ..files import EMBEDDING, Backend, ComputePath, GGUFFile, Placement, resolve
from .layers import weight_paths
from .registry import model_module

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedModel:
    """A GGUF file and what its metadata says: the architecture's module and
    its ``ModelArgs`` (no tensor read yet)."""

    gguf: GGUFFile
    module: ModuleType
    args: object

    @property
    def state_spec(self):
        return self.args.state_spec()


def open_model(path_or_file: str | Path | GGUFFile) -> OpenedModel:
    gguf = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile.open(path_or_file)
    module = model_module(gguf.architecture, gguf.path)
    gguf.check_block_count()
    with malformed_as_model_file_error(gguf):
        opened = OpenedModel(gguf, module, module.ModelArgs.from_config(gguf.config, vocab_size(gguf)))
        opened.state_spec  # computed from the metadata: a bad value fails here, not in the first request
    check_tensor_shapes(opened)
    return opened


def check_tensor_shapes(opened: OpenedModel) -> None:
    """Every tensor the metadata gives a shape for has it (``ModelFileError``
    naming the tensor otherwise): the token table's width, and each layer's
    (``ModelArgs.tensor_shapes``) where the file has the tensor."""
    gguf, args = opened.gguf, opened.args
    expected = {EMBEDDING: (args.vocab_size, args.hidden_size)}
    for layer in range(args.n_layers):
        expected |= {f"blk.{layer}.{name}": shape for name, shape in args.tensor_shapes(layer).items()}
    for name, shape in expected.items():
        if gguf.has_tensor(name) and (actual := gguf.tensor_info(name).shape) != shape:
            raise ModelFileError(f"{gguf.path}: tensor {name} has shape {list(actual)}, but the metadata "
                                 f"({gguf.architecture}.embedding_length, .attention.head_count, "
                                 f".attention.head_count_kv, .attention.key_length, .feed_forward_length) gives "
                                 f"{list(shape)}; the file is malformed: convert it again")


def vocab_size(gguf: GGUFFile) -> int:
    """The number of rows of the token table: the logits' width (the one rule)."""
    return gguf.tensor_info(EMBEDDING).shape[0]


def check_vocabulary(gguf: GGUFFile, tokens: int) -> None:
    """The tokenizer's ids must all have a row in the token table: an id in
    between would index past it (a device-side assert on a GPU)."""
    rows = vocab_size(gguf)
    if tokens > rows:
        raise ModelFileError(f"{gguf.path}: the tokenizer has {tokens} tokens (tokenizer.ggml.tokens) but the token "
                             f"table {EMBEDDING} has {rows} rows; the file is malformed: convert it again")


@contextmanager
def malformed_as_model_file_error(gguf: GGUFFile) -> Iterator[None]:
    """Whatever building a model from ``gguf`` trips over in its metadata or
    tensor shapes (a zero head count, an array where a number belongs, a
    shape that does not fit) becomes a ``ModelFileError`` naming the file;
    the checks that name a key or tensor raise their own before this."""
    try:
        yield
    except ModelFileError as e:
        if str(gguf.path) in str(e):
            raise
        raise ModelFileError(f"{gguf.path}: {e}") from e
    except (ZeroDivisionError, TypeError, ValueError, IndexError, KeyError, OverflowError, AttributeError,
            RuntimeError) as e:
        if isinstance(e, StrataError) or is_out_of_memory(e):
            raise
        raise ModelFileError(f"{gguf.path} does not describe a {gguf.architecture} model Strata can build "
                             f"({type(e).__name__}: {describe(e)}); its metadata or tensor shapes are malformed: "
                             "convert it again") from e


class Weights:
    """What a model file reads its tensors through.

    ``weights(name)`` is the tensor on its placed device; ``weights(name,
    head=True)`` the same tensor read as the output head (a tied token
    table: on the last stage, the very same ``QuantTensor`` when that is
    the embedding's device). ``backend(name)`` is the ``Backend`` of the
    device ``name`` is placed on, chosen once per device.
    """

    def __init__(self, gguf: GGUFFile, placement: Placement, path: ComputePath, bar=None):
        self.gguf = gguf
        self.placement = placement
        self.path = path
        self.activations = path.activations
        self._names = set(gguf.tensor_names())
        self._loaded: dict[tuple[str, torch.device], QuantTensor] = {}
        self._backends: dict[torch.device, Backend] = {}
        self._bar = bar

    def __call__(self, name: str, head: bool = False) -> QuantTensor:
        device = self.placement.device_of(name, head)
        key = (name, device)
        if key not in self._loaded:
            if self._bar is not None:
                self._bar.update(1)
            self._loaded[key] = self.gguf.tensor(name).to(device)
        return self._loaded[key]

    def on_host(self, name: str) -> QuantTensor:
        """``name`` read on the CPU, whatever the placement: a small tensor
        every stage derives constants from (llama3's ``rope_freqs``)."""
        return self.gguf.tensor(name)

    def has(self, name: str) -> bool:
        return name in self._names

    def backend(self, name: str, head: bool = False) -> Backend:
        device = self.placement.device_of(name, head)
        if device not in self._backends:
            self._backends[device] = Backend.choose(device, self.activations, self.path.fast,
                                                    self.path.prefill_matmuls)
        return self._backends[device]

    def backends(self) -> list[Backend]:
        """Every backend chosen so far, one per device."""
        return list(self._backends.values())

    def layer_backend(self, layer: int) -> Backend:
        return self.backend(f"blk.{layer}.")


def build_model(opened: OpenedModel, placement: Placement, dtype: str, progress: bool, desc: str):
    """``opened.module.Model`` over the file's tensors, each on its placed
    device, with a progress bar over the tensors read. ``dtype`` (see
    ``compute_path``) is resolved on the first stage's device; the model
    keeps the result as ``compute_path``."""
    path = resolve(dtype, placement.stage_devices[0])
    names = opened.gguf.tensor_names()
    with tqdm(total=len(names), desc=desc, unit="tensor", disable=not progress) as bar:
        weights = Weights(opened.gguf, placement, path, bar)
        with torch.inference_mode(), malformed_as_model_file_error(opened.gguf):
            model = opened.module.Model(opened.args, weights)
    model.placement = placement
    model.activations = path.activations
    model.compute_path = path
    model.backends = weights.backends()
    dense = {name: how for name, how in weight_paths(model).items() if how.startswith("dense")}
    if dense and path.fast:
        log.warning("the kernels here cannot read %s: dequantized at load instead, costing %s of memory and "
                    "speed (strata info lists what each type takes)", ", ".join(dense),
                    ", ".join(f"{name} {how.removeprefix('dense copy ')}" for name, how in dense.items()))
    return model

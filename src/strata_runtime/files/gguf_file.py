"""Opening a GGUF file: metadata as a typed config, weights as QuantTensors.

The file is memory-mapped through ``gguf.GGUFReader``; a tensor's bytes are
read only when something touches them, so opening a file costs its header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from strata_kernels import SUPPORTED_TYPES, QuantTensor, block_format

from ..errors import ModelFileError
from .gguf_reader import CompactGGUFReader

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, last dimension is the row length
    nbytes: int


@dataclass(frozen=True)
class ModelConfig:
    """The architecture-level hyperparameters of a GGUF, read from ``{arch}.*`` keys.

    ``metadata`` holds every scalar and string key as plain Python values (big
    arrays such as the vocabulary are left in the file until asked for), so a
    model's ``ModelArgs`` can read keys this dataclass does not name.
    """

    architecture: str
    name: str
    context_length: int
    embedding_length: int
    block_count: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    rms_norm_eps: float
    rope_freq_base: float
    sliding_window: int | None
    file_type: int | None
    metadata: dict[str, Any] = field(repr=False)
    path: str = ""  # the file it came from, for errors

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def arch_whole(self, key: str, default: int | None = None, minimum: int = 1) -> int | None:
        """``{arch}.{key}`` as a count: a whole number of at least ``minimum``
        (``ModelFileError`` naming the key otherwise); ``default`` where absent."""
        return whole_number(self.path, f"{self.architecture}.{key}", self.arch_key(key, default), minimum)

    def experts(self) -> Experts | None:
        """A mixture-of-experts model's routing as its metadata gives it; None
        for a dense model (no ``{arch}.expert_count``)."""
        count = int(self.arch_key("expert_count", 0) or 0)
        if not count:
            return None
        return Experts(count, int(self.arch_key("expert_used_count", 0) or 0),
                       int(self.arch_key("expert_feed_forward_length", 0) or 0))


@dataclass(frozen=True)
class Experts:
    """``count`` experts per layer, ``per_token`` of them serving each token,
    each a feed-forward ``width`` wide (0 where the file does not say)."""

    count: int
    per_token: int
    width: int


class GGUFFile:
    """An open GGUF file. Invariant: ``reader`` maps ``path`` read-only in
    copy-on-write mode, so tensors handed out can never write to the file."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self.reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self.metadata = {
            name: _scalar_value(f) for name, f in reader.fields.items() if not _is_big_array(f)
        }
        self.config = _model_config(self)

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = check_gguf_path(path)
        try:
            reader = CompactGGUFReader(path, "c")
        except (ValueError, IndexError, KeyError, OverflowError) as e:
            raise ModelFileError(
                f"{path} is truncated or corrupt ({e}); download or assemble the file again"
            ) from None
        _check_complete(path, reader)
        return cls(path, reader)

    # --- metadata -------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, arrays included (the vocabulary is read here, on demand)."""
        if key in self.metadata:
            return self.metadata[key]
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    # --- tensors --------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def check_block_count(self) -> None:
        """``block_count`` layers must have tensors (``blk.N.*``): a count far
        past them would size every per-layer structure by it before any
        missing tensor is noticed."""
        blocks = self.config.block_count
        in_file = 1 + max((int(n.split(".")[1]) for n in self._tensors
                           if n.startswith("blk.") and n.split(".")[1].isdigit()), default=-1)
        if blocks > in_file:
            raise ModelFileError(f"{self.path}: metadata key {self.architecture}.block_count is {blocks} but the "
                                 f"tensors cover {in_file} layers; the file is malformed: convert it again")

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(name, GGMLQuantizationType(t.tensor_type), _logical_shape(t), int(t.n_bytes))

    def tensor_infos(self) -> list[TensorInfo]:
        return [self.tensor_info(name) for name in self._tensors]

    def tensor(self, name: str) -> QuantTensor:
        """The tensor's blocks as a QuantTensor over the mapped file (no copy)."""
        t = self._tensor(name)
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise ModelFileError(
                f"tensor {name} in {self.path} has type {qtype.name}, which Strata cannot read; "
                f"supported types: {supported}. Requantize the model to one of them with llama-quantize"
            )
        shape = _logical_shape(t)
        rows = math.prod(shape[:-1])
        data = torch.from_numpy(t.data.reshape(-1).view(np.uint8)).reshape(rows, -1)
        return QuantTensor(data, qtype, shape)

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path} has no tensor {name}; the file is incomplete or not a "
                f"{self.architecture} model as Strata expects it"
            ) from None


def check_gguf_path(path: str | Path) -> Path:
    """The cheap checks, before any parsing: the file exists and starts with
    the GGUF magic. Returns the expanded path."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFileError(
            f"model file {path} does not exist; pass the path of a .gguf file "
            f"(or omit it to use the default model)"
        )
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; pass the path of a .gguf file inside it")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            f"convert the model with llama.cpp's convert_hf_to_gguf.py or pass a .gguf file"
        )
    return path


def _logical_shape(t) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ne0 = row length); torch order is the reverse.
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _is_big_array(f) -> bool:
    # parts[4] is an array's element count, in gguf-py's fields and in PackedArrayField
    return bool(f.types) and f.types[0] == GGUFValueType.ARRAY and int(f.parts[4][0]) > 64


def _scalar_value(f) -> Any:
    value = f.contents()
    return value.item() if hasattr(value, "item") else value


def _check_complete(path: Path, reader: GGUFReader) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(
                f"{path} is truncated: tensor {t.name} ends at byte {end} but the file has "
                f"{size} bytes; download or assemble the file again"
            )


def _model_config(gguf: GGUFFile) -> ModelConfig:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(
            f"{gguf.path} has no general.architecture key; it is not a model file Strata can load"
        )

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelFileError(f"{gguf.path} lacks the metadata key {arch}.{name}; the file is incomplete")
        return value

    def whole(name: str, default: Any = None, required: bool = False, minimum: int = 1) -> int | None:
        return whole_number(str(gguf.path), f"{arch}.{name}", key(name, default, required), minimum)

    def positive(name: str, default: float) -> float:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ModelFileError(f"{gguf.path}: metadata key {arch}.{name} is {value!r}; a positive number belongs "
                                 "there. The file is malformed: convert it again")
        return float(value)

    n_embd = whole("embedding_length", required=True)
    n_head = whole("attention.head_count", required=True)
    n_head_kv = whole("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelFileError(f"{gguf.path}: {arch}.attention.head_count ({n_head}) is not a multiple of "
                             f"{arch}.attention.head_count_kv ({n_head_kv}); the file is malformed")
    head_dim = n_embd // n_head
    blocks = whole("block_count", required=True)
    return ModelConfig(
        architecture=arch,
        name=str(md.get("general.name", gguf.path.stem)),
        context_length=whole("context_length", required=True),
        embedding_length=n_embd,
        block_count=blocks,
        feed_forward_length=whole("feed_forward_length", 0, minimum=0),
        head_count=n_head,
        head_count_kv=n_head_kv,
        key_length=whole("attention.key_length", max(head_dim, 1)),
        value_length=whole("attention.value_length", max(head_dim, 1)),
        rms_norm_eps=positive("attention.layer_norm_rms_epsilon", 1e-6),
        rope_freq_base=positive("rope.freq_base", 10000.0),
        sliding_window=whole("attention.sliding_window"),
        file_type=md.get("general.file_type"),
        metadata=md,
        path=str(gguf.path),
    )


def whole_number(path: str, key: str, value: Any, minimum: int = 1) -> int | None:
    """A count read from metadata ``key``: a whole number (not an array, text
    or flag) of at least ``minimum``; None stays None (absent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelFileError(f"{path}: metadata key {key} is {value!r}; a whole number of at least {minimum} "
                             "belongs there. The file is malformed: convert it again")
    return value


def describe_types(gguf: GGUFFile) -> dict[str, tuple[int, int]]:
    """Tensor type name -> (count, bytes)."""
    out: dict[str, tuple[int, int]] = {}
    for info in gguf.tensor_infos():
        count, nbytes = out.get(info.qtype.name, (0, 0))
        out[info.qtype.name] = (count + 1, nbytes + info.nbytes)
    return out


def bits_per_weight(gguf: GGUFFile) -> float:
    total_bytes = total_weights = 0
    for info in gguf.tensor_infos():
        total_bytes += info.nbytes
        total_weights += math.prod(info.shape)
    return total_bytes * 8 / max(1, total_weights)


__all__ = ["GGUFFile", "ModelConfig", "TensorInfo", "block_format", "describe_types", "bits_per_weight"]

"""A model file's identity: the part of a parked entry's fingerprint that
says which file its bytes came from (the rest is the state's layout,
``state.layout``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

_SAMPLE = 1 << 20  # bytes of tensor data read at each of three places


def model_file_identity(path: str | Path, data_offset: int) -> str:
    """A digest of the file's size, its header (metadata and tensor table:
    everything before ``data_offset``) and three 1 MiB samples of its tensor
    data: the same content copied elsewhere or assembled again has the same
    identity; another model, another quantization or a fine-tune with the
    same header does not."""
    path = Path(path)
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(data_offset))
        for at in (data_offset, data_offset + (size - data_offset) // 2, max(data_offset, size - _SAMPLE)):
            f.seek(at)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()



"""What a parked entry's bytes mean: the model file, the architecture, the
KV format and layout, the backend and the split. Two engines with the same
fingerprint read each other's entries; any difference refuses them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .kv_pool import KVPool, store_fields

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


def state_fingerprint(file_identity: str, architecture: str, kv: str, compute_path: str, pool: KVPool,
                      stage_devices: list[str]) -> str:
    """The fingerprint of the state an engine keeps: ``pool``'s stores give
    the layout (each field's row shape and dtype, layer by layer, and each
    layer's stage)."""
    layout: list[Any] = []
    for layer, store in enumerate(pool.stores):
        fields = {name: [list(t.shape[1:]), str(t.dtype)] for name, t in store_fields(store).items()}
        layout.append([pool.layer_stages[layer], type(store).__name__, fields])
    described = {"model": file_identity, "architecture": architecture, "kv": kv, "compute_path": compute_path,
                 "devices": [d.split(":")[0] for d in stage_devices], "layout": layout}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def row_bytes(pool: KVPool) -> dict[tuple[int, str], int]:
    """Bytes per position (slot) of each layer's field: what a part's size is checked against."""
    return {(layer, name): t[0].numel() * t.element_size()
            for layer, store in enumerate(pool.stores) for name, t in store_fields(store).items()}

"""What a parked entry's bytes mean, from the pool's layout: the state's
fingerprint (with the model file's identity, ``files.fingerprint``) and each
field's bytes per position. Two engines with the same fingerprint read each
other's entries; any difference refuses them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .kv_pool import KVPool, store_fields


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

"""The KV cache of one sequence."""

from __future__ import annotations

import torch


def kv_bytes_per_token(config, bytes_per_value: int) -> int:
    """Bytes one token of context costs across all layers (keys and values)."""
    per_layer = config.head_count_kv * (config.key_length + config.value_length)
    return config.block_count * per_layer * bytes_per_value


class KVCache:
    """Keys and values of every layer of one sequence, in storage sized once.

    Invariant: for each layer ``l``, ``keys[l, :length]`` and
    ``values[l, :length]`` hold the keys and values of positions
    ``0 .. length-1``, written in place by position; nothing beyond
    ``length`` is meaningful. Storage is allocated once, at construction,
    for ``max_tokens`` positions, so a long generation never reallocates.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (n_layers, max_tokens, n_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0

    def update_and_fetch(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Write ``keys``/``values`` ``[T, Hkv, D]`` at positions ``start..start+T-1``
        of ``layer`` and return that layer's keys and values for ``0..start+T-1``."""
        end = start + keys.shape[0]
        if start != self.length:
            raise ValueError(f"cache holds {self.length} positions; cannot write at {start}")
        if end > self.max_tokens:
            raise ValueError(
                f"the sequence needs {end} positions but the cache holds {self.max_tokens}; "
                f"load the model with a larger context_length"
            )
        self.keys[layer, start:end] = keys
        self.values[layer, start:end] = values
        return self.keys[layer, :end], self.values[layer, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions written (after every layer has written them)."""
        self.length += n

    def trim(self, length: int) -> None:
        """Forget positions from ``length`` on."""
        self.length = min(self.length, max(0, length))

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def bytes_per_token(self) -> int:
        return self.nbytes // self.max_tokens

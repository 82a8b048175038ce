"""The GGUF block formats as data.

Sizes come from ``gguf.GGML_QUANT_SIZES`` and the lookup tables of the IQ
family and the non-linear 4-bit formats from ``gguf.quants``; none is copied
here by hand. Tables are turned into tensors on first use and cached per
device, so importing this module does no work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

QK_K = 256
# Types stored as plain floats (norms, biases, some embeddings and heads): no
# blocks to read, so every backend holds them dense and converts them in torch.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF type: ``block_size`` weights are stored in ``type_size`` bytes."""

    qtype: GGMLQuantizationType
    block_size: int
    type_size: int

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block_size


def block_format(qtype: GGMLQuantizationType) -> BlockFormat:
    qtype = GGMLQuantizationType(qtype)
    try:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except KeyError:
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    return BlockFormat(qtype, block_size, type_size)


def _grid_source(name: str) -> np.ndarray:
    cls = getattr(gguf_quants, name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


_TABLES = {
    # name -> (builder, dtype)
    "iq2xxs_grid": (lambda: _grid_source("IQ2_XXS"), torch.float32),
    "iq2xs_grid": (lambda: _grid_source("IQ2_XS"), torch.float32),
    "iq2s_grid": (lambda: _grid_source("IQ2_S"), torch.float32),
    "iq3xxs_grid": (lambda: _grid_source("IQ3_XXS"), torch.float32),
    "iq3s_grid": (lambda: _grid_source("IQ3_S"), torch.float32),
    "iq1s_grid": (lambda: _grid_source("IQ1_S"), torch.float32),
    "ksigns": (lambda: np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy(), torch.uint8),
    "iq4nl_values": (lambda: np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.float32), torch.float32),
    "mxfp4_values": (lambda: np.array(gguf_quants.MXFP4.kvalues, dtype=np.float32), torch.float32),
}


@lru_cache(maxsize=None)
def lookup_table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """A lookup table from ``gguf.quants`` as a tensor on ``device``, built once."""
    builder, dtype = _TABLES[name]
    return torch.from_numpy(builder()).to(device=device, dtype=dtype)


def iq1_delta() -> float:
    return float(gguf_quants.IQ1_S.delta)

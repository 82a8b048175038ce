"""Qwen 3: Llama with per-head RMS norms of the queries and keys before the rotation,
the half-split rotation (no row permutation in the file), and a head size of its own."""

from __future__ import annotations

from . import llama
from .llama import ModelArgs, Variant

__all__ = ["Model", "ModelArgs"]


class Model(llama.Model):
    variant = Variant(permuted_rotary=False, qk_norm=True)

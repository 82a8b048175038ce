"""Qwen 2 (and 2.5): Llama with biases on the query, key and value projections, and
the half-split rotation llama.cpp uses for it (no row permutation in the file)."""

from __future__ import annotations

from . import llama
from .llama import ModelArgs, Variant

__all__ = ["Model", "ModelArgs"]


class Model(llama.Model):
    variant = Variant(permuted_rotary=False, qkv_bias=True)

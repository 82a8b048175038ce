"""Small GGUF files made by the tests themselves, through ``gguf.GGUFWriter``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter


def write_gguf(
    path: Path,
    architecture: str = "gemma3",
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None, tuple[int, ...] | None]] | None = None,
    metadata: dict[str, object] | None = None,
    tokenizer: dict[str, object] | None = None,
) -> Path:
    w = GGUFWriter(str(path), architecture)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, value)
    if tokenizer:
        w.add_tokenizer_model(tokenizer["model"])
        w.add_tokenizer_pre(tokenizer.get("pre", "default"))
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        if "scores" in tokenizer:
            w.add_token_scores(tokenizer["scores"])
        if "merges" in tokenizer:
            w.add_token_merges(tokenizer["merges"])
        if "bos" in tokenizer:
            w.add_bos_token_id(tokenizer["bos"])
            w.add_add_bos_token(True)
        if "eos" in tokenizer:
            w.add_eos_token_id(tokenizer["eos"])
    for name, (array, raw_dtype, raw_shape) in (tensors or {"output_norm.weight": (np.ones(64, np.float32), None, None)}).items():
        if raw_dtype is None:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, array, raw_shape=raw_shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""Malformed model files (issue 23, item 9): whatever a file's metadata or
tensor table says, loading it either works or raises ``ModelFileError``
naming the file (and the key or tensor where one is to blame); never a raw
``ZeroDivisionError``/``TypeError``, and never an engine whose tokenizer
has ids past its token table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strata_runtime
from strata_runtime import ModelFileError
from strata_runtime.errors import RequestError
from tiny_models import Shape, write_tiny_model

DROP = object()  # an edit that removes the key (or tensor)
_INTERNAL = ("GGUF.", "general.architecture")  # written by GGUFWriter itself


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("malformed")
    return {arch: write_tiny_model(root / f"{arch}.gguf", arch, Shape(), 3) for arch in ("llama", "gemma3")}


def rewrite(src: Path, dst: Path, fields: dict[str, object] = {}, drop_tensor: str | None = None) -> Path:
    """``src`` copied to ``dst`` with metadata ``fields`` set (or removed: ``DROP``) and a tensor left out."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith(_INTERNAL) or name in fields:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    for name, value in fields.items():
        if value is DROP:
            continue
        if isinstance(value, list):
            sub = GGUFValueType.STRING if value and isinstance(value[0], str) else GGUFValueType.INT32
            w.add_key_value(name, value, GGUFValueType.ARRAY, sub)
        elif isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_key_value(name, value, GGUFValueType.INT64 if value < 0 or value >= 2**32 else GGUFValueType.UINT32)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_string(name, value)
    for t in reader.tensors:
        if t.name == drop_tensor:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _load_and_generate(path: Path) -> None:
    """Load (``ModelFileError`` or an engine), then generate: a file that
    loads serves, or refuses the request for its own reasons (a context too
    short for the prompt is the request's error, not a crash)."""
    engine = strata_runtime.load(path, progress=False, context_length=64, conversation_cache_mib=0, kv_memory_mib=4)
    try:
        engine.generate("The quick brown fox", max_tokens=2, temperature=0)
    except RequestError:
        pass


@pytest.mark.parametrize("key, value, named", [
    ("llama.attention.head_count", 0, "llama.attention.head_count is 0"),
    ("llama.attention.head_count", [4, 4], "llama.attention.head_count is [4, 4]"),
    ("llama.embedding_length", "sixty-four", "llama.embedding_length is 'sixty-four'"),
    ("llama.attention.head_count_kv", 3, "is not a multiple of llama.attention.head_count_kv (3)"),
    ("llama.rope.freq_base", -1.0, "llama.rope.freq_base is -1.0"),
    ("llama.block_count", DROP, "lacks the metadata key llama.block_count"),
])
def test_a_malformed_key_is_named(tiny, tmp_path, key, value, named):
    broken = rewrite(tiny["llama"], tmp_path / "broken.gguf", {key: value})
    with pytest.raises(ModelFileError, match=named.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _load_and_generate(broken)


def test_a_zero_sliding_window_pattern_is_a_model_file_error(tiny, tmp_path):
    broken = rewrite(tiny["gemma3"], tmp_path / "broken.gguf", {"gemma3.attention.sliding_window_pattern": 0})
    with pytest.raises(ModelFileError, match="gemma3.attention.sliding_window_pattern is 0"):
        _load_and_generate(broken)


def test_more_tokens_than_the_token_table_has_rows_is_refused_at_load(tiny, tmp_path):
    reader = GGUFReader(tiny["llama"])
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    extra = [f"<extra_{i}>" for i in range(8)]
    broken = rewrite(tiny["llama"], tmp_path / "broken.gguf", {"tokenizer.ggml.tokens": tokens + extra,
                                                               "tokenizer.ggml.token_type": DROP})
    with pytest.raises(ModelFileError, match=f"the tokenizer has {len(tokens) + 8} tokens .* has {len(tokens)} rows"):
        _load_and_generate(broken)


_KEYS = ["llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
         "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
         "llama.attention.value_length", "llama.rope.dimension_count", "llama.rope.freq_base",
         "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "tokenizer.ggml.bos_token_id"]
_VALUES = st.one_of(st.just(DROP), st.integers(-3, 3), st.integers(4, 300), st.integers(2**31, 2**40), st.booleans(),
                    st.floats(allow_nan=True, allow_infinity=True, width=32), st.text(max_size=4),
                    st.lists(st.integers(0, 5), min_size=1, max_size=3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=2),
       drop=st.one_of(st.none(), st.sampled_from(["token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight",
                                                  "blk.1.ffn_down.weight"])))
def test_any_mutation_of_the_metadata_or_tensor_table_loads_or_is_a_model_file_error(tiny, tmp_path, edits, drop):
    broken = rewrite(tiny["llama"], tmp_path / "mutated.gguf", edits, drop)
    try:
        _load_and_generate(broken)
    except ModelFileError as e:
        assert "mutated.gguf" in str(e)

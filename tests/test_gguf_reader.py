"""The compact GGUF reader: every metadata field reads as gguf-py's reader has
it, a vocabulary costs a few arrays instead of a Python object per token, and
a corrupt array is a clear error."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime import ModelFileError
from strata_runtime.files.gguf_file import GGUFFile
from strata_runtime.files.gguf_reader import CompactGGUFReader, PackedArrayField

SCALARS = {
    GGUFValueType.UINT8: st.integers(0, 255), GGUFValueType.INT16: st.integers(-2**15, 2**15 - 1),
    GGUFValueType.UINT32: st.integers(0, 2**32 - 1), GGUFValueType.INT64: st.integers(-2**63, 2**63 - 1),
    GGUFValueType.FLOAT32: st.floats(width=32, allow_nan=False), GGUFValueType.BOOL: st.booleans(),
}
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
ARRAY = st.one_of(
    st.lists(TEXT, min_size=1, max_size=40).map(lambda v: (GGUFValueType.STRING, v)),
    *(st.lists(values, min_size=1, max_size=40).map(lambda v, t=t: (t, v)) for t, values in SCALARS.items()),
)


def _write(path, fields: dict, endian: GGUFEndian):
    w = GGUFWriter(str(path), "llama", endianess=endian)
    for key, value in fields.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            element, values = value
            w.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=element)
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_fields(path) -> None:
    theirs, ours = GGUFReader(path), CompactGGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types, key
        assert mine.contents() == field.contents(), key
        if field.types[0] == GGUFValueType.ARRAY:
            assert [bytes(part) for part in mine.parts[:5]] == [bytes(part) for part in field.parts[:5]], key
            assert isinstance(mine, PackedArrayField), key
            assert int(mine.parts[4][0]) == len(field.data)  # the element count, where gguf_file looks
            n = len(field.data)
            for index in {0, n // 2, n - 1} if n else ():
                assert mine.contents(index) == field.contents(index), (key, index)
            assert mine.contents(slice(1, n, 3)) == field.contents(slice(1, n, 3)), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.data.tolist()) for t in ours.tensors] == [(t.name, t.data.tolist()) for t in theirs.tensors]


@settings(max_examples=40, deadline=None)
@given(arrays=st.lists(ARRAY, max_size=5), title=TEXT, big_endian=st.booleans())
def test_every_metadata_field_reads_as_gguf_py_reads_it(tmp_path_factory, arrays, title, big_endian):
    fields = {"general.title": title} | {f"test.array.{i}": a for i, a in enumerate(arrays)}
    fields["test.after"] = "a scalar after the arrays"
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    _same_fields(_write(path, fields, GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE))


def test_the_real_vocabulary_reads_whole_and_costs_a_few_arrays(model_file):
    tracemalloc.start()
    try:
        g = GGUFFile.open(model_file)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # gguf-py's reader allocates ~270 MiB here: two ndarray views per token.
    assert peak < 16 * 2**20, f"opening the file allocated {peak / 2**20:.0f} MiB"
    tokens = g.get("tokenizer.ggml.tokens")
    assert len(tokens) == 262144 and tokens[2] == "<bos>" and "<start_of_turn>" in tokens
    theirs = GGUFReader(model_file).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert g.get(key) == theirs[key].contents(), key


def test_an_array_longer_than_the_file_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "m.gguf", {"test.words": (GGUFValueType.STRING, ["a", "bc"])}, GGUFEndian.LITTLE)
    data = bytearray(path.read_bytes())
    count_at = data.index(b"test.words") + len(b"test.words") + 8  # after the value type and element type
    assert int.from_bytes(data[count_at:count_at + 8], "little") == 2
    data[count_at:count_at + 8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"m\.gguf is truncated or corrupt .*cannot fit"):
        GGUFFile.open(path)


def test_a_scalar_may_end_the_file(tmp_path):
    """No tensors and no padding: the last field's few bytes are the file's last."""
    w = GGUFWriter(str(tmp_path / "full.gguf"), "llama")
    w.add_bool("test.last", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = (tmp_path / "full.gguf").read_bytes()
    end = data.index(b"test.last") + len(b"test.last") + 4 + 1  # the key, its value type, one byte of value
    path = tmp_path / "m.gguf"
    path.write_bytes(data[:end])
    _same_fields(path)

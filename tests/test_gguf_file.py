"""Opening GGUF files: the real model's metadata, and clear errors for bad files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_factory import write_gguf

import strata_runtime
from strata_runtime import ModelFileError
from strata_runtime.files.gguf_file import GGUFFile, describe_types


def test_real_model_config_and_tensors(model_gguf):
    g = model_gguf
    c = g.config
    assert (c.architecture, c.block_count, c.embedding_length) == ("gemma3", 18, 640)
    assert (c.head_count, c.head_count_kv, c.key_length, c.sliding_window) == (4, 1, 256, 512)
    assert c.context_length == 32768
    q = g.tensor("blk.0.attn_q.weight")
    assert q.qtype == T.Q5_0 and q.shape == (1024, 640) and q.data.dtype == torch.uint8
    assert q.data.shape == (1024, 640 // 32 * 22)
    emb = g.tensor("token_embd.weight")
    assert emb.shape == (262144, 640) and emb.qtype == T.Q8_0
    types = describe_types(g)
    assert types["Q4_K"][0] == 27 and sum(n for n, _ in types.values()) == 236


def test_tensors_are_views_of_the_file_mapping(model_gguf):
    g = model_gguf
    emb = g.tensor("token_embd.weight")
    # No private copy of the 170 MiB table: its bytes lie inside the mapping.
    start = g.reader.data.ctypes.data
    assert start <= emb.data.data_ptr() < start + g.reader.data.nbytes
    assert emb.data.data_ptr() + emb.nbytes <= start + g.reader.data.nbytes


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match=r"nope\.gguf does not exist; pass the path of a \.gguf file"):
        GGUFFile.open(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory"):
        GGUFFile.open(tmp_path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ModelFileError, match=r"model\.bin is not a GGUF file .*convert_hf_to_gguf"):
        GGUFFile.open(path)


@pytest.mark.parametrize("keep", [64, 5_000_000])
def test_truncated(tmp_path, model_file, keep):
    path = tmp_path / "cut.gguf"
    with open(model_file, "rb") as f:
        path.write_bytes(f.read(keep))
    with pytest.raises(ModelFileError, match=r"cut\.gguf is truncated.*assemble the file again"):
        GGUFFile.open(path)


def test_truncated_inside_tensor_data(tmp_path):
    full = write_gguf(tmp_path / "full.gguf", tensors={"w": (np.ones((8, 64), np.float32), None, None)})
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ModelFileError, match=r"cut\.gguf is truncated"):
        GGUFFile.open(cut)


def test_unsupported_architecture_names_supported(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", architecture="mamba9")
    with pytest.raises(ModelFileError, match=r"architecture 'mamba9' is not supported; supported: gemma3"):
        strata_runtime.load(path, progress=False)


def test_unsupported_tensor_type(tmp_path):
    raw = np.zeros((4, 40), np.uint8)  # Q8_1: 40 bytes per 32 weights, a type only used for activations
    path = write_gguf(tmp_path / "m.gguf", tensors={"blk.0.attn_q.weight": (raw, T.Q8_1, (4, 40))})
    g = GGUFFile.open(path)
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_q\.weight .* has type Q8_1.*supported types: .*Q4_K.*llama-quantize"):
        g.tensor("blk.0.attn_q.weight")


def test_missing_tensor_is_named(tmp_path):
    g = GGUFFile.open(write_gguf(tmp_path / "m.gguf"))
    with pytest.raises(ModelFileError, match="has no tensor blk.0.attn_q.weight"):
        g.tensor("blk.0.attn_q.weight")

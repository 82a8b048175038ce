"""The model interface (models/decoder.py): what the runtime reads of a model,
and the state storage made from it agreeing with what the planner counted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import Shape, write_tiny_model

import strata_runtime
from strata_runtime.state.kv_cache import KVCache
from strata_runtime.models.loader import open_model
from strata_runtime.split.pipeline import plan_split
from strata_runtime.files.placement import Placement
from strata_runtime.state.spec import AttentionState

SRC = Path(strata_runtime.__file__).parent
# What only an architecture's own file may read: its ModelArgs, Gemma's embedding
# scale and sliding pattern, the modules a model is made of.
ARCHITECTURE_FIELDS = re.compile(r"\.args\b|embed_scale|is_sliding|sliding_window_pattern|\.embedding\b|"
                                 r"attention_windows|model\.norm\b|model\.output\b|model\.layers\[\d")


def test_nothing_outside_models_reads_an_architectures_fields():
    offenders = []
    for path in SRC.rglob("*.py"):
        if "models" in path.relative_to(SRC).parts or path.name == "loader.py":  # the loader builds from ModelArgs
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ARCHITECTURE_FIELDS.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_gemma_declares_its_sliding_layers_before_any_weight_is_read(model_file, engine):
    spec = open_model(model_file).state_spec
    assert spec == engine.model.state_spec()
    windows = [layer.window for layer in spec]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert {(layer.kv_heads, layer.head_dim) for layer in spec} == {(1, 256)}


def _tiny(tmp_path, layers=4):
    return write_tiny_model(tmp_path / "llama.gguf", "llama", Shape(hidden=128, layers=layers, heads=2, kv_heads=1,
                                                                    head_dim=64, tied=True), 3, Q.Q8_0)


@pytest.mark.parametrize("dtype, stored", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_splits_cache_is_what_its_plan_counted(tmp_path, dtype, stored):
    """The in-process split once stored f16 KV as float32 on the fast path
    while the planner counted bfloat16: the cache must be what was planned."""
    path = _tiny(tmp_path)
    split = strata_runtime.load(path, dtype=dtype, devices=["cpu", "cpu"], layer_split=[1], progress=False,
                                conversation_cache_mib=0, context_length=256)
    cache = split.new_cache(200)
    assert {store.k.dtype for store in cache.stores} == {stored}
    plan = plan_split(open_model(path).gguf, ["cpu", "cpu"], [1], 200, "f16", dtype=dtype)
    assert cache.nbytes == sum(stage.kv_bytes for stage in plan)
    assert [list(s.layers) for s in plan] == [list(r) for r in split.model.placement.stage_layers()]


def test_a_rank_holds_its_stage_and_types_the_others_as_they_store_them():
    spec = [AttentionState(2, 64, 32), AttentionState(2, 64)] * 2
    placement = Placement((torch.device("cpu"), torch.device("cpu")), (0, 0, 1, 1), stage=1)
    cache = KVCache.for_placement("f16", spec, placement, 100, torch.bfloat16)
    assert [store.k.device.type for store in cache.stores] == ["meta", "meta", "cpu", "cpu"]
    assert {store.k.dtype for store in cache.stores} == {torch.bfloat16}
    assert [store.capacity for store in cache.stores] == [100, 100, 100, 100]  # 32 + a 512-token chunk > 100
    assert cache.bytes_per_token() == sum(layer.bytes_per_slot("f16", 2) for layer in spec)


def test_a_tied_head_is_one_table_per_device(tmp_path):
    """A tied head is the token table: one copy on a device, however many
    stages share it (a stage on another device reads its own copy)."""
    path = _tiny(tmp_path)
    one = strata_runtime.load(path, progress=False, conversation_cache_mib=0, context_length=256)
    assert one.model.output is one.model.embedding
    split = strata_runtime.load(path, devices=["cpu", "cpu"], layer_split=[2], progress=False,
                                conversation_cache_mib=0, context_length=256)
    inner = split.model.model
    assert inner.output is inner.embedding
    ids = one.tokenize("The quick brown fox jumps over the lazy dog.")
    torch.testing.assert_close(split.logits(ids), one.logits(ids), atol=1e-5, rtol=0)

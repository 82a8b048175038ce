"""Planning a layer split from metadata alone: stages, bytes, and clear
errors for bad split arguments before any weight is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_memory import _proc

from strata_runtime.conversations.memory import MiB, HostMemory
from strata_runtime.files.placement import SplitError, check_split, parse_devices, parse_layer_split
from strata_runtime.split.pipeline import plan_split


def test_two_stages_cover_every_layer_and_every_byte(model_gguf):
    stages = plan_split(model_gguf, "cpu,cpu", "9", context=4096, dtype="float32")
    assert [s.layers for s in stages] == [range(0, 9), range(9, 18)]
    infos = {t.name: t.nbytes for t in model_gguf.tensor_infos()}
    embed = infos["token_embd.weight"]
    # The tied table sits on both ends: embeddings first, the output head last.
    assert sum(s.weight_bytes for s in stages) == sum(infos.values()) + embed
    assert stages[0].weight_bytes > embed and stages[1].weight_bytes > embed
    # Sliding layers hold window + one prefill chunk; layers 5, 11, 17 hold the whole context.
    per_layer = 2 * 256 * 4  # keys and values, one KV head of 256; f16 is stored as float32 on the exact CPU path
    assert stages[0].kv_bytes == per_layer * (8 * 1024 + 4096)
    assert stages[1].kv_bytes == per_layer * (7 * 1024 + 2 * 4096)
    fast = plan_split(model_gguf, "cpu,cpu", "9", context=4096, dtype="bfloat16")  # bfloat16 storage: half
    assert [s.kv_bytes for s in fast] == [s.kv_bytes // 2 for s in stages]


def test_planned_kv_bytes_are_the_bytes_a_cache_allocates(engine, model_file):
    """The plan counts the storage the engine actually allocates (f16 as float32 on the exact CPU path),
    for the sequences its pool holds."""
    (stage,) = plan_split(engine.gguf, ["cpu"], None, context=engine.context_length, dtype="float32",
                          sequences=engine.props()["parallel"])
    assert stage.kv_bytes == engine.props()["kv_bytes"]


def test_one_device_is_one_stage(model_gguf):
    (stage,) = plan_split(model_gguf, ["cpu"], None, context=1024, kv="int8")
    assert stage.layers == range(0, 18)


@pytest.mark.parametrize("devices, split, message", [
    (["cpu", "cpu"], [0], "boundary 0 is out of range"),
    (["cpu", "cpu"], [18], "must be in 1..17"),
    (["cpu", "cpu", "cpu"], [12, 6], "strictly increasing"),
    (["cpu", "cpu", "cpu"], [6, 6], "strictly increasing"),
    (["cpu", "cpu"], [6, 12], "makes 3 stages but 2 devices were given"),
    (["cpu", "cpu", "cpu"], [9], "makes 2 stages but 3 devices were given"),
])
def test_bad_boundaries_are_clear(devices, split, message):
    with pytest.raises(SplitError, match=message):
        check_split(18, devices, split)


def test_bad_device_and_split_text():
    with pytest.raises(SplitError, match="'tpu:0' is not 'cpu', 'cuda' or 'cuda:N'"):
        parse_devices("cpu,tpu:0")
    with pytest.raises(SplitError, match="must be 'auto' or first layers"):
        parse_layer_split("nine")
    assert parse_layer_split("6,12") == [6, 12] and parse_layer_split("auto") == "auto"


def test_auto_splits_by_free_memory_and_refuses_what_cannot_fit(model_gguf, tmp_path):
    roomy = HostMemory(_proc(tmp_path / "a", available_kb=8 * 1024 * 1024), tmp_path / "none")
    stages = plan_split(model_gguf, "cpu,cpu", "auto", context=1024, memory=roomy)
    assert len(stages) == 2 and stages[0].layers.stop == stages[1].layers.start
    assert all(len(s.layers) >= 1 for s in stages)
    small = HostMemory(_proc(tmp_path / "b", available_kb=500 * 1024), tmp_path / "none")
    with pytest.raises(SplitError, match="the weights need .* MiB but the devices have"):
        plan_split(model_gguf, "cpu,cpu", "auto", context=1024, memory=small, reserve_bytes=100 * MiB)
    unknown = HostMemory(_proc(tmp_path / "c", available_kb="lots"), tmp_path / "none")
    with pytest.raises(SplitError, match="needs the host's free memory"):
        plan_split(model_gguf, "cpu,cpu", "auto", context=1024, memory=unknown)


def test_info_prints_the_planned_split(model_file):
    out = subprocess.run([sys.executable, "-m", "strata_server.cli", "info", str(model_file), "--devices", "cpu,cpu",
                          "--layer-split", "9", "--context", "2048"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "planned split over 2 stage(s)" in out.stdout
    assert "stage 0 cpu      layers   0-8" in out.stdout and "(+ embeddings)" in out.stdout
    assert "stage 1 cpu      layers   9-17" in out.stdout and "(+ output head)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "strata_server.cli", "info", str(model_file), "--devices", "cpu,cpu",
                          "--layer-split", "30"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "out of range" in bad.stderr

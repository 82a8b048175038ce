"""Fixtures shared by kernels_test/ and tests/: the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "tests" / "data"


@pytest.fixture(scope="session")
def model_file() -> Path:
    """The default model's GGUF, assembled once from the PyPI package."""
    from strata_runtime.default_model import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def engine(model_file):
    """One loaded engine (exact float32 path) shared by the session."""
    import strata_runtime

    return strata_runtime.load(model_file, dtype="float32", progress=False, context_length=2048)


@pytest.fixture(scope="session")
def model_gguf(engine):
    """The default model's open GGUFFile (parsing its header takes seconds: share it)."""
    return engine.gguf


@pytest.fixture(scope="session")
def reference_float32() -> dict:
    return json.loads((DATA / "gemma-3-270m-q4_k_m.float32.json").read_text())


@pytest.fixture(scope="session")
def reference_llamacpp() -> dict:
    return json.loads((DATA / "gemma-3-270m-q4_k_m.llamacpp.json").read_text())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA; on a machine without it they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); runs unchanged where one is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

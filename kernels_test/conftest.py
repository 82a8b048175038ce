"""Kernel tests run Triton kernels on the CPU through its interpreter.

The variable must be set before triton is first imported, hence here. The one
exception is a run of the GPU-marked tests alone (``pytest -m gpu``): on a GPU
those are the compiled kernels' tests, which the interpreter would run on the
host instead (and there ``tl.dot`` on bf16 is wrong). Without CUDA they are
skipped either way.
"""

import os

import pytest


def pytest_configure(config):
    if config.option.markexpr.strip() != "gpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Under the interpreter a GPU-marked kernel test would run on the host:
    skip it, naming the command that runs it compiled."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="the Triton interpreter is on: run `pytest -m gpu kernels_test` on a GPU "
                                   "for the compiled kernels")
    for item in items:
        if "gpu" in item.keywords and str(item.path).startswith(here):
            item.add_marker(skip)

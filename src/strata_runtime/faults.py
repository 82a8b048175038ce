"""Which failures an engine survives, decided in one place.

The rule (ARCHITECTURE.md): an optimization that runs out of memory is
skipped, logged and counted. Any other failure inside the engine (a device
error that is not out-of-memory, a lost or failed rank, a broken invariant,
a bug) may have left state half-written, so the engine process ends and its
supervisor starts a fresh one. Argument checks (``RequestError``) come before
a request touches state and are the caller's to fix.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import StrataError

# What allocators say when memory runs out: CUDA's caching allocator raises
# torch.OutOfMemoryError, but the CPU allocator ("DefaultCPUAllocator: can't
# allocate memory") and some device paths raise a plain RuntimeError.
_OUT_OF_MEMORY_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


class RankFailed(StrataError):
    """A rank of a split reported a failure of its own part (its message says
    which); ``out_of_memory`` when it was only memory."""

    def __init__(self, message: str, out_of_memory: bool):
        super().__init__(message)
        self.out_of_memory = out_of_memory


class StepFailed(StrataError):
    """A scheduler step raised; the state of the ``sequences`` (their ids) it
    carried was dropped, as a failure midway may have half-written it, and
    they ended with finish reason "error". ``__cause__`` is the failure."""

    def __init__(self, sequences: Sequence[int], cause: BaseException):
        super().__init__(f"a step over sequences {list(sequences)} failed: {type(cause).__name__}: "
                         f"{describe(cause)}")
        self.sequences = tuple(sequences)
        self.out_of_memory = is_out_of_memory(cause)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says memory ran out (and nothing worse)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(e, (RankFailed, StepFailed)):
        return e.out_of_memory
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(t in text for t in _OUT_OF_MEMORY_TEXT)


def describe(e: BaseException) -> str:
    """An error's first line, short enough for one log line."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]

"""Test seams: ``inject_fault`` makes a named point in the runtime raise.

Points: ``park_copy``, ``restore_copy``, ``checkpoint_copy`` (the copies
between the device cache and the staging pool), ``recurrent_copy`` (within
any of those, the part holding recurrent layers' state) and
``staging_lease`` (asking the pool for pages). Nothing is armed unless a
test arms it (or ``strata serve --inject-fault``, for chaos tests of a server).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

POINTS = ("park_copy", "restore_copy", "checkpoint_copy", "recurrent_copy", "staging_lease")


@dataclass
class _Fault:
    exc: BaseException
    times: int | None
    rate: float
    rng: random.Random
    stage: int | None = None
    fired: int = 0
    calls: int = field(default=0)


_armed: dict[str, list[_Fault]] = {}


@contextmanager
def inject_fault(point: str, exc: BaseException | None = None, times: int | None = None,
                 rate: float = 1.0, seed: int = 0, stage: int | None = None) -> Iterator[_Fault]:
    """While inside, calls reaching ``point`` raise ``exc`` (default: a torch
    out-of-memory error): on every call, at most ``times`` times, and each
    time with probability ``rate`` (seeded, so a run is reproducible).
    ``stage``: only the copies of that pipeline stage's part."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; points: {', '.join(POINTS)}")
    fault = _Fault(exc or torch.OutOfMemoryError("injected: out of memory"), times, rate, random.Random(seed), stage)
    _armed.setdefault(point, []).append(fault)
    try:
        yield fault
    finally:
        _armed[point].remove(fault)


def fault_point(point: str, stage: int = 0) -> None:
    """Raise here if a test armed ``point`` (for this pipeline ``stage``)."""
    for fault in _armed.get(point, ()):
        if fault.stage is not None and fault.stage != stage:
            continue
        fault.calls += 1
        if fault.times is not None and fault.fired >= fault.times:
            continue
        if fault.rng.random() < fault.rate:
            fault.fired += 1
            raise fault.exc

"""Test seams: ``inject_fault`` makes a named point in the runtime fail.

Points: ``park_copy``, ``restore_copy``, ``checkpoint_copy`` (the copies
between the device cache and the staging pool), ``recurrent_copy`` (within
any of those, the part holding recurrent layers' state), ``staging_lease``
(asking the pool for pages), ``disk_index`` (the disk tier reading its
directory at engine start: ``hang`` is a hung mount), ``disk_write`` and ``disk_read`` (the disk
tier writing a file, on its writer thread, and reading one back), ``verify`` (a decoding sequence's verify of
its draft, as the step is planned; subject: its tokens), ``verify_copy`` (a recurrent layer copying
a verify's state from slot to slot; subject: the slots), ``verify_forward``
(after the forward of a step carrying verifies, every position written:
what an out-of-memory inside it leaves), ``forward`` (a scheduler step's forward; its
subject is the token lists of the step's sequences, for ``match``) and
``layer`` (before each decoder layer; its ``stage`` is the layer's index). Nothing is armed unless a test arms it (or ``strata
serve --inject-fault``, for chaos tests of a server).

How a fault fails (``KINDS``): ``oom`` raises torch's out-of-memory error
(what an optimization skips); ``device_error`` raises the error torch gives
for an illegal memory access (what ends an engine); ``hang`` blocks the
thread for good (a stuck kernel); ``kill`` ends the process with SIGKILL (a
segfault, the OOM killer); ``slow`` makes the work at the point take
``SLOW_SECONDS`` longer and then go on (a copy slow enough for a test to
kill the process in the middle of it; each time it is logged).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger(__name__)

# The optimizations' points: out-of-memory at any of them is skipped and the request served.
# The conversation cache's:
OPTIMIZATION_POINTS = ("park_copy", "restore_copy", "checkpoint_copy", "recurrent_copy", "staging_lease")
# The disk tier's (reached only with a conversation_cache_dir):
DISK_POINTS = ("disk_index", "disk_write", "disk_read")
# Speculative decoding's:
SPECULATION_POINTS = ("verify", "verify_copy", "verify_forward")
POINTS = (*OPTIMIZATION_POINTS, *DISK_POINTS, *SPECULATION_POINTS, "forward", "layer")
KINDS = ("oom", "device_error", "hang", "kill", "slow")
SLOW_SECONDS = 4.0


@dataclass
class _Fault:
    exc: BaseException | None  # None: ``kind`` says what happens
    kind: str
    times: int | None
    rate: float
    rng: random.Random
    stage: int | None = None
    match: Callable[[Any], bool] | None = None
    fired: int = 0
    calls: int = field(default=0)


_armed: dict[str, list[_Fault]] = {}


def device_error(what: str = "injected") -> BaseException:
    """The error torch raises after an illegal memory access on a GPU."""
    kind = getattr(torch, "AcceleratorError", RuntimeError)
    return kind(f"CUDA error: an illegal memory access was encountered ({what})")


@contextmanager
def inject_fault(point: str, exc: BaseException | None = None, times: int | None = None,
                 rate: float = 1.0, seed: int = 0, stage: int | None = None, kind: str = "oom",
                 match: Callable[[Any], bool] | None = None) -> Iterator[_Fault]:
    """While inside, calls reaching ``point`` fail: raising ``exc`` if given,
    else as ``kind`` says; on every call, at most ``times`` times, and each
    time with probability ``rate`` (seeded, so a run is reproducible).
    ``stage``: only that pipeline stage's part of a copy (for ``layer``:
    that layer). ``match``: only calls whose subject it accepts."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; points: {', '.join(POINTS)}")
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")
    fault = _Fault(exc, kind, times, rate, random.Random(seed), stage, match)
    _armed.setdefault(point, []).append(fault)
    try:
        yield fault
    finally:
        _armed[point].remove(fault)


def armed(point: str) -> bool:
    """Whether anything is armed at ``point`` (a hot path asks before building a subject)."""
    return bool(_armed.get(point))


def fault_point(point: str, stage: int = 0, subject: Any = None) -> None:
    """Fail here if a test armed ``point`` (for this pipeline ``stage``, this ``subject``)."""
    for fault in _armed.get(point, ()):
        if fault.stage is not None and fault.stage != stage:
            continue
        if fault.match is not None and not fault.match(subject):
            continue
        fault.calls += 1
        if fault.times is not None and fault.fired >= fault.times:
            continue
        if fault.rng.random() < fault.rate:
            fault.fired += 1
            _fail(fault, point)


def _fail(fault: _Fault, point: str) -> None:
    if fault.exc is not None:
        raise fault.exc
    if fault.kind == "oom":
        raise torch.OutOfMemoryError(f"injected at {point}: out of memory")
    if fault.kind == "device_error":
        raise device_error(f"injected at {point}")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "slow":
        log.warning("fault injection: %s slowed down by %.0f s (test hook)", point, SLOW_SECONDS)
        time.sleep(SLOW_SECONDS)
        return
    threading.Event().wait()  # "hang": never set

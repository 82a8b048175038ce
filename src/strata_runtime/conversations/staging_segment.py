"""The staging pool's memory as a shared segment that outlives the engine.

The server reserves it (the same admission check as the engine's own pool:
need + floor within the least of MemAvailable and the cgroup's room) as an
anonymous memory file (``memfd``, mode 0600, named ``strata-staging-PID``),
allocated in full at once (``posix_fallocate``: a tmpfs without room fails
here, not with SIGBUS in the middle of a copy), and hands its descriptor to
each engine child it starts. The child maps it, so when the child dies the
parked conversations stay in the segment and the next child takes them back
(``ConversationCache.recover``). The memory goes away with the last
descriptor: the server's exit, however it ends, removes it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from .memory import HostMemory
from .staging import DEFAULT_PAGE_BYTES, PoolDecision, admit, describe_decision

log = logging.getLogger(__name__)


@dataclass
class StagingSegment:
    """A shared memory file of ``nbytes`` (whole pages of ``page_bytes``).

    Invariant: ``fd`` is open for as long as the segment is in use; every
    byte of it is allocated; ``decision`` is the admission that sized it."""

    fd: int
    nbytes: int
    page_bytes: int
    decision: str

    @classmethod
    def reserve(cls, requested_bytes: int, *, min_free_bytes: int, memory: HostMemory | None = None,
                page_bytes: int = DEFAULT_PAGE_BYTES, strict: bool = False) -> tuple["StagingSegment", PoolDecision]:
        """Admit and allocate the segment; log the decision. Where nothing
        was granted the segment is empty (``refused``): an engine given it
        keeps a conversation cache that skips and counts every park, naming
        the refusal, as it would had it been refused the pool itself."""
        granted, why, headroom = admit(requested_bytes, min_free_bytes=min_free_bytes, memory=memory,
                                       page_bytes=page_bytes, strict=strict)
        requested = requested_bytes // page_bytes * page_bytes
        segment = None
        if granted:
            try:
                segment = cls._allocate(granted, page_bytes)
            except OSError as e:
                hint = (" (the shared memory filesystem has no room: raise its size or lower "
                        "--conversation-cache-mib)" if e.errno == errno.ENOSPC else "")
                granted, why = 0, f"refused: allocating shared memory failed ({e.strerror or e}){hint}"
        message = describe_decision(why, granted, requested, headroom, min_free_bytes,
                                    where=" (shared, kept across engine restarts)")
        log.info(message)
        if segment is None:
            segment = cls(-1, 0, page_bytes, message)
        segment.decision = message
        return segment, PoolDecision(requested, granted, headroom, min_free_bytes, message)

    @property
    def refused(self) -> bool:
        return self.nbytes == 0

    @classmethod
    def _allocate(cls, nbytes: int, page_bytes: int) -> "StagingSegment":
        fd = os.memfd_create(f"strata-staging-{os.getpid()}", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, nbytes)  # every page now, zeroed: no entry anywhere
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, page_bytes, "")

    # --- handing it to an engine process ------------------------------------

    def describe(self) -> dict[str, Any]:
        """What a child needs to attach (its ``fd`` passed to it open; -1 when refused)."""
        return {"fd": self.fd, "bytes": self.nbytes, "page_bytes": self.page_bytes, "decision": self.decision}

    @classmethod
    def attach(cls, described: dict[str, Any]) -> "StagingSegment":
        fd, nbytes = int(described["fd"]), int(described["bytes"])
        if nbytes == 0:
            return cls(-1, 0, int(described["page_bytes"]), str(described["decision"]))
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"the staging segment (fd {fd}) holds {size} bytes, {nbytes} were announced")
        return cls(fd, nbytes, int(described["page_bytes"]), str(described["decision"]))

    def map(self) -> torch.Tensor:
        """The segment as a flat uint8 tensor, mapped shared and populated
        (so a copy into it never waits on a page fault)."""
        if self.refused:
            return torch.empty(0, dtype=torch.uint8)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(self.fd, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._mapped = mapped  # the tensor borrows it: keep it while the pool lives
        return torch.frombuffer(mapped, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            os.close(self.fd)
        except OSError:
            pass


def pin(buffer: torch.Tensor) -> bool:
    """Register ``buffer`` as pinned memory with CUDA (device copies then run
    asynchronously); False where that is not possible (no GPU, or it failed)."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(err) != 0:
        log.warning("staging pool: registering the shared segment as pinned memory failed (CUDA error %s); "
                    "copies to it are synchronous", int(err))
        return False
    return True

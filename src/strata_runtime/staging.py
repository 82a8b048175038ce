"""The host staging pool: memory for parked conversations and checkpoints,
reserved once at engine start and handed out in fixed-size pages."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .memory import MiB, Headroom, HostMemory

log = logging.getLogger(__name__)

DEFAULT_PAGE_BYTES = 2 * MiB


@dataclass(frozen=True)
class PoolDecision:
    """What the reservation asked for, what it got, and why."""

    requested: int
    granted: int
    headroom: Headroom
    floor: int
    message: str


class Lease:
    """Some pages of the pool, holding up to ``nbytes`` bytes as one logical
    byte range (page ``pages[i]`` holds bytes ``i * page_bytes ..``).
    Copies in and out go straight between a tensor and the pages: no
    temporary on the host."""

    def __init__(self, pool: "StagingPool", pages: tuple[int, ...], nbytes: int):
        self.pool = pool
        self.pages = pages
        self.nbytes = nbytes
        self.released = False

    def _spans(self, offset: int, length: int):
        """(pool byte offset, lease byte offset, length) pieces of ``[offset, offset+length)``."""
        if offset < 0 or offset + length > self.nbytes:
            raise ValueError(f"bytes {offset}..{offset + length} are outside this {self.nbytes}-byte lease")
        page = self.pool.page_bytes
        pos = offset
        while pos < offset + length:
            index, within = divmod(pos, page)
            n = min(page - within, offset + length - pos)
            yield self.pages[index] * page + within, pos, n
            pos += n

    def byte_views(self, offset: int, length: int) -> list[torch.Tensor]:
        """Lease bytes ``offset..offset+length-1`` as contiguous uint8 views of
        the pool buffer, in order (one per page touched): for writers, such as
        a receive from another process, that fill the pages directly."""
        buf = self.pool.buffer
        return [buf[at:at + n] for at, _, n in self._spans(offset, length)]

    def copy_in(self, offset: int, src: torch.Tensor) -> int:
        """Copy ``src`` (contiguous) to lease bytes ``offset..``; return the bytes written."""
        data = _bytes_of(src)
        buf = self.pool.buffer
        for at, pos, n in self._spans(offset, data.numel()):
            buf[at:at + n].copy_(data[pos - offset:pos - offset + n], non_blocking=buf.is_pinned())
        return data.numel()

    def copy_out(self, offset: int, dst: torch.Tensor) -> int:
        """Fill ``dst`` (contiguous) from lease bytes ``offset..``; return the bytes read."""
        data = _bytes_of(dst)
        buf = self.pool.buffer
        for at, pos, n in self._spans(offset, data.numel()):
            data[pos - offset:pos - offset + n].copy_(buf[at:at + n], non_blocking=buf.is_pinned())
        return data.numel()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("staging copies need contiguous tensors (copy from or into contiguous slices)")
    return t.reshape(-1).view(torch.uint8)


class StagingPool:
    """Host memory for snapshots, reserved once.

    Invariant: ``buffer`` is one ``uint8`` allocation of ``n_pages *
    page_bytes``, made and touched (so it is resident) at construction and
    never reallocated; every page is either in the free list or in exactly one
    unreleased ``Lease``. A lease is all or nothing: ``lease`` returns
    ``None`` rather than part of what was asked. On CUDA machines the buffer
    is pinned, so device copies run asynchronously.
    """

    def __init__(self, n_pages: int, page_bytes: int = DEFAULT_PAGE_BYTES, pin: bool = False):
        self.page_bytes = page_bytes
        self.buffer = torch.empty(n_pages * page_bytes, dtype=torch.uint8, pin_memory=pin)
        self.buffer.zero_()  # touch every page now: the memory is really there later
        self._free = list(range(n_pages - 1, -1, -1))
        self.n_pages = n_pages

    @classmethod
    def reserve(cls, requested_bytes: int, *, min_free_bytes: int, memory: HostMemory | None = None,
                page_bytes: int = DEFAULT_PAGE_BYTES, strict: bool = False,
                pin: bool = False) -> tuple["StagingPool", PoolDecision]:
        """Admit ``requested_bytes`` against the host's headroom minus
        ``min_free_bytes``: grant it, shrink it to what fits, or (``strict``,
        or unknown telemetry) refuse it; log the decision with its numbers."""
        headroom = (memory or HostMemory()).headroom()
        requested = requested_bytes // page_bytes * page_bytes
        if requested <= 0:
            granted, why = 0, ("no conversation cache requested" if requested_bytes <= 0 else
                                f"less than one page ({page_bytes / MiB:g} MiB) requested")
        elif not headroom.known:
            granted, why = 0, f"refused: {headroom.reason}"
        else:
            room = max(0, headroom.bytes - min_free_bytes) // page_bytes * page_bytes
            if requested <= room:
                granted, why = requested, "reserved"
            elif strict:
                granted, why = 0, "refused (strict)"
            else:
                granted, why = room, "shrunk to fit"
        try:
            pool = cls(granted // page_bytes, page_bytes, pin=pin and granted > 0)
        except (RuntimeError, MemoryError) as e:
            pool, granted, why = cls(0, page_bytes), 0, f"refused: reserving failed ({e})"
        known = f"headroom {headroom.bytes // MiB} MiB" if headroom.known else headroom.reason
        message = (f"staging pool: {why}: {granted // MiB} MiB of {requested // MiB} MiB requested "
                   f"({known}; floor {min_free_bytes // MiB} MiB)")
        log.info(message)
        return pool, PoolDecision(requested, granted, headroom, min_free_bytes, message)

    # --- leases -----------------------------------------------------------

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def lease(self, nbytes: int) -> Lease | None:
        """Pages for ``nbytes``, or ``None`` when the pool cannot give them all."""
        need = self.pages_for(nbytes)
        if need > len(self._free) or nbytes <= 0:
            return None
        pages = tuple(self._free.pop() for _ in range(need))
        return Lease(self, pages, nbytes)

    def release(self, lease: Lease) -> None:
        if lease.released or lease.pool is not self:
            raise ValueError("this lease was already released or belongs to another pool")
        lease.released = True
        self._free.extend(reversed(lease.pages))

    # --- figures ------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

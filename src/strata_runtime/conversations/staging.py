"""The host staging pool: memory for parked conversations and checkpoints,
reserved once at start and handed out in fixed-size pages.

The pool's memory is either the engine's own (a library user's engine) or a
shared segment the server reserved and keeps across engine restarts
(``staging_segment``): the pool itself does not care which."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .memory import Headroom, HostMemory, MiB

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


def admit(requested_bytes: int, *, min_free_bytes: int, memory: HostMemory | None = None,
          page_bytes: int = DEFAULT_PAGE_BYTES, strict: bool = False) -> tuple[int, str, Headroom]:
    """How much of ``requested_bytes`` the host can give, leaving
    ``min_free_bytes`` of its headroom free: (granted bytes, a page multiple;
    why; the headroom read). ``strict`` or unknown telemetry refuse rather
    than shrink."""
    headroom = (memory or HostMemory()).headroom()
    requested = requested_bytes // page_bytes * page_bytes
    if requested <= 0:
        return 0, ("no conversation cache requested" if requested_bytes <= 0 else
                   f"less than one page ({page_bytes / MiB:g} MiB) requested"), headroom
    if not headroom.known:
        return 0, f"refused: {headroom.reason}", headroom
    room = max(0, headroom.bytes - min_free_bytes) // page_bytes * page_bytes
    if requested <= room:
        return requested, "reserved", headroom
    if strict:
        return 0, "refused (strict)", headroom
    return room, "shrunk to fit", headroom


def describe_decision(why: str, granted: int, requested: int, headroom: Headroom, min_free_bytes: int,
                      where: str = "") -> str:
    known = f"headroom {headroom.bytes // MiB} MiB" if headroom.known else headroom.reason
    return (f"staging pool: {why}: {granted // MiB} MiB of {requested // MiB} MiB requested{where} "
            f"({known}; floor {min_free_bytes // MiB} MiB)")


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
            buf[at:at + n].copy_(data[pos - offset:pos - offset + n], non_blocking=self.pool.pinned)
        return data.numel()

    def copy_out(self, offset: int, dst: torch.Tensor) -> int:
        """Fill ``dst`` (contiguous) from lease bytes ``offset..``; return the bytes read."""
        data = _bytes_of(dst)
        buf = self.pool.buffer
        for at, pos, n in self._spans(offset, data.numel()):
            data[pos - offset:pos - offset + n].copy_(buf[at:at + n], non_blocking=self.pool.pinned)
        return data.numel()

    def read(self, offset: int, length: int) -> bytes:
        """Lease bytes ``offset..offset+length-1`` as a ``bytes`` object (small reads: headers)."""
        return b"".join(v.numpy().tobytes() for v in self.byte_views(offset, length))

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` to lease bytes ``offset..`` (small writes: headers)."""
        if data:
            self.copy_in(offset, torch.frombuffer(bytearray(data), dtype=torch.uint8))


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
        buffer = torch.empty(n_pages * page_bytes, dtype=torch.uint8, pin_memory=pin)
        buffer.zero_()  # touch every page now: the memory is really there later
        self._init(buffer, page_bytes, pin)

    def _init(self, buffer: torch.Tensor, page_bytes: int, pinned: bool) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() % page_bytes:
            raise ValueError(f"a staging pool needs a flat uint8 buffer of whole {page_bytes}-byte pages")
        self.page_bytes = page_bytes
        self.buffer = buffer
        self.pinned = pinned
        self.n_pages = buffer.numel() // page_bytes
        self._free = list(range(self.n_pages - 1, -1, -1))
        # The disk tier's writer thread releases the pages it held: free-list changes are locked.
        self._lock = threading.Lock()

    @classmethod
    def reserve(cls, requested_bytes: int, *, min_free_bytes: int, memory: HostMemory | None = None,
                page_bytes: int = DEFAULT_PAGE_BYTES, strict: bool = False,
                pin: bool = False) -> tuple["StagingPool", PoolDecision]:
        """Admit ``requested_bytes`` against the host's headroom minus
        ``min_free_bytes``: grant it, shrink it to what fits, or (``strict``,
        or unknown telemetry) refuse it; log the decision with its numbers."""
        granted, why, headroom = admit(requested_bytes, min_free_bytes=min_free_bytes, memory=memory,
                                       page_bytes=page_bytes, strict=strict)
        requested = requested_bytes // page_bytes * page_bytes
        try:
            pool = cls(granted // page_bytes, page_bytes, pin=pin and granted > 0)
        except (RuntimeError, MemoryError) as e:
            pool, granted, why = cls(0, page_bytes), 0, f"refused: reserving failed ({e})"
        message = describe_decision(why, granted, requested, headroom, min_free_bytes)
        log.info(message)
        return pool, PoolDecision(requested, granted, headroom, min_free_bytes, message)

    @classmethod
    def over(cls, buffer: torch.Tensor, page_bytes: int, pinned: bool = False) -> "StagingPool":
        """A pool in memory reserved elsewhere (a shared segment): ``buffer``
        is a uint8 tensor of whole pages, already resident; every page free."""
        pool = cls.__new__(cls)
        pool._init(buffer, page_bytes, pinned)
        return pool

    # --- leases -----------------------------------------------------------

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def lease(self, nbytes: int) -> Lease | None:
        """Pages for ``nbytes``, or ``None`` when the pool cannot give them all."""
        need = self.pages_for(nbytes)
        with self._lock:
            if need > len(self._free) or nbytes <= 0:
                return None
            pages = tuple(self._free.pop() for _ in range(need))
        return Lease(self, pages, nbytes)

    def claim(self, pages: Sequence[int], nbytes: int) -> Lease:
        """The lease of ``pages`` (free until now) holding ``nbytes``: what a
        restarted engine takes back of an entry it found in a shared pool."""
        if self.pages_for(nbytes) != len(pages):
            raise ValueError(f"{len(pages)} pages cannot hold exactly {nbytes} bytes of {self.page_bytes}-byte pages")
        with self._lock:
            free = set(self._free)
            if not all(p in free for p in pages) or len(set(pages)) != len(pages):
                raise ValueError("pages claimed twice, or outside the pool")
            taken = set(pages)
            self._free = [p for p in self._free if p not in taken]
        return Lease(self, tuple(pages), nbytes)

    def release(self, lease: Lease) -> None:
        with self._lock:
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
        with self._lock:
            return len(self._free) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

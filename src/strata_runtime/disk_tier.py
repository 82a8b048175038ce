"""The conversation cache's disk tier: entries written through to files, so
a server started again on the same directory restores the conversations it
had, and conversations evicted from RAM come back from disk.

Every entry committed to the staging pool is queued for a background writer
(write-through: by the time RAM evicts an entry it is usually on disk
already, so eviction never waits on a disk). The writer writes
``<id>.tmp`` (mode 0600), fsyncs it and renames it to ``<id>.entry``: a
file of that name is complete. The file is the entry's header (without a
page list) and its payload, read straight from the pool's pages. A full
disk, a write error or a queue too long for the disk (a slow disk): the
spill is skipped, logged and counted; nothing waits on it.

At start the index is rebuilt from the files' headers: leftover ``.tmp``
files, and files of another model, another format version, cut short or
whose header does not parse, are removed and counted. A file's payload hash
is checked when it is read back, into pool pages (never into fresh host
memory); one that fails is removed and counted, and the request is served
from what else there is. Over ``budget_bytes``, the least recently used
files go first.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import parked_entry as entry
from .faults import describe
from .memory import MiB
from .parked_entry import EntryMeta, EntryRejected
from .staging import Lease
from .testing import fault_point

log = logging.getLogger(__name__)

SUFFIX, TMP_SUFFIX = ".entry", ".tmp"
MAX_QUEUED = 64  # spills waiting for the writer; past this the disk is too slow and spills are skipped


@dataclass
class DiskEntry:
    """A complete file of the directory: ``meta`` from its header (trusted
    as far as the header's hash and the fingerprint go; the payload's hash
    is checked on read)."""

    meta: EntryMeta
    path: Path
    nbytes: int
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.meta.tokens

    @property
    def scope(self) -> str:
        return self.meta.scope


@dataclass
class _Spill:
    """A committed entry's lease lent to the writer. Invariant: while
    ``done`` is unset the writer may read the lease; whoever drops the entry
    meanwhile sets ``abandoned`` and the writer releases the lease."""

    meta: EntryMeta
    lease: Lease
    header: int
    payload_hash: int
    done: bool = False
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def abandon(self) -> None:
        """The entry is dropped from RAM: its lease is released now if the
        writer is done with it, else by the writer when it stops."""
        with self.lock:
            self.abandoned = True
            release = self.done
        if release:
            self.lease.pool.release(self.lease)

    def _finish(self) -> None:
        with self.lock:
            self.done = True
            release = self.abandoned
        if release:
            self.lease.pool.release(self.lease)


class DiskTier:
    """The files of one directory, and the thread that writes them.

    Invariant: ``entries`` holds every complete file of this model in the
    directory (by entry id), and their bytes add up to ``used_bytes`` <=
    ``budget_bytes`` (after each write); ``counters`` count every spill,
    read, skip and rejection."""

    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: str, max_queued: int = MAX_QUEUED):
        self.directory = Path(directory)
        self.max_queued = max_queued
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.entries: dict[str, DiskEntry] = {}  # complete files by entry id
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Spill | None] = queue.Queue()
        self._make_directory()
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="conversation-cache-disk", daemon=True)
        self._writer.start()

    # --- the directory and its index ----------------------------------------

    def _make_directory(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = self.directory.stat().st_mode & 0o777
        if mode & 0o077:
            os.chmod(self.directory, 0o700)  # parked conversations are the users' text: no one else reads them
            log.warning("conversation cache: %s was mode %o; made 0700", self.directory, mode)

    def _rebuild_index(self) -> None:
        t0 = time.perf_counter()
        for path in sorted(self.directory.iterdir()):
            if path.suffix == TMP_SUFFIX:
                _remove(path)  # a write cut off by a crash
                self.rejected["cut_off"] += 1
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                found = self._read_index_entry(path)
            except EntryRejected as e:
                self.rejected[e.cause] += 1
                log.info("conversation cache: removed %s (%s)", path.name, e)
                _remove(path)
                continue
            self.entries[found.meta.id] = found
        used = self.used_bytes
        if self.entries or self.rejected:
            causes = ", ".join(f"{n} {c}" for c, n in sorted(self.rejected.items())) or "none"
            log.info("conversation cache: %d entries (%s) on disk in %s, indexed in %.2f s; removed: %s",
                     len(self.entries), _mib(used), self.directory, time.perf_counter() - t0, causes)
        self._fit_budget()

    def _read_index_entry(self, path: Path) -> DiskEntry:
        try:
            with path.open("rb") as f:
                head = f.read(entry.PREFIX_BYTES)
                prefix = entry.parse_prefix(head)
                if prefix is None:
                    raise EntryRejected("corrupt" if len(head) == entry.PREFIX_BYTES else "truncated",
                                        "not an entry file (no magic)")
                if prefix.n_pages:
                    raise EntryRejected("corrupt", "a file's header lists pages")
                header = head + f.read(prefix.header_bytes - entry.PREFIX_BYTES)
                size = os.fstat(f.fileno()).st_size
                st = os.fstat(f.fileno())
        except OSError as e:
            raise EntryRejected("unreadable", f"cannot read it ({e.strerror or e})") from None
        _, meta, _ = entry.parse_header(header, self.fingerprint)
        if size != prefix.header_bytes + prefix.payload_bytes:
            raise EntryRejected("truncated" if size < prefix.header_bytes + prefix.payload_bytes else "corrupt",
                                f"{size} bytes, its header says {prefix.header_bytes + prefix.payload_bytes}")
        if path.name != meta.id + SUFFIX:
            raise EntryRejected("corrupt", f"the file of entry {meta.id} is named {path.name}")
        # Least recently used by modification time: a read touches the file.
        return DiskEntry(meta, path, size, time.monotonic() - max(0.0, time.time() - st.st_mtime))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self.entries.values())

    def _fit_budget(self, keep: str | None = None) -> None:
        with self._lock:
            while sum(e.nbytes for e in self.entries.values()) > self.budget_bytes:
                victims = [e for e in self.entries.values() if e.meta.id != keep]
                if not victims:
                    return
                victim = min(victims, key=lambda e: e.last_used)
                del self.entries[victim.meta.id]
                _remove(victim.path)
                self.counters["disk_evictions"] += 1

    def forget(self, entry_id: str, cause: str) -> None:
        """Remove a file found wrong on read (counted by ``cause``)."""
        with self._lock:
            found = self.entries.pop(entry_id, None)
        if found is not None:
            _remove(found.path)
            self.rejected[cause] += 1

    def snapshot_metas(self) -> list[DiskEntry]:
        with self._lock:
            return list(self.entries.values())

    def has(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self.entries

    # --- writing -----------------------------------------------------------------

    def spill(self, meta: EntryMeta, lease: Lease, header: int, payload_hash: int) -> _Spill | None:
        """Queue a committed entry for the writer; None where it is skipped
        (counted: too large for the budget, or the writer is behind)."""
        if self.has(meta.id):
            return None
        nbytes = entry.header_bytes(meta, 0) + meta.payload_bytes
        if nbytes > self.budget_bytes:
            return self._skip("too_large", f"{_mib(nbytes)} is more than the disk budget of {_mib(self.budget_bytes)}")
        if self._queue.qsize() >= self.max_queued:
            return self._skip("disk_slow", f"{self.max_queued} spills are still waiting for the disk")
        job = _Spill(meta, lease, header, payload_hash)
        self._queue.put(job)
        return job

    def _skip(self, cause: str, why: str) -> None:
        self.skipped[cause] += 1
        log.warning("conversation cache: spill to disk skipped (%s)", why)
        return None

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                if not job.abandoned:
                    self._write(job)
            finally:
                job._finish()
                self._queue.task_done()

    def _write(self, job: _Spill) -> None:
        final = self.directory / (job.meta.id + SUFFIX)
        tmp = final.with_suffix(TMP_SUFFIX)
        t0 = time.perf_counter()
        header = entry.encode_header(job.meta, (), job.payload_hash, entry.COMMITTED)
        try:
            fault_point("disk_write")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb", closefd=True) as f:
                    f.write(header)
                    for view in job.lease.byte_views(job.header, job.meta.payload_bytes):
                        if job.abandoned:  # dropped meanwhile: not worth finishing
                            raise _Abandoned
                        f.write(view.numpy().data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                _fsync_directory(self.directory)
            except BaseException:
                _remove(tmp)
                raise
        except _Abandoned:
            return
        except Exception as e:  # a full disk, a write error: the spill is skipped, nothing else
            cause = "no_space" if isinstance(e, OSError) and e.errno == 28 else "write_error"
            self._skip(cause, f"writing {final.name} failed: {describe(e) if not isinstance(e, OSError) else e}")
            return
        nbytes = len(header) + job.meta.payload_bytes
        with self._lock:
            self.entries[job.meta.id] = DiskEntry(job.meta, final, nbytes)
            self.counters["disk_spills"] += 1
            self.counters["disk_spill_bytes"] += nbytes
            self.counters["disk_spill_seconds"] += time.perf_counter() - t0
        self._fit_budget(keep=job.meta.id)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued spill is written (or ``timeout``); whether it finished."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)

    # --- reading -----------------------------------------------------------------

    def read_into(self, found: DiskEntry, lease: Lease, header: int) -> int:
        """Read ``found``'s payload into ``lease`` from byte ``header`` on
        and check its hash (returned); ``EntryRejected`` (the file removed
        and counted) where it does not hold or the file is short."""
        t0 = time.perf_counter()
        meta = found.meta
        try:
            fault_point("disk_read")
            with found.path.open("rb") as f:
                prefix = entry.parse_prefix(f.read(entry.PREFIX_BYTES))
                if prefix is None:
                    raise EntryRejected("corrupt", "not an entry file any more")
                f.seek(prefix.header_bytes)
                for view in lease.byte_views(header, meta.payload_bytes):
                    if f.readinto(view.numpy()) != view.numel():
                        raise EntryRejected("truncated", "the file ended early")
        except OSError as e:
            self.forget(meta.id, "unreadable")
            raise EntryRejected("unreadable", f"cannot read {found.path.name} ({e.strerror or e})") from None
        except EntryRejected as e:
            self.forget(meta.id, e.cause)
            raise
        digest = entry.payload_hash(v.numpy() for v in lease.byte_views(header, meta.payload_bytes))
        if digest != prefix.payload_hash:
            self.forget(meta.id, "corrupt")
            raise EntryRejected("corrupt", f"{found.path.name}: the payload's hash does not hold")
        found.last_used = time.monotonic()
        try:
            os.utime(found.path)  # the index's order at the next start
        except OSError:
            pass
        with self._lock:
            self.counters["disk_reads"] += 1
            self.counters["disk_read_bytes"] += found.nbytes
            self.counters["disk_read_seconds"] += time.perf_counter() - t0
        return digest


class _Abandoned(Exception):
    pass


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"

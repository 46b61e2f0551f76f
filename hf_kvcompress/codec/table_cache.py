"""An on-disk cache of the built table weights, so a new process skips ~1-3 s of float64 table building.

The cache is only a shortcut: `model.get_tables` verifies whatever it loads against `TABLES_SHA256` (the same
check a fresh build gets) and rebuilds on any mismatch or read error. Kept under `hf_kvcompress.downloads.
cache_dir()` (``$HF_KVCOMPRESS_CACHE`` or ``~/.cache/hf_kvcompress``); ``HF_KVCOMPRESS_TABLE_CACHE=0``
turns it off. Writes are atomic (temporary file, then rename) and failures to write are ignored.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def _path(digest: str) -> Path | None:
    if os.environ.get("HF_KVCOMPRESS_TABLE_CACHE", "1") == "0":
        return None
    try:
        from ..downloads import cache_dir

        return cache_dir() / "codec" / f"tables-{digest[:16]}.npz"
    except OSError:
        return None


def load(digest: str) -> list[np.ndarray] | None:
    """Weights cached for tables of hash ``digest``, unverified (the caller hashes them), or None."""
    path = _path(digest)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as z:
            flat, sizes = z["weights"].astype(np.int64), z["sizes"].astype(np.int64)
    except (OSError, ValueError, KeyError):
        return None
    if sizes.sum() != flat.size or (sizes <= 0).any():
        return None
    return np.split(flat, np.cumsum(sizes)[:-1])


def save(digest: str, weights: list[np.ndarray]) -> None:
    path = _path(digest)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, weights=np.concatenate(weights).astype(np.int32),
                     sizes=np.array([w.size for w in weights], dtype=np.int32))
        os.replace(tmp, path)
    except OSError:
        pass

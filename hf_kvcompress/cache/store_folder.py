"""The folder a `PrefixStore` owns: the names it creates there (namespace folders, chunk files, temporary files),
the marker that makes a folder a store's, atomic writes under a lock, least-recently-used marks, and the CLI's
folder-level tools (`folder_usage`, `clear`). Nothing here follows a link or touches a name the store does not
produce (docs/prefix_store.md "Trust")."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..downloads import cache_dir

log = logging.getLogger("hf_kvcompress.cache.store")  # the store's one logger: its warnings name the store

SUFFIX = ".kvp"
#: the file that marks a folder as a store's: the store refuses to take over a non-empty folder without it
MARKER = ".hf_kvcompress-prefix-store"
MARKER_VERSION = 1  # the marker file's content version (written since the first store, with chunk format 1)
#: a temporary file older than this whose writer holds no lock on it is a killed writer's leftover (younger: its
#: writer may be between creating and locking it, microseconds apart)
TEMP_GRACE_SECONDS = 10.0
#: where locks do not work (some network file systems), temporary files older than this are leftovers
STALE_SECONDS = 3600.0
#: the names the store creates: one folder per namespace, chunk files and temporary files in it (mkstemp's)
_FOLDER = re.compile(r"[0-9a-f]{32}")
_CHUNK = re.compile(r"[0-9a-f]{64}\.kvp")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.[a-z0-9_]+\.tmp")


def folder_usage(root: str | Path) -> list[dict[str, Any]]:
    """Per model folder under ``root`` (a store's folder): chunks, bytes and the newest use (a Unix time)."""
    out = []
    for folder in sorted(namespace_folders(Path(root)), key=lambda f: f.name):
        files = list(own_files(folder))
        chunks = [info for _, info, chunk in files if chunk]
        out.append({"folder": folder.name, "chunks": len(chunks), "bytes": sum(info.st_size for info in chunks),
                    "temporary_files": len(files) - len(chunks),
                    "last_used": max((info.st_mtime for info in chunks), default=None)})
    return out


def clear(root: str | Path) -> int:
    """Remove every chunk and temporary file of the store at ``root`` (and the folders that leaves empty);
    returns bytes removed. Only names the store creates, in its own namespace folders: nothing else is touched
    (a folder that is no store's is refused with a ``ValueError``)."""
    root = Path(root)
    if not root.is_dir():
        return 0
    if not is_store(root):
        raise ValueError(f"{root} is not a prefix store's folder (no {MARKER} file, and it holds other files)")
    removed = 0
    for folder in namespace_folders(root):
        for path, info, _chunk in list(own_files(folder)):
            removed += unlink(path, info.st_size)
        with contextlib.suppress(OSError):  # left non-empty by files that are not the store's
            folder.rmdir()
    return removed


def claim(path: object) -> Path:
    """The store's root for ``path``: created if missing, marked as a store's (`MARKER`) if new or empty (or a
    store's from before the marker: namespace folders only); any other folder is refused."""
    if path is None:
        root = cache_dir() / "prefixes"
    elif isinstance(path, (str, os.PathLike)):
        if os.fspath(path) in ("", b""):
            raise ValueError("PrefixStore: path is empty; name the store's folder (the working directory is not one)")
        root = Path(os.fsdecode(path))
    else:
        raise TypeError(f"PrefixStore: path must be a str or os.PathLike folder, got {type(path).__name__}")
    if root.exists() and not root.is_dir():
        raise ValueError(f"PrefixStore: path {str(root)!r} is not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise ValueError(f"PrefixStore: path {str(root)!r} is not a folder") from err
    if not is_store(root):
        raise ValueError(f"PrefixStore: path {str(root)!r} holds files that are not a prefix store's (no {MARKER} "
                         "file); name a new or empty folder")
    marker = root / MARKER
    if not is_regular(marker):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            pass  # another process marked it meanwhile
        else:
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps({"format": "hf_kvcompress.prefix_store", "version": MARKER_VERSION}) + "\n")
    return root


def is_store(root: Path) -> bool:
    """Whether ``root`` is a store's folder: it holds the marker, or nothing but namespace folders (empty, or
    written before the marker existed)."""
    if is_regular(root / MARKER):
        return True
    with os.scandir(root) as entries:
        return all(_FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False) for e in entries)


def own_folder(folder: Path, *, create: bool) -> bool:
    """Whether ``folder`` (a namespace folder) is a real folder to read or write chunks in (``create``: made if
    missing); a link or another file there is refused once per process, with a warning."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        if not create:
            return False
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        info = os.lstat(folder)
    if stat.S_ISDIR(info.st_mode):
        return True
    if folder not in _REFUSED:
        _REFUSED.add(folder)
        log.warning("prefix store: %s is a link or not a folder; nothing is read or written through it", folder)
    return False


_REFUSED: set[Path] = set()


def namespace_folders(root: Path) -> list[Path]:
    """The namespace folders directly under ``root`` (real folders of the store's names; links are not
    followed)."""
    try:
        with os.scandir(root) as entries:
            return [Path(e.path) for e in entries if _FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def own_files(folder: Path) -> Iterator[tuple[Path, os.stat_result, bool]]:
    """The regular files in ``folder`` named as the store names them: (path, stat, whether a chunk: else a
    temporary file)."""
    try:
        with os.scandir(folder) as entries:
            found = [e for e in entries if (_CHUNK.fullmatch(e.name) or _TEMP.fullmatch(e.name))
                     and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        yield Path(entry.path), info, entry.name.endswith(SUFFIX)


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def writer_gone(path: Path, info: os.stat_result) -> bool:
    """Whether a temporary file's writer is gone: it holds no lock on it (a writer locks its file from creation to
    rename; the kernel drops the lock of a killed process). Without locks (some network file systems), its age."""
    age = time.time() - info.st_mtime
    if age < TEMP_GRACE_SECONDS:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return age > STALE_SECONDS
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file: a temporary file in the same folder,
    locked while it is written (`writer_gone`), then a rename (atomic on POSIX; it replaces whatever is at
    ``path`` without following it); another writer of the same chunk writes the same bytes."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with contextlib.suppress(OSError):  # no locks here: a killed writer's file goes after STALE_SECONDS
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep other users' processes from reading a shared store
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.replace(tmp, path)  # still locked: an evicting process never takes it for a leftover
    except BaseException:
        unlink(Path(tmp), 0)
        raise


def touch_chain(paths: list[Path]) -> None:
    """Mark a prompt's chunks (in chain order) used now, each a microsecond older than the one before it: eviction
    takes the least recently used first, so a chain loses its tail before its head (a chunk is of no use without
    every chunk before it; same-time marks would leave the order to sizes and names). Links are not followed."""
    now = time.time_ns()
    for index, path in enumerate(paths):
        with contextlib.suppress(OSError, NotImplementedError):  # evicted meanwhile
            os.utime(path, ns=(now - 1000 * index, now - 1000 * index), follow_symlinks=False)


def unlink(path: Path, size: int) -> int:
    try:
        path.unlink()
        return size
    except OSError:
        return 0

"""The folder a `PrefixStore` owns: the names it creates there (namespace folders, chunk files, temporary files),
the marker that makes a folder a store's, atomic writes under a lock, least-recently-used marks, and the CLI's
folder-level tools (`folder_usage`, `clear`). Nothing here follows a link or touches a name the store does not
produce (docs/prefix_store.md "Trust").

Every name below the root is opened relative to a folder descriptor, never through a path: the root is opened
once (`open_root`), each namespace folder below it without following a link (`open_folder`: ``O_NOFOLLOW``), and
each file in it through that folder's descriptor (``dir_fd=``). A folder swapped for a link by another process
after it was checked cannot redirect a write, read, rename, removal or time stamp outside the store: the
descriptor still names the folder that was checked."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
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
#: the names the store creates: one folder per namespace, chunk files and temporary files in it (`write_atomic`'s, as mkstemp named them before)
_FOLDER = re.compile(r"[0-9a-f]{32}")
_CHUNK = re.compile(r"[0-9a-f]{64}\.kvp")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.[a-z0-9_]+\.tmp")


#: a folder's descriptor: read-only (only the names in it are written, through it), not inherited by programs run
_DIR = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def opened(fd: int | None) -> Iterator[int | None]:
    """``fd`` (None passes), closed on leaving."""
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def open_root(root: Path) -> int | None:
    """A descriptor of the folder ``root`` as named (a link there is the user's own choice of folder), or None
    where there is no folder to open."""
    try:
        return os.open(root, _DIR)
    except OSError:
        return None


def folder_usage(root: str | Path) -> list[dict[str, Any]]:
    """Per model folder under ``root`` (a store's folder): chunks, bytes and the newest use (a Unix time)."""
    with opened(open_root(Path(root))) as root_fd:
        if root_fd is None:
            return []
        out = []
        for name, fd in each_folder(root_fd):
            files = list(own_files(fd))
            chunks = [info for _, info, chunk in files if chunk]
            out.append({"folder": name, "chunks": len(chunks), "bytes": sum(info.st_size for info in chunks),
                        "temporary_files": len(files) - len(chunks),
                        "last_used": max((info.st_mtime for info in chunks), default=None)})
        return out


def clear(root: str | Path) -> int:
    """Remove every chunk and temporary file of the store at ``root`` (and the folders that leaves empty);
    returns bytes removed. Only names the store creates, in its own namespace folders: nothing else is touched
    (a folder that is no store's is refused with a ``ValueError``)."""
    root = Path(root)
    with opened(open_root(root)) as root_fd:
        if root_fd is None:
            return 0
        if not is_store(root_fd):
            raise ValueError(f"{root} is not a prefix store's folder (no {MARKER} file, and it holds other files)")
        return clear_at(root_fd)


def clear_at(root_fd: int) -> int:
    """`clear` of the store whose root ``root_fd`` is; returns bytes removed."""
    removed = 0
    for name, fd in each_folder(root_fd):
        for file, info, _chunk in list(own_files(fd)):
            removed += unlink(fd, file, info.st_size)
        with contextlib.suppress(OSError):  # left non-empty by files that are not the store's; or a link now
            os.rmdir(name, dir_fd=root_fd)
    return removed


def claim(path: object) -> tuple[Path, int]:
    """The store's root for ``path`` and a descriptor of it (the caller closes it): created if missing, marked as a
    store's (`MARKER`) if new or empty (or a store's from before the marker: namespace folders only); any other
    folder is refused (``ValueError``), one this process cannot create or mark raises an ``OSError`` naming it."""
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
        root_fd = os.open(root, _DIR)
    except (FileExistsError, NotADirectoryError) as err:
        raise ValueError(f"PrefixStore: path {str(root)!r} is not a folder") from err
    except OSError as err:
        raise _not_writable(err, root, "cannot be created or opened") from err
    try:
        if not is_store(root_fd):
            raise ValueError(f"PrefixStore: path {str(root)!r} holds files that are not a prefix store's (no "
                             f"{MARKER} file); name a new or empty folder")
        if not is_regular(root_fd, MARKER):
            try:
                fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=root_fd)
            except FileExistsError:
                pass  # another process marked it meanwhile
            except OSError as err:
                raise _not_writable(err, root, "cannot be written (its marker file could not be created)") from err
            else:
                with os.fdopen(fd, "w") as out:
                    out.write(json.dumps({"format": "hf_kvcompress.prefix_store", "version": MARKER_VERSION}) + "\n")
    except BaseException:
        os.close(root_fd)
        raise
    return root, root_fd


def _not_writable(err: OSError, root: Path, problem: str) -> OSError:
    """``err`` (a ``PermissionError``, a read-only file system's ``OSError``...) of the same type, saying which
    folder and what to do."""
    return type(err)(err.errno, f"PrefixStore: the store's folder {str(root)!r} {problem}: {err.strerror}; name a "
                                "folder this process can write (path=...)")


def is_store(root_fd: int) -> bool:
    """Whether the folder ``root_fd`` is a store's: it holds the marker, or nothing but namespace folders (empty,
    or written before the marker existed)."""
    if is_regular(root_fd, MARKER):
        return True
    with os.scandir(root_fd) as entries:
        return all(_FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False) for e in entries)


def open_folder(root_fd: int, name: str, *, create: bool) -> int | None:
    """A descriptor of the namespace folder ``name`` under ``root_fd``, opened without following a link
    (``create``: made if missing), or None: missing, or a link or another file there (refused once per process,
    with a warning). Other failures (permissions) raise ``OSError``."""
    for attempt in (0, 1):
        try:
            return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=root_fd)
        except FileNotFoundError:
            if not create or attempt:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_fd=root_fd)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW's answer for a link; a file there
                raise
            if name not in _REFUSED:
                _REFUSED.add(name)
                log.warning("prefix store: namespace folder %s is a link or not a folder; nothing is read or "
                            "written through it", name)
            return None
    return None


_REFUSED: set[str] = set()


def namespace_folders(root_fd: int) -> list[str]:
    """The names of the namespace folders directly under ``root_fd`` (real folders of the store's names; links
    are not followed), sorted."""
    try:
        with os.scandir(root_fd) as entries:
            return sorted(e.name for e in entries if _FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def each_folder(root_fd: int) -> Iterator[tuple[str, int]]:
    """Each namespace folder under ``root_fd``: its name and a descriptor (`open_folder`: a folder swapped for a
    link since it was listed is skipped), closed when the next is taken."""
    for name in namespace_folders(root_fd):
        try:
            fd = open_folder(root_fd, name, create=False)
        except OSError:
            continue
        if fd is None:
            continue
        with opened(fd):
            yield name, fd


def own_files(folder_fd: int) -> Iterator[tuple[str, os.stat_result, bool]]:
    """The regular files in the folder ``folder_fd`` named as the store names them: (name, stat, whether a chunk:
    else a temporary file)."""
    try:
        with os.scandir(folder_fd) as entries:
            found = [e for e in entries if (_CHUNK.fullmatch(e.name) or _TEMP.fullmatch(e.name))
                     and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        yield entry.name, info, entry.name.endswith(SUFFIX)


def is_regular(folder_fd: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def writer_gone(folder_fd: int, name: str, info: os.stat_result) -> bool:
    """Whether a temporary file's writer is gone: it holds no lock on it (a writer locks its file from creation to
    rename; the kernel drops the lock of a killed process). Without locks (some network file systems), its age."""
    age = time.time() - info.st_mtime
    if age < TEMP_GRACE_SECONDS:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
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


def write_atomic(folder_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` in the folder ``folder_fd`` so that no reader ever sees a partial file: a
    temporary file in the same folder (named as `_TEMP` matches), locked while it is written (`writer_gone`), then
    a rename (atomic on POSIX; it replaces whatever is at ``name`` without following it); another writer of the
    same chunk writes the same bytes."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = f".{name[:16]}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=folder_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name for {name}")
    try:
        with contextlib.suppress(OSError):  # no locks here: a killed writer's file goes after STALE_SECONDS
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o644)  # others' processes read a shared store (the umask may have taken bits)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            # still locked: an evicting process never takes it for a leftover
            os.replace(tmp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        unlink(folder_fd, tmp, 0)
        raise


def touch_chain(folder_fd: int, names: list[str]) -> None:
    """Mark a prompt's chunks (in chain order) used now, each a microsecond older than the one before it: eviction
    takes the least recently used first, so a chain loses its tail before its head (a chunk is of no use without
    every chunk before it; same-time marks would leave the order to sizes and names). Links are not followed."""
    now = time.time_ns()
    for index, name in enumerate(names):
        with contextlib.suppress(OSError, NotImplementedError):  # evicted meanwhile
            os.utime(name, ns=(now - 1000 * index, now - 1000 * index), dir_fd=folder_fd, follow_symlinks=False)


def unlink(folder_fd: int, name: str, size: int) -> int:
    """Remove ``name`` from the folder ``folder_fd`` (a link itself, never its target); ``size`` if it went."""
    try:
        os.unlink(name, dir_fd=folder_fd)
        return size
    except OSError:
        return 0

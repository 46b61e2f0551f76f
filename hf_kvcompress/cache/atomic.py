"""Replacing a file so that no reader, crash or full disk ever leaves it half written: the new bytes go to a hidden
temporary file in the target's folder, are flushed to the disk, then renamed onto the target (atomic on POSIX).
`files.save_cache` writes cache files this way; it needs nothing of the prefix store's folder (locks, names), so the
store's `store_folder.write_atomic` could call `replace_file` too."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

#: the longest part of the target's name the temporary name keeps (NAME_MAX is 255 on common file systems)
_NAME_KEPT = 200


def temporary_name(target: Path) -> Path:
    """A hidden name beside ``target`` that says whose it is: ``.<name>.<random>.tmp``."""
    return target.with_name(f".{target.name[:_NAME_KEPT]}.{secrets.token_hex(6)}.tmp")


def replace_file(target: Path, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
    """Write ``pieces`` (in order) to ``target``: all of them or, on any failure (``OSError`` of a full disk, an
    interrupt), nothing: the temporary file is removed and ``target`` keeps its old bytes. The new file gets the
    mode a plain ``open(target, "w")`` would give it: the old file's, else ``0o666`` less the umask (the kernel
    applies it at creation). A symbolic link at ``target`` is written through, as ``open`` does."""
    target = Path(os.path.realpath(target)) if os.path.islink(target) else target
    try:
        old_mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        old_mode = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    while True:  # O_EXCL: never another's file; a clash of 48 random bits is retried
        temporary = temporary_name(target)
        try:
            fd = os.open(temporary, flags, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as out:
            if old_mode is not None:
                os.fchmod(out.fileno(), old_mode)
            for piece in pieces:
                out.write(piece)
            out.flush()
            os.fsync(out.fileno())  # the bytes on the disk before the name points at them
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    sync_folder(target.parent)


def sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename) to the disk where the system allows it (not on every platform or file
    system: the rename has happened either way)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""Local filesystem helpers: directories, and writes that are either complete or absent."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO


def local_mkdir_safe(path: str) -> str:
    """Create ``path`` (and parents) if needed; safe when several ranks race to create it."""
    os.makedirs(path, exist_ok=True)
    return path


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries (a rename or new entry inside it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", durable: bool = True) -> Iterator[IO]:
    """A file handle whose content replaces ``path`` only when the block ends without error: readers see the
    old or the new file, never half of one; on error ``path`` is untouched and the temp file removed.

    ``durable``: fsync the file and its directory, so that the new file also survives a power loss.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with os.fdopen(_create_exclusive(tmp), mode) as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if durable:
        fsync_path(directory)


def _create_exclusive(path: str) -> int:
    """A new file at ``path``, never a symlink followed nor an existing file reused: the temp name is
    predictable, so one planted in a shared directory could otherwise redirect the write. A leftover of a
    crashed writer is unlinked (the link itself, not its target) and the creation tried once more."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o666)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, 0o666)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` durably, all or nothing (``atomic_open``)."""
    with atomic_open(path, "w") as handle:
        handle.write(text)

"""Local filesystem helpers: directories, and writes that are either complete or absent."""

from __future__ import annotations

import os


def local_mkdir_safe(path: str) -> str:
    """Create ``path`` (and parents) if needed; safe when several ranks race to create it."""
    os.makedirs(path, exist_ok=True)
    return path


def fsync_dir(path: str) -> None:
    """Make a rename or new entry inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via temp file + fsync + rename: readers see the old or the new file, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)

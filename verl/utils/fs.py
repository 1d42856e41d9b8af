"""Filesystem helpers with upstream verl's names: the local cache of remote paths, directories, and writes that
are either complete or absent.

Upstream's remote backend is HDFS (``hdfs://`` paths through the ``hdfs`` command line); this package has none,
so ``copy`` / ``exists`` / ``makedirs`` refuse a remote path, while the cache logic around them
(``copy_to_local``: one copy per remote path, a directory re-copied when its recorded structure changed) is
upstream's and works with any ``copy`` patched in.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from filelock import FileLock

__all__ = ["copy", "exists", "makedirs"]

_HDFS_PREFIX = "hdfs://"
_RECORD_NAME = ".directory_record.txt"


def is_non_local(path: str) -> bool:
    """Whether ``path`` is remote (HDFS), i.e. must be copied before use."""
    return path.startswith(_HDFS_PREFIX)


def _refuse_remote(*paths: str) -> None:
    remote = [p for p in paths if is_non_local(p)]
    if remote:
        raise NotImplementedError(f"{remote[0]}: HDFS paths are not supported here; copy it to a local path first")


def exists(path: str, **kwargs) -> bool:
    """``os.path.exists`` for a local path (remote paths are refused)."""
    _refuse_remote(path)
    return os.path.exists(path)


def makedirs(name: str, mode: int = 0o777, exist_ok: bool = False, **kwargs) -> None:
    """``os.makedirs`` for a local path (remote paths are refused)."""
    _refuse_remote(name)
    os.makedirs(name, mode=mode, exist_ok=exist_ok)


def copy(src: str, dst: str, **kwargs) -> str:
    """``shutil.copytree`` for a directory, ``shutil.copy`` for a file (remote paths are refused)."""
    _refuse_remote(src, dst)
    if os.path.isdir(src):
        return shutil.copytree(src, dst, **kwargs)
    return shutil.copy(src, dst, **kwargs)


def md5_encode(path: str) -> str:
    """The hex MD5 of a path string: the cache's directory name for it."""
    return hashlib.md5(path.encode()).hexdigest()


def get_local_temp_path(hdfs_path: str, cache_dir: str) -> str:
    """``{cache_dir}/{md5(hdfs_path)}/{basename}``, its directory created: two remote paths with one basename
    do not collide."""
    temp_dir = os.path.join(cache_dir, md5_encode(hdfs_path))
    os.makedirs(temp_dir, exist_ok=True)
    return os.path.join(temp_dir, os.path.basename(hdfs_path))


def _directory_entries(folder_path: str) -> set[str]:
    entries = set()
    for root, dirs, files in os.walk(folder_path):
        entries.update(f"dir:{os.path.relpath(os.path.join(root, d), folder_path)}" for d in dirs)
        entries.update(f"file:{os.path.relpath(os.path.join(root, f), folder_path)}" for f in files if f != _RECORD_NAME)
    return entries


def _record_directory_structure(folder_path: str | os.PathLike) -> str:
    """Write the list of ``folder_path``'s directories and files into it; returns the record's path."""
    record_file = os.path.join(folder_path, _RECORD_NAME)
    entries = _directory_entries(os.fspath(folder_path))
    with open(record_file, "w") as handle:
        handle.writelines(f"{entry}\n" for entry in sorted(entries))
    return record_file


def _check_directory_structure(folder_path: str | os.PathLike, record_file: str) -> bool:
    """Whether ``folder_path`` still holds exactly the entries ``record_file`` lists (False without a record)."""
    if not os.path.exists(record_file):
        return False
    with open(record_file) as handle:
        recorded = set(handle.read().splitlines())
    return _directory_entries(os.fspath(folder_path)) == recorded


def copy_to_local(
    src: str,
    cache_dir: str | os.PathLike | None = None,
    filelock: str = ".file.lock",
    verbose: bool = False,
    always_recopy: bool = False,
    use_shm: bool = False,
) -> str:
    """A local path for ``src``: ``src`` itself when local, else its copy in ``cache_dir`` (default: the
    system temp dir), made once and reused, re-made with ``always_recopy`` or when a copied directory changed."""
    if use_shm:
        raise NotImplementedError("copy_to_local(use_shm=True) is not supported here; pass use_shm=False")
    return copy_local_path_from_hdfs(src, cache_dir, filelock, verbose, always_recopy)


def copy_local_path_from_hdfs(
    src: str,
    cache_dir: str | os.PathLike | None = None,
    filelock: str = ".file.lock",
    verbose: bool = False,
    always_recopy: bool = False,
) -> str:
    """``copy_to_local`` without shared memory (upstream's older name). ``filelock`` is ignored, as upstream:
    the lock is named after ``src``, so concurrent ranks copy it once."""
    if src.endswith("/"):
        raise ValueError(f"{src}: drop the trailing '/' (the cache names the copy after its basename)")
    if not is_non_local(src):
        return src
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else tempfile.gettempdir()
    os.makedirs(cache_dir, exist_ok=True)
    local_path = get_local_temp_path(src, cache_dir)
    with FileLock(os.path.join(cache_dir, md5_encode(src) + ".lock")):
        if always_recopy and os.path.exists(local_path):
            if os.path.isdir(local_path):
                shutil.rmtree(local_path, ignore_errors=True)
            else:
                os.remove(local_path)
        stale = (
            os.path.isdir(local_path)
            and not _check_directory_structure(local_path, os.path.join(local_path, _RECORD_NAME))
        )
        if stale:
            shutil.rmtree(local_path, ignore_errors=True)
        if not os.path.exists(local_path):
            if verbose:
                print(f"Copy from {src} to {local_path}")
            copy(src, local_path)
            if os.path.isdir(local_path):
                _record_directory_structure(local_path)
    return local_path


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
    # A new file, never a symlink followed nor an existing file reused: the temp name is predictable, so one
    # planted in a shared directory could otherwise redirect the write. A leftover of a crashed writer is
    # unlinked (the link itself, not its target) and the creation tried once more.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            os.unlink(tmp)
            fd = os.open(tmp, flags, 0o666)
        with os.fdopen(fd, mode) as handle:
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


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` durably, all or nothing (``atomic_open``)."""
    with atomic_open(path, "w") as handle:
        handle.write(text)

"""Per-writer durability: each file of a step is made durable by the process that wrote it, before the commit.

On a filesystem several hosts share (NFS, Lustre) the pages a host wrote sit in that host's client cache until
that host flushes them: an fsync on another host does not. So the rule, owned here:

- every rank hashes (the manifest's CRC-32) and fsyncs the files its writers report it wrote, then the
  directories holding them and the directories its save made (``Sealer``: the files in background threads
  while the save goes on, the directories as it waits), and waits for them (``Sealer.results``) before it enters the step commit's gather (its barrier),
  which fails the commit on every rank when one rank's fsync failed;
- a process forked to write (the async writers) fsyncs what it writes, in the fork: megatron's dist-checkpoint
  writer processes fsync each file they write; a snapshot fork's HF export fsyncs its files (``fsync_written``);
- what no writer reports is rank 0's (``own_files``): megatron's coordinator files (``.metadata``,
  ``common.pt``, ``metadata.json``), the HF export of a bridge that gathers every tensor to rank 0 (mbridge's
  ``save_weights``, Megatron-Bridge's ``save_hf_weights``: rank 0 writes every file, and they report none), the
  step's JSON metadata. Rank 0's commit fsyncs every file no rank sealed and every directory, writes the commit
  mark and manifest durably, renames, and fsyncs the parent (``fsync_unsealed``; ``step_commit``).

In a sync save hashing sits with the writer too: its pages are in its own cache, where another host would read
them over the network (an async save's forks report no checksums: rank 0 hashes their files at the commit).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from verl.utils.checkpoint.checksum import file_checksum
from verl.utils.checkpoint.integrity import files_under, start_writeback
from verl.utils.fs import fsync_path


def _fsync(path: str) -> None:
    """``fsync_path``, its error naming the path: on a shared filesystem a write error shows here (the pages the
    writer's host held may be lost), and it fails the save."""
    try:
        fsync_path(path)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from exc


def files_in(directory: str) -> list[str]:
    """Every file below ``directory``, as paths under it, sorted (none when it does not exist)."""
    return [os.path.join(directory, relpath) for relpath in files_under(directory, [directory])]


def own_files(directory: str, reported: list[str] | None, rank: int) -> list[str]:
    """The files of ``directory`` that ``rank`` wrote, once they are complete on every rank: those its writer
    reported; a writer that reports none (None) wrote every file of it on rank 0."""
    if reported is not None:
        return sorted(reported)
    return files_in(directory) if rank == 0 else []


def _directories_up_to(step_path: str, paths: Iterable[str]) -> list[str]:
    """Each of ``paths``'s directories (a path that is a directory itself included) and their parents up to
    ``step_path``, deepest first: a new entry is durable once the directory holding it is fsynced."""
    step_path = os.path.abspath(step_path)
    found: set[str] = {step_path}
    for path in paths:
        path = os.path.abspath(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        while directory.startswith(step_path + os.sep) and directory not in found:
            found.add(directory)
            directory = os.path.dirname(directory)
    return sorted(found, key=lambda d: (-d.count(os.sep), d))


def fsync_written(step_path: str, paths: list[str]) -> None:
    """In the process that wrote ``paths`` (files inside ``step_path``): fsync each, then their directories."""
    for path in paths:
        _fsync(path)
    for directory in _directories_up_to(step_path, paths):
        _fsync(directory)


def _checksum_and_sync(path: str) -> str:
    """The file's CRC-32, then an fsync of it: read from the page cache first, written back while others hash."""
    checksum = file_checksum(path)
    _fsync(path)
    return checksum


class Sealer:
    """A rank's part of the rule for one step: hashes and fsyncs the files it wrote in background threads
    (``seal``, as soon as they are complete); ``results`` waits for them, then fsyncs their directories and the
    ``directories`` the save made (every rank makes them; any one of them may have created each)."""

    def __init__(self, step_path: str, directories: Iterable[str] = (), threads: int = 2) -> None:
        self.step_path = step_path
        self.directories = [step_path, *directories]
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-seal")
        self._pending: dict[str, Future] = {}
        self._sealed: dict[str, str] | None = None  # ``results``, once they are in

    def seal(self, paths: Iterable[str]) -> None:
        """Start every file's writeback at once (the disk writes while the threads hash), then hash and fsync
        each. ``paths``: absolute, or relative to the step."""
        full = [os.path.join(self.step_path, path) for path in paths]
        for path in full:
            start_writeback(path)
        for path in full:
            self._pending[os.path.relpath(path, self.step_path)] = self._pool.submit(_checksum_and_sync, path)

    def results(self) -> dict[str, str]:
        """Relative path -> checksum of every sealed file, once each is durable with its directory. Any error is
        raised and the step commit fails on every rank: an fsync's EIO (pages this host held may be lost), or a
        file its writer reported that is gone (something removed part of the step while it was being saved).
        Asked again, the same answer."""
        if self._sealed is not None:
            return self._sealed
        self._pool.shutdown(wait=True)
        for relpath, future in self._pending.items():
            error = future.exception()
            if isinstance(error, FileNotFoundError):
                raise FileNotFoundError(
                    error.errno, f"{relpath} was reported written by this rank's writer but is gone before it was made durable "
                    "(was the staging directory changed during the save?)", os.path.join(self.step_path, relpath),
                ) from error
            if error is not None:
                raise error
        sealed = {relpath: future.result() for relpath, future in self._pending.items()}
        written = [os.path.join(self.step_path, relpath) for relpath in sealed]
        for directory in _directories_up_to(
            self.step_path, [*written, *(d for d in self.directories if os.path.isdir(d))]
        ):
            _fsync(directory)
        self._sealed = sealed
        return sealed


def fsync_unsealed(step_path: str, sealed: Iterable[str]) -> None:
    """Rank 0's part, before the rename: every file of the step no rank sealed (relative paths ``sealed``), i.e.
    what rank 0 wrote and no writer reported, then every directory, deepest first."""
    sealed = set(sealed)
    directories = []
    for root, _, names in os.walk(step_path):
        directories.append(root)
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, step_path) not in sealed:
                _fsync(path)
    for directory in sorted(directories, key=lambda d: -d.count(os.sep)):
        _fsync(directory)

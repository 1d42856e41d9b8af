"""One writer per checkpoint directory: an OS lock held by a training run for its whole life.

Two runs writing one ``trainer.default_local_dir`` commit steps neither can load (their dist-checkpoint
writes interleave), so a run that may write there takes ``fcntl.flock`` on ``<dir>/.verl_writer.lock``
before anything else starts. The lock belongs to the open file, so the OS drops it when the process dies,
however it dies (SIGKILL, OOM killer): there is never a stale lock to clean up. The file records the
holder's pid, host and command so that a refused run can say who is writing. Readers
(``python -m verl.model_merger verify``) take no lock.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: anyone who can write a shared
checkpoint directory could otherwise plant a symlink there and have the next run overwrite its target
with the holder's JSON; such a lock path is refused, naming it, and its target is left untouched.

The descriptor is close-on-exec, so processes the run execs (Ray's raylet, GCS, workers) do not hold the
lock, and a child forked without exec closes its copy at once (an ``os.register_at_fork`` hook): a forked
helper that outlives the run (stuck, or orphaned by a SIGKILL) must never keep the directory locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass

LOCK_FILENAME = ".verl_writer.lock"

_held: list[DirLock] = []  # the locks this process holds, closed in every child it forks
_fork_hook_registered = False


class DirLockError(RuntimeError):
    """The writer lock of a checkpoint directory cannot be taken; the message says why and what to do."""


class UnsafeLockFileError(DirLockError):
    """The lock path is a symlink or not a regular file: writing the holder record there would write elsewhere."""

    def __init__(self, lock_path: str, what: str) -> None:
        self.lock_path = lock_path
        super().__init__(
            f"{lock_path} is {what}, not the regular lock file a run writes; refusing to follow it (the next write "
            "would land on whatever it points to). Remove it if nothing should be there, then start the run again."
        )


class CheckpointDirBusyError(DirLockError):
    """Another live process holds the directory's writer lock; ``holder`` is what it wrote into the lock file."""

    def __init__(self, directory: str, lock_path: str, holder: dict) -> None:
        self.directory, self.lock_path, self.holder = directory, lock_path, holder
        super().__init__(
            f"trainer.default_local_dir={directory} is being written by another run ({describe_holder(holder)}; "
            f"lock {lock_path}); two writers would corrupt its checkpoints. Wait for that run or stop it, or set "
            "trainer.default_local_dir to another directory."
        )


@dataclass
class DirLock:
    """A held (``fd`` set) or unavailable (``warning`` set: the filesystem refuses locks) writer lock."""

    path: str
    fd: int | None
    warning: str | None = None
    created_dir: bool = False  # the directory did not exist before the lock

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Drop the lock (the file stays: unlinking it would let two runs lock two different files)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file releases the flock
            self.fd = None
        _held[:] = [lock for lock in _held if lock is not self]

    def discard(self) -> None:
        """Release, and remove what taking the lock created when the run stops before writing anything
        (a bad config found after the lock leaves no empty directory behind). The file is unlinked while the
        lock is still held, so no run can lock it in between; one that opened it before locks a file no
        longer there, sees that, and locks the path's new file (``lock_checkpoint_dir``)."""
        if self.created_dir:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        self.release()
        if self.created_dir:
            with contextlib.suppress(OSError):  # not empty: another run is already using it
                os.rmdir(os.path.dirname(self.path))


def lock_checkpoint_dir(directory: str) -> DirLock:
    """Take the writer lock of ``directory`` (created if missing) without waiting.

    Raises ``CheckpointDirBusyError`` when another process holds it. On a filesystem without working
    locks (e.g. NFS without lockd: ENOLCK) the returned lock is not held and carries a warning to print.
    """
    directory = os.path.abspath(os.path.expanduser(directory))
    created = not os.path.isdir(directory)
    path = os.path.join(directory, LOCK_FILENAME)
    while True:
        os.makedirs(directory, exist_ok=True)
        fd = _open_lock_file(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_holder(fd)
                os.close(fd)
                raise CheckpointDirBusyError(directory, path, holder) from None
            os.close(fd)
            return DirLock(
                path,
                None,
                created_dir=created,
                warning=f"cannot lock {path} ({exc.strerror or exc}): this filesystem does not support file locks, so nothing "
                "stops a second run from writing the same trainer.default_local_dir; make sure only one run uses it",
            )
        if _names_the_open_file(path, fd):
            break
        os.close(fd)  # a run that stopped before writing removed the file after we opened it: lock the path's new one
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(sys.argv)}  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    lock = DirLock(path, fd, created_dir=created)
    global _fork_hook_registered
    if not _fork_hook_registered:  # os.register_at_fork cannot unregister: once per process
        os.register_at_fork(after_in_child=_drop_in_child)
        _fork_hook_registered = True
    _held.append(lock)
    return lock


def _drop_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (the parent's lock stays held: flock belongs
    to the open file, which the parent's descriptor keeps open)."""
    for lock in _held:
        with contextlib.suppress(OSError):
            os.close(lock.fd)
        lock.fd = None
    _held.clear()


def read_lock_holder(directory: str) -> dict:
    """What the current or last holder of ``directory``'s lock wrote (empty when there is no lock file)."""
    path = os.path.join(os.path.abspath(os.path.expanduser(directory)), LOCK_FILENAME)
    try:
        fd = _open_lock_file(path, os.O_RDONLY)
    except (OSError, UnsafeLockFileError):
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def describe_holder(holder: dict) -> str:
    if "pid" not in holder:
        return "holder unknown: its lock file is empty, it may be starting"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _open_lock_file(path: str, flags: int) -> int:
    """``path`` opened without following a symlink; raises ``UnsafeLockFileError`` for a link or a non-regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeLockFileError(path, f"a symlink to {os.readlink(path)!r}") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeLockFileError(path, "not a regular file")
    return fd


def _names_the_open_file(path: str, fd: int) -> bool:
    """Whether ``path`` still is the file open as ``fd`` (a lock on an unlinked file stops nobody)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}

"""Every process a rank starts for a save dies when the process that started it dies.

A save starts processes: the async save's fork, megatron's per-bucket dist-checkpoint writers (forked
even in a synchronous save) and the multiprocessing Manager server through which those writers report
(spawned, i.e. exec'd, at a process's first save). A rank killed mid-save (SIGKILL, the OOM killer, a
preemption) used to leave them behind, reparented to init: a writer done writing blocks forever in
``JoinableQueue.task_done`` on its dead parent's condition, holding the rank's copy-on-write image
(hundreds of MB each), and the Manager serves forever. ``install`` arms every later ``os.fork`` of this
process (and of its forks, which inherit the hook) with ``die_with``; a process started by exec runs no
fork hook, so whoever spawns one passes ``die_with`` as its initializer (the Manager:
``verl.utils.internals.megatron_core.tie_write_results_queue``).

``die_with(parent)`` ends the calling process when its parent process ends:

- started by the parent's thread-group leader (its main thread, which lives as long as the process),
  it gets Linux's parent-death signal (``PR_SET_PDEATHSIG``, SIGKILL): the kernel kills it the moment
  the parent dies, whatever it is doing;
- the kernel sends that signal when the starting *thread* exits, not the process, so a process started
  by another thread (a threaded Ray actor's call, a helper thread of the caller), which would be killed
  with that thread, is watched instead: a daemon thread in it waits on a pidfd of the parent (readable
  once the whole parent process has exited) and ends the process then. Being a thread of the child, it
  lives exactly as long as the child; it holds no lock and touches nothing the child uses.

A child whose parent died before the hook ran ends at once.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_INTERVAL_S = 0.2  # only where pidfds are missing (Linux < 5.3, non-Linux)

_installed = False
_fork_parent: tuple[int, bool] = (0, True)  # (pid, forked by its thread-group leader), set just before each fork


def install() -> None:
    """Arm every later fork of this process (idempotent). Called when a rank initialises."""
    global _installed
    if _installed:
        return
    os.register_at_fork(before=_note_parent, after_in_child=_bind_to_parent)
    _installed = True


def starter() -> tuple[int, bool]:
    """(this process's pid, whether the calling thread is its thread-group leader): ``die_with``'s arguments for
    a process the calling thread starts now."""
    return os.getpid(), threading.get_native_id() == os.getpid()


def start_manager() -> multiprocessing.managers.SyncManager:
    """A started multiprocessing Manager whose (spawned) server process dies with this process."""
    import multiprocessing.managers

    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(die_with, starter())
    return manager


def _note_parent() -> None:
    global _fork_parent
    _fork_parent = starter()


def _bind_to_parent() -> None:
    die_with(*_fork_parent)


def die_with(parent_pid: int, started_by_leader: bool) -> None:
    """End this process (SIGKILL or ``os._exit(1)``) when process ``parent_pid``, its parent, ends.

    ``started_by_leader``: whether the thread of the parent that started this process is the parent's
    thread-group leader (``starter``): then the kernel's parent-death signal does it, else a watcher thread.
    """
    if started_by_leader and _set_parent_death_signal():
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent died before the signal was armed
        return
    pidfd = _open_pidfd(parent_pid)
    if os.getppid() != parent_pid:  # checked after opening: the pidfd then names the live parent, not a reused pid
        os._exit(1)
    threading.Thread(target=_end_when_gone, args=(parent_pid, pidfd), name="die-with-parent", daemon=True).start()


def wait_for_exit(pidfd: int) -> None:
    """Block until the process ``pidfd`` names has exited (its pidfd turns readable). ``poll``, not ``select``:
    ``select`` refuses a descriptor numbered 1024 or above, which a rank with gloo's and Ray's sockets reaches."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.poll()


def _end_when_gone(parent_pid: int, pidfd: int | None) -> None:
    if pidfd is not None:
        wait_for_exit(pidfd)  # every thread of the parent has exited
    else:
        while os.getppid() == parent_pid:
            time.sleep(POLL_INTERVAL_S)
    os._exit(1)


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (or the parent is already gone: getppid says so next)
        return None


def _set_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False

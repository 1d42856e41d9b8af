"""Every process a rank forks dies when the process that forked it dies.

A save forks processes (the async save's fork, megatron's per-bucket dist-checkpoint writers, which
megatron forks even in a synchronous save). A rank killed mid-save (SIGKILL, the OOM killer, a
preemption) used to leave them behind, reparented to init: a writer done writing blocks forever in
``JoinableQueue.task_done`` on its dead parent's condition, holding the rank's copy-on-write image
(hundreds of MB each). ``install`` arms every later ``os.fork`` of this process (and of its forks, which
inherit the hook) so that the child ends with its parent:

- a fork made from the parent's main thread gets Linux's parent-death signal (``PR_SET_PDEATHSIG``,
  SIGKILL): the kernel kills it the moment the parent dies;
- the kernel sends that signal when the forking *thread* exits, not the process, so a fork made from
  another thread (which may end long before the process) is not armed. (A watcher thread started in
  such a child hung the async save's fork in the Ray workers, whose calls run on a non-main thread;
  there the fork, a direct child of the worker, is stopped by Ray with the worker, and the writers it
  forks from its own main thread are armed.)

A child whose parent died before the hook ran ends at once. Processes started by exec (subprocess,
multiprocessing's spawn) run no fork hook; the ranks' group stops those (docs/operations.md).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h

_installed = False
_fork_parent: tuple[int, bool] = (0, True)  # (pid, forking from its main thread), set just before each fork


def install() -> None:
    """Arm every later fork of this process (idempotent). Called when a rank initialises."""
    global _installed
    if _installed:
        return
    os.register_at_fork(before=_note_parent, after_in_child=_bind_to_parent)
    _installed = True


def _note_parent() -> None:
    global _fork_parent
    _fork_parent = (os.getpid(), threading.current_thread() is threading.main_thread())


def _bind_to_parent() -> None:
    parent_pid, from_main_thread = _fork_parent
    if from_main_thread and _set_parent_death_signal() and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was armed


def _set_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False

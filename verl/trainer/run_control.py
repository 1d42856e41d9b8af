"""What the driver does around a run: hold the checkpoint directory's writer lock, and stop cleanly on a signal.

- ``take_writer_lock``: a run that writes into ``trainer.default_local_dir`` holds its OS lock for its whole
  life (``verl.utils.checkpoint.dir_lock``), so a second run on the same directory is refused before Ray starts.
- ``StopSignals``: SIGINT and SIGTERM become a ``KeyboardInterrupt`` in the driver's main thread, so the
  ``finally`` blocks stop the ranks and Ray in order, instead of Ray's own SIGTERM handler tearing Ray down
  under a live core worker (a C++ abort, exit 134) or a KeyboardInterrupt traceback through Ray. A second
  signal during that cleanup exits at once.
- ``stop_message``: the one line printed then: the committed step (what the tracker names) and the command
  that resumes from it.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from typing import Any

from verl.trainer.config import TrainerConfig
from verl.utils.checkpoint.dir_lock import DirLock, lock_checkpoint_dir
from verl.utils.checkpoint.errors import TrackerError
from verl.utils.checkpoint.layout import tracker_path
from verl.utils.checkpoint.tracker import read_tracker

_RESUME_OVERRIDES = ("trainer.resume_mode=", "trainer.resume_from_path=", "+trainer.resume_mode=", "++trainer.resume_mode=")


def output_dir(trainer: TrainerConfig) -> str:
    return os.path.abspath(os.path.expanduser(trainer.default_local_dir))


def writes_to_output_dir(trainer: TrainerConfig) -> bool:
    """Checkpoints (``save_freq > 0``) or ``metrics.jsonl`` / ``reward_curve.png`` (the file logger)."""
    return trainer.save_freq > 0 or "file" in trainer.logger


def take_writer_lock(trainer: TrainerConfig) -> DirLock | None:
    """The writer lock of ``trainer.default_local_dir`` when the run writes there (None otherwise).

    Raises ``CheckpointDirBusyError`` when another run holds it, ``UnsafeLockFileError`` when the lock path is a symlink; prints a warning when the filesystem has no locks.
    """
    if not writes_to_output_dir(trainer):
        return None
    lock = lock_checkpoint_dir(output_dir(trainer))
    if lock.warning:
        print(f"[main_ppo] WARNING: {lock.warning}", file=sys.stderr, flush=True)
    return lock


class StopSignals:
    """SIGINT / SIGTERM -> ``KeyboardInterrupt`` in the main thread, remembering which signal came first."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        """(Re)install the handlers; again after ``ray.init``, which sets its own SIGTERM handler."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os.write(2, f"[main_ppo] {signal.Signals(signum).name} again: exiting now, without cleanup\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        raise KeyboardInterrupt

    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process killed by it: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + (self.signum or signal.SIGINT)


def read_committed_step(directory: str) -> tuple[int | None, str]:
    """(step the tracker names, or None; a note when it is absent or unreadable), without importing torch."""
    tracker = tracker_path(directory)
    try:
        step = read_tracker(directory)
    except TrackerError as exc:
        return None, str(exc)
    if step is None:
        return None, f"no step is committed yet ({tracker} does not exist)"
    return step, f"step {step} is committed (tracker {tracker})"


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same overrides, resuming from the tracked step."""
    kept = [arg for arg in argv if not arg.startswith(_RESUME_OVERRIDES)]
    return shlex.join(["python", "-m", "verl.trainer.main_ppo", *kept, "trainer.resume_mode=auto"])


def stop_message(trainer: TrainerConfig | None, signum: int, step: int | None, pending: int | None, argv: list[str]) -> str:
    """One line: which signal stopped the run where, what is committed, and how to resume."""
    name = signal.Signals(signum).name
    where = f" at step {step}" if step else ""
    # None: stopped while the config was still being checked, before anything was written
    committed, note = read_committed_step(output_dir(trainer)) if trainer is not None else (None, "nothing was saved")
    lost = f"; step {pending}'s async save was not finalized and is discarded" if pending else ""
    action = "resume with" if committed is not None else "start again with"
    return f"[main_ppo] stopped by {name}{where}: {note}{lost}; {action}: {resume_command(argv)}"

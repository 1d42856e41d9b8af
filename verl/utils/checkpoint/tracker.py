"""The tracker (``<root>/latest_checkpointed_iteration.txt``): the step a resume loads, read in one place.

Torch-free: the config checks before Ray, the driver's stop message and the ranks' retention read it alike,
and a corrupt tracker gets one message, naming the file and the fix, wherever it is read.
"""

from __future__ import annotations

from verl.utils.checkpoint.errors import TrackerError
from verl.utils.checkpoint.layout import tracker_path

MAX_STEP_DIGITS = 18  # any step a run reaches; fits an int64
_FIX = "write the last committed step's N (of global_step_N) into it, or set trainer.resume_mode=disable"


def read_tracker(root_path: str) -> int | None:
    """The step the tracker under ``root_path`` names; None without a tracker; ``TrackerError`` when it cannot
    be read or holds anything but a step number (ASCII digits: ``str.isdigit`` admits '²', which ``int``
    refuses, and ``int`` refuses 4301+ digits with a message that names no file)."""
    tracker = tracker_path(root_path)
    try:
        with open(tracker, "rb") as handle:
            raw = handle.read(64)  # a step number is a few digits; anything longer is corrupt either way
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TrackerError(
            f"checkpoint tracker {tracker} is unreadable ({exc.strerror}); make it readable by this user (its permissions, "
            "or the disk it lies on), or set trainer.resume_mode=disable"
        ) from exc
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise TrackerError(f"checkpoint tracker {tracker} is corrupt: expected a step number, found non-text bytes {raw[:16]!r}; {_FIX}") from exc
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_STEP_DIGITS):
        raise TrackerError(f"checkpoint tracker {tracker} is corrupt: expected a step number, found {text[:50]!r}; {_FIX}")
    return int(text)

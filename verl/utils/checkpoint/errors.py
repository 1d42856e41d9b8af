"""The one family of checkpoint errors: the bottom floor of ``verl.utils.checkpoint`` (it imports nothing).

Every refusal of a step, a tracker or a save is a ``CheckpointError`` whose message names the file, the cause
and the fix; callers that report a checkpoint problem catch this one class.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the cause."""


class TrackerError(CheckpointError, ValueError):
    """The tracker (``latest_checkpointed_iteration.txt``) holds no step number. A ``ValueError`` too: the
    tracker reader raised one before the error family existed, and callers catch it."""


class ChecksumMismatchError(CheckpointError):
    """A file a load read differs from the checksum its step's manifest records; nothing of it was applied."""

"""What this process checked of a checkpoint, for whoever asks: the public hook that shows a resume checks once.

Each check of a file notes itself here (``note``: a checksum of a file, an HF export compared with its config,
the driver's record taken in place of a check); ``recording()`` collects the notes taken inside it, in this
process only, and nothing is kept outside one. The trainer sums the driver's and every rank's notes of one
resume into its metrics (``resume/...``), so a test sees from outside how often each file was checked.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

CHECKSUM = "checksum"  # a file's content checksum taken (the path: the file)
HF_EXPORT = "hf_export"  # an HF folder's tensors compared with its config (the path: the folder)
RECORD = "record"  # the driver's record of a step taken in place of checking it again (the path: the step)

_OPEN: list[collections.Counter] = []


def note(kind: str, path: str) -> None:
    """One check of ``path`` (``CHECKSUM``, ``HF_EXPORT`` or ``RECORD``), counted by every ``recording()`` open."""
    for counts in _OPEN:
        counts[(kind, path)] += 1


@contextlib.contextmanager
def recording() -> Iterator[collections.Counter]:
    """The checks this process makes inside the block: (kind, path) -> how many times."""
    counts: collections.Counter = collections.Counter()
    _OPEN.append(counts)
    try:
        yield counts
    finally:
        _OPEN.remove(counts)

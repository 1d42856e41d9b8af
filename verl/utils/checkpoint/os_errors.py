"""A save that fails in the operating system says so: the errno's name, its text and the path being written.

A full disk surfaces in many shapes: an ``OSError`` without a file name from a writer's ``stream.write``,
the same error pickled back from one of megatron's writer processes, wrapped in torch's
``CheckpointException`` (its per-rank ``failures``), or only as text (safetensors' Rust I/O error: ``os
error 28``). ``find_os_error`` digs the errno out of any of them, so a rank's error reads ``No space left
on device (ENOSPC) writing <path>`` instead of a wrapper's last line.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import errno
import os
import re
from collections.abc import Iterator

from verl.utils.checkpoint.errors import CheckpointError

FULL_MARGIN_BYTES = 1 << 20  # the least room a failed write without an errno must find for it not to be ENOSPC
# Rust's io::Error; Python's OSError as text, with the repr of its file name where it has one
_TEXT_ERRNO = re.compile(r"""\(os error (\d+)\)|\[Errno (\d+)\][^:\n]*(?:: ('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))?""")


@dataclasses.dataclass(frozen=True)
class OsFailure:
    """The operating system's answer to a write: errno number, its name (``ENOSPC``), its text, the path."""

    errno: int
    name: str
    strerror: str
    filename: str | None
    note: str | None = None  # how it was known, when no error carried the errno (``disk_full``)

    def describe(self, path: str | None = None) -> str:
        """One line: ``No space left on device (ENOSPC) writing <path>``; ``path`` where the error named none."""
        where = self.filename or path
        return f"{self.strerror} ({self.name})" + (f" writing {where}" if where else "") + (f" ({self.note})" if self.note else "")

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def _failure(code: int, filename: str | None) -> OsFailure:
    return OsFailure(code, errno.errorcode.get(code, f"errno {code}"), os.strerror(code), filename)


def _linked(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it wraps: its cause and context, and torch DCP's per-rank ``failures``."""
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # torch's CheckpointException: rank -> (exception, traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]
        todo += [current.__cause__, current.__context__]


def find_os_error(exc: BaseException, text: bool = True) -> OsFailure | None:
    """The first OSError (with an errno) in ``exc`` or what it wraps; with ``text``, also an errno only its
    message holds (an error raised outside Python, or another rank's as text). The first file name any of them
    carries is kept (in text, the one Python's OSError prints after its errno)."""
    chain = list(_linked(exc))
    filename = next((str(e.filename) for e in chain if isinstance(e, OSError) and e.filename), None)
    for current in chain:
        if isinstance(current, OSError) and current.errno:
            return _failure(current.errno, filename)
    if text:
        for current in chain:
            match = _TEXT_ERRNO.search(str(current))
            if match:
                return _failure(int(match.group(1) or match.group(2)), filename or _unquoted(match.group(3)))
    return None


def _unquoted(text: str | None) -> str | None:
    """A file name as Python's OSError prints it (its repr), or None."""
    try:
        return ast.literal_eval(text) if text else None
    except (ValueError, SyntaxError):
        return None


def disk_full(path: str) -> OsFailure | None:
    """ENOSPC when the filesystem of ``path`` (a step's staging directory, ``.../global_step_N/<role>.incomplete``)
    has less room left for this user than a step of this run takes (the newest other step of the role on disk;
    at least ``FULL_MARGIN_BYTES``), else None.

    For a write that failed without an errno: torch's zip writer turns a stream's ENOSPC into ``unexpected
    pos``, and megatron's sync finalize raises the writers' errors on the coordinator rank only (the others
    get ``CheckpointException ranks:dict_keys([])``). What is left after the failed write can be anything up
    to that write's size, hence a step's size as the measure."""
    left = free_bytes(path)
    if left is None:
        return None
    needed = max(FULL_MARGIN_BYTES, _step_size(path))
    if left >= needed:
        return None
    note = f"the write failed with {left} bytes left on its filesystem, less than a step of this run takes ({needed})"
    return OsFailure(errno.ENOSPC, "ENOSPC", os.strerror(errno.ENOSPC), None, note)


def free_bytes(path: str) -> int | None:
    """Room left for this user on the filesystem of ``path`` (its nearest existing parent); None if unknown."""
    probe = os.path.abspath(path)
    while True:
        try:
            stats = os.statvfs(probe)
        except FileNotFoundError:  # not made yet, or removed meanwhile (another rank's cleanup): its parent
            if os.path.dirname(probe) == probe:
                return None
            probe = os.path.dirname(probe)
        except OSError:
            return None
        else:
            return stats.f_bavail * stats.f_frsize


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it is gone; files vanishing meanwhile are skipped)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps, or its message: a failure another rank reported as text) is a full
    disk or quota: ENOSPC or EDQUOT."""
    found = find_os_error(exc)
    if found is not None and found.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(f"({name})" in str(exc) for name in ("ENOSPC", "EDQUOT"))


def space_needed(staging: str, written: int) -> str:
    """For a save that failed on a full disk, once its staging directory is removed: one sentence with the bytes
    a step of this run takes (the newest committed one of the role; else at least what was written before the
    disk filled) against the bytes free now."""
    step, free = _step_size(staging), free_bytes(staging)
    needed = f"about {step} bytes (the size of the last committed step)" if step else f"more than the {written} bytes it wrote before the disk filled"
    room = f"{free} bytes are free" if free is not None else "the free space is unknown"
    return f"The save needed {needed}; {room} on {os.path.dirname(os.path.dirname(os.path.abspath(staging)))}'s filesystem with its staging directory removed."


def _step_size(staging: str) -> int:
    """Bytes of the newest committed step of the role ``staging`` is saving (0 when there is none)."""
    from verl.utils.checkpoint.layout import STAGING_SUFFIX, list_step_dirs

    step_dir = os.path.dirname(os.path.abspath(staging))
    role = os.path.basename(os.path.abspath(staging)).removesuffix(STAGING_SUFFIX)
    for _, other in reversed(list_step_dirs(os.path.dirname(step_dir))):
        if other != step_dir and os.path.isdir(os.path.join(other, role)):
            return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(os.path.join(other, role)) for name in names)
    return 0


def explain(exc: BaseException, path: str) -> OsFailure | None:
    """Why a write under ``path`` failed, as far as the operating system tells: an errno in ``exc``, else a
    full disk under ``path``; None for a failure of another kind, and for this package's own CheckpointError
    (its message says what it is: a NaN refusal is no disk error, however full the disk)."""
    if isinstance(exc, CheckpointError):
        return None
    return find_os_error(exc) or disk_full(path)


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Name ``path`` in an operating-system error of the block whose own error names no file (a write to an
    open stream, a writer process's error, a Rust library's): re-raised as an ``OSError`` with that errno."""
    try:
        yield
    except Exception as exc:
        found = find_os_error(exc)
        if found is None or found.filename:
            raise
        raise OSError(found.errno, found.strerror, path) from exc

"""The step transaction: the one owner of what turns a role's written parts into a committed, tracked step.

A part writer (``MegatronCheckpointManager.save_checkpoint``, or any object that fills a directory) writes
into the staging directory the transaction hands out; the transaction does everything else, in this order:

1. staging: a leftover ``<role>.incomplete`` (an interrupted attempt) is removed, every rank waits;
2. verify: the HF export holds every tensor its config implies (once, on rank 0; strict fails the save); its
   verdict reaches every rank in the same collective as every rank's seal of the files it wrote;
3. manifest: our commit mark, then ``manifest.json`` over every other file (checksums the writer sealed are
   reused, the rest computed);
4. fsync of what rank 0 wrote (every other file was fsynced by the rank that wrote it before this phase's
   gather: ``durability``) + one rename of the staging directory into place (an older copy goes only after);
5. retention: upstream's ``max_ckpt_to_keep`` rule over the steps committed on disk up to this one, never the
   tracked step (``stale_steps``: the disk is the list, so no object keeps one), applied by rank 0;
6. the step's other files (the driver's ``data.pt``), written atomically beside the role's directory;
7. the tracker, last: only now does a resume take this step.

Every rank passes through each phase; rank 0 does the file work and every rank learns its verdict, a failure
there included, in the phase's collective (``from_rank_zero``; ``done_by_rank_zero`` where no value is shared; or for the HF check the seal gather that opens
``commit``: no rank waits for a verdict that never comes). ``hf_verify`` has no collective of its own, nor has a
tracked commit's ``retention``: the next phase's collective is where the ranks meet and its outcome travels. A failure
anywhere (the writer's included) discards the staging directory, and a step already renamed into place but not
yet tracked, and leaves every committed step and the tracker as they were. ``commit`` (or ``finalize`` for a writer that finishes in the background)
returns a ``CommittedStep``, the record the driver trusts instead of reading the step again.

Handed an explicit ``StepSpec``: this module imports nothing of the manager's, nor megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import torch

from verl.utils.checkpoint import layout, os_errors
from verl.utils.checkpoint.durability import fsync_unsealed
from verl.utils.checkpoint.errors import CheckpointError, TrackerError
from verl.utils.checkpoint.hf_verify import HFCheckpointIncompleteError, verify_hf_checkpoint
from verl.utils.checkpoint.integrity import FORMAT_VERSION, BridgeRecord, build_manifest
from verl.utils.checkpoint.tracker import read_tracker
from verl.utils.fs import atomic_open, atomic_write_text, fsync_path
from verl.utils.rank_comm import RankComm, describe


class Retention(Protocol):
    """What removes the steps retention drops: upstream's ``BaseCheckpointManager.remove_previous_save_local_path``
    (the transaction calls it on rank 0). Which steps go is the transaction's decision (``stale_steps``)."""

    def remove_previous_save_local_path(self, path: str | list[str]) -> None: ...


T = TypeVar("T")


def _no_phase(phase: str) -> None:
    """The default phase hook: nothing observes the phases."""


def _outcome_on_rank_zero(work: Callable[[], T], what: str, path: str) -> tuple[bool, Any]:
    """Rank 0 only: ``(True, work())``, or ``(False, the one line every rank raises)`` when ``work`` fails (an
    OS error named with its errno and path)."""
    try:
        return True, work()
    except Exception as exc:
        found = os_errors.explain(exc, path)
        cause = f"{type(exc).__name__}: {found.describe(path)}" if found else describe(exc)
        return False, f"rank 0 could not {what} ({cause})"


def _raise_unless_ok(outcome: tuple[bool, Any]) -> Any:
    ok, value = outcome
    if not ok:
        raise CheckpointError(value)
    return value


def from_rank_zero(work: Callable[[], T], what: str, path: str) -> T:
    """All ranks: rank 0 runs ``work`` and every rank returns its value. When it fails there, every rank raises
    the same ``CheckpointError`` naming the cause (an OS error with its errno and path), so the other ranks do
    not wait in the broadcast until the collective times out."""
    outcome: list = [_outcome_on_rank_zero(work, what, path) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(outcome, src=0)
    return _raise_unless_ok(outcome[0])


def done_by_rank_zero(work: Callable[[], Any], what: str, path: str) -> None:
    """``from_rank_zero`` for work whose value no other rank needs: every rank raises the same
    ``CheckpointError`` when it failed on rank 0; when it did not, the ranks learn that from one
    ``RankComm.any`` instead of a broadcast of the outcome."""
    _shared_by_rank_zero(_outcome_on_rank_zero(work, what, path) if torch.distributed.get_rank() == 0 else (True, None))


def _shared_by_rank_zero(outcome: tuple[bool, Any]) -> None:
    """All ranks, ``outcome`` rank 0's (``_outcome_on_rank_zero``; ``(True, None)`` elsewhere): one ``RankComm.any``,
    and when it failed, every rank raises the same ``CheckpointError``."""
    (failed,) = RankComm().any(not outcome[0])
    if failed:
        shared: list = [outcome if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        _raise_unless_ok(shared[0])


def stale_steps(root: str, role: str, step: int, max_ckpt_to_keep: int | None) -> list[str]:
    """The committed ``global_step_N/<role>`` directories retention removes once ``step`` is committed: all but the
    newest ``max_ckpt_to_keep`` (0 or None: keep all) of those on disk up to ``step``, never the one the tracker
    names (an unreadable tracker: none). Listed from disk, so a resumed run prunes the steps before it as the
    run that saved them would have; steps past ``step`` (a run resumed from an earlier point) are left for its
    later saves to replace."""
    if not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0):
        return []
    try:
        tracked = read_tracker(root)
    except TrackerError:
        return []
    saved = [(number, os.path.join(path, role)) for number, path in layout.list_step_dirs(root) if number <= step and os.path.isdir(os.path.join(path, role))]
    return [path for number, path in saved[: max(len(saved) - max_ckpt_to_keep, 0)] if number != tracked]


def _put_back(role_path: str) -> bool:
    """A re-save of a committed step moves the older copy aside (``layout.superseded_path``), and the step files it
    replaces beside it, and discards them only once its commit has ended. Where the older copy is still there,
    that commit did not end: the older copy and its step files go back into place, the unfinished copy goes.
    Returns whether anything was put back."""
    superseded = layout.superseded_path(role_path)
    if not os.path.isdir(superseded):
        return False
    shutil.rmtree(role_path, ignore_errors=True)
    os.replace(superseded, role_path)
    step_dir = os.path.dirname(role_path)
    for name in os.listdir(step_dir):
        older = os.path.join(step_dir, name)
        if name.endswith(layout.SUPERSEDED_SUFFIX) and os.path.isfile(older):
            os.replace(older, older[: -len(layout.SUPERSEDED_SUFFIX)])
    fsync_path(step_dir)
    return True


def put_back_superseded(root: str, role: str = "actor") -> list[str]:
    """Under the run's writer lock, before a resume reads the tracker: each step whose re-save stopped before
    its commit ended (a crash) gets its committed copy back (``_put_back``); an older step file left after a
    commit ended is removed. One note per step touched."""
    notes = []
    for _, step_dir in layout.list_step_dirs(root):
        role_path = os.path.join(step_dir, role)
        if _put_back(role_path):
            notes.append(f"put the committed copy of {role_path} back in place: a re-save of the step stopped before its commit ended")
            continue
        for leftover in (os.path.join(step_dir, f) for f in os.listdir(step_dir) if f.endswith(layout.SUPERSEDED_SUFFIX)):
            if os.path.isfile(leftover):  # another role's older copy (a directory) is that role's to put back
                os.remove(leftover)
                notes.append(f"removed {leftover}: the older copy of a step file that a committed save replaced")
    return notes


@dataclasses.dataclass
class StepSpec:
    """What the transaction is told about the step; nothing is read from the writer.

    ``hf_config``: the HF config whose tensors the export must hold, None when the step has no HF export.
    ``parallel``: the layout the parts were written at, ``bridge`` the bridge that wrote them (the manifest records
    both; None: no bridge recorded). ``sealed``: this rank's checksums of the files it wrote, relative paths, once
    each is fsynced with its directory (called after the writer finished, before the gather: ``durability``); the
    commit fsyncs only what no rank sealed.
    ``retention``: what removes the steps ``max_ckpt_to_keep`` drops (None: no retention). ``step_files``:
    name -> bytes written beside the role's directory after the commit; ``track``: then move the tracker.
    ``on_phase``: called on every rank as each phase starts (crash-injection tests, benchmarks), ``discard`` (a
    failure's cleanup) included."""

    role: str = "actor"
    hf_config: Any = None
    strict_hf_verify: bool = True
    parallel: Mapping[str, int] = dataclasses.field(default_factory=dict)
    use_distributed_optimizer: bool | None = None
    bridge: BridgeRecord | None = None
    sealed: Callable[[], Mapping[str, str]] = dict
    retention: Retention | None = None
    max_ckpt_to_keep: int | None = None
    step_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    track: bool = False
    on_phase: Callable[[str], None] = _no_phase


@dataclasses.dataclass(frozen=True)
class CommittedStep:
    """A committed step, the same on every rank but for the rank's own phase times: where it is, the files its manifest lists (relative paths),
    what it holds (``ckpt_contents.json``'s ``save_contents``, when written), how many HF tensors were checked
    (None: no HF export), whether the tracker names it, and the seconds of each of the transaction's phases (through
    ``MegatronEngine``, the record also carries the writer's phases from the manager's save report)."""

    path: str
    step: int
    files: tuple[str, ...]
    contents: tuple[str, ...] | None
    hf_tensors: int | None
    tracked: bool
    phase_seconds: dict[str, float]


class StepCommit:
    """One step's transaction. ``path`` is the role's committed directory (``<root>/global_step_N/<role>``;
    the tracker and the step files go to ``<root>`` and ``global_step_N``), ``step`` its number.

    Synchronous writer::

        with StepCommit(path, step, spec) as staging:
            writer.save_checkpoint(staging)
        committed = transaction.committed

    A writer that finishes in the background calls ``defer()`` inside the block; ``finalize(wait)`` commits
    once ``wait(blocking)`` says the parts are durable (None: not yet)."""

    def __init__(self, path: str, step: int, spec: StepSpec) -> None:
        self.path = os.path.abspath(path.rstrip("/"))
        self.step = int(step)
        self.spec = spec
        self.staging = layout.staging_path(self.path)
        self.step_dir = os.path.dirname(self.path)
        self.root = os.path.dirname(self.step_dir)
        self.phase_seconds: dict[str, float] = {}
        self.committed: CommittedStep | None = None
        self.deferred = False
        self.placed = False  # renamed into place; not committed until the tracker (when asked) names it
        self.tracker_moved = False
        self.superseded = layout.superseded_path(self.path)  # the committed copy while a re-save replaces it
        self._replaced = False  # rank 0: a re-save moved older copies aside, discarded once the commit ends
        self._new_step_files: list[str] = []  # rank 0: step files written where none was (removed if the commit fails)
        self._rank = torch.distributed.get_rank()

    # ------------------------------------------------------------------ the block

    def __enter__(self) -> str:
        with self._phase("staging"):
            if self._rank == 0:
                if os.path.isdir(self.superseded):  # an earlier re-save of this step stopped before its commit ended
                    _put_back(self.path)
                shutil.rmtree(self.staging, ignore_errors=True)
            torch.distributed.barrier()
        return self.staging

    def __exit__(self, kind, exc, trace) -> bool:
        if exc is not None:
            self._fail(exc)
        if not self.deferred:
            try:
                self.commit()
            except BaseException as failure:
                self._fail(failure)
        return False

    def defer(self) -> None:
        """The writer goes on in the background: the block ends without committing; ``finalize`` commits."""
        self.deferred = True

    def finalize(self, wait: Callable[[bool], Any], blocking: bool = True) -> CommittedStep | None:
        """Commit once ``wait(blocking)`` returns the proof that the write into this staging directory completed:
        a report whose ``local_path`` is the staging directory and whose ``completed`` is true (the manager's
        ``completed_save(staging)``); None while it is still writing. Any other answer (a ``FinalizeState``,
        True, another directory's report) is a caller's mistake: ``TypeError``, and the step stays pending,
        nothing discarded. A failure of the writer or of the commit discards the step and raises. Once committed,
        every later call returns the same record without asking ``wait``: each caller that follows the recipe
        (docs/checkpoint.md) gets the step, whichever of them committed it."""
        if self.committed is not None:
            return self.committed
        start = time.monotonic()
        try:
            proof = wait(blocking)
        except BaseException as failure:
            self._fail(failure)
        if proof is None:
            return None
        self._check_proof(proof)
        self.phase_seconds["background_wait"] = time.monotonic() - start
        try:
            return self.commit()
        except BaseException as failure:
            self._fail(failure)

    def _check_proof(self, proof: Any) -> None:
        """``finalize``'s guard: only the completed report of this very staging directory commits it."""
        local_path = getattr(proof, "local_path", None)
        if getattr(proof, "completed", None) is True and isinstance(local_path, str) and os.path.abspath(local_path) == self.staging:
            return
        raise TypeError(
            f"finalize's wait returned {proof!r}, not the completed save's report for {self.staging}: return "
            "manager.completed_save(transaction.staging) once finalize_async_save is not WRITING (docs/checkpoint.md's recipe)"
        )

    # ------------------------------------------------------------------ the commit

    def commit(self) -> CommittedStep:
        """All ranks, once every part is in the staging directory: verify, mark, rename, retention, step files,
        tracker. Raises (and keeps every committed step) when the HF export is incomplete."""
        with self._phase("hf_verify"):
            verdict = self._hf_verdict()
        with self._phase("commit"):
            verdict, seals = self._gather_verdict_and_seals(verdict)
            hf_tensors, hf_proof = self._judge_hf_export(verdict)
            sealed = self._check_sealed(seals)
            files, contents = from_rank_zero(lambda: self._mark_and_rename(sealed, hf_proof), f"commit step {self.step}", self.staging)
            self.placed = True
        writes_tracker = bool(self.spec.step_files or self.spec.track)
        with self._phase("retention"):
            # rank 0, on the filesystem every rank shares (rank 0 alone renamed the step); every rank learns its
            # outcome where the ranks next meet
            removed = _outcome_on_rank_zero(self._remove_stale_steps, "remove the older steps", self.root) if self._rank == 0 else (True, None)
            if not writes_tracker:
                _shared_by_rank_zero(removed)
        if writes_tracker:
            with self._phase("tracker"):
                _shared_by_rank_zero(removed)  # every rank got here: a rank lost now leaves the tracker where it was
                done_by_rank_zero(self._write_step_files_and_tracker, f"track step {self.step}", self.step_dir)
        if self._replaced:
            with contextlib.suppress(OSError):  # committed either way; a copy left is put back or removed next run
                self._discard_superseded()
        self.committed = CommittedStep(self.path, self.step, files, contents, hf_tensors, self.spec.track, dict(self.phase_seconds))
        return self.committed

    def _hf_verdict(self) -> tuple[bool, Any] | None:
        """Rank 0: fix 2's proof, once per save: the bridge wrote every tensor the config implies (the count
        checked): ``(True, (ok, problem, expected, proof))`` or rank 0's failure to verify; None elsewhere or with
        no export. ``proof``: the manifest's record of the export found complete (``hf_verify.export_proof``)."""
        if self.spec.hf_config is None or self._rank != 0:
            return None

        def verdict() -> tuple[bool, str, int, dict | None]:
            report = verify_hf_checkpoint(layout.hf_path(self.staging), self.spec.hf_config)
            return report.ok, report.describe() if not report.ok else "", report.expected, report.proof

        return _outcome_on_rank_zero(verdict, "verify the HF export", self.staging)

    def _gather_verdict_and_seals(self, verdict: tuple[bool, Any] | None) -> tuple[tuple[bool, Any] | None, list]:
        """One collective: rank 0's verdict on the HF export to every rank, every rank's seal (the checksums of
        the files it wrote, each made durable by it before this gather: ``durability``) to every rank."""
        try:
            mine = (True, dict(self.spec.sealed()))
        except Exception as exc:
            mine = (False, describe(exc))
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, (mine, verdict))
        return everyone[0][1], [seal for seal, _ in everyone]

    def _judge_hf_export(self, verdict: tuple[bool, Any] | None) -> tuple[int | None, dict | None]:
        """Every rank alike: the HF export's tensor count and the proof of it, or its problem raised (strict) or
        warned on rank 0 (then neither)."""
        if self.spec.hf_config is None:
            return None, None
        ok, problem, expected, proof = _raise_unless_ok(verdict)
        if ok:
            return expected, proof
        if self.spec.strict_hf_verify:
            raise HFCheckpointIncompleteError(problem)
        if self._rank == 0:
            warnings.warn(problem, stacklevel=3)
        return None, None

    @staticmethod
    def _check_sealed(everyone: list) -> dict[str, str]:
        """A rank whose seal failed (an fsync error: pages its host held may be lost) fails the commit on every
        rank, named, before anything is renamed; else every rank's checksums, by file."""
        failed = [(rank, cause) for rank, (ok, cause) in enumerate(everyone) if not ok]
        if failed:
            raise CheckpointError(f"rank {failed[0][0]} could not make the files it wrote durable ({failed[0][1]})")
        return {relpath: checksum for _, share in everyone for relpath, checksum in share.items()}

    def _mark_and_rename(self, sealed: dict[str, str], hf_proof: dict | None) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """Rank 0: the commit mark, the manifest (which covers every other file; ``hf_proof``, the HF export found
        complete), fsync of what no writer sealed, then one rename."""
        mark = {"format_version": FORMAT_VERSION, "global_step": self.step, "role": self.spec.role}
        atomic_write_text(os.path.join(self.staging, layout.COMMIT_MARK_FILENAME), json.dumps(mark, indent=2))
        manifest = build_manifest(
            self.staging,
            dict(self.spec.parallel),
            self.spec.use_distributed_optimizer,
            known_checksums=sealed,
            bridge=self.spec.bridge,
            hf_export=hf_proof,
        )
        atomic_write_text(os.path.join(self.staging, layout.MANIFEST_FILENAME), json.dumps(manifest, indent=2))
        contents = None
        with contextlib.suppress(FileNotFoundError):
            with open(os.path.join(self.staging, layout.CONTENTS_FILENAME), encoding="utf-8") as handle:
                contents = tuple(json.load(handle).get("save_contents", ()))
        fsync_unsealed(self.staging, sealed)  # the rest was fsynced by its writer (``durability``)
        if os.path.exists(self.path):  # a re-save: the committed copy waits aside until this commit ends
            os.replace(self.path, self.superseded)
            self._replaced = True
        try:
            os.replace(self.staging, self.path)
        except OSError:
            if self._replaced:  # the older copy goes back where it was
                os.replace(self.superseded, self.path)
                self._replaced = False
            raise
        fsync_path(self.step_dir)
        return tuple(manifest["files"]), contents

    def _remove_stale_steps(self) -> None:
        """Rank 0: upstream's ``max_ckpt_to_keep`` rule, through the spec's retention (``stale_steps`` decides)."""
        if self.spec.retention is not None:
            self.spec.retention.remove_previous_save_local_path(stale_steps(self.root, self.spec.role, self.step, self.spec.max_ckpt_to_keep))

    def _write_step_files_and_tracker(self) -> None:
        """Rank 0, every role committed: the step's own files durable, then the tracker names the step."""
        for name, data in self.spec.step_files.items():
            path = os.path.join(self.step_dir, name)
            if os.path.exists(path):  # a re-saved step's file: aside with the role's older copy until the commit ends
                os.replace(path, layout.superseded_path(path))
                self._replaced = True
            else:
                self._new_step_files.append(name)
            with atomic_open(path, "wb") as handle:
                handle.write(data)
        if self.spec.track:
            atomic_write_text(layout.tracker_path(self.root), str(self.step))
            self.tracker_moved = True

    def _discard_superseded(self) -> None:
        """Rank 0, the step committed: its older copy goes (renamed to the free staging path first, so that a
        crash in the removal leaves an interrupted-save directory, not an older copy to put back), then the
        older step files."""
        if os.path.isdir(self.superseded):
            os.replace(self.superseded, self.staging)
            shutil.rmtree(self.staging)
        for name in self.spec.step_files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(layout.superseded_path(os.path.join(self.step_dir, name)))

    # ------------------------------------------------------------------ failure

    def _fail(self, exc: BaseException) -> None:
        """Discard the staging directory and a step placed but not tracked, putting back what a re-save of the
        step replaced (its older copy, its step files as they were; a ``global_step_N`` left empty goes), then
        re-raise: a ``CheckpointError`` of the same class, saying what was committed."""
        self.deferred = False
        self.spec.on_phase("discard")  # announced like the others: a test can hold a rank away from its cleanup
        full = os_errors.out_of_space(exc)
        written = os_errors.tree_bytes(self.staging) if full else 0
        # every rank, once its own writers stopped: a rank still writing when rank 0 removed the directory
        # would otherwise leave its part of it behind, on a disk that is full
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._rank == 0:
            if self.placed and self.spec.track and not self.tracker_moved:
                for name in self._new_step_files:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.step_dir, name))
                with contextlib.suppress(OSError):  # else the next run's put_back_superseded does it
                    if not _put_back(self.path):  # not a re-save: the step goes
                        shutil.rmtree(self.path, ignore_errors=True)
            elif self.placed and self._replaced:  # the new step stands (tracked, or not to be tracked)
                with contextlib.suppress(OSError):
                    self._discard_superseded()
            with contextlib.suppress(OSError):  # not empty (another role's save, the data position) or already gone
                os.rmdir(self.step_dir)
        if isinstance(exc, CheckpointError):
            space = f" {os_errors.space_needed(self.staging, written)}" if full else ""
            # the same class (e.g. HFCheckpointIncompleteError), so callers can still tell the failures apart
            raise type(exc)(f"{exc}.{space} {self._what_was_committed()}") from exc
        raise exc

    def _what_was_committed(self) -> str:
        """A ``CheckpointError``'s outcome: rank 0 reports its own failures before it moves the tracker, so every
        rank knows it was not moved (a lost rank raises the collective's own error, without this sentence)."""
        if self.placed and not self.spec.track:
            return f"Step {self.step} is in place at {self.path}, not tracked (as asked)."
        return "Nothing was committed; the previous checkpoint and the tracker are unchanged."

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self.spec.on_phase(name)
        start = time.monotonic()
        yield
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.monotonic() - start


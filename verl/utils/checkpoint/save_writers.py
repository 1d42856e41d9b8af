"""One writer object per save mode (``AsyncMode``), chosen once when the checkpoint manager is built.

A save's phases ask the writer where they run; nothing in a save tests the host. Each writer is given a
``SaveJob`` (the step's staging directory, what the rank plans, and what a fork would be given: state dicts'
sources, paths, strategies, the HF export) and returns what a forked process is to run, if anything:

================  ============================  ==========================  ============  =============
writer            dist checkpoints: plan/write  NaN/Inf check               HF export     hosts
================  ============================  ==========================  ============  =============
``sync``          rank / rank (its threads)     rank, before anything       rank [2]_     every host
``background``    rank / forked process         rank, before anything       rank          every host
``snapshot``      rank, then fork / fork        fork, on what it writes     fork [1]_     host memory
================  ============================  ==========================  ============  =============

.. [1] When the bridge saves in parallel over any group and the ranks met through a TCP store (the forks form
   their own group); else in the rank. Decided when the manager is built, like the rest.
.. [2] Beside the dist write, in a thread over a gloo group of its own (``GroupRankComm``, made once), when the
   bridge saves in parallel over any group, on every host: gloo sends host tensors, so on an accelerator each
   piece travels as the host copy the file write needs anyway (``RankComm.host_only``). Else (mbridge's gathered
   save) after it, over the default group. Two threads never share a group: their collectives would interleave.

The snapshot writer plans in the rank until megatron's plan is reusable without a collective (validated on two
saves of one structure), then in the fork: a fork has no process group of the rank's to plan with. A format
whose state dict is built by a collective (the distributed optimizer's ``fully_reshardable``) is always planned
in the rank (the manager's ``plans_reusable`` says so).

The sync writer also seals its files (``Sealer``): the step transaction needs every file's CRC-32 (the manifest)
and every file durable (before the rename). Done by rank 0 at the end, that is one more pass over the whole step
on one rank; instead each rank takes its share of the dist-checkpoint files, and then of the HF files, as soon
as they are complete on every rank and hashes and fsyncs them in background threads (zlib and fsync release the
GIL) while the rest of the save runs; the step transaction gathers the shares and hashes only what is left (the
small metadata files), and its fsync of the tree finds the sealed files clean.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from verl.utils.checkpoint.async_modes import AsyncMode
from verl.utils.checkpoint.forked_save import ForkedSave, forked_request
from verl.utils.checkpoint.integrity import file_checksum, files_under, start_writeback
from verl.utils.fs import fsync_path

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest


def share_of(relpaths: list[str], sizes: list[int], rank: int, world_size: int) -> list[str]:
    """This rank's files of ``relpaths``: the largest file first to the rank with the fewest bytes so far. Every
    rank computes the same split from the same listing, so no collective is needed."""
    loads = [0] * world_size
    mine = []
    for size, relpath in sorted(zip(sizes, relpaths, strict=True), reverse=True):
        owner = loads.index(min(loads))
        loads[owner] += size
        if owner == rank:
            mine.append(relpath)
    return mine


def checksum_and_sync(path: str) -> str:
    """The file's CRC-32, then an fsync of it: read from the page cache first, written back while others hash."""
    checksum = file_checksum(path)
    fsync_path(path)
    return checksum


class Sealer:
    """Hashes and fsyncs files of one step in background threads; ``results`` waits for them."""

    def __init__(self, step_path: str, threads: int = 2) -> None:
        self.step_path = step_path
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-seal")
        self._pending: dict[str, Future] = {}

    def seal(self, relpaths: list[str]) -> None:
        """Start every file's writeback at once (the disk writes while the threads hash), then hash and fsync each."""
        for relpath in relpaths:
            start_writeback(os.path.join(self.step_path, relpath))
        for relpath in relpaths:
            self._pending[relpath] = self._pool.submit(checksum_and_sync, os.path.join(self.step_path, relpath))

    def seal_share(self, directories: list[str], rank: int, world_size: int) -> None:
        """This rank's share (``share_of``) of the files under ``directories``, complete on every rank."""
        relpaths = files_under(self.step_path, directories)
        sizes = [os.path.getsize(os.path.join(self.step_path, r)) for r in relpaths]
        self.seal(share_of(relpaths, sizes, rank, world_size))

    def results(self) -> dict[str, str]:
        """Relative path -> checksum of every file given to ``seal`` that could be read; one that could not is
        left out (the step transaction then hashes it itself, and reports it if it is gone)."""
        self._pool.shutdown(wait=True)
        return {relpath: future.result() for relpath, future in self._pending.items() if future.exception() is None}


@dataclasses.dataclass
class SaveJob:
    """One save as a writer sees it. ``plan_in_rank(in_background)``: the rank's dist-checkpoint save (written
    here, or only planned with ``in_background``; the writes still to run); ``plans_reusable``: megatron's plans
    need no collective any more; ``fork``: what a forked pipeline is given (built when asked); ``dist_dirs``: the
    dist checkpoints' directories in ``staging``; ``hf_beside``: the rank's HF export over a group of its own,
    which the sync writer runs beside the dist write (None: the manager exports after it); ``hf_dir``: its folder."""

    staging: str
    rank: int
    world_size: int
    dist_dirs: list[str]
    plan_in_rank: Callable[[bool], list[AsyncRequest] | None]
    plans_reusable: Callable[[], bool]
    fork: Callable[[], ForkedSave]
    hf_beside: Callable[[], None] | None = None
    hf_dir: str | None = None
    planned_in_background: bool = False  # set by the writer: the fork planned this save's dist checkpoints
    sealer: Sealer | None = None  # set by the sync writer: its files, being hashed and fsynced
    hf_exported: bool = False  # set by the sync writer: it ran ``hf_beside``


class SyncWriter:
    """Everything in the rank before ``save_checkpoint`` returns (the dist checkpoints by ``dist_writer``); with
    ``hf_beside`` the HF export in a thread of its own while the dist checkpoints are written and sealed."""

    mode = AsyncMode.SYNC
    checks_in_rank = True
    exports_hf_in_rank = True
    exports_hf_beside = True  # see [2]_

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        """Write the dist checkpoints; once they are complete on every rank, start sealing this rank's share.
        The HF export beside them seals its share as soon as its files are complete on every rank (its last
        barrier), while the dist write may still run. The export thread is always waited for: a save never
        returns (or fails) with it still writing."""
        job.sealer = Sealer(job.staging)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hf") as pool:
            hf = pool.submit(self._export_and_seal, job) if job.hf_beside is not None else None
            job.plan_in_rank(False)
            job.sealer.seal_share(job.dist_dirs, job.rank, job.world_size)
        if hf is not None:
            hf.result()
            job.hf_exported = True
        return None

    @staticmethod
    def _export_and_seal(job: SaveJob) -> None:
        job.hf_beside()
        job.sealer.seal_share([job.hf_dir], job.rank, job.world_size)


class BackgroundWriter:
    """Checked, planned and HF-exported in the rank; megatron's planned file writes run in one forked process."""

    mode = AsyncMode.BACKGROUND_WRITE
    checks_in_rank = True
    exports_hf_in_rank = True
    exports_hf_beside = False

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        return forked_request(job.fork(), job.plan_in_rank(True))


class SnapshotWriter:
    """The forked process checks, writes (and, once the plans are reusable, plans) and exports: the rank is held
    only for the fork. ``hf_in_fork``: whether the HF export can run over the forks' group (see the table)."""

    mode = AsyncMode.SNAPSHOT
    checks_in_rank = False
    exports_hf_beside = False

    def __init__(self, hf_in_fork: bool) -> None:
        self.exports_hf_in_rank = not hf_in_fork

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        if job.plans_reusable():
            job.planned_in_background = True
            return forked_request(job.fork(), None)
        return forked_request(job.fork(), job.plan_in_rank(True))


Writer = SyncWriter | BackgroundWriter | SnapshotWriter


def make_writer(mode: AsyncMode, hf_in_fork: bool) -> Writer:
    """The writer of ``mode`` (``async_modes.choose_mode``); ``hf_in_fork`` matters to the snapshot's only."""
    if mode is AsyncMode.SNAPSHOT:
        return SnapshotWriter(hf_in_fork)
    return BackgroundWriter() if mode is AsyncMode.BACKGROUND_WRITE else SyncWriter()

"""One writer object per save mode (``AsyncMode``), chosen once when the checkpoint manager is built.

The writer runs the rank's part of a save (``run(job) -> WriterOutcome``): the NaN/Inf check, the dist
checkpoints and the HF export, in its own order, each phase a callable of the ``SaveJob`` the manager binds to
the save; it returns what is left (the request a forked process runs, if any) and where each part ran. The
manager neither tests the writer nor the host. ``WRITERS`` maps each ``AsyncMode`` to its writer's factory: a
writer is added here and in ``async_modes`` (its mode), nowhere else:

================  ============================  ==========================  ============  =============
writer            dist checkpoints: plan/write  NaN/Inf check               HF export     hosts
================  ============================  ==========================  ============  =============
``sync``          rank / rank (its threads)     rank, before anything       rank [2]_     every host
``background``    rank, then fork / fork [3]_   fork, on what it writes     fork [1]_     every host
``snapshot``      rank, then fork / fork        fork, on what it writes     fork [1]_     host memory
================  ============================  ==========================  ============  =============

.. [1] When the bridge saves in parallel over any group and the ranks met through a TCP store (the forks form
   their own group); else in the rank. Decided when the manager is built, like the rest.
.. [3] The background writer's rank first copies what of the state lives in device memory into host memory
   (``host_copy``; nothing on a host-memory run), which its fork then reads: the snapshot's pipeline on a copy.
.. [2] Beside the dist write, in a thread over a gloo group of its own (``GroupRankComm``, made once), when the
   bridge saves in parallel over any group, on every host: gloo sends host tensors, so on an accelerator each
   piece travels as the host copy the file write needs anyway (``RankComm.host_only``). Else (mbridge's gathered
   save) after it, over the default group. Two threads never share a group: their collectives would interleave.

The snapshot writer plans in the rank until megatron's plan is reusable without a collective (validated on two
saves of one structure), then in the fork: a fork has no process group of the rank's to plan with. A format
whose state dict is built by a collective (the distributed optimizer's ``fully_reshardable``) is always planned
in the rank (the manager's ``plans_reusable`` says so).

Every writer seals what its rank writes (``durability.Sealer``, the per-writer durability rule): the step
transaction needs every file's CRC-32 (the manifest) and every file durable before the rename, fsynced by the
host that wrote it. The sync writer seals the dist-checkpoint files this rank's writer threads wrote as soon as
they are complete on every rank, and the rank's HF files once the export's last barrier passed, hashing and
fsyncing them in background threads (zlib and fsync release the GIL) while the rest of the save runs; the step
transaction gathers every rank's checksums and hashes and fsyncs only what rank 0 wrote unreported (megatron's
coordinator files, the small metadata files). The async writers seal the HF files the rank exported; their forked
processes fsync what they write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from verl.utils.checkpoint.async_modes import AsyncMode
from verl.utils.checkpoint.durability import Sealer, own_files
from verl.utils.checkpoint.forked_save import ForkedSave, forked_request
from verl.utils.internals import megatron_core

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from verl.utils.rank_comm import RankComm


@dataclasses.dataclass
class SaveJob:
    """One save's phases as a writer runs them, each bound to the save by the manager (announced and timed there).

    ``check()``: the rank's NaN/Inf check; ``prepare(make_room)``: with ``make_room`` upstream's pre-save
    retention, then the save's directories (after the check: a refused save writes and removes nothing);
    ``plan_in_rank(in_background)``: the dist checkpoints written here, or only planned (returns the writes still
    to run); ``plans_reusable()``: megatron's plans need no collective any more; ``dist_written()``: the files
    this rank's in-rank writer wrote (after ``plan_in_rank(False)``); ``fork(check, export_hf, to_host)``: what a
    forked pipeline is given (with ``to_host`` the host copy of the state it reads); ``export_hf(comm)``: the rank's HF export (``HFExport.run``) over ``comm`` (None: the
    default group), the files it wrote; ``hf_group()``: the export's own group beside the dist write, made once
    (collectively); ``hf_dir``: the HF folder (None: no HF export this save); ``hf_parallel``: the bridge saves
    in parallel over any group; ``hf_in_fork``: its export can run over the forks' group."""

    rank: int
    sealer: Sealer
    check: Callable[[], None]
    prepare: Callable[[bool], None]
    plan_in_rank: Callable[[bool], list[AsyncRequest] | None]
    plans_reusable: Callable[[], bool]
    dist_written: Callable[[], list[str]]
    fork: Callable[[bool, bool, bool], ForkedSave]
    export_hf: Callable[[RankComm | None], list[str] | None]
    hf_group: Callable[[], RankComm]
    hf_dir: str | None = None
    hf_parallel: bool = False
    hf_in_fork: bool = False

    def export_and_seal(self, comm: RankComm | None = None) -> bool:
        """The HF export in the rank, then the sealing of the files it wrote; whether there was one to run."""
        if self.hf_dir is None:
            return False
        self.sealer.seal(own_files(self.hf_dir, self.export_hf(comm), self.rank))
        return True


@dataclasses.dataclass(frozen=True)
class WriterOutcome:
    """What a writer's ``run`` leaves: ``background``, the request a forked process is to run (None: every part
    is written), and where each part ran (``SaveReport``'s fields of the same names)."""

    background: AsyncRequest | None = None
    checked_in_background: bool = False
    hf_weights_in_background: bool = False
    planned_in_background: bool = False
    hf_exported: bool = False


class Writer(Protocol):
    """A save mode's writer: ``run`` performs the rank's part of one save."""

    mode: AsyncMode

    def run(self, job: SaveJob) -> WriterOutcome: ...


class SyncWriter:
    """Everything in the rank before ``save_checkpoint`` returns (the dist checkpoints by ``dist_writer``); with a
    bridge that saves in parallel the HF export in a thread of its own while the dist checkpoints are written and
    sealed, else after them."""

    mode = AsyncMode.SYNC

    def run(self, job: SaveJob) -> WriterOutcome:
        """Once the dist checkpoints are complete on every rank, start sealing the files this rank wrote. The HF
        export beside them seals this rank's files as soon as they are complete on every rank (its last
        barrier), while the dist write may still run. The export thread is always waited for: a save never
        returns (or fails) with it still writing."""
        job.check()
        job.prepare(True)
        beside = job.hf_group() if job.hf_dir is not None and job.hf_parallel else None  # see [2]_
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hf") as pool:
            hf = pool.submit(job.export_and_seal, beside) if beside is not None else None
            job.plan_in_rank(False)
            job.sealer.seal(job.dist_written())
        exported = hf.result() if hf is not None else job.export_and_seal()
        return WriterOutcome(hf_exported=exported)


class SnapshotWriter:
    """The forked process checks, writes (and, once the plans are reusable, plans) and exports (when it can, see
    the table): the rank is held only for the fork. It reads the live tensors' copy-on-write image: host memory only."""

    mode = AsyncMode.SNAPSHOT
    to_host = False

    def run(self, job: SaveJob) -> WriterOutcome:
        drain_stale_results()
        job.prepare(False)
        hf_in_fork = job.hf_dir is not None and job.hf_in_fork
        reusable = job.plans_reusable()
        fork = job.fork(True, hf_in_fork, self.to_host)
        request = forked_request(fork, None if reusable else job.plan_in_rank(True))
        exported = False if hf_in_fork else job.export_and_seal()
        return WriterOutcome(
            request, checked_in_background=True, hf_weights_in_background=hf_in_fork, planned_in_background=reusable, hf_exported=exported
        )


class BackgroundWriter(SnapshotWriter):
    """The snapshot's pipeline on a host copy: the rank copies what of the state lives in device memory into host
    memory, then forks; the fork reads that copy. Every host, the rank held for the copy and the fork."""

    mode = AsyncMode.BACKGROUND_WRITE
    to_host = True


def drain_stale_results() -> None:
    """Before an async save: a writer killed with its failed save's fork may have sent its result after that
    save's drain; with no call pending in the process no writer runs now, and whatever the queue holds is stale."""
    megatron_core.drain_write_results()


WRITERS: dict[AsyncMode, Callable[[], Writer]] = {
    AsyncMode.SYNC: SyncWriter,
    AsyncMode.BACKGROUND_WRITE: BackgroundWriter,
    AsyncMode.SNAPSHOT: SnapshotWriter,
}


def make_writer(mode: AsyncMode) -> Writer:
    """The writer of ``mode`` (``async_modes.choose_mode``), as registered in ``WRITERS``."""
    return WRITERS[mode]()

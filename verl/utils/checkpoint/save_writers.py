"""One writer object per save mode (``AsyncMode``), chosen once when the checkpoint manager is built.

A save's phases ask the writer where they run; nothing in a save tests the host. Each writer is given a
``SaveJob`` (what the rank plans and wrote, its sealer, and what a fork would be given: state dicts' sources,
paths, strategies, the HF export) and returns what a forked process is to run, if anything:

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
from typing import TYPE_CHECKING

from verl.utils.checkpoint.async_modes import AsyncMode
from verl.utils.checkpoint.durability import Sealer, own_files
from verl.utils.checkpoint.forked_save import ForkedSave, forked_request

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest


@dataclasses.dataclass
class SaveJob:
    """One save as a writer sees it. ``plan_in_rank(in_background)``: the rank's dist-checkpoint save (written
    here, or only planned with ``in_background``; the writes still to run); ``plans_reusable``: megatron's plans
    need no collective any more; ``fork``: what a forked pipeline is given (built when asked); ``dist_written``:
    the files this rank's in-rank writer wrote into the dist checkpoints (after ``plan_in_rank(False)``);
    ``sealer``: this rank's, for the files it writes; ``hf_beside``: the rank's HF export over a group of its own,
    which the sync writer runs beside the dist write (None: the manager exports after it), returning the files it
    wrote (``HFExport.run``); ``hf_dir``: its folder."""

    rank: int
    plan_in_rank: Callable[[bool], list[AsyncRequest] | None]
    plans_reusable: Callable[[], bool]
    fork: Callable[[], ForkedSave]
    dist_written: Callable[[], list[str]]
    sealer: Sealer
    hf_beside: Callable[[], list[str] | None] | None = None
    hf_dir: str | None = None
    planned_in_background: bool = False  # set by the writer: the fork planned this save's dist checkpoints
    hf_exported: bool = False  # set by the sync writer: it ran ``hf_beside``


class SyncWriter:
    """Everything in the rank before ``save_checkpoint`` returns (the dist checkpoints by ``dist_writer``); with
    ``hf_beside`` the HF export in a thread of its own while the dist checkpoints are written and sealed."""

    mode = AsyncMode.SYNC
    checks_in_rank = True
    exports_hf_in_rank = True
    exports_hf_beside = True  # see [2]_

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        """Write the dist checkpoints; once they are complete on every rank, start sealing the files this rank
        wrote. The HF export beside them seals this rank's files as soon as they are complete on every rank (its
        last barrier), while the dist write may still run. The export thread is always waited for: a save never
        returns (or fails) with it still writing."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hf") as pool:
            hf = pool.submit(self._export_and_seal, job) if job.hf_beside is not None else None
            job.plan_in_rank(False)
            job.sealer.seal(job.dist_written())
        if hf is not None:
            hf.result()
            job.hf_exported = True
        return None

    @staticmethod
    def _export_and_seal(job: SaveJob) -> None:
        job.sealer.seal(own_files(job.hf_dir, job.hf_beside(), job.rank))


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

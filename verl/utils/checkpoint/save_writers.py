"""One writer object per save mode (``AsyncMode``), chosen once when the checkpoint manager is built.

A save's phases ask the writer where they run; nothing in a save tests the host. Each writer is given a
``SaveJob`` (the step's staging directory, what the rank plans, and what a fork would be given: state dicts'
sources, paths, strategies, the HF export) and returns what a forked process is to run, if anything:

================  ============================  ==========================  ============  =============
writer            dist checkpoints: plan/write  NaN/Inf check               HF export     hosts
================  ============================  ==========================  ============  =============
``sync``          rank / rank (its threads)     rank, before anything       rank          every host
``background``    rank / forked process         rank, before anything       rank          every host
``snapshot``      rank, then fork / fork        fork, on what it writes     fork [1]_     host memory
================  ============================  ==========================  ============  =============

.. [1] When the bridge saves in parallel over any group and the ranks met through a TCP store (the forks form
   their own group); else in the rank. Decided when the manager is built, like the rest.

The snapshot writer plans in the rank until megatron's plan is reusable without a collective (validated on two
saves of one structure), then in the fork: a fork has no process group of the rank's to plan with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from verl.utils.checkpoint.async_modes import AsyncMode
from verl.utils.checkpoint.forked_save import ForkedSave, forked_request, in_one_fork

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest


@dataclasses.dataclass
class SaveJob:
    """One save as a writer sees it. ``plan_in_rank(in_background)``: the rank's dist-checkpoint save (written
    here, or only planned with ``in_background``; the writes still to run); ``plans_reusable``: megatron's plans
    need no collective any more; ``fork``: what a forked pipeline is given (built when asked)."""

    plan_in_rank: Callable[[bool], list[AsyncRequest] | None]
    plans_reusable: Callable[[], bool]
    fork: Callable[[], ForkedSave]
    planned_in_background: bool = False  # set by the writer: the fork planned this save's dist checkpoints


class SyncWriter:
    """Everything in the rank before ``save_checkpoint`` returns (the dist checkpoints by ``dist_writer``)."""

    mode = AsyncMode.SYNC
    checks_in_rank = True
    exports_hf_in_rank = True

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        job.plan_in_rank(False)
        return None


class BackgroundWriter:
    """Checked, planned and HF-exported in the rank; megatron's planned file writes run in one forked process."""

    mode = AsyncMode.BACKGROUND_WRITE
    checks_in_rank = True
    exports_hf_in_rank = True

    def save_dist_parts(self, job: SaveJob) -> AsyncRequest | None:
        return in_one_fork(job.plan_in_rank(True))


class SnapshotWriter:
    """The forked process checks, writes (and, once the plans are reusable, plans) and exports: the rank is held
    only for the fork. ``hf_in_fork``: whether the HF export can run over the forks' group (see the table)."""

    mode = AsyncMode.SNAPSHOT
    checks_in_rank = False

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

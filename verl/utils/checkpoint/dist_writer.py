"""The sync dist-checkpoint save, written by the rank's own threads: no process forked per save.

megatron's torch_dist strategy writes every save through ``FileSystemWriterAsync``, which forks one writer
process per file bucket from the whole rank (page tables of a GiB-sized process, twice per checkpoint, even for
the few KB of RNG state), waits for and reaps them, and reports through a results queue that a spawned manager
process serves (started by a process's first save). This module keeps megatron's planning (same planner, keys,
file names and ``.metadata``: the format upstream verl reads) and writes with torch DCP's own
``FileSystemWriter`` in threads of the rank (``torch.save`` and the writes release the GIL), each file fsynced.

Threads per save (``writer_threads``): one per ``BYTES_PER_THREAD`` of this rank's bytes, at most the cores
this rank may use (the CPUs of its affinity mask shared by the local ranks) and ``MAX_THREADS``. A thread below
~128 MiB would write for less than ~0.1 s at disk speed while adding a file, its fsync and a thread start; more
threads than cores only contend for the GIL and the page cache. So the RNG / scheduler state (``extra``) is
written by the calling thread alone, and a 460 MiB optimizer state on a 2-core host by 2 threads.

The save plan is reused from the first save: megatron validates its cached plan by comparing two saves'
plans, so only its third save skips planning. The manager keys each strategy by the sharded structure of
what it saves (every item's kind, key, place, shape, dtype) and starts afresh when that changes, which is
what makes a plan valid; the ranks agree on reusing it (one small collective), so a rank that replans never
waits for one that does not. An async save (``checkpoint.async_save``) keeps megatron's forked writer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
import warnings
from pathlib import Path

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from verl.utils.internals import InternalsChangedError, megatron_core
from verl.utils.internals import torch as torch_internals

MiB = 1 << 20
BYTES_PER_THREAD = 128 * MiB
MAX_THREADS = 8


def cores_per_rank() -> int:
    """The CPUs this process may run on, shared by the ranks of this host (``LOCAL_WORLD_SIZE``, else the
    world size: every rank assumed on this host, the conservative guess)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (dist.get_world_size() if dist.is_initialized() else 1)
    return max(1, cpus // max(1, local))


def writer_threads(nbytes: int, cores: int | None = None) -> int:
    """Writer threads for ``nbytes`` of one rank: one per ``BYTES_PER_THREAD``, at most ``cores`` (default:
    ``cores_per_rank()``) and ``MAX_THREADS``, at least one."""
    cores = cores_per_rank() if cores is None else cores
    return max(1, min(math.ceil(nbytes / BYTES_PER_THREAD), cores, MAX_THREADS))


def planned_bytes(plan: SavePlan) -> int:
    """The tensor bytes a rank's save plan writes (bytes items, a few KB of objects, are not counted)."""
    total = 0
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            total += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
    return total


class InRankWriter(FileSystemWriter):
    """DCP's file-system writer (one file per thread, each fsynced; ``.metadata`` fsynced, then renamed into
    place) as megatron's planning drives it: the plan is made without a collective where it can be, and the
    write runs when the caller says (``write``), not inside planning."""

    can_run_decentralized_global_plan = True  # megatron's planner then names files per rank, as its writer does

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._planned: tuple[SavePlan, SavePlanner] | None = None
        self._results: list | tuple | None = None

    @property
    def checkpoint_id(self) -> str:
        """A string, as megatron's writer records it in ``.metadata`` (a ``Path`` there is not plain data)."""
        return str(self.path)

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        return dataclasses.replace(local_plan, storage_data=torch_internals.dcp_storage_prefix(f"__{dist.get_rank()}_"))

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """megatron's planning hands over the final plan here; ``write`` writes it."""
        self._planned = (plan, planner)

    def write(self, threads: int | None = None) -> int:
        """Write this rank's files; returns the threads used. A failure is kept for ``retrieve_write_results``
        (megatron's finalize then fails the save on every rank, naming this one), not raised here."""
        plan, planner = self._planned
        self.thread_count = threads or writer_threads(planned_bytes(plan))
        try:
            results = self.write_data(plan, planner).wait()
            if len(results) != len(plan.items):
                raise RuntimeError(
                    f"writing {self.path}: {len(plan.items) - len(results)} of {len(plan.items)} items were not "
                    "written (a writer thread failed; its traceback is on stderr)"
                )
            self._results = results
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the finalize
            self._results = (exc, traceback.extract_tb(exc.__traceback__))  # DCP's WRAPPED_EXCEPTION
        return self.thread_count

    def retrieve_write_results(self) -> list | tuple:
        """This rank's write results, or its failure as DCP wraps one (what megatron's finalize gathers)."""
        if self._results is None:
            raise RuntimeError(f"{self.path}: write results asked for before the write")
        return self._results


class InRankSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy whose sync ``save`` writes in the rank's threads (``InRankWriter``)
    and reuses its plan from the second save; ``async_save`` stays megatron's (a forked writer)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, cached_metadata=True)
        self.last_threads = 0  # writer threads of the last sync save (0: megatron's writer took it)

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        reuse = _everyone_agrees(self.cached_central_plan is not None)
        writer = InRankWriter(checkpoint_dir)
        try:
            torch_internals.DCP_STORAGE_PREFIX.get()  # checked before planning, like the megatron internals
            metadata, dist_wrapper = megatron_core.plan_torch_dist_save(self, sharded_state_dict, writer, reuse)
        except InternalsChangedError as exc:
            warnings.warn(f"{exc} This save is written by megatron's forked writer processes.", stacklevel=2)
            self.last_threads = 0
            super().save(sharded_state_dict, checkpoint_dir)
            return
        self.last_threads = writer.write()
        megatron_core.finish_torch_dist_save(writer, metadata, dist_wrapper)


def _everyone_agrees(mine: bool) -> bool:
    """Whether ``mine`` holds on every rank (one tiny collective; every rank of a save calls it in turn)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return all(everyone)

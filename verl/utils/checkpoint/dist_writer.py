"""The sync dist-checkpoint save, written by the rank's own threads: no process forked per save.

megatron's torch_dist strategy writes every save through ``FileSystemWriterAsync``, which forks one writer
process per file bucket from the whole rank (page tables of a GiB-sized process, twice per checkpoint, even for
the few KB of RNG state), waits for and reaps them, and reports through a results queue that a spawned manager
process serves (started by a process's first save). This module keeps megatron's planning (same planner, keys,
file names and ``.metadata``: the format upstream verl reads) and writes the files torch DCP's
``FileSystemWriter`` writes, in threads of the rank (``torch.save`` and the writes release the GIL).

What a save's bytes cost beyond the copy into the page cache: DCP ``torch.save``s each tensor item (a zip
archive, which ``torch.load`` reads back: the reader's requirement, so the format stays) and computes a CRC-32
of every record, ~40% of a 460 MiB optimizer's serialization CPU here; the step's manifest already has a CRC-32
of every whole file, so the items are written without record CRCs. The manager's save does not fsync here
(``fsync=False``): the strategy reports the files this rank wrote (``last_files``), and the rank's sealer hashes
and fsyncs them in the background while the HF export runs, before the step commit's barrier; the coordinator's
``.metadata`` is rank 0's and its commit fsyncs it (``durability``; tests/test_dist_writer.py audits each rank).

Threads per save (``writer_threads``): one per ``BYTES_PER_THREAD`` of this rank's bytes, at most the cores
this rank may use (the CPUs of its affinity mask shared by the local ranks) and ``MAX_THREADS``. A thread below
~128 MiB would write for less than ~0.1 s at disk speed while adding a file, its fsync and a thread start; more
threads than cores only contend for the GIL and the page cache. So the RNG / scheduler state (``extra``) is
written by the calling thread alone, and a 460 MiB optimizer state on a 2-core host by 2 threads.

The save plan is reused from the first save: megatron validates its cached plan by comparing two saves'
plans, so only its third save skips planning. The manager keys each strategy by the sharded structure of
what it saves (every item's kind, key, place, shape, dtype) and starts afresh when that changes, which is
what makes a plan valid; the ranks agree on reusing it (one small collective), so a rank that replans never
waits for one that does not. A reused plan needs only each item's current data, so megatron's conversion
into torch ``ShardedTensor``s (validated shard by shard, most of a reused plan's cost) is skipped for the
items a fresh plan found resolved to the very same tensors (``megatron_core.plan_torch_dist_save``). An
async save (``checkpoint.async_save``) keeps megatron's forked writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from verl.utils.checkpoint.integrity import start_range_writeback
from verl.utils.internals import InternalsChangedError, megatron_core
from verl.utils.internals import torch as torch_internals
from verl.utils.rank_comm import RankComm

MiB = 1 << 20
BYTES_PER_THREAD = 128 * MiB
MAX_THREADS = 8
WRITEBACK_BYTES = 16 * MiB  # a file's written bytes are handed to the disk in steps of this, while it grows


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


def item_bytes(item: WriteItem) -> int:
    """A tensor item's bytes; 0 for a bytes item (a few KB of objects)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def planned_bytes(plan: SavePlan) -> int:
    """The tensor bytes a rank's save plan writes (bytes items are not counted)."""
    return sum(item_bytes(item) for item in plan.items)


def split_items(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """``items`` in at most ``count`` files of about equal bytes: the largest item first to the file
    with the fewest bytes so far (bytes items last, to whichever file is then lightest)."""
    files: list[list[WriteItem]] = [[] for _ in range(max(1, count))]
    loads = [0] * len(files)
    for item in sorted(items, key=item_bytes, reverse=True):
        lightest = loads.index(min(loads))
        files[lightest].append(item)
        loads[lightest] += item_bytes(item)
    nonempty = [items_of_file for items_of_file in files if items_of_file]
    return nonempty or [[]]  # a rank with nothing to write: one empty file, as DCP writes


def write_archive(tensor: torch.Tensor, stream: BinaryIO, templates: dict) -> None:
    """Write ``tensor``'s ``torch.save`` archive (without record CRCs) to ``stream``: built once per kind of
    tensor (dtype, shape, strides) into ``templates`` and then written around each later tensor's data, the
    same bytes (``torch_internals.archive_around_data``) without the pickling and archive writing per item
    that held the GIL for most of a reused plan's write (886 items at the bench's model; docs/perf.md). A
    strategy keeps its ``templates`` across its saves; a kind that cannot be templated is saved whole."""
    templated = type(tensor) is torch.Tensor and tensor.is_contiguous() and not tensor.requires_grad and tensor.storage_offset() == 0
    key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) if templated else None
    if key is not None and key not in templates:
        templates[key] = torch_internals.archive_around_data(tensor)
    parts = templates.get(key)
    if parts is None:
        torch_internals.save_without_record_crc(tensor, stream)
        return
    stream.write(parts[0])
    stream.write(torch_internals.host_bytes(tensor))
    stream.write(parts[1])


class InRankWriter(FileSystemWriter):
    """DCP's file-system writer (one file per thread; ``.metadata`` written, then renamed into place) as
    megatron's planning drives it: the plan is made without a collective where it can be, and the write runs
    when the caller says (``write``), not inside planning.

    The files are the ones DCP's ``FileSystemWriter`` writes (each tensor item one ``torch.save`` archive at an
    offset, each bytes item its raw bytes; file names, offsets and lengths in ``.metadata``), written by
    ``write_file``: the archives without record CRCs (``write_archive``) and, with ``fsync=False``, no fsync
    (the caller makes the files ``write`` returns durable, in this process: the manager's sealer)."""

    can_run_decentralized_global_plan = True  # megatron's planner then names files per rank, as its writer does

    def __init__(self, path: str | os.PathLike, fsync: bool = True, archives: dict | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=fsync, thread_count=1, overwrite=True)
        self.archives = {} if archives is None else archives  # ``write_archive``'s templates
        self._planned: tuple[SavePlan, SavePlanner] | None = None
        self._results: list | tuple | None = None
        self.direct: dict[megatron_core.Place, torch.Tensor] = {}  # tensor items' data, resolved without the planner

    @property
    def checkpoint_id(self) -> str:
        """A string, as megatron's writer records it in ``.metadata`` (a ``Path`` there is not plain data)."""
        return str(self.path)

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        return dataclasses.replace(local_plan, storage_data=torch_internals.dcp_storage_prefix(f"__{dist.get_rank()}_"))

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """megatron's planning hands over the final plan here; ``write`` writes it."""
        self._planned = (plan, planner)

    def write(self, threads: int | None = None) -> list[str]:
        """Write this rank's files, one per thread; returns their paths (``thread_count``: the threads used). A
        failure is kept for ``retrieve_write_results`` and ``failure`` (every rank then fails the save, naming this
        one), not raised here."""
        plan, planner = self._planned
        self.thread_count = threads or writer_threads(planned_bytes(plan))
        files = split_items(plan.items, self.thread_count)
        names = [f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}" for index in range(len(files))]
        try:
            with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="dist-writer") as pool:
                written = list(pool.map(self.write_file, names, files, [planner] * len(files)))
            self._results = [result for results in written for result in results]
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the finalize
            self._results = (exc, traceback.extract_tb(exc.__traceback__))  # DCP's WRAPPED_EXCEPTION
        return [os.path.join(self.path, name) for name in names]

    @property
    def failure(self) -> Exception | None:
        """The error that stopped this rank's ``write``, if one did."""
        return self._results[0] if isinstance(self._results, tuple) else None

    def write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """One file of ``items``, bytes items first (as DCP orders them); each item's place in the results."""
        storage_info = torch_internals.dcp_storage_info()
        results = []
        handed_to_disk = 0  # the file's bytes whose writeback has been started
        with open(os.path.join(self.path, name), "wb") as stream:
            for item in sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO):
                data = self.direct.get((item.index.fqn, item.index.offset)) if item.type != WriteItemType.BYTE_IO else None
                if data is None:
                    data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: torch.save would write its whole storage
                    write_archive(tensor, stream, self.archives)
                length = stream.tell() - offset
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, offset, length))
                )
                if offset + length - handed_to_disk >= WRITEBACK_BYTES:
                    stream.flush()
                    start_range_writeback(stream.fileno(), handed_to_disk, offset + length - handed_to_disk)
                    handed_to_disk = offset + length
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        return results

    def retrieve_write_results(self) -> list | tuple:
        """This rank's write results, or its failure as DCP wraps one (what megatron's finalize gathers)."""
        if self._results is None:
            raise RuntimeError(f"{self.path}: write results asked for before the write")
        return self._results


_METADATA_FILES = "write its dist checkpoint's .metadata and metadata.json"


class InRankSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy whose sync ``save`` writes in the rank's threads (``InRankWriter``)
    and reuses its plan from the second save; ``async_save`` stays megatron's (a forked writer). Saved through
    ``save_agreeing_on_rank_zero_files``, a failed write of the files rank 0 writes alone fails every rank."""

    def __init__(self, fsync: bool = True) -> None:
        super().__init__("torch_dist", 1, cached_metadata=True)
        self.fsync = fsync  # False: the caller fsyncs every file of ``last_files`` before it relies on them
        self.last_threads = 0  # writer threads of the last sync save (0: megatron's writer took it)
        self.last_files: list[str] = []  # the files this rank wrote in the last sync save (none: megatron's writer did, fsyncing each)
        self.agreed: frozenset[megatron_core.Place] = frozenset()  # what a reused plan resolves directly
        self.last_direct = 0  # tensor items the last sync save resolved without megatron's conversion
        self.archives: dict = {}  # the tensor items' archive templates (``write_archive``), kept across saves
        self._comm: RankComm | None = None  # the default group, made at the first save, keeping the write results' gather
        self._common = _KeptFailure(None)  # rank 0's common.pt write of the save in progress (``save_agreeing_on_rank_zero_files``)
        self._taken = False  # megatron's writers of common.pt and metadata.json are this save's (``rank_zero_files_taken``)
        self._config_written = False  # this sync save wrote metadata.json itself (megatron's write then skipped)
        self._async_metadata: tuple[_KeptFailure, str] | None = None  # an async save's kept .metadata write, and where

    def save_agreeing_on_rank_zero_files(self, save: Callable[..., Any], **kwargs: Any) -> Any:
        """``save(**kwargs)``: megatron's save with this strategy (what it returns), where the three files megatron
        writes on rank 0 alone, each before a collective the other ranks wait in, fail every rank when that write
        fails. ``common.pt``'s error is kept for the save's first agreement (the sync save's plan reuse, an async
        save's own); ``.metadata`` and ``metadata.json`` are written together, before the agreement on both (a sync
        save's last; an async save's finalize, in place of megatron's barrier)."""
        self._common, self._config_written, self._async_metadata = _KeptFailure(None), False, None
        kept = None
        with contextlib.ExitStack() as taken:
            try:
                taken.enter_context(megatron_core.rank_zero_files_taken(self._kept_common, self._save_config_unless_written))
                self._taken = True
            except InternalsChangedError as exc:
                warnings.warn(f"{exc} A common.pt or metadata.json write that fails on rank 0 fails there alone.", stacklevel=2)
            try:
                request = save(**kwargs)
                kept = self._async_metadata
            finally:  # nothing of this save held past it (the writer's buckets hold its tensors)
                self._taken, self._common, self._async_metadata = False, _KeptFailure(None), None  # a fork's save: no agreement
        if request is not None and kept is not None:
            finish, path = kept
            try:
                write_config = megatron_core.checkpointing_config_writer(self)
                megatron_core.replace_metadata_finalize(request, functools.partial(self._agree_on_metadata_files, finish, path, write_config))
            except InternalsChangedError as exc:
                warnings.warn(f"{exc} A metadata.json write that fails on rank 0 fails there alone.", stacklevel=2)
                names = [getattr(fn, "__name__", None) for fn in request.finalize_fns]  # before megatron's metadata.json
                at = names.index(megatron_core.METADATA_FINALIZE) if megatron_core.METADATA_FINALIZE in names else len(names)
                request.finalize_fns.insert(at, functools.partial(self._agree_on_metadata_files, finish, path, None))
        return request

    def _kept_common(self, save_common: Callable[..., None]) -> _KeptFailure:
        self._common = _KeptFailure(save_common)
        return self._common

    def _save_config_unless_written(self, config: Any, checkpoint_dir: str | Path) -> None:
        if not self._config_written:
            megatron_core.SAVE_CONFIG.get()(config, checkpoint_dir)

    def async_save(self, sharded_state_dict: dict, checkpoint_dir: str | Path, *args: Any, **kwargs: Any) -> Any:
        if self._taken:  # planned in the rank (a forked writer's plan is reused in the fork, which takes nothing over)
            _everyone_agrees(True, self._common.error)
        return super().async_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        reuse = _everyone_agrees(self.cached_central_plan is not None, self._common.error)
        writer = InRankWriter(checkpoint_dir, self.fsync, self.archives)
        write_config = None  # megatron's metadata.json write, where the save has not taken it over
        try:
            for internal in torch_internals.IN_RANK_WRITER:  # checked before planning, like the megatron internals
                internal.get()
            write_config = megatron_core.checkpointing_config_writer(self) if self._taken else None
            plan = megatron_core.plan_torch_dist_save(self, sharded_state_dict, writer, reuse, self.agreed)
        except InternalsChangedError as exc:
            warnings.warn(f"{exc} This save is written by megatron's forked writer processes.", stacklevel=2)
            self.last_threads, self.last_files = 0, []
            super().save(sharded_state_dict, checkpoint_dir)  # its finalize kept a failed .metadata write
            if self._async_metadata is not None:
                (finish, path), self._async_metadata = self._async_metadata, None
                self._agree_on_metadata_files(finish, path, write_config)
                self._config_written = write_config is not None
            return
        self.agreed, writer.direct, self.last_direct = plan.agreed, plan.direct, len(plan.direct)
        self.last_files = writer.write()
        self.last_threads = writer.thread_count
        # Every rank learns a write's failure, the failed rank raising its own error (megatron's finalize names it
        # on the coordinator only). The same all-reduce says whether any rank's write results changed since the
        # last save: a reused plan writes the same items at the same offsets save after save, so they are
        # gathered to the coordinator (for ``.metadata``) only then.
        self._comm = self._comm or RankComm(keep_gathers=True)
        results = self._comm.agree(
            writer.failure, "write its dist checkpoint files", share=writer.retrieve_write_results(), gather=plan.dist_wrapper.gather_object
        )
        # The coordinator's ``.metadata`` and ``metadata.json``, and every rank told how that went in one
        # all-reduce: megatron's finalize raised a failed write there before the broadcast (``.metadata``) or
        # the barrier (``metadata.json``) the other ranks waited in.
        finish = _KeptFailure(writer.finish)
        if plan.dist_wrapper.is_coordinator:
            finish(plan.metadata, results)
        self._agree_on_metadata_files(finish, str(writer.path), write_config, self._comm)
        self._config_written = write_config is not None  # and agreed on: megatron's own write is skipped

    def _agree_on_metadata_files(
        self, finish: _KeptFailure, path: str, write_config: Callable[[str], None] | None, comm: RankComm | None = None
    ) -> None:
        """Every rank: rank 0 writes ``metadata.json`` (with ``write_config``; None: megatron writes it after) once
        its ``.metadata`` (``finish``) was written, then all agree on both."""
        config = _KeptFailure(write_config)
        if write_config is not None and dist.get_rank() == 0 and finish.error is None:
            config(path)
        (comm or RankComm()).agree(finish.error or config.error, _METADATA_FILES)

    def _get_save_and_finalize_callbacks(self, writer: Any, *args: Any, **kwargs: Any) -> Any:
        """megatron's async save's request (a save planned in the rank), whose finalize raised a failed
        ``.metadata`` write on the coordinator alone, before the broadcast the other ranks waited in: the failure
        is kept there, for the agreement that ends the finalize (``save_agreeing_on_rank_zero_files``)."""
        try:
            megatron_core.SAVE_CALLBACKS.get()
        except InternalsChangedError as exc:
            warnings.warn(f"{exc} A .metadata write that fails on the coordinator fails there alone.", stacklevel=2)
            return super()._get_save_and_finalize_callbacks(writer, *args, **kwargs)
        writer.finish = kept = _KeptFailure(writer.finish)
        self._async_metadata = (kept, str(writer.path))
        return super()._get_save_and_finalize_callbacks(writer, *args, **kwargs)


class _KeptFailure:
    """A write of rank 0's alone (``.metadata``, ``metadata.json``, ``common.pt``) that keeps its error instead of
    raising it, for the agreement that tells every rank (``write`` None: never called, so never an error)."""

    def __init__(self, write: Callable[..., None] | None) -> None:
        self.write = write
        self.error: Exception | None = None

    def __call__(self, *args: Any) -> None:
        try:
            self.write(*args)
        except Exception as exc:  # noqa: BLE001 - every rank fails with it, in the agreement that follows
            self.error = exc


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a save builds, plans and writes its dist checkpoints (left
    off if it was off). Their state dicts, plans and write results are thousands of objects alive for the
    whole phase: a collection inside it promotes them, and every few saves that sets off a full collection
    of the trainer's heap (~0.3 s at the bench's 60M model, half a million objects). With none inside, they
    are freed by reference counting when the phase ends, never promoted; any cycle among them is still
    collected by the next young collection after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _everyone_agrees(mine: bool, common_error: Exception | None) -> bool:
    """Whether ``mine`` holds on every rank (one tiny collective; every rank of a save calls it in turn), which
    also carries rank 0's failed ``common.pt`` write: then every rank raises."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if common_error is not None:
            raise common_error
        return mine
    comm = RankComm()
    failed, someone_not = comm.any(common_error is not None, not mine)
    if failed:
        comm.fail_together(common_error, "write its dist checkpoint's common.pt")
    return not someone_not

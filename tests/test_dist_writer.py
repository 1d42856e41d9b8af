"""The sync save's in-rank dist-checkpoint writer: durable, fork-free, the plan reused from the second save.

The fsync audit records, in each rank (and the processes it forks), every file it writes, every directory it
makes, every ``os.fsync`` and every rename, by inode with a system-wide monotonic stamp, wrapping the real calls:
every file and directory of the committed step must have been fsynced by the rank that wrote (or made) it before
the staging directory was renamed into place, and the parent after it. So no speed-up is ever bought by
dropping durability, nor by one host fsyncing what another host wrote (which does not flush the writer's cache
on a shared filesystem).
"""

from __future__ import annotations

import errno
import os
import time

import psutil
import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.utils.checkpoint import dist_writer, layout
from verl.utils.distributed import run_on_ranks
from verl.utils.internals import megatron_core
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(ep=2, etp=1)  # 2 ranks: experts split, dense data parallel
WORLD = 2


def _actor(src: str):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return MegatronEngine(*actor_configs(src, total_training_steps=TRAINING_STEPS))


def _recording_writes_and_fsyncs(log_path: str) -> None:
    """Wrap, in this process and the processes it forks, every way a save writes a file (``builtins.open`` /
    ``io.open`` / ``os.open`` for writing; ``torch.save``, ``safetensors``' ``save_file`` and ``tokenizers``'
    ``Tokenizer.save`` to a path: their writes run in C++ or Rust), makes a directory (``os.mkdir``), fsyncs
    (``os.fsync``) and renames (``os.replace`` / ``os.rename``). Each call, the real one unchanged, appends one
    JSON line to ``log_path`` (this rank's log; a fork's lines land in its rank's): monotonic ns, the op and the
    inode it touched (a rename keeps it, so a file is followed from its temp name to the committed step)."""
    import builtins
    import io
    import json

    import safetensors.torch
    import tokenizers

    from verl.models.mcore import parallel_hf_save

    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    real_open, real_os_open, real_mkdir, real_fsync = builtins.open, os.open, os.mkdir, os.fsync

    def record(op: str, start: int, inode: int, *paths: str) -> None:
        line = json.dumps([start, time.monotonic_ns(), op, inode, *paths]) + "\n"
        os.write(log, line.encode())  # one short O_APPEND write: lines of several processes never interleave

    def opening(file, mode="r", *args, **kwargs):
        start = time.monotonic_ns()
        handle = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int) and any(c in mode for c in "wax+"):
            record("wrote", start, os.fstat(handle.fileno()).st_ino, os.path.abspath(file))
        return handle

    def os_opening(path, flags, *args, **kwargs):
        start = time.monotonic_ns()
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & (os.O_WRONLY | os.O_RDWR):
            record("wrote", start, os.fstat(fd).st_ino, os.path.abspath(path))
        return fd

    def writing_to_a_path(real, path_arg: int):
        def write(*args, **kwargs):
            start = time.monotonic_ns()
            result = real(*args, **kwargs)
            target = args[path_arg] if len(args) > path_arg else None
            if isinstance(target, (str, os.PathLike)):
                record("wrote", start, os.stat(target).st_ino, os.path.abspath(target))
            return result

        return write

    def mkdir(path, *args, **kwargs):
        start = time.monotonic_ns()
        real_mkdir(path, *args, **kwargs)
        record("made", start, os.stat(path).st_ino, os.path.abspath(path))

    def fsync(fd) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        start = time.monotonic_ns()
        real_fsync(fd)
        record("fsync", start, os.fstat(number).st_ino, os.readlink(f"/proc/self/fd/{number}"))

    def renaming(real):
        def rename(src, dst, **kwargs) -> None:
            start = time.monotonic_ns()
            real(src, dst, **kwargs)
            record("rename", start, os.stat(dst).st_ino, os.path.abspath(src), os.path.abspath(dst))

        return rename

    builtins.open = io.open = opening
    os.open, os.mkdir, os.fsync = os_opening, mkdir, fsync
    os.replace, os.rename = renaming(os.replace), renaming(os.rename)
    torch.save = writing_to_a_path(torch.save, 1)
    save_file = writing_to_a_path(safetensors.torch.save_file, 1)
    safetensors.torch.save_file = parallel_hf_save.save_file = save_file
    tokenizers.Tokenizer.save = writing_to_a_path(tokenizers.Tokenizer.save, 1)


def _audited_saves(src: str, root: str, logs: str) -> dict:
    actor = _actor(src)
    actor.train_step([torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))] * 2)
    forks: list = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    _recording_writes_and_fsyncs(os.path.join(logs, f"rank{torch.distributed.get_rank()}.jsonl"))
    for step in (1, 2):  # the first save (cold: no writer helper may start) and a warm one
        actor.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step)
    children_after = {p.pid for p in psutil.Process().children(recursive=True)}
    report = {"forks": len(forks), "new_children": sorted(children_after - children_before)}
    # the forked writers: the snapshot's fork (which exports the HF weights here) and megatron's writer processes
    manager = actor.checkpoint_manager
    manager.async_save, manager.async_mode = True, "snapshot"  # the manager's public setters: the writer chosen again
    actor.save_checkpoint(os.path.join(root, "global_step_3", "actor"), global_step=3)
    actor.finalize_checkpoint()
    report["hf_in_fork"] = manager.last_save.hf_weights_in_background
    return report


def _events(logs: str) -> list[tuple]:
    """Every rank's recorded calls as (start ns, end ns, op, inode, paths..., rank), in the order they ended."""
    import json

    events = []
    for rank in range(WORLD):
        with open(os.path.join(logs, f"rank{rank}.jsonl")) as handle:
            events += [(*json.loads(line), rank) for line in handle]
    return sorted(events, key=lambda e: e[1])


def _not_durable_by_their_writers(local_path: str, events: list[tuple]) -> tuple[list[str], int, list[int]]:
    """Per-writer durability of a committed step (``verl.utils.checkpoint.durability``): for every file, the
    rank that wrote it (its last writing open before the commit's rename, followed by inode through renames)
    fsynced it and the directory holding it after the write and before the rename; every directory, the rank
    that made it fsynced it. Returns the breaches, the files checked and the ranks that wrote them."""
    staging = os.path.realpath(layout.staging_path(local_path))
    renamed = [e for e in events if e[2] == "rename" and list(e[4:6]) == [staging, os.path.realpath(local_path)]]
    assert len(renamed) == 1, f"{local_path}: the staging directory was renamed {len(renamed)} times"
    rename_ns = renamed[0][0]

    def fsynced_by(rank: int, inode: int, after: int) -> bool:
        return any(e[2] == "fsync" and e[3] == inode and e[-1] == rank and after < e[0] and e[1] < rename_ns for e in events)

    breaches, files, writers = [], 0, set()
    for directory, _, names in os.walk(local_path):
        made = [e for e in events if e[2] == "made" and e[3] == os.stat(directory).st_ino and e[1] < rename_ns]
        if made and not fsynced_by(made[-1][-1], made[-1][3], made[-1][1]):
            breaches.append(f"{directory}/ made by rank {made[-1][-1]}, which did not fsync it")
        for name in names:
            path = os.path.join(directory, name)
            files += 1
            wrote = [e for e in events if e[2] == "wrote" and e[3] == os.stat(path).st_ino and e[0] < rename_ns]
            if not wrote:
                breaches.append(f"{path}: no rank was seen writing it")
                continue
            writer, written = wrote[-1][-1], wrote[-1][1]
            writers.add(writer)
            if not fsynced_by(writer, wrote[-1][3], written):
                breaches.append(f"{path}: written by rank {writer}, which did not fsync it before the rename")
            elif not fsynced_by(writer, os.stat(directory).st_ino, written):
                breaches.append(f"{path}: written by rank {writer}, which did not fsync its directory after it")
    return breaches, files, sorted(writers)


def test_every_file_of_a_committed_step_was_fsynced_by_the_rank_that_wrote_it_and_no_sync_save_forked(tiny_moe_path, tmp_path):
    """On hosts that share a filesystem, only the writer's fsync flushes its cache: each rank (or the process it
    forked to write) fsyncs what it wrote and its directories before the commit; rank 0 fsyncs the parent after
    the rename. Steps 1 and 2: the sync writer; step 3: the snapshot writer, whose forks write everything."""
    root, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    os.makedirs(logs)
    results = run_on_ranks(_audited_saves, WORLD, LAYOUT, args=(tiny_moe_path, root, logs))
    for rank, result in enumerate(results):
        assert result["forks"] == 0 and result["new_children"] == [], f"rank {rank}: a sync save started processes"
        assert result["hf_in_fork"], f"rank {rank}: the snapshot's HF export ran in the rank, not in its fork"
    events = _events(logs)
    for step in (1, 2, 3):
        local_path = os.path.realpath(os.path.join(root, f"global_step_{step}", "actor"))
        breaches, files, writers = _not_durable_by_their_writers(local_path, events)
        assert files >= 10, f"step {step}: only {files} files committed"
        assert writers == [0, 1], f"step {step}: files written by ranks {writers}, not by both"
        assert not breaches, f"step {step}: " + "; ".join(breaches)
        rename_ns = next(e[1] for e in events if e[2] == "rename" and e[5] == local_path)
        parent = os.stat(os.path.dirname(local_path)).st_ino
        assert any(e[2] == "fsync" and e[3] == parent and e[0] > rename_ns for e in events), (
            f"step {step}: the parent directory was not fsynced after the rename"
        )


def _two_saves_with_one_strategy(root: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    strategy = dist_writer.InRankSaveStrategy()
    report: dict = {"reusable_after": [], "loaded": [], "threads": []}
    for index in range(2):
        path = os.path.join(root, f"save{index}")
        os.makedirs(path)
        weight = torch.arange(64.0).reshape(8, 8) + index
        state = {
            "w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
            "rng": ShardedObject("rng", {"seed": index}, (1,), (0,), replica_id=0),
        }
        dist_checkpointing.save(state, path, sharded_strategy=strategy)
        report["reusable_after"].append(megatron_core.save_plan_is_reusable(strategy))
        report["threads"].append(strategy.last_threads)
        loaded = dist_checkpointing.load(
            {
                "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8), replica_id=0),
                "rng": ShardedObject("rng", None, (1,), (0,), replica_id=0),
            },
            path,
        )
        report["loaded"].append(torch.equal(loaded["w"], weight) and loaded["rng"] == {"seed": index})
        report.setdefault("files", []).append(sorted(os.listdir(path)))
    return report


def test_the_plan_is_reusable_after_the_first_save_and_each_save_loads_back(tmp_path):
    report = run_on_ranks(_two_saves_with_one_strategy, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert report["reusable_after"] == [True, True]
    assert report["loaded"] == [True, True]
    assert report["threads"] == [1, 1]  # 256 bytes: the calling thread writes them
    assert all(".metadata" in files and "__0_0.distcp" in files for files in report["files"])


@pytest.mark.parametrize(
    ("nbytes", "cores", "threads"),
    [
        (4 << 10, 16, 1),  # RNG / scheduler state: the calling thread
        (100 << 20, 16, 1),
        (460 << 20, 2, 2),  # one rank's optimizer on a 2-core host
        (460 << 20, 16, 4),  # one thread per 128 MiB
        (8 << 30, 16, dist_writer.MAX_THREADS),
        (8 << 30, 1, 1),  # never more threads than cores
    ],
)
def test_writer_threads_follow_bytes_and_cores(nbytes, cores, threads):
    assert dist_writer.writer_threads(nbytes, cores) == threads


def _save_without(internal_index: int, root: str) -> dict:
    import warnings

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from verl.utils.internals import torch as torch_internals

    internal = (
        megatron_core.PLAN_SAVE,
        torch_internals.DCP_STORAGE_PREFIX,
        torch_internals.ZIP_SAVE,
    )[internal_index]
    module_name, _, name = internal.path.partition(":")
    module = __import__(module_name, fromlist=[name])
    if internal is torch_internals.ZIP_SAVE:  # torch.save itself calls it: changed (a parameter renamed), not gone
        original = getattr(module, name)
        setattr(
            module,
            name,
            lambda obj, zip_file, pickle_module, pickle_protocol, renamed: original(
                obj, zip_file, pickle_module, pickle_protocol, renamed
            ),
        )
    else:
        delattr(module, name)
    strategy = dist_writer.InRankSaveStrategy()
    weight = torch.arange(16.0).reshape(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_checkpointing.save(
            {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}, root, sharded_strategy=strategy
        )
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=0)}, root)
    messages = [str(w.message) for w in caught if internal.name in str(w.message)]
    return {"warned": messages, "threads": strategy.last_threads, "loaded": torch.equal(loaded["w"], weight)}


@pytest.mark.parametrize("internal_index", range(3))
def test_an_in_rank_writer_internal_gone_falls_back_to_megatrons_writer_naming_it(tmp_path, internal_index):
    """Removed from the module the adapter reads (megatron's strategy module keeps its own bindings, so its
    writer still runs), or changed where torch.save itself calls it. The torch-strategy helpers megatron's writer
    calls by module name themselves (and ``_StorageInfo``, ``PyTorchFileWriter``) cannot be removed without
    removing that writer too: a release without them changes megatron's strategy as well."""
    report = run_on_ranks(_save_without, 1, ParallelSizes(), args=(internal_index, str(tmp_path)))[0]
    assert report["loaded"] and report["threads"] == 0  # megatron's forked writer wrote it
    assert report["warned"] and "forked writer" in report["warned"][0]


def _fallback_save_whose_metadata_fails(root: str) -> str:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemWriter

    module_name, _, name = megatron_core.PLAN_SAVE.path.partition(":")
    delattr(__import__(module_name, fromlist=[name]), name)  # megatron's forked writer takes the save

    def finish(writer, metadata, results) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(str(writer.path), ".metadata"))

    FileSystemWriter.finish = finish
    strategy = dist_writer.InRankSaveStrategy()
    try:
        strategy.save_agreeing_on_rank_zero_files(
            dist_checkpointing.save,
            sharded_state_dict={"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0)},
            checkpoint_dir=root,
            sharded_strategy=strategy,
        )
    except OSError as exc:
        return str(exc)
    return "saved"


def test_a_save_that_falls_back_to_megatrons_writer_still_raises_a_failed_metadata_write(tmp_path):
    message = run_on_ranks(_fallback_save_whose_metadata_fails, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert "No space left on device" in message and ".metadata" in message, message


def _save_with_config_writer_changed(root: str) -> dict:
    import warnings

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    original = serialization.save_config
    serialization.save_config = lambda config, path: original(config, path)  # a parameter renamed
    strategy = dist_writer.InRankSaveStrategy()
    weight = torch.arange(16.0).reshape(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.save_agreeing_on_rank_zero_files(
            dist_checkpointing.save,
            sharded_state_dict={"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)},
            checkpoint_dir=root,
            sharded_strategy=strategy,
        )
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=0)}, root)
    messages = [str(w.message) for w in caught if megatron_core.SERIALIZATION_SAVE_CONFIG.name in str(w.message)]
    return {"warned": messages, "loaded": torch.equal(loaded["w"], weight), "files": sorted(os.listdir(root))}


def test_a_changed_rank_0_file_writer_leaves_rank_0s_own_files_to_megatron_naming_it(tmp_path):
    """Where megatron's save no longer writes common.pt and metadata.json as the strategy expects, the save warns
    naming the internal and megatron writes both files itself, as without the takeover."""
    report = run_on_ranks(_save_with_config_writer_changed, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert report["warned"] and "fails there alone" in report["warned"][0], report
    assert report["loaded"] and {"common.pt", "metadata.json", ".metadata"} <= set(report["files"]), report


def test_an_item_without_record_crc_is_torch_saves_archive_and_loads_back():
    """The in-rank writer's tensor item: the bytes torch.save writes with its (process-wide) CRC switch off,
    and what DCP's reader does with them (torch.load) gives the tensor back; torch.save's own setting is
    left as it was."""
    import io

    from verl.utils.internals import torch as torch_internals

    tensor = torch.randn(3, 5)
    ours = io.BytesIO()
    torch_internals.save_without_record_crc(tensor, ours)
    assert torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        theirs = io.BytesIO()
        torch.save(tensor, theirs)
    finally:
        torch.serialization.set_crc32_options(True)
    assert ours.getvalue() == theirs.getvalue()
    ours.seek(0)
    assert torch.equal(torch.load(ours, weights_only=True), tensor)


def test_items_split_into_files_of_about_equal_bytes_and_a_rank_with_none_writes_one_empty_file():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def item(name: str, numel: int) -> WriteItem:
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([numel]))
        return WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR, tensor_data=data)

    items = [
        item("a", 100),
        item("b", 60),
        item("c", 50),
        item("d", 10),
        WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO),
    ]
    files = dist_writer.split_items(items, 2)
    assert sorted(sum(dist_writer.item_bytes(i) for i in f) for f in files) == [440, 440]
    assert sorted(i.index.fqn for f in files for i in f) == ["a", "b", "c", "d", "obj"]
    assert dist_writer.split_items(items[:1], 4) == [items[:1]]  # no empty files beside one with items
    assert dist_writer.split_items([], 2) == [[]]


def _collections_inside_the_dist_checkpoint_phase(src: str, root: str) -> dict:
    import gc

    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    window = {"inside": False, "collections": []}

    class Observed(MegatronCheckpointManager):
        def on_save_phase(self, phase):
            window["inside"] = {"dist_checkpoint": True, "after_dist_checkpoint": False}.get(phase, window["inside"])
            super().on_save_phase(phase)

    def record(phase, info):
        if phase == "start" and window["inside"]:
            window["collections"].append(info["generation"])

    actor = MegatronEngine(*actor_configs(src, total_training_steps=TRAINING_STEPS), manager_cls=Observed)
    actor.train_step([torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))] * 2)
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)  # a collection, and a full one, every few dozen objects: certain inside the phase
    gc.callbacks.append(record)
    try:
        for step in (1, 2):
            actor.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step)
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)
    return {"collections": window["collections"], "enabled_after": gc.isenabled()}


def test_no_garbage_collection_runs_while_the_dist_checkpoints_are_saved(tiny_moe_path, tmp_path):
    """A collection inside the phase would promote its thousands of live objects and, every few saves, set
    off a full collection of the trainer's heap (~0.3 s at the bench's model); the collector is back on after."""
    report = run_on_ranks(_collections_inside_the_dist_checkpoint_phase, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path)))[0]
    assert report["collections"] == [] and report["enabled_after"]


def _dirty_pages(path: str) -> int:
    """The file's page-cache pages not yet handed to the disk (Linux ``cachestat``, 6.5+)."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]

    libc, stat = ctypes.CDLL(None, use_errno=True), Stat()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(Range(0, 0)), ctypes.byref(stat), 0) != 0:  # SYS_cachestat
            raise OSError(ctypes.get_errno(), f"cachestat {path}")
    finally:
        os.close(fd)
    return stat.dirty


def _unsynced_save_of(nbytes: int, root: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(nbytes >> 22)}  # 4 MiB each
    sharded = {key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in tensors.items()}
    dist_checkpointing.save(sharded, root, sharded_strategy=dist_writer.InRankSaveStrategy(fsync=False))
    data = [os.path.join(root, name) for name in os.listdir(root) if name.endswith(".distcp")]
    return {path: (os.path.getsize(path), _dirty_pages(path)) for path in data}


def test_a_file_is_handed_to_the_disk_while_it_is_written_not_left_for_the_fsync(tmp_path):
    """Unsynced (the sealer fsyncs later), a 48 MiB file still has at most its last ``WRITEBACK_BYTES`` dirty:
    the rest was handed to the disk as it was written, so the disk writes while the save goes on (without the
    hint the kernel leaves every page dirty for up to 30 s, and the fsync then starts the whole write)."""
    try:
        _dirty_pages(__file__)
    except OSError as exc:  # ENOSYS before Linux 6.5 (Ubuntu 22.04's 5.15): no call reads a file's dirty pages
        if exc.errno != errno.ENOSYS:
            raise
        pytest.skip(f"cachestat needs Linux 6.5+, this kernel is {os.uname().release}")
    files = run_on_ranks(_unsynced_save_of, 1, ParallelSizes(), args=(48 << 20, str(tmp_path)))[0]
    assert [size >= 48 << 20 for size, _ in files.values()] == [True]
    page = os.sysconf("SC_PAGE_SIZE")
    assert dist_writer.WRITEBACK_BYTES <= 16 << 20  # a quarter of the file, at most
    assert all(dirty * page <= dist_writer.WRITEBACK_BYTES for _, dirty in files.values()), files


def test_a_template_is_built_with_at_most_one_copy_of_the_tensors_bytes():
    """The first tensor of a kind may be gigabytes (an embedding, its Adam moments): building its template holds
    the probe archive, never further copies of the data (tracemalloc sees every Python buffer of it)."""
    import tracemalloc

    from verl.utils.internals import torch as torch_internals

    tensor = torch.randn(4 << 20)  # 16 MiB
    tracemalloc.start()
    try:
        parts = torch_internals.archive_around_data(tensor)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert parts is not None and peak < 1.5 * tensor.nbytes, peak / tensor.nbytes


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(3, 4, 5, generator=g),
        lambda g: torch.randn(64, generator=g).to(torch.bfloat16),
        lambda g: torch.randn((), generator=g),  # 0-d
        lambda g: torch.empty(0),
        lambda g: torch.randint(0, 9, (4, 4), generator=g),
        lambda g: torch.randn(4, 6, generator=g).t(),  # not contiguous: saved whole
        lambda g: torch.randn(8, generator=g)[2:],  # a view at an offset: saved whole
        lambda g: torch.randn(5, generator=g).requires_grad_(),  # its flag is in the archive: saved whole
    ],
)
def test_a_templated_archive_is_the_bytes_torch_save_writes_for_every_tensor_of_the_kind(make):
    import io

    from verl.utils.internals import torch as torch_internals

    templates, g = {}, torch.Generator().manual_seed(0)
    for tensor in (make(g), make(g), make(g)):  # the first builds the template, the others are written around it
        ours, torchs = io.BytesIO(), io.BytesIO()
        dist_writer.write_archive(tensor, ours, templates)
        torch_internals.save_without_record_crc(tensor, torchs)
        assert ours.getvalue() == torchs.getvalue()
        ours.seek(0)
        assert torch.equal(torch.load(ours), tensor.detach())
        tensor.untyped_storage().resize_(0)  # still resizable: the offload frees a parameter's storage after a save

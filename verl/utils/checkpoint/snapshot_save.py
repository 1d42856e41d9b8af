"""A whole save written by a process forked from each rank: the fork is the snapshot.

megatron's async save plans the dist checkpoint on the training path (sharded state dicts, torch's
sharded tensors, the write plan, clones of every tensor that is a view) and forks only the file
writes. Once a strategy's plan has been validated on two saves, its planning needs no collective any
more (``TorchDistSaveShardedStrategy`` reuses the central plan), so all of it can run in the fork,
together with the HF export over a gloo group of the forked processes (``ForkedRankComm``). What
stays in the parent is what needs the parent's process groups: the ``.metadata`` of each dist
checkpoint, made from every rank's write results when the save is finalized.

On an accelerator the fork sees no device memory: this path is for tensors in host memory, the
``snapshot`` writer's (``verl.utils.checkpoint.save_writers``), which ``checkpoint.async_mode`` picks and the
config check refuses on an accelerator run (``verl.utils.checkpoint.async_modes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import psutil
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from verl.utils import process_lifetime, rank_comm
from verl.utils.checkpoint import os_errors
from verl.utils.fs import atomic_open
from verl.utils.internals import InternalsChangedError, megatron_core
from verl.utils.internals import torch as torch_internals

OUTCOME_DIRNAME = ".background"  # inside the staging directory; removed before the manifest is built
RESERVE_BYTES = 4096  # room kept for a fork's failed outcome (``reserve_outcome``)


def write_dist_checkpoint(strategy: TorchDistSaveShardedStrategy, state: dict, path: str, content_metadata: dict) -> list:
    """In the fork: plan ``state`` with the reusable ``strategy`` and write this rank's files; its write results.

    megatron's async request is run here to its end; its finalize (a gather of every rank's results)
    is the parent's part: ``finish_dist_checkpoint``.
    """
    with os_errors.writing(path):  # a writer's ENOSPC names no file: name the directory it was writing
        request = dist_checkpointing.save(
            state, path, sharded_strategy=strategy, validate_access_integrity=False, async_sharded_save=True, content_metadata=content_metadata,
            **megatron_core.async_save_options(),
        )
        if request.async_fn is None:
            return []  # nothing of this checkpoint is written by this rank
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
        results = megatron_core.results_queue(request).get()
        if isinstance(results, BaseException):
            raise RuntimeError(f"writing {path} failed: {results}") from results
    buckets = megatron_core.write_buckets(request)
    if len(results) != len(buckets):
        raise RuntimeError(f"writing {path}: {len(results)} of {len(buckets)} writer processes reported")
    return list(chain.from_iterable(results.values()))


def finish_dist_checkpoint(strategy: TorchDistSaveShardedStrategy, path: str, all_results: list[list]) -> None:
    """On the coordinator (rank 0): the ``.metadata`` and ``metadata.json`` that make ``path`` loadable."""
    megatron_core.write_checkpoint_metadata(strategy, path, all_results)


def outcome_path(staging: str, rank: int) -> str:
    return os.path.join(staging, OUTCOME_DIRNAME, f"rank{rank}.json")


def _reserve_path(staging: str, rank: int) -> str:
    return os.path.join(staging, OUTCOME_DIRNAME, f"rank{rank}.reserve")


def reserve_outcome(staging: str, rank: int) -> None:
    """In the rank, before it forks: ``RESERVE_BYTES`` of disk for the fork's outcome. A fork that fills the
    disk cannot write its outcome file any more; it overwrites this one in place (no new blocks needed) and
    renames it, so the parent still learns why (ENOSPC and the path) instead of finding nothing. Failing here,
    the disk is full already, and the save fails at once with that error."""
    path = _reserve_path(staging, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_open(path, "w", durable=False) as handle:
        handle.write(" " * RESERVE_BYTES)


def _write_result_to_json(value: Any) -> dict:
    """A dist-checkpoint write result (torch DCP's ``WriteResult`` of a file-system write) as plain JSON."""
    if not isinstance(value, WriteResult) or not isinstance(value.storage_data, torch_internals.dcp_storage_info()):
        raise TypeError(f"a background save's outcome holds a {type(value).__name__}, which has no data-only form")
    index, info = value.index, value.storage_data
    return {
        "write_result": {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset), "index": index.index},
        "size_in_bytes": value.size_in_bytes,
        "storage": [info.relative_path, info.offset, info.length, info.transform_descriptors],
    }


def _write_result_from_json(entry: dict) -> Any:
    if "write_result" not in entry:
        return entry
    index, (relative_path, offset, length, transforms) = entry["write_result"], entry["storage"]
    if not (isinstance(relative_path, str) and isinstance(offset, int) and isinstance(length, int) and isinstance(entry["size_in_bytes"], int)):
        raise ValueError(f"a write result of unexpected types: {entry}")
    return WriteResult(
        index=MetadataIndex(index["fqn"], None if index["offset"] is None else torch.Size(index["offset"]), index["index"]),
        size_in_bytes=entry["size_in_bytes"],
        storage_data=torch_internals.dcp_storage_info()(relative_path, offset, length, transforms),
    )


def _died(pid: int) -> str | None:
    """How child ``pid`` ended, if it ended badly (a signal or a non-zero exit); it stays waitable for its owner."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or (info.si_code == os.CLD_EXITED and info.si_status == 0):
        return None
    return f"exit code {info.si_status}" if info.si_code == os.CLD_EXITED else f"signal {info.si_status}"


_watched = False  # this process's children are watched already (fail_when_a_writer_dies ran here)


def _watch_children(
    on_death: Callable[[str], None], stop: threading.Event, ignore: frozenset[int], interval_s: float, owner: str
) -> None:
    """Until ``stop``: the first child process (not in ``ignore``) that died badly ends this process (status 1)
    after ``on_death(reason)``, with every other process below it killed first, so none is left behind.
    ``owner``: this process, as the reason names it (a rank, or a save's fork and the rank it was forked from)."""
    me = psutil.Process()
    while not stop.wait(interval_s):
        for child in me.children():
            reason = None if child.pid in ignore else _died(child.pid)
            if reason is None:
                continue
            on_death(f"a dist-checkpoint writer process (pid {child.pid}) of {owner} died ({reason})")
            for other in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    other.kill()
            os._exit(1)


def fail_when_a_writer_dies(on_death: Callable[[str], None], rank: int, interval_s: float = 0.2) -> Callable[[], None]:
    """In a process forked for rank ``rank``'s save: end it (status 1) as soon as one of its child processes
    dies badly, until the returned ``stop()`` is called.

    megatron's dist-checkpoint writer runs one process per file bucket and waits on a queue for every one
    of them: a writer killed by a signal (the OOM killer, an operator) would leave this process, and every
    rank's save with it, waiting forever. ``on_death(reason)`` records why first (the reason names the writer,
    this process and the rank's own process it was forked from); the other writers are killed, so none is
    left behind. The fork calls ``stop()`` once its job has returned, before it records the outcome and exits:
    by then every writer has reported and been joined, and a child its exit ends (multiprocessing's
    finalizers send SIGTERM to a Manager slow to shut down) is no writer's death.
    """
    global _watched
    _watched = True
    owner = f"rank {rank}'s save process (pid {os.getpid()}, forked from the rank's process, pid {os.getppid()})"
    stop = threading.Event()
    watch = threading.Thread(target=_watch_children, args=(on_death, stop, frozenset(), interval_s, owner), name="save-writer-watch", daemon=True)
    watch.start()

    def stop_watching() -> None:
        stop.set()
        watch.join()

    return stop_watching


def watch_writers_in_the_rank(original: Callable[..., None]) -> Callable[..., None]:
    """megatron's ``write_preloaded_data_multiproc`` (which forks the writers and waits for each on a queue),
    watched where nothing watches it yet: in a synchronous save that is the rank itself, which would wait
    forever for a killed writer, its peers with it in the next collective. A writer that dies badly then
    ends the rank within moments (status 1), its reason on stderr: the group stops the run and blames this
    rank, whose process died. In a save's fork (``fail_when_a_writer_dies`` watches) it runs as it is."""

    def write_preloaded_data_multiproc(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
        if _watched:
            return original(transform_list, use_msc, rank, write_buckets, global_results_queue)
        stop = threading.Event()
        earlier = frozenset(child.pid for child in psutil.Process().children())  # the Manager, an async fork
        owner = f"rank {rank} (pid {os.getpid()})"
        watch = threading.Thread(target=_watch_children, args=(_report_and_end, stop, earlier, 0.2, owner), name="save-writer-watch", daemon=True)
        watch.start()
        try:
            return original(transform_list, use_msc, rank, write_buckets, global_results_queue)
        finally:
            stop.set()
            watch.join()

    return write_preloaded_data_multiproc


def _report_and_end(reason: str) -> None:
    print(f"[checkpoint] rank {os.environ.get('RANK', '?')}: the save failed: {reason}; ending this rank", file=sys.stderr, flush=True)


def guard_writers() -> None:
    """megatron's dist-checkpoint writers in this process: the Manager server they report through dies with the
    process that starts it (``megatron_core.tie_write_results_queue``), and a writer that dies fails the save
    at once, also in the rank (``watch_writers_in_the_rank``). Where those internals moved, a warning: a killed
    rank may then leave megatron's Manager behind, and a killed writer hang a synchronous save."""
    try:
        megatron_core.tie_write_results_queue(process_lifetime.start_manager)
        megatron_core.wrap_writer_processes(watch_writers_in_the_rank)
    except InternalsChangedError as exc:
        warnings.warn(f"{exc} A killed rank may leave its writers' Manager behind; a killed writer may hang a save.", stacklevel=2)


def report_to_stderr(reason: str) -> None:
    print(f"[checkpoint] background save failed: {reason}", file=sys.stderr, flush=True)


def _record(staging: str, rank: int, outcome: dict[str, Any]) -> None:
    """The outcome file; when the disk refuses it, the failure (the job's, else this write's) in the reserve."""
    path = outcome_path(staging, rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_open(path, "w", durable=False) as handle:  # read by the parent in this boot, never after a crash
            json.dump(outcome, handle, default=_write_result_to_json)
    except OSError as exc:
        failed = outcome if not outcome.get("ok") else _failed(exc, path)
        _record_in_reserve(staging, rank, failed)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(_reserve_path(staging, rank))


def _record_in_reserve(staging: str, rank: int, outcome: dict[str, Any]) -> None:
    """A failed outcome, cut to fit the reserve (its last line, the cause, kept), written over it in place."""
    error, extra = outcome["error"], {k: v for k, v in outcome.items() if k not in ("ok", "error")}
    data = b""
    for keep in (len(error), 2000, 500, 0):
        text = error[-keep:] if keep else error.strip().splitlines()[-1][-200:]
        data = json.dumps({"ok": False, "error": text, **extra}).encode()
        if len(data) <= RESERVE_BYTES:
            break
    reserve = _reserve_path(staging, rank)
    with contextlib.suppress(OSError):  # no reserve (the fork ran without one): the parent says it found nothing
        fd = os.open(reserve, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.pwrite(fd, data.ljust(RESERVE_BYTES), 0)  # JSON ends in spaces; blocks already allocated
        finally:
            os.close(fd)
        os.replace(reserve, outcome_path(staging, rank))


def _failed(exc: BaseException, path: str | None = None) -> dict[str, Any]:
    """A failed outcome: the traceback, and for an operating-system error its errno, text and path, with a
    last line (the one the ranks' error shows) of ``<strerror> (<ERRNO>) writing <path>``."""
    found = os_errors.explain(exc, path) if path else os_errors.find_os_error(exc)
    text = "".join(traceback.format_exception(exc))
    if found is None:
        return {"ok": False, "error": text}
    return {"ok": False, "error": f"{text}{found.describe(path)}", "os_error": found.as_json()}


class ForkedJob:
    """What a save's fork runs (as megatron's ``async_fn``): ``job``, its outcome left for the parent. ``group``:
    the ``ForkedRankComm`` name the fork meets its peers under, if it does (see ``fork``)."""

    def __init__(self, staging: str, rank: int, job: Callable[[], dict[str, Any]], group: str | None = None) -> None:
        self.staging, self.rank, self.job, self.group = staging, rank, job, group

    def __call__(self) -> None:
        """The fork's entry: run ``job`` and leave what it returned, or its traceback, for the parent (an
        operating-system error as such: ``_failed``). The parent reserved room for it (``reserve_outcome``).

        The fork dies with its rank (``verl.utils.process_lifetime``, armed by the manager)."""
        stop_watching = fail_when_a_writer_dies(lambda reason: _record(self.staging, self.rank, {"ok": False, "error": reason}), self.rank)
        try:
            outcome: dict[str, Any] = {"ok": True, **self.job()}
        except BaseException as exc:  # noqa: BLE001 - the parent reports it; a fork must not raise into multiprocessing
            outcome = _failed(exc, self.staging)
        stop_watching()  # the writers are done: what this process's exit ends is not a writer's death
        _record(self.staging, self.rank, outcome)


def fork(queue: Any, request: Any) -> None:
    """Start ``request`` on megatron's ``AsyncCallsQueue`` (it forks); for a ``ForkedJob`` that meets its peers,
    a thread of this rank then waits for the fork to end and, if it left no successful outcome (killed in its
    first instants included), says so to the peers' forks (``rank_comm.announce_death``), which then fail at
    once instead of waiting to meet it. It watches a pidfd, not the exit status: the queue reaps the fork."""
    job = request.async_fn
    if not isinstance(job, ForkedJob) or job.group is None:
        queue.schedule_async_request(request)
        return
    before = _children_of_this_thread()
    queue.schedule_async_request(request)
    for pid in _children_of_this_thread() - before:
        with contextlib.suppress(OSError):  # no pidfds here: the peers wait out their meeting time instead
            pidfd = os.pidfd_open(pid)  # before this returns: the fork is not reaped yet, even if it died
            threading.Thread(target=_announce_if_it_fails, args=(pidfd, job), name="save-fork-watch", daemon=True).start()


def _children_of_this_thread() -> set[int]:
    """The child processes the calling thread started (a fork it makes is among them): Linux lists them per
    thread, a small read, where psutil reads every process's ``stat`` on the host (milliseconds on a busy one,
    on the training path). Without that list (a kernel built without it): every child of this process."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/children") as handle:
            return {int(pid) for pid in handle.read().split()}
    except OSError:
        return {child.pid for child in psutil.Process().children()}


def _announce_if_it_fails(pidfd: int, job: ForkedJob) -> None:
    process_lifetime.wait_for_exit(pidfd)
    os.close(pidfd)
    outcome = read_outcome(job.staging, job.rank)
    if not outcome["ok"]:
        cause = (outcome["error"].strip().splitlines() or ["no error text"])[-1]
        rank_comm.announce_death(job.group, job.rank, f"its process forked for the save failed: {cause}")


def read_outcome(staging: str, rank: int) -> dict[str, Any]:
    """What this rank's fork recorded; a fork that died first (killed, segfault) recorded nothing.

    The file is JSON (data only, never unpickled): one that is not, or not an outcome, fails the save, named."""
    path = outcome_path(staging, rank)
    try:
        with open(path, encoding="utf-8") as handle:
            outcome = json.load(handle, object_hook=_write_result_from_json)
    except FileNotFoundError:
        return {"ok": False, "error": f"the background writer of rank {rank} exited without a result (killed?)"}
    except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {"ok": False, "error": f"the outcome file {path} is not a background save's JSON outcome ({type(exc).__name__}); nothing of it was run"}
    valid = isinstance(outcome, dict) and (
        isinstance(outcome.get("writes"), dict) if outcome.get("ok") is True else isinstance(outcome.get("error"), str)
    )
    return outcome if valid else {"ok": False, "error": f"the outcome file {path} is not a background save's outcome"}

"""No process of a save outlives its rank, and the errors around it, through ``python -m verl.trainer.main_ppo`` (real Ray, ranks, megatron):

- SIGKILL of the whole run while an async save runs (the driver and every process of the run except those the
  save started: as a preemption that kills the process group, or every process it finds while the save forks)
  leaves no process of the run alive 10 s later: the async save's fork, megatron's writers below it, the Manager
  server the writers report through. A sync save writes in the rank's threads and starts none
  (tests/test_dist_writer.py; only its fallback to megatron's writer, taken where a torch internal changed, forks),
  so in a sync save the run's processes are the ones killed here;
- SIGKILL of the whole run in the same way while both ranks' vLLM engines (in the ranks' processes, with their
  threads) are mid-generation leaves no process of the run either, what the ranks and their engines started
  included;
- a save's process that dies (a writer SIGKILLed, the async fork SIGKILLed in its first instant) fails the run
  within seconds, and the headline blames the rank that lost it, not rank 0's echo.

The async cases run the default writer, ``background_write``. The ``snapshot`` writer is the same class with
``to_host`` off (verl/utils/checkpoint/save_writers.py): the same fork, writers and Manager; its processes are
proven at the rank level (tests/test_checkpoint_lifecycle.py: a killed writer of each mode fails the save fast and
leaves no process; the crash matrix of every writer's phases) and by ``test_async_saves_forked_from_a_thread_complete``
below.

The points of a save are set through the run's environment (tests/save_points). Every process of a run carries
the run's marker (tests/process_marker.py); that is how the survivors are found.
"""

import os
import re
import time
from pathlib import Path

import psutil
import pytest

from tests.cli_runs import TRACKER, kill_session, start_trainer, two_ranks_ep2
from tests.process_marker import MARKER
from tests.save_points.points import ACTION, DIR, POINT, RANKS

POINTS_DIR = str(Path(__file__).resolve().parent / "save_points")
ASYNC = "actor_rollout_ref.actor.checkpoint.async_save=True"
MODE = "actor_rollout_ref.actor.checkpoint.async_mode"


def _start_at(env: dict, tmp_path: Path, model: str, point: str, ranks: str, action: str, async_mode: str | None, extra: tuple = ()):
    """A one-step run whose save takes ``async_mode``'s writer (None: the sync one), held at ``point``; ``extra``:
    more overrides."""
    reached = tmp_path / "reached"
    reached.mkdir()
    run_env = {**env, "PYTHONPATH": os.pathsep.join([POINTS_DIR, env["PYTHONPATH"]]), POINT: point, RANKS: ranks, ACTION: action, DIR: str(reached)}
    writer = [ASYNC, f"{MODE}={async_mode}"] if async_mode else []
    overrides = [*two_ranks_ep2(model, tmp_path / "ckpt"), "trainer.total_training_steps=1", *writer, *extra]
    log = tmp_path / "run.log"
    return start_trainer(overrides, tmp_path, run_env, log), reached, log


def _wait_until_reached(proc, reached: Path, ranks: str, log: Path, timeout_s: float = 480) -> None:
    wanted = set(ranks.split(","))
    deadline = time.monotonic() + timeout_s
    while {name.split(".")[1] for name in os.listdir(reached)} < wanted:
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before the point:\n{log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"the point was not reached within {timeout_s}s:\n{log.read_text()[-5000:]}"
        time.sleep(0.2)


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    described = []
    for proc in procs:
        try:
            described.append(f"{proc.pid} (parent {proc.ppid()}) {' '.join(proc.cmdline())[:100]}")
        except psutil.Error:
            described.append(f"{proc.pid} (gone)")
    return described


def _started_by_a_save(procs: list[psutil.Process]) -> set[int]:
    """Of the run's processes, those a rank started: below a Ray worker process (``ray::...``) whose parent is not one."""

    def is_worker(pid: int) -> bool:
        try:
            return " ".join(psutil.Process(pid).cmdline()).startswith("ray::")
        except psutil.Error:
            return False

    ranks = {p.pid for p in procs if is_worker(p.pid) and not is_worker(p.ppid())}
    return {child.pid for pid in ranks for child in psutil.Process(pid).children(recursive=True)}


# The async writer's fork in its first instant and its writers done writing. A sync save writes in the rank's
# threads and starts no process (tests/test_dist_writer.py): its run's processes are the ones killed here too.
@pytest.mark.parametrize(
    "async_mode, point, ranks",
    [("background_write", "fork_start", "1"), ("background_write", "writer", "0,1")],
    ids=["background_write-fork_first_instant", "background_write-writers_done_writing"],
)  # fmt: skip
def test_sigkill_of_the_whole_run_mid_save_leaves_no_process(tmp_path, env, tiny_moe_path, async_mode, point, ranks):
    """The driver, Ray and the ranks SIGKILLed mid-save: the save's fork and megatron's writers below it die by
    themselves."""
    proc, reached, log = _start_at(env, tmp_path, tiny_moe_path, point, ranks, "pause", async_mode)
    saves, survivors = _kill_the_run_but_what_ranks_started(proc, reached, ranks, log)
    assert saves, "no process of a save to outlive its rank"
    assert not survivors, f"{len(survivors)} of the {len(saves)} processes of the save outlived the run by 10 s: {_describe(survivors)}"


def _kill_the_run_but_what_ranks_started(proc, reached: Path, ranks: str, log: Path) -> tuple[set[int], list[psutil.Process]]:
    """Once ``ranks`` are held at the run's point, SIGKILL every process of the run but those the ranks started,
    all at once; (the pids the ranks started, the run's processes left 10 s later)."""
    try:
        _wait_until_reached(proc, reached, ranks, log)
        time.sleep(1.0)  # the other ranks' processes get where this point holds them
        run = _marked(proc.marker)
        started = _started_by_a_save(run)
        for victim in [p for p in run if p.pid not in started]:  # the driver, Ray, the ranks: all at once
            try:
                victim.kill()
            except psutil.Error:
                pass
        deadline = time.monotonic() + 10
        while _marked(proc.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        return started, _marked(proc.marker)
    finally:
        kill_session(proc)


def test_sigkill_of_the_whole_run_mid_vllm_generation_leaves_no_process(tmp_path, env, tiny_moe_path):
    """Both ranks held inside their vLLM engine's generation (``generate``: the engine in the rank's process, its
    threads running), the run SIGKILLed as above: no process of the run is left, what a rank or its engine
    started (children of the ranks, left alive by the kill) included."""
    pytest.importorskip("vllm", reason="the vLLM rollout (the main leg has vLLM)")
    extra = ("actor_rollout_ref.rollout.name=vllm",)
    proc, reached, log = _start_at(env, tmp_path, tiny_moe_path, "generate", "0,1", "pause", None, extra)
    started, survivors = _kill_the_run_but_what_ranks_started(proc, reached, "0,1", log)
    assert not survivors, f"{len(survivors)} processes ({len(started)} started by the ranks) outlived the run by 10 s: {_describe(survivors)}"


@pytest.mark.parametrize(
    "async_mode, point",
    [("background_write", "writer"), ("background_write", "fork_start")],
    ids=["background_write-a_writer", "background_write-the_fork_in_its_first_instant"],
)
def test_a_killed_save_process_fails_the_run_within_seconds_blaming_its_rank(tmp_path, env, tiny_moe_path, async_mode, point):
    """Rank 1's process of an async save SIGKILLed (was: "rank 0 failed first", rank 0's echo; a fork killed as
    it started failed the run only after the forks' 2-minute wait to meet, 123 s)."""
    proc, reached, log = _start_at(env, tmp_path, tiny_moe_path, point, "1", "kill", async_mode)
    try:
        _wait_until_reached(proc, reached, "1", log)
        killed = time.monotonic()
        proc.wait(timeout=300)
        seconds = time.monotonic() - killed
    finally:
        kill_session(proc)
    out = log.read_text()
    assert proc.returncode == 1, out[-5000:]
    assert re.search(r"rank\(s\) failed; rank 1 failed first", out), out[-5000:]
    assert seconds < 30, f"the run failed {seconds:.0f}s after the kill"
    assert not (tmp_path / "ckpt" / TRACKER).exists()
    print(f"{point}: the run failed {seconds:.1f}s after the kill")


# ------------------------------------------------------------------ on the ranks of run_on_ranks (no Ray)


def _async_saves_from_a_thread(src: str, root: str, async_mode: str) -> list[str]:
    """Each save called from a thread that ends before the save is finalized (a threaded actor's call): its fork
    must neither die with that thread nor hang; with either async writer the third save runs whole in the forks."""
    import threading

    from tests.test_checkpoint_lifecycle import _actor, _batches, _step_path

    actor = _actor(src, async_save=True, async_mode=async_mode)
    modes = []
    for step in (1, 2, 3):
        actor.train_step(_batches(step))
        caller = threading.Thread(target=actor.save_checkpoint, args=(_step_path(root, step),), kwargs={"global_step": step})
        caller.start()
        caller.join()
        report = actor.checkpoint_manager.last_save
        modes.append((report.mode.value, report.planned_in_background))
        assert actor.finalize_checkpoint() == _step_path(root, step)
    return modes


@pytest.mark.parametrize("async_mode", ["background_write", "snapshot"])
def test_async_saves_forked_from_a_thread_complete(tiny_moe_path, tmp_path, async_mode):
    from tests.test_checkpoint_lifecycle import LAYOUT, WORLD, _step_path
    from verl.utils.checkpoint.integrity import verify_checkpoint
    from verl.utils.distributed import run_on_ranks

    root = str(tmp_path / "run")
    modes = run_on_ranks(_async_saves_from_a_thread, WORLD, LAYOUT, args=(tiny_moe_path, root, async_mode), timeout_s=300)[0]
    assert modes == [(async_mode, False), (async_mode, False), (async_mode, True)], modes
    for step in (1, 2, 3):
        verify_checkpoint(_step_path(root, step))


def test_a_process_exit_is_seen_through_a_descriptor_numbered_above_1024():
    """A rank with gloo's and Ray's sockets holds over 1024 descriptors: the pidfd that tells a rank its save's
    fork died (and a child its parent) is then numbered above what ``select`` accepts (ValueError)."""
    import resource
    import subprocess
    import sys

    from verl.utils.process_lifetime import wait_for_exit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        pidfd = os.pidfd_open(child.pid)
        held.append(pidfd)
        assert pidfd > 1024
        wait_for_exit(pidfd)
        assert child.wait(timeout=5) == 0
    finally:
        child.kill()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------ the blame of a dead writer, word for word


def test_a_dead_writer_of_a_save_fork_names_the_fork_and_the_rank_it_was_forked_from(tmp_path):
    """Was: "... of rank pid <the fork's pid>": the fork's pid called the rank's, sending an operator to the wrong
    process. Run as a save's fork runs it (``fail_when_a_writer_dies``), its writer SIGKILLed."""
    import signal

    from verl.utils.checkpoint.snapshot_save import fail_when_a_writer_dies

    report = tmp_path / "reason"
    fork = os.fork()
    if fork == 0:  # the save's fork: it must end here whatever happens
        try:
            fail_when_a_writer_dies(report.write_text, 3, interval_s=0.05)
            if os.fork() == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # the writer
            time.sleep(30)
        finally:
            os._exit(2)
    _, status = os.waitpid(fork, 0)
    assert os.waitstatus_to_exitcode(status) == 1  # ended by the watch, not by the sleep's end
    expected = (
        rf"a dist-checkpoint writer process \(pid \d+\) of rank 3's save process \(pid {fork}, forked from the rank's "
        rf"process, pid {os.getpid()}\) died \(signal 9\)"
    )
    assert re.fullmatch(expected, report.read_text()), report.read_text()


def test_a_child_the_fork_ends_once_its_job_returned_is_no_dead_writer(tmp_path):
    """Was: a fork whose writers found no results queue of the rank's started a Manager of its own; at the fork's
    exit multiprocessing stopped it, after 1 s, with SIGTERM, and the writer watch, still running, took that for a
    dead writer: a save fully written failed (4 ranks, about one save in twenty). Run as a save's fork runs its
    job (``ForkedJob``), then ends a child the job started as that exit does: SIGTERM, reaped a moment later."""
    import signal
    import subprocess

    from verl.utils.checkpoint.snapshot_save import ForkedJob, read_outcome

    staging = str(tmp_path)
    fork = os.fork()
    if fork == 0:  # the save's fork: it must end here whatever happens
        code = 2
        try:
            started = []
            ForkedJob(staging, 0, lambda: started.append(subprocess.Popen(["sleep", "30"])) or {"writes": {}})()
            started[0].send_signal(signal.SIGTERM)
            time.sleep(1.0)  # not reaped yet: a watch still running sees a child killed by a signal
            started[0].wait()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(fork, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # not ended by the watch
    assert read_outcome(staging, 0) == {"ok": True, "writes": {}}


def test_a_dead_writer_of_a_sync_save_names_the_rank_and_its_pid():
    """A sync save's writers are the rank's own children: the line a rank ends with names it and its pid. The
    process's RANK (5) and megatron's rank argument (2) differ here, so the test tells which part names which."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from verl.utils.checkpoint.snapshot_save import watch_writers_in_the_rank\n"
        "def write(transform_list, use_msc, rank, write_buckets, global_results_queue):\n"
        "    if os.fork() == 0:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    time.sleep(30)\n"
        "watch_writers_in_the_rank(write)(None, False, 2, [], None)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": "5"}, stderr=subprocess.PIPE, text=True)
    _, err = rank.communicate(timeout=60)
    assert rank.returncode == 1, err
    expected = (
        rf"\[checkpoint\] rank 5: the save failed: a dist-checkpoint writer process \(pid \d+\) of rank 2 "
        rf"\(pid {rank.pid}\) died \(signal 9\); ending this rank"
    )
    assert re.search(expected, err), err


# ------------------------------------------------------------------ the results queue's drain


def _drain_with_the_manager_server_gone() -> dict:
    import multiprocessing
    import warnings

    from verl.utils.internals import megatron_core

    server = multiprocessing.Manager()
    megatron_core.tie_write_results_queue(lambda: server)
    megatron_core.WRITE_RESULTS_QUEUE.get()().put("a write result left by a failed save")
    server.shutdown()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            raise RuntimeError("the save's own failure")
        except RuntimeError:
            try:
                megatron_core.drain_write_results()
            except BaseException as exc:
                return {"raised": type(exc).__name__, "warnings": []}
    return {"raised": None, "warnings": [str(warning.message) for warning in seen]}


def test_a_drain_whose_manager_server_is_gone_warns_and_leaves_the_original_failure():
    """Was: the drain caught only ``queue.Empty``; with the Manager server gone it raised EOFError or
    ConnectionRefusedError inside the failed finalize's handler, replacing the save's own failure."""
    from verl.utils.distributed import run_on_ranks

    (result,) = run_on_ranks(_drain_with_the_manager_server_gone, 1)
    assert result["raised"] is None, result
    assert len(result["warnings"]) == 1 and "results queue" in result["warnings"][0], result

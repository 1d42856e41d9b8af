"""One writer per checkpoint directory, clean stops on SIGTERM / SIGINT, and the errors a user meets around them:
a second run is refused while the first's steps stay loadable; a SIGKILLed holder leaves no lock;
a mistyped key or a binary tracker is one line; a killed rank is blamed, not rank 0's echo of it; a resume of
another model is refused before Ray starts."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir

from tests.cli_runs import MEGATRON, TRACKER, kill_session, read_metrics, run_trainer, start_trainer, two_ranks_ep2
from tests.main_leg import MBRIDGE, with_rollout
from tests.test_ray_worker_group import REPO as WORKER_PYTHONPATH
from tests.test_ray_worker_group import ProbeWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool, WorkerGroupError
from verl.trainer.resume_step import check_resume_step
from verl.trainer.run_config import ConfigError, build_run_config
from verl.trainer.run_control import resume_command
from verl.trainer.validation import check_config
from verl.utils.checkpoint.dir_lock import (
    LOCK_FILENAME,
    CheckpointDirBusyError,
    UnsafeLockFileError,
    lock_checkpoint_dir,
    read_lock_holder,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(REPO / "verl" / "trainer" / "config")


def _config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from verl.utils.checkpoint.dir_lock import lock_checkpoint_dir as lock\n"
         f"held = lock({str(directory)!r}); print('locked', flush=True); time.sleep(600)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointDirBusyError) as busy:
            lock_checkpoint_dir(str(directory))
        assert f"pid {holder.pid} on host {os.uname().nodename}" in str(busy.value)
        assert str(directory / LOCK_FILENAME) in str(busy.value)
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    lock = lock_checkpoint_dir(str(directory))  # the OS dropped the dead holder's lock: no waiting, no cleanup
    try:
        assert lock.held and time.monotonic() - start < 1
        assert read_lock_holder(str(directory))["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_run_that_discards_its_new_directory_never_lets_two_later_runs_both_hold_it(tmp_path):
    """Run A created the directory and stops before writing (a bad config): it removes the lock file and the
    directory. Run B opened that file just before and locks it just after: B must notice it locked a file no
    longer there and lock the path's new one, so run C is refused. B is paused between its open and its flock
    by a line tracer (the real interleaving of two starts, made deterministic)."""
    import inspect

    from verl.utils.checkpoint import dir_lock

    directory = tmp_path / "new_run"
    first = lock_checkpoint_dir(str(directory))
    source, start = inspect.getsourcelines(lock_checkpoint_dir)
    flock_line = start + next(i for i, line in enumerate(source) if "fcntl.flock(" in line)
    interleaved = []

    def tracer(frame, event, arg):
        if frame.f_code is not dir_lock.lock_checkpoint_dir.__code__:
            return None
        if event == "line" and frame.f_lineno == flock_line and not interleaved:
            first.discard()  # A stops between B's open and B's flock
            interleaved.append(not os.path.exists(directory / LOCK_FILENAME))
        return tracer

    sys.settrace(tracer)
    try:
        second = lock_checkpoint_dir(str(directory))
    finally:
        sys.settrace(None)
    assert interleaved == [True] and second.held
    with pytest.raises(CheckpointDirBusyError):
        lock_checkpoint_dir(str(directory))
    second.release()


def test_a_filesystem_without_locks_is_reported_not_fatal(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):  # what flock gives on NFS without lockd
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = lock_checkpoint_dir(str(tmp_path / "ckpt"))
    assert not lock.held
    assert "does not support file locks" in lock.warning and "No locks available" in lock.warning
    lock.discard()  # a run stopping before it writes leaves no directory behind, lock or no lock
    assert not (tmp_path / "ckpt").exists()


def test_a_symlink_where_the_lock_should_be_is_refused_and_its_target_untouched(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (directory / LOCK_FILENAME).symlink_to(victim)
    with pytest.raises(UnsafeLockFileError) as refused:
        lock_checkpoint_dir(str(directory))
    assert str(directory / LOCK_FILENAME) in str(refused.value) and "symlink" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert victim.read_text() == "precious\n"
    assert read_lock_holder(str(directory)) == {}


def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    os.mkfifo(directory / LOCK_FILENAME)
    with pytest.raises(UnsafeLockFileError, match="not a regular file"):
        lock_checkpoint_dir(str(directory))


def test_mistyped_keys_are_one_line_each_not_a_traceback(tmp_path):
    config = _config(f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=abc", "actor_rollout_ref.rollout.temperature=hot")
    assert check_config(config, None) == [
        "trainer.save_freq=abc must be an integer; set trainer.save_freq=<n>",
        "actor_rollout_ref.rollout.temperature must be a number, got 'hot'",
    ]


@pytest.mark.parametrize("content", [b"\xff\xfe3\n", "\u00b2\n".encode(), b"7" * 5000, b"-3"], ids=["binary", "superscript", "5000-digits", "negative"])
def test_a_corrupt_tracker_is_named(tmp_path, content):
    (tmp_path / TRACKER).write_bytes(content)
    with pytest.raises(ConfigError) as err:
        check_resume_step(build_run_config(_config(f"trainer.default_local_dir={tmp_path}")))
    assert f"checkpoint tracker {tmp_path / TRACKER} is corrupt" in str(err.value)


def test_the_resume_command_keeps_the_overrides_and_resumes():
    argv = ["trainer.n_gpus_per_node=2", "trainer.resume_mode=disable", "trainer.default_local_dir=/a b"]
    assert resume_command(argv) == (
        "python -m verl.trainer.main_ppo trainer.n_gpus_per_node=2 'trainer.default_local_dir=/a b' trainer.resume_mode=auto"
    )


def test_a_killed_rank_is_blamed_not_the_echo_on_rank_0():
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
    try:
        group = MegatronRayWorkerGroup(RayResourcePool([2], use_gpu=False, name_prefix="die"), RayClassWithInitArgs(DyingWorker), init_timeout_s=180)
        with pytest.raises(WorkerGroupError) as err:
            group.die_on([1, 1])
    finally:
        ray.shutdown()
    message = str(err.value)
    assert "rank 1 failed first (its process died" in message, message
    # rank 0's gloo error is reported too, after the cause
    assert message.index("--- rank 1 ---") < message.index("--- rank 0 ---")
    assert "Connection closed by peer" in message.split("--- rank 0 ---")[1]


class DyingWorker(ProbeWorker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def die_on(self, bad_rank: int) -> int:
        import torch

        if self.rank == bad_rank:
            time.sleep(1.0)  # the others are inside the barrier by now
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()
        return self.rank


def _wait_for(pattern: str, log: Path, proc: subprocess.Popen, timeout_s: float = 480) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        assert proc.poll() is None, f"exited early ({proc.returncode}):\n{log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in time:\n{log.read_text()[-5000:]}"
        time.sleep(0.2)


def _stop_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("[main_ppo] stopped by ")]
    assert len(lines) == 1, out[-5000:]
    return lines[0]


def _stop(proc: subprocess.Popen, log: Path, send, expected_code: int) -> tuple[str, str]:
    """``send()`` the stop signal; the run must exit with ``expected_code`` within 30 s and print one stop line."""
    try:
        send()
        start = time.monotonic()
        proc.wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        kill_session(proc)
    out = log.read_text()
    assert proc.returncode == expected_code, out[-5000:]
    assert seconds < 30, f"took {seconds:.0f}s to stop"
    return out, _stop_line(out)


def test_one_writer_and_clean_stops_through_the_cli(tmp_path, env, tiny_moe_path):
    """A run that trained a step holds the directory: a second run is refused at once; SIGTERM stops the first
    with one line naming the committed step and the resume command; resuming another model is refused before
    Ray; that resume command continues from the committed step; Ctrl-C (SIGINT to the process group) stops it."""
    ckpt = tmp_path / "ckpt"
    common = [*two_ranks_ep2(tiny_moe_path, ckpt), f"{MEGATRON}use_distributed_optimizer=False"]
    first_log = tmp_path / "first.log"
    first = start_trainer([*common, "trainer.total_training_steps=50"], tmp_path, env, first_log)
    try:
        _wait_for(r"\[trainer\] step 1/50", first_log, first)

        code, out = run_trainer([*common, "trainer.total_training_steps=50"], tmp_path, env, timeout_s=120)
        assert code == 2, out[-3000:]
        assert f"is being written by another run (pid {first.pid} on host {os.uname().nodename}" in out
        assert "Ray instance" not in out and "ranks up" not in out
    except BaseException:
        kill_session(first)
        raise
    # The driver only, as `kill <pid>` or a scheduler does.
    out, last = _stop(first, first_log, lambda: os.kill(first.pid, signal.SIGTERM), 143)
    committed = int((ckpt / TRACKER).read_text())
    assert last.startswith("[main_ppo] stopped by SIGTERM at step ") and f"step {committed} is committed" in last, last
    assert "Traceback" not in out and "SIGABRT" not in out and "*** " not in out, out[-5000:]
    resume = last.split("; resume with: ")[1]
    # the bridge and the rollout it ran with, too
    assert resume == resume_command([MBRIDGE, *with_rollout([*common, "trainer.total_training_steps=50"])])

    code, out = run_trainer([*common, "trainer.save_freq=abc"], tmp_path, env, timeout_s=120)
    assert code == 2 and "trainer.save_freq=abc must be an integer; set trainer.save_freq=<n>" in out and "Traceback" not in out, out[-3000:]

    from verl.models.tiny import make_tiny_hf_model

    other = make_tiny_hf_model(str(tmp_path / "four_experts"), kind="moe", num_experts=4)
    start = time.monotonic()
    code, out = run_trainer([*common, f"actor_rollout_ref.model.path={other}", "trainer.total_training_steps=50"], tmp_path, env, timeout_s=120)
    assert code == 2 and "is of a different model" in out and "num_moe_experts: checkpoint 8, this model 4" in out, out[-3000:]
    assert "Ray instance" not in out and "ranks up" not in out and time.monotonic() - start < 90

    # The printed command, as a user would paste it, resumes from the committed step; then Ctrl-C.
    second_log = tmp_path / "second.log"
    second = start_trainer(shlex.split(resume)[3:], tmp_path, env, second_log, bridge=None)  # the command names it
    try:
        _wait_for(rf"resumed from {ckpt}/global_step_{committed} \(step {committed}\)", second_log, second)
        _wait_for(rf"\[trainer\] step {committed + 1}/50", second_log, second)
    except BaseException:
        kill_session(second)
        raise
    # What a terminal sends to the foreground process group.
    out, last = _stop(second, second_log, lambda: os.killpg(second.pid, signal.SIGINT), 130)
    assert last.startswith("[main_ppo] stopped by SIGINT at step ") and "resume with: python -m verl.trainer.main_ppo" in last, last
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-5000:]
    assert [m["step"] for m in read_metrics(ckpt)][-1] > committed


def test_a_local_ray_instance_gets_a_temp_dir_private_to_the_user(tmp_path, monkeypatch):
    """Ray's default /tmp/ray is 0777 without the sticky bit: any user could replace a run's sockets and logs."""
    import stat

    from verl.trainer.main_ppo import private_ray_temp_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = os.path.dirname(private_ray_temp_dir())  # Ray makes its own temp dir 0777: its parent is private
    assert path == str(tmp_path / f"ray-{os.getuid()}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    os.rmdir(path)
    os.symlink(tmp_path / "elsewhere", path)  # planted by another user of the host
    with pytest.raises(RuntimeError, match="is not a directory of this user's"):
        private_ray_temp_dir()

"""A save that the operating system refuses says so: ENOSPC (any errno) by name, with the path, from a forked
writer too, even when the full disk leaves no room for the fork's outcome file (a real tmpfs, filled); and a run
whose save fills the disk leaves nothing of that step on it (through the CLI); a ``.metadata`` that rank 0 alone
writes and cannot fails every rank, naming it."""

import contextlib
import errno
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.cli_runs import run_trainer, two_ranks_ep2
from tests.save_points.points import ACTION, DIR, POINT, RANKS
from tests.test_checkpoint_lifecycle import LAYOUT, WORLD, _actor, _batches, _step_path, _tracked
from tests.test_save_process_lifetime import POINTS_DIR
from verl.utils.checkpoint import snapshot_save
from verl.utils.checkpoint.integrity import CheckpointError
from verl.utils.checkpoint.os_errors import find_os_error, writing
from verl.utils.distributed import run_on_ranks


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the block: a disk that really fills. Needs root (the test
    machines run as root); anything else fails the test loudly, since without it nothing here is tested."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.fail(f"mounting a tmpfs at {path} needs root (uid {os.geteuid()}); run this test as root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {path}: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True)


def fill(directory: str) -> None:
    """Write ``directory``'s filesystem full (the last write fails with ENOSPC)."""
    with contextlib.suppress(OSError), open(os.path.join(directory, "filler"), "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 4096)


def _in_a_fork(staging: str, job) -> int:
    """``ForkedJob`` as a save runs it: in a process forked from this one."""
    process = multiprocessing.get_context("fork").Process(target=snapshot_save.ForkedJob(staging, 0, job))
    process.start()
    process.join(60)
    return process.exitcode


def test_a_fork_that_fills_the_disk_reports_enospc_and_the_path(tmp_path):
    with small_tmpfs(str(tmp_path / "disk"), "256k") as disk:
        staging = os.path.join(disk, "actor.incomplete")
        os.makedirs(staging)
        snapshot_save.reserve_outcome(staging, 0)
        shard = os.path.join(staging, "shard.distcp")

        def job() -> dict:
            fill(disk)
            with writing(shard), open(shard, "wb") as handle:  # a stream's ENOSPC names no file: writing() does
                handle.write(b"x" * 65536)
            return {"writes": {}}

        assert _in_a_fork(staging, job) == 0
        outcome = snapshot_save.read_outcome(staging, 0)
        assert not outcome["ok"]
        assert outcome["error"].strip().splitlines()[-1] == f"No space left on device (ENOSPC) writing {shard}", outcome["error"][-500:]
        assert outcome["os_error"] == {"errno": errno.ENOSPC, "name": "ENOSPC", "strerror": os.strerror(errno.ENOSPC), "filename": shard, "note": None}
        assert not os.path.exists(os.path.join(staging, snapshot_save.OUTCOME_DIRNAME, "rank0.reserve"))


def test_an_outcome_the_full_disk_cannot_hold_is_reported_as_enospc(tmp_path):
    """The fork's work succeeded but its outcome file does not fit: the reserve says why, naming that file."""
    with small_tmpfs(str(tmp_path / "disk"), "128k") as disk:
        staging = os.path.join(disk, "actor.incomplete")
        os.makedirs(staging)
        snapshot_save.reserve_outcome(staging, 0)

        def job() -> dict:
            fill(disk)
            return {"writes": {"optimizer": ["x" * 100] * 5000}}  # ~0.5 MB of JSON

        assert _in_a_fork(staging, job) == 0
        outcome = snapshot_save.read_outcome(staging, 0)
        assert not outcome["ok"] and outcome["os_error"]["name"] == "ENOSPC", outcome
        assert outcome["error"].endswith(f"No space left on device (ENOSPC) writing {snapshot_save.outcome_path(staging, 0)}"), outcome["error"][-500:]


def test_a_successful_outcome_frees_its_reserve(tmp_path):
    staging = str(tmp_path / "actor.incomplete")
    os.makedirs(staging)
    snapshot_save.reserve_outcome(staging, 0)
    assert _in_a_fork(staging, lambda: {"writes": {}}) == 0
    assert snapshot_save.read_outcome(staging, 0) == {"ok": True, "writes": {}}
    assert os.listdir(os.path.join(staging, snapshot_save.OUTCOME_DIRNAME)) == ["rank0.json"]


def test_an_errno_is_found_wherever_it_is_wrapped():
    """Wrapped by a RuntimeError, inside torch DCP's CheckpointException, or only as text (safetensors)."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as wrapped:
        assert find_os_error(wrapped).describe("/ckpt/x") == "No space left on device (ENOSPC) writing /ckpt/x"
    dcp = CheckpointException("write", {1: _wrap_exception(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/ckpt/y"))})
    assert find_os_error(dcp).describe("/elsewhere") == f"{os.strerror(errno.EDQUOT)} (EDQUOT) writing /ckpt/y"
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert find_os_error(rust).name == "ENOSPC"
    assert find_os_error(ValueError("no errno here")) is None


def test_another_ranks_os_error_as_text_keeps_its_file_name():
    peer = RuntimeError("rank 0 could not write it (OSError: [Errno 28] No space left on device: '/ckpt/a b/.metadata')")
    assert find_os_error(peer).describe("/elsewhere") == "No space left on device (ENOSPC) writing /ckpt/a b/.metadata"
    assert find_os_error(RuntimeError("failed (os error 28)")).describe("/staging") == "No space left on device (ENOSPC) writing /staging"
    quoted = RuntimeError(f"rank 1 could not write it (OSError: {OSError(errno.ENOSPC, 'No space left on device', 'it' + chr(39) + 's' + chr(92))})")
    assert find_os_error(quoted).filename == "it's" + chr(92)
    later_line = RuntimeError("[Errno 28] No space left on device\nwhile writing key: 'decoder.w'")
    assert find_os_error(later_line).describe("/staging") == "No space left on device (ENOSPC) writing /staging"


def test_a_write_that_fails_without_an_errno_on_a_full_disk_is_named_enospc(tmp_path):
    """torch's zip writer reports a stream's ENOSPC as ``unexpected pos``: the full filesystem tells."""
    from verl.utils.checkpoint.integrity import CheckpointError
    from verl.utils.checkpoint.os_errors import explain

    unexpected = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert explain(unexpected, str(tmp_path)) is None  # room left: not a disk error
    with small_tmpfs(str(tmp_path / "disk"), "64k") as disk:
        fill(disk)
        found = explain(unexpected, os.path.join(disk, "step", "actor.incomplete"))  # a path not created yet
        assert found.describe(os.path.join(disk, "x")).startswith(f"No space left on device (ENOSPC) writing {disk}/x (the write failed with ")
        assert explain(CheckpointError("refusing to save step 3: NaN"), disk) is None


def test_the_free_space_is_known_when_the_staging_directory_went_meanwhile(tmp_path, monkeypatch):
    """Another rank's cleanup may remove the step's directory between a look and the statvfs: the free space is
    its parent's filesystem's, not unknown."""
    from verl.utils.checkpoint.os_errors import free_bytes

    gone = tmp_path / "global_step_2" / "actor.incomplete"
    monkeypatch.setattr(os.path, "exists", lambda path: True)  # it was there when looked at
    assert free_bytes(str(gone)) is not None


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_run_whose_save_fills_the_disk_leaves_no_staging_behind(tmp_path, env, tiny_moe_path, async_save):
    """Through the CLI, a tmpfs with room for step 1 and half of step 2: the run fails in one line naming ENOSPC
    and the space the save needed; step 1 stays tracked and verifies, and nothing of step 2 keeps the disk full,
    although rank 0 is held at its own cleanup (``discard``) until the worker group kills it, as a rank still
    winding down its writers is: the driver removes what the killed rank could not."""
    reached = tmp_path / "reached"
    reached.mkdir()
    held = {"PYTHONPATH": os.pathsep.join([POINTS_DIR, env["PYTHONPATH"]]), POINT: "discard", RANKS: "0", ACTION: "pause", DIR: str(reached)}
    with small_tmpfs(str(tmp_path / "disk"), "6m") as disk:  # a step of this run takes about 4 MB
        ckpt = os.path.join(disk, "ckpt")
        overrides = [*two_ranks_ep2(tiny_moe_path, ckpt), "trainer.total_training_steps=2", f"actor_rollout_ref.actor.checkpoint.async_save={async_save}"]
        code, out = run_trainer(overrides, tmp_path, {**env, **held}, timeout_s=300)
        assert code == 1, out[-6000:]
        assert [f.split(".")[:2] for f in os.listdir(reached)] == [["discard", "0"]], out[-6000:]  # rank 0 was held
        line = next(line for line in out.splitlines() if "The save needed about" in line)
        assert "No space left on device (ENOSPC) writing " + os.path.join(ckpt, "global_step_2", "actor.incomplete") in line, line
        assert not os.path.exists(os.path.join(ckpt, "global_step_2", "actor.incomplete"))
        assert not os.path.exists(os.path.join(ckpt, "global_step_2")), os.listdir(os.path.join(ckpt, "global_step_2"))
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
            assert handle.read() == "1"
        verified = subprocess.run(
            [sys.executable, "-m", "verl.model_merger", "verify", "--local_dir", os.path.join(ckpt, "global_step_1", "actor")], capture_output=True, text=True, env=env
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr


def _full_disk(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _fail_on_rank_0(file: str) -> None:
    """From now on this rank's writes of ``file`` (one of the three a dist checkpoint's rank 0 writes alone)
    fail for a full disk."""
    from megatron.core.dist_checkpointing import core, serialization
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from torch.distributed.checkpoint import FileSystemWriter

    if file == ".metadata":

        def finish(writer, metadata, results) -> None:
            raise _full_disk(os.path.join(str(writer.path), file))

        FileSystemWriter.finish = finish
    elif file == "common.pt":

        def save_common(strategy, common_state_dict, checkpoint_dir) -> None:
            raise _full_disk(os.path.join(str(checkpoint_dir), file))

        TorchCommonSaveStrategy.save_common = save_common
    else:

        def save_config(config, checkpoint_dir) -> None:
            raise _full_disk(os.path.join(str(checkpoint_dir), file))

        core.save_config = serialization.save_config = save_config


def _a_save_whose_metadata_rank_0_cannot_write(src: str, root: str, mode: str, failing: int, met: str, file: str) -> str:
    """Steps 1 to ``failing`` - 1 saved; then step ``failing``, whose ``file`` write (rank 0's alone) fails for a
    full disk. Each rank's error, or "saved". Rank 0 stays in the run until rank 1 has its error: a rank 1 still
    waiting for it would never get one, and ``run_on_ranks`` fails the test at its timeout."""
    rank = torch.distributed.get_rank()
    actor = _actor(src) if mode == "sync" else _actor(src, async_save=True, async_mode=mode)
    actor.train_step(_batches(0))
    for step in range(1, failing):
        actor.save_checkpoint(_step_path(root, step), global_step=step, track=True)
        actor.finalize_checkpoint()
    if rank == 0:
        _fail_on_rank_0(file)
    try:
        actor.save_checkpoint(_step_path(root, failing), global_step=failing, track=True)
        actor.finalize_checkpoint()
        message = "saved"
    except CheckpointError as exc:
        message = str(exc)
    finally:
        if rank == 1:
            open(met, "w").close()  # whatever rank 1 raised: rank 0 then returns, and rank 1's error is reported
    deadline = time.monotonic() + 180
    while rank == 0 and not os.path.exists(met) and time.monotonic() < deadline:
        time.sleep(0.1)
    return message


@pytest.mark.parametrize(
    ("mode", "failing", "file"),
    [
        ("sync", 2, ".metadata"),
        ("background_write", 2, ".metadata"),
        ("background_write", 3, ".metadata"),
        ("sync", 2, "common.pt"),
        ("sync", 2, "metadata.json"),
        ("background_write", 2, "common.pt"),
        ("background_write", 2, "metadata.json"),
    ],
    ids=[
        "sync",
        "async-planned-in-the-rank",
        "async-plan-reused",
        "sync-common.pt",
        "sync-metadata.json",
        "async-planned-in-the-rank-common.pt",
        "async-planned-in-the-rank-metadata.json",
    ],
)  # an async save's plan is reused from a strategy's third save: its fork plans, the ranks finalize without megatron
def test_a_metadata_write_that_fails_on_rank_0_fails_every_rank_naming_it(tiny_moe_path, tmp_path, mode, failing, file):
    root = str(tmp_path / "run")
    rank_0, rank_1 = run_on_ranks(
        _a_save_whose_metadata_rank_0_cannot_write, WORLD, LAYOUT, args=(tiny_moe_path, root, mode, failing, str(tmp_path / "met"), file), timeout_s=240
    )
    cause = f"No space left on device (ENOSPC) writing {_step_path(root, failing)}.incomplete/optimizer/dist_ckpt/{file}"
    assert cause in rank_0, rank_0
    assert "failed (PeerFailure: rank 0 could not write its dist checkpoint" in rank_1 and cause in rank_1, rank_1  # the file, not the step
    assert "Nothing was committed" in rank_1, rank_1
    assert _tracked(root) == str(failing - 1) and not os.path.exists(_step_path(root, failing))

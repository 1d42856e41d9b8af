"""Crash-safe lifecycle: atomic commit, resume from the last complete step, retention, bad checkpoints."""

import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint_builders import (
    CreatesFile,
    craft_metadata,
    edit_manifest,
    entry_outside_the_step,
    rewrite_manifest,
)
from tests.main_leg import HF_ROLLOUT, MBRIDGE, TRAINING_STEPS, actor_configs, override
from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.checkpoint.finite import is_finite
from verl.utils.checkpoint.integrity import (
    MODEL_IDENTITY_FIELDS,
    CheckpointError,
    find_resume_checkpoint,
    verify_checkpoint,
)
from verl.utils.checkpoint.megatron_checkpoint_manager import AsyncMode, MegatronCheckpointManager
from verl.utils.distributed import RankFailure, run_on_ranks
from verl.utils.fs import atomic_write_text
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(ep=2, etp=1)  # 2 ranks: MoE with expert parallel, dense data parallel
WORLD = 2


def _batches(seed: int) -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def _actor(src: str, manager_cls=MegatronCheckpointManager, **checkpoint):
    """``checkpoint``: values of the actor's ``checkpoint`` node (``async_save=True``) over the YAML's."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    overrides = [override(f"checkpoint.{key}", value) for key, value in checkpoint.items()]
    return MegatronEngine(*actor_configs(src, *overrides, total_training_steps=TRAINING_STEPS), manager_cls=manager_cls)


def _step_path(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}", "actor")


def _tracked(root: str) -> str:
    with open(get_checkpoint_tracker_filename(root)) as handle:
        return handle.read().strip()


def _save_first_step(src: str, root: str) -> None:
    actor = _actor(src)
    actor.train_step(_batches(0))
    actor.save_checkpoint(_step_path(root, 1), global_step=1, track=True)


@pytest.fixture(scope="module")
def base_root(tiny_moe_path, tmp_path_factory) -> str:
    """A run directory holding one complete, tracked step (global_step_1)."""
    root = str(tmp_path_factory.mktemp("base_run"))
    run_on_ranks(_save_first_step, WORLD, LAYOUT, args=(tiny_moe_path, root))
    return root


def _copy_run(base_root: str, tmp_path) -> str:
    root = str(tmp_path / "run")
    shutil.copytree(base_root, root)
    return root


def _files(root: str) -> set:
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


# --------------------------------------------------------------------------- crash injection

PHASES = ["dist_checkpoint_optimizer", "after_dist_checkpoint", "hf_config", "hf_weights", "hf_verify", "commit", "tracker"]


def _crashing_manager(phase: str, mode: str) -> type:
    class CrashingManager(MegatronCheckpointManager):
        """SIGKILLs rank 1 (mode 'one'; rank 0 for rank-0-only phases) or every rank ('all') at ``phase``."""

        def on_save_phase(self, name):
            if name != phase:
                return
            victims = {0, 1} if mode == "all" else ({0} if phase == "hf_config" else {1})
            if self.rank in victims:
                os.kill(os.getpid(), signal.SIGKILL)

        def wait_for_hf_config(self, config_failure=None):
            if self.rank != 0:  # in 'all' mode the ranks waiting for rank 0's config die there
                self.on_save_phase("hf_config")
            super().wait_for_hf_config(config_failure)

    return CrashingManager


# Every writer (``save_writers.WRITERS``) and the toy one a test registers (tests/test_save_writers.py): the
# checkpoint keys that choose it. Both async writers' HF export runs in their fork (the ranks met through a TCP
# store; the background write's from its host copy), where a SIGKILL is the fork's death, not a rank's
# (tests/test_async_finalize.py).
WRITERS = {
    "sync": {},
    "background_write": {"async_save": True, "async_mode": "background_write"},
    "snapshot": {"async_save": True, "async_mode": "snapshot"},
    "toy": {},
}
IN_THE_FORK = {"snapshot": ("hf_config", "hf_weights"), "background_write": ("hf_config", "hf_weights")}


def test_the_crash_matrix_runs_every_registered_writer():
    """A writer added to ``save_writers.WRITERS`` joins the SIGKILL matrix below, or this fails."""
    from verl.utils.checkpoint.save_writers import WRITERS as REGISTERED

    assert set(WRITERS) - {"toy"} == {mode.value for mode in REGISTERED}


def _resume_then_crash(src: str, root: str, phase: str, mode: str, writer: str = "sync") -> None:
    if writer == "toy":
        from tests.test_save_writers import register_toy_writer

        register_toy_writer()
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, manager_cls=_crashing_manager(phase, mode), **WRITERS[writer])
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    actor.save_checkpoint(_step_path(root, 2), global_step=2, track=True)  # "tracker": killed as the transaction reaches it
    actor.finalize_checkpoint()  # an async save's transaction commits here; a no-op after a synchronous one


def _resume_and_continue(src: str, root: str, async_save: bool = False) -> tuple[str, list[str], float]:
    path, notes = find_resume_checkpoint(root)
    actor = _actor(src, async_save=async_save)
    actor.load_checkpoint(path)
    loss = actor.train_step(_batches(1))["loss"]
    actor.save_checkpoint(_step_path(root, 2), global_step=2, track=True)
    actor.finalize_checkpoint()  # a no-op after a synchronous save
    return path, notes, loss


def _crash_and_check_what_is_left(src: str, root: str, phase: str, mode: str, writer: str) -> bool:
    """Kill the save of step 2 at ``phase``; the previous step stays tracked, and step 2 is either not visible or
    whole. Whether it is visible."""
    with pytest.raises(RankFailure, match="died with exit code -9"):
        run_on_ranks(_resume_then_crash, WORLD, LAYOUT, args=(src, root, phase, mode, writer), timeout_s=240)
    assert _tracked(root) == "1"
    untracked = os.path.exists(_step_path(root, 2))
    if phase in ("tracker", "commit") and untracked:
        # every rank had finished every part, so rank 0 may have renamed it into place before it died, or
        # before it could remove it again (a surviving rank 0 does): whole, but untracked
        verify_checkpoint(_step_path(root, 2))
    else:
        assert not untracked, "a crashed save must not leave a visible step"
    return untracked


@pytest.mark.parametrize("mode", ["one", "all"])
@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_in_any_phase_keeps_the_previous_step(tiny_moe_path, base_root, tmp_path, phase, mode):
    root = _copy_run(base_root, tmp_path)
    untracked = _crash_and_check_what_is_left(tiny_moe_path, root, phase, mode, "sync")
    path, notes, loss = run_on_ranks(_resume_and_continue, WORLD, LAYOUT, args=(tiny_moe_path, root))[0]
    assert path == _step_path(root, 1)
    assert any("never tracked" in note for note in notes) == untracked
    assert math.isfinite(loss)  # training continued
    assert _tracked(root) == "2"
    verify_checkpoint(_step_path(root, 2))
    assert not os.path.exists(_step_path(root, 2) + ".incomplete")


@pytest.mark.parametrize(
    ("writer", "phase"),
    [(writer, phase) for writer in WRITERS if writer != "sync" for phase in PHASES if phase not in IN_THE_FORK.get(writer, ())],
)
def test_sigkill_in_any_phase_of_every_writer_keeps_the_previous_step(tiny_moe_path, base_root, tmp_path, writer, phase):
    """The matrix above over every other writer, one rank killed: what the crash leaves is the same, and the
    resume finds the previous step (training on from it is the sync rows' part: the load takes no writer)."""
    root = _copy_run(base_root, tmp_path)
    untracked = _crash_and_check_what_is_left(tiny_moe_path, root, phase, "one", writer)
    path, notes = find_resume_checkpoint(root)
    assert path == _step_path(root, 1)
    assert any("never tracked" in note for note in notes) == untracked


# --------------------------------------------------------------------------- async save


def _params_and_optimizer(actor) -> dict[str, object]:
    """Every parameter, optimizer state entry and RNG state of this rank, copied, by path."""
    out = {f"param.{name}": tensor for name, tensor in actor.parameters_snapshot().items()}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        else:
            out[prefix] = value.detach().clone() if isinstance(value, torch.Tensor) else value

    walk("optimizer", actor.optimizer.state_dict())
    walk("rng", actor.checkpoint_manager.get_rng_state(use_dist_ckpt=False))
    return out


def _differing(a: dict, b: dict) -> list[str]:
    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return bool(x == y) if not hasattr(x, "shape") else bool((x == y).all())

    return sorted(set(a) ^ set(b)) + [key for key in a if key in b and not same(a[key], b[key])]


def _async_and_sync_saves_of_one_state(src: str, root: str, async_mode: str) -> dict:
    actor = _actor(src, async_save=True, async_mode=async_mode)
    manager = actor.checkpoint_manager
    actor.train_step(_batches(0))
    manager.async_save = False  # the reference: the same state, saved synchronously
    assert actor.save_checkpoint(os.path.join(root, "sync", "global_step_1", "actor"), global_step=1) is False
    manager.async_save = True
    async_root = os.path.join(root, "async")
    pending = actor.save_checkpoint(_step_path(async_root, 1), global_step=1)
    # Training goes on while the write runs: a write of the live tensors would see these steps.
    for step in (1, 2):
        actor.train_step(_batches(step))
    step_1_visible_while_pending = os.path.exists(_step_path(async_root, 1))
    before_step_3 = _params_and_optimizer(actor)
    actor.save_checkpoint(_step_path(async_root, 3), global_step=3)  # finalizes step 1 first
    # The third save of this structure: megatron's plan is reusable, so the fork plans, writes and exports (the
    # background write's from the host copy its rank took: on this host, nothing to copy).
    report = manager.last_save
    step_3_where = (report.mode, report.checked_in_background, report.planned_in_background, report.hf_weights_in_background)
    step_1_committed_by_next_save = os.path.exists(_step_path(async_root, 1))
    actor.train_step(_batches(3))
    finalized = actor.finalize_checkpoint()
    trained_on = _params_and_optimizer(actor)

    loaded = {}
    for name, path in (("sync", os.path.join(root, "sync", "global_step_1", "actor")), ("async", _step_path(async_root, 1)), ("async3", _step_path(async_root, 3))):
        actor.load_checkpoint(path)
        loaded[name] = _params_and_optimizer(actor)
    manager.async_save = False  # the state of step 3, loaded last, saved again in the foreground
    actor.save_checkpoint(os.path.join(root, "sync", "global_step_3", "actor"), global_step=3)
    return {
        "pending": pending,
        "step_3_where": step_3_where,
        "visible_while_pending": step_1_visible_while_pending,
        "committed_by_next_save": step_1_committed_by_next_save,
        "finalized": finalized,
        "async_vs_sync": _differing(loaded["sync"], loaded["async"]),
        "sync_vs_trained_on": len(_differing(loaded["sync"], trained_on)),
        "async3_vs_state_at_save": _differing(loaded["async3"], before_step_3),
    }


@pytest.mark.parametrize("async_mode", ["background_write", "snapshot"])
def test_async_save_equals_a_sync_save_while_training_goes_on(tiny_moe_path, tmp_path, async_mode):
    root = str(tmp_path)
    for result in run_on_ranks(_async_and_sync_saves_of_one_state, WORLD, LAYOUT, args=(tiny_moe_path, root, async_mode)):
        assert result["pending"] is True
        assert not result["visible_while_pending"], "an async step must stay in staging until finalized"
        assert result["committed_by_next_save"], "a second save must first finalize the pending one"
        assert result["finalized"] == _step_path(os.path.join(root, "async"), 3)
        assert result["sync_vs_trained_on"] > 0, "training after the save must have changed the state"
        assert result["async_vs_sync"] == []
        assert result["async3_vs_state_at_save"] == [], result["async3_vs_state_at_save"][:5] + result["async3_vs_state_at_save"][-5:]
        assert result["step_3_where"] == (AsyncMode(async_mode), True, True, True), result["step_3_where"]  # check, plan, HF export
    for step in (1, 3):
        verify_checkpoint(_step_path(os.path.join(root, "async"), step))
        # The HF export (in the parent for step 1, in the forks for step 3) equals a foreground one.
        hf = ("model", "huggingface")
        sync_hf = os.path.join(root, "sync", f"global_step_{step}", "actor", *hf)
        async_hf = os.path.join(_step_path(os.path.join(root, "async"), step), *hf)
        assert sorted(os.listdir(sync_hf)) == sorted(os.listdir(async_hf))
        for name in os.listdir(sync_hf):
            with open(os.path.join(sync_hf, name), "rb") as a, open(os.path.join(async_hf, name), "rb") as b:
                assert a.read() == b.read(), (step, name)


def _saves_before_and_after_training(src: str, root: str) -> list[str]:
    actor = _actor(src, save_contents=("model", "optimizer", "extra"))
    for step in (1, 2):  # the optimizer has no state yet: megatron validates (and caches) that plan
        actor.save_checkpoint(_step_path(root, step), global_step=step)
    actor.train_step(_batches(0))
    at_save = _params_and_optimizer(actor)
    actor.save_checkpoint(_step_path(root, 3), global_step=3)
    actor.train_step(_batches(1))
    actor.load_checkpoint(_step_path(root, 3))
    return _differing(at_save, _params_and_optimizer(actor))


def test_a_cached_save_plan_is_not_reused_once_the_state_grows(tiny_moe_path, tmp_path):
    """megatron's cached plan lists what to write: reused for a state that gained Adam moments, the
    optimizer checkpoint would silently lack them."""
    for differing in run_on_ranks(_saves_before_and_after_training, WORLD, LAYOUT, args=(tiny_moe_path, str(tmp_path))):
        assert differing == []


def _async_save_then_crash(src: str, root: str) -> None:
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, async_save=True)
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    assert actor.save_checkpoint(_step_path(root, 2), global_step=2)
    actor.train_step(_batches(2))
    os.kill(os.getpid(), signal.SIGKILL)  # every rank, after the save returned, before its finalize


def test_sigkill_before_async_finalize_keeps_the_previous_step(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    with pytest.raises(RankFailure, match="died with exit code -9"):
        run_on_ranks(_async_save_then_crash, WORLD, LAYOUT, args=(tiny_moe_path, root), timeout_s=240)
    assert _tracked(root) == "1"
    assert not os.path.exists(_step_path(root, 2))
    staging = _step_path(root, 2) + ".incomplete"
    assert os.path.isdir(staging) and not os.path.exists(os.path.join(staging, "manifest.json"))
    path, notes, loss = run_on_ranks(_resume_and_continue, WORLD, LAYOUT, args=(tiny_moe_path, root, True))[0]
    assert path == _step_path(root, 1)
    assert any("interrupted save of step 2" in note for note in notes)
    assert math.isfinite(loss)
    assert _tracked(root) == "2"
    verify_checkpoint(_step_path(root, 2))
    assert not os.path.exists(staging)


# --------------------------------------------------------------------------- write failures


def _save_with_a_full_disk(src: str, root: str, limited: tuple[int, ...]) -> str:
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src)
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024 if torch.distributed.get_rank() in limited else soft, hard))
    try:
        actor.save_checkpoint(_step_path(root, 2), global_step=2)
        message = "no error"
    except CheckpointError as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    torch.distributed.barrier()
    intact = os.path.exists(_step_path(root, 1)) and not os.path.exists(_step_path(root, 2))
    actor.save_checkpoint(_step_path(root, 2), global_step=2, track=True)  # with space again, the next save succeeds
    return message, intact


@pytest.mark.parametrize("limited", [(0, 1), (1,)], ids=["every_rank", "one_rank"])
def test_disk_full_fails_clearly_and_loses_nothing(tiny_moe_path, base_root, tmp_path, limited):
    """Every rank's writes fail (EFBIG past a file-size limit), or one rank's only: its HF files fail while the
    other rank's are written, and every rank still fails the save at once, naming the cause, instead of waiting
    in the export's next collective for the failed rank until the group's timeout."""
    root = _copy_run(base_root, tmp_path)
    results = run_on_ranks(_save_with_a_full_disk, WORLD, LAYOUT, args=(tiny_moe_path, root, limited), timeout_s=120)
    for message, intact in results:
        assert "failed" in message and "previous checkpoint and the tracker are unchanged" in message, message
        assert "File too large (EFBIG)" in message, message
        assert intact
    if limited == (1,):  # rank 0's error names the rank that failed, at what, and its file
        assert "(PeerFailure: rank 1 could not " in results[0][0] and ": File too large (EFBIG) writing " + root in results[0][0], results[0][0]
    assert _tracked(root) == "2"
    verify_checkpoint(_step_path(root, 1))
    verify_checkpoint(_step_path(root, 2))


class _ConfigWriteFailsOnRankZero(MegatronCheckpointManager):
    """Rank 0's HF config cannot be written: a directory stands where ``config.json`` goes."""

    def on_save_phase(self, phase):
        super().on_save_phase(phase)
        if phase == "hf_config" and self.rank == 0:
            os.makedirs(os.path.join(self.last_save.local_path, "model", "huggingface", "config.json"))


def _save_with_the_config_failing(src: str, root: str) -> str:
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, manager_cls=_ConfigWriteFailsOnRankZero)
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    try:
        actor.save_checkpoint(_step_path(root, 2), global_step=2)
        message = "no error"
    except CheckpointError as exc:
        message = str(exc)
    torch.distributed.barrier()
    return message


def test_a_config_write_that_fails_on_rank_zero_fails_every_rank_at_fix_2s_barrier(tiny_moe_path, base_root, tmp_path):
    """Fix 2's barrier carries rank 0's outcome: the other ranks raise there, naming it, instead of waiting in
    the weight save's collectives for a rank 0 that left the export."""
    root = _copy_run(base_root, tmp_path)
    for message in run_on_ranks(_save_with_the_config_failing, WORLD, LAYOUT, args=(tiny_moe_path, root), timeout_s=120):
        assert "Is a directory (EISDIR) writing " in message and "previous checkpoint and the tracker are unchanged" in message, message
    assert _tracked(root) == "1" and not os.path.exists(os.path.join(root, "global_step_2"))


def _save_onto_a_full_disk(src: str, root: str, async_mode: str | None) -> str:
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, async_save=async_mode is not None, async_mode=async_mode or "background_write")
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    try:
        actor.save_checkpoint(_step_path(root, 2), global_step=2)
        actor.finalize_checkpoint()
        message = "no error"
    except CheckpointError as exc:
        message = str(exc)
    torch.distributed.barrier()
    return message


@pytest.mark.parametrize("async_mode", ["background_write", "snapshot", None], ids=["background_write", "snapshot", "sync"])
def test_a_full_disk_is_named_enospc_with_the_path(tiny_moe_path, base_root, tmp_path, async_mode):
    """A real filesystem that fills during the save (a tmpfs with room for about half a step): every rank's error
    names ENOSPC and the path being written, from an async save's fork too (not "exited without a result"), and
    the room a step takes against the room left; nothing is committed, the previous step stays whole, and no
    staging directory is left to keep the disk full (rank 0 used to remove it while another rank still wrote)."""
    from tests.test_save_os_errors import small_tmpfs

    used = sum(-(-os.path.getsize(f) // 4096) * 4096 for f in _files(base_root))
    with small_tmpfs(str(tmp_path / "disk"), str(used + (used // 2 // 4096) * 4096)) as disk:
        root = _copy_run(base_root, type("Dir", (), {"__truediv__": lambda self, name: os.path.join(disk, name)})())
        for message in run_on_ranks(_save_onto_a_full_disk, WORLD, LAYOUT, args=(tiny_moe_path, root, async_mode), timeout_s=300):
            assert f"No space left on device (ENOSPC) writing {root}/global_step_2/actor" in message, message
            assert "without a result" not in message and "previous checkpoint and the tracker are unchanged" in message, message
            assert re.search(rf"The save needed about \d+ bytes \(the size of the last committed step\); \d+ bytes are free on {re.escape(root)}'s filesystem", message), message
        assert _tracked(root) == "1" and not os.path.exists(os.path.join(root, "global_step_2", "actor"))
        assert not os.path.exists(os.path.join(root, "global_step_2")), os.listdir(os.path.join(root, "global_step_2"))  # no staging left to fill the disk
        verify_checkpoint(_step_path(root, 1))


# --------------------------------------------------------------------------- retention


def test_retention_never_deletes_the_tracked_step(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    # max_ckpt_to_keep=1: after step 2 the tracker still names step 1, which must survive;
    # after step 3 (tracker at 2) step 2 survives the save and goes only once step 3 is tracked.
    actor_history = run_on_ranks(_save_steps_with_retention_from_one, WORLD, LAYOUT, args=(tiny_moe_path, root))[0]
    assert actor_history[0] == ["global_step_1", "global_step_2"]
    assert actor_history[1] == ["global_step_2", "global_step_3"]
    assert _tracked(root) == "3"


def _save_steps_with_retention_from_one(src: str, root: str, resumed: bool = False) -> list[list[str]]:
    """Steps 2 and 3 with max_ckpt_to_keep=1, the run knowing step 1 from a resume (the steps on disk become
    its previous saves) or, as upstream's cleanup test seeds it, by hand."""
    actor = _actor(src)
    if resumed:
        actor.load_checkpoint(_step_path(root, 1))
    else:
        actor.checkpoint_manager.previous_saved_paths.append(_step_path(root, 1))
    seen = []
    for step in (2, 3):
        actor.train_step(_batches(step))
        actor.save_checkpoint(_step_path(root, step), global_step=step, max_ckpt_to_keep=1, track=True)
        seen.append(sorted(d for d in os.listdir(root) if d.startswith("global_step_")))
    return seen


def test_ranks_removing_the_same_old_steps_at_once_do_not_fail(tmp_path):
    # On a shared filesystem every rank prunes the same paths; one rank's rmdir must not trip another.
    from concurrent.futures import ThreadPoolExecutor

    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    olds = [str(tmp_path / f"global_step_{i}" / "actor") for i in range(300)]
    for old in olds:
        os.makedirs(os.path.join(old, "dist_ckpt"))
    with ThreadPoolExecutor(8) as pool:
        for result in [pool.submit(BaseCheckpointManager.remove_previous_save_local_path, None, olds) for _ in range(8)]:
            result.result()
    assert os.listdir(tmp_path) == []


def test_a_resumed_run_prunes_the_steps_before_it(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    history = run_on_ranks(_save_steps_with_retention_from_one, WORLD, LAYOUT, args=(tiny_moe_path, root, True))[0]
    assert history[0] == ["global_step_1", "global_step_2"]  # step 1 is still the tracked one
    assert history[1] == ["global_step_2", "global_step_3"]  # known from disk, pruned once no longer tracked


# --------------------------------------------------------------------------- bad checkpoints


def _truncate_shard(step):
    shard = next(os.path.join(step, "optimizer", "dist_ckpt", f) for f in os.listdir(os.path.join(step, "optimizer", "dist_ckpt")) if f.endswith(".distcp"))
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    return "truncated"


def _delete_metadata(step):
    os.remove(os.path.join(step, "optimizer", "dist_ckpt", ".metadata"))
    return "optimizer/dist_ckpt/.metadata is missing"


def _manifest_names_absent_file(step):
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    manifest["files"]["extra/dist_ckpt/__9_0.distcp"] = {"size": 123, "checksum": "crc32:00000000"}
    open(os.path.join(step, "manifest.json"), "w").write(json.dumps(manifest))
    return "extra/dist_ckpt/__9_0.distcp is missing"


def _hf_missing_tensors(step):
    hf = os.path.join(step, "model", "huggingface")
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    victim = "model.layers.3.mlp.experts.7.down_proj.weight"
    shard = os.path.join(hf, index["weight_map"][victim])
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    rewrite_manifest(step)  # a consistent manifest: only the HF check can catch it
    return victim


def _missing_contents(step):
    os.remove(os.path.join(step, "ckpt_contents.json"))
    return "ckpt_contents.json is missing"


def _corrupt_contents(step):
    open(os.path.join(step, "ckpt_contents.json"), "w").write("{not json")
    return "unreadable"


def _missing_manifest(step):
    os.remove(os.path.join(step, "manifest.json"))
    return "manifest.json is missing"


def _step_is_a_file(step):
    shutil.rmtree(step)
    open(step, "w").write("oops")
    return "is not a directory"


def _flip_bytes(step: str, directory: str, suffix: str) -> str:
    """64 bytes XOR 0xFF in the middle of the first ``suffix`` file of ``directory``: same size, other content."""
    folder = os.path.join(step, directory)
    victim = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(suffix))[0])
    with open(victim, "r+b") as handle:
        handle.seek(os.path.getsize(victim) // 2)
        data = handle.read(64)
        handle.seek(-len(data), os.SEEK_CUR)
        handle.write(bytes(b ^ 0xFF for b in data))
    return f"{victim}: its content checksum differs"


def _flip_optimizer_shard(step):
    return _flip_bytes(step, "optimizer/dist_ckpt", ".distcp")


def _flip_rng_shard(step):
    return _flip_bytes(step, "extra/dist_ckpt", ".distcp")


def _flip_hf_weights(step):
    return _flip_bytes(step, "model/huggingface", ".safetensors")


def _manifest_lists_no_files(step):
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    manifest["files"] = {}
    open(os.path.join(step, "manifest.json"), "w").write(json.dumps(manifest))
    return "optimizer/dist_ckpt/.metadata is missing from the manifest"


def _manifest_without_checksums(step):
    """A version-2 manifest with sizes only: it would let any bytes of the right length through."""
    edit_manifest(step, lambda m: m.update(files={name: {"size": e["size"]} for name, e in m["files"].items()}))
    return "needs an integer 'size' and a 'checksum'"


def _manifest_of_version_1(step):
    edit_manifest(step, lambda m: m.update(format_version=1, files={name: e["size"] for name, e in m["files"].items()}))
    return "format_version 1; this package writes and accepts only 2"


def _unlisted_file(step):
    extra = os.path.join(step, "optimizer", "dist_ckpt", "__7_0.distcp")
    open(extra, "wb").write(b"planted")
    return f"{extra} is not listed in"


def _json_of_the_wrong_type(name: str, value: str, named: str):
    def corrupt(step):
        open(os.path.join(step, name), "w").write(value)
        return f"{os.path.join(step, name)} ({named}) holds a JSON"

    corrupt.__name__ = f"_{name.split('.')[0]}_is_{value.strip('[]{}') or 'empty'}"
    return corrupt


def _contents_entry_not_an_object(step):
    path = os.path.join(step, "ckpt_contents.json")
    contents = json.loads(open(path).read())
    contents["contents"]["optimizer"] = 3
    open(path, "w").write(json.dumps(contents))
    return "'contents' must be an object of content -> {path, format}"


CORRUPTIONS = [
    _flip_optimizer_shard,
    _flip_rng_shard,
    _flip_hf_weights,
    _manifest_lists_no_files,
    _truncate_shard,
    _delete_metadata,
    _manifest_names_absent_file,
    _hf_missing_tensors,
    _missing_contents,
    _corrupt_contents,
    _missing_manifest,
    _step_is_a_file,
    _manifest_without_checksums,
    _manifest_of_version_1,
    _unlisted_file,
    entry_outside_the_step,
    _json_of_the_wrong_type("manifest.json", "null", "manifest"),
    _json_of_the_wrong_type("manifest.json", "[]", "manifest"),
    _json_of_the_wrong_type("ckpt_contents.json", "7", "checkpoint contents"),
    _json_of_the_wrong_type("committed.json", "[1]", "commit mark"),
    _contents_entry_not_an_object,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_bad_checkpoint_gets_a_clear_error_and_nothing_is_deleted(base_root, tmp_path, corrupt):
    root = _copy_run(base_root, tmp_path)
    step = _step_path(root, 1)
    expected = corrupt(step)
    before = _files(root)
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        verify_checkpoint(step)
    with pytest.raises(CheckpointError):
        find_resume_checkpoint(root)  # a resume refuses the damaged tracked step too
    assert _files(root) == before


def test_a_step_linked_under_another_number_is_refused(base_root, tmp_path):
    """``global_step_9 -> global_step_1`` with the tracker at 9: the commit mark says 1, so it is not step 9."""
    root = _copy_run(base_root, tmp_path)
    os.symlink("global_step_1", os.path.join(root, "global_step_9"))
    atomic_write_text(get_checkpoint_tracker_filename(root), "9")
    with pytest.raises(CheckpointError, match=r"committed.json says step 1, but the step lies in .*global_step_9"):
        find_resume_checkpoint(root)


def test_a_check_without_checksums_reads_sizes_only(base_root, tmp_path):
    """``checksums=False`` (for a caller that has just hashed the step) skips the content checksums and keeps
    every other check: a flipped byte passes it, a truncated shard does not."""
    root = _copy_run(base_root, tmp_path)
    step = _step_path(root, 1)
    flipped = _flip_optimizer_shard(step)
    verify_checkpoint(step, checksums=False)
    with pytest.raises(CheckpointError, match=re.escape(flipped)):
        verify_checkpoint(step)
    truncated = _truncate_shard(step)
    with pytest.raises(CheckpointError, match=re.escape(truncated)):
        verify_checkpoint(step, checksums=False)


def _poison(actor, where: str) -> None:
    """Rank 1 gets a NaN in a parameter or an Inf in an Adam moment."""
    if actor.checkpoint_manager.rank == 1:
        if where == "model":
            next(actor.model[0].parameters()).data.view(-1)[0] = float("nan")
        else:
            inner = actor.optimizer.chained_optimizers[0].optimizer
            next(iter(inner.state.values()))["exp_avg"].view(-1)[0] = float("inf")


def _save_with_a_non_finite_state(src: str, root: str, where: str, mode: str) -> dict:
    """Sync: the save refuses at once, in the rank. The async writers (a first save, planned in the rank, and a
    snapshot's third, planned in the fork): the fork finds it on the state it was about to write and the save
    fails when finalized."""
    actor = _actor(src, async_save=mode != "sync", async_mode="snapshot" if mode.startswith("snapshot") else "background_write")
    actor.load_checkpoint(_step_path(root, 1))
    step = 2
    if mode == "snapshot":
        for step in (2, 3):  # the plans, then their validation: the next save is the snapshot's
            actor.train_step(_batches(step))
            actor.save_checkpoint(_step_path(root, step), global_step=step, track=True)
            actor.finalize_checkpoint()
        step = 4
    actor.train_step(_batches(step))
    _poison(actor, where)
    returned = False
    try:
        actor.save_checkpoint(_step_path(root, step), global_step=step)
        returned = True
        actor.finalize_checkpoint()
    except CheckpointError as exc:
        torch.distributed.barrier()  # rank 0 discards the staging directory
        report = actor.checkpoint_manager.last_save
        where = (report.mode, report.checked_in_background, report.planned_in_background, returned)
        return {"error": str(exc), "where": where, "step": step, "step_dir": os.path.exists(os.path.join(root, f"global_step_{step}"))}
    return {"error": None}


# (mode, checked in the fork, planned in the fork, save_checkpoint returned before the refusal)
WHERE_CHECKED = {
    "sync": (AsyncMode.SYNC, False, False, False),
    "background_write": (AsyncMode.BACKGROUND_WRITE, True, False, True),
    "snapshot_first_save": (AsyncMode.SNAPSHOT, True, False, True),
    "snapshot": (AsyncMode.SNAPSHOT, True, True, True),
}


@pytest.mark.parametrize(
    ("where", "mode"),
    [("model", "sync"), ("optimizer", "sync"), ("model", "background_write"), ("model", "snapshot_first_save"), ("optimizer", "snapshot")],
)
def test_a_non_finite_state_is_never_saved(tiny_moe_path, base_root, tmp_path, where, mode):
    root = _copy_run(base_root, tmp_path)
    results = run_on_ranks(_save_with_a_non_finite_state, WORLD, LAYOUT, args=(tiny_moe_path, root, where, mode), timeout_s=300)
    for result in results:
        assert result["error"] is not None and "rank 1's" in result["error"] and "NaN or Inf" in result["error"]
        assert ("exp_avg" in result["error"]) == (where == "optimizer")
        assert result["where"] == WHERE_CHECKED[mode], result["where"]
        assert not result["step_dir"], "nothing of the refused step may be written"
    previous = results[0]["step"] - 1
    verify_checkpoint(_step_path(root, previous))  # the previous step is whole
    assert _tracked(root) == str(previous)


def _poisoned_once_the_save_returned(src: str, root: str, async_mode: str) -> dict:
    """The async save returns; then NaN / Inf reach the live parameters and Adam moments before it is finalized."""
    actor = _actor(src, async_save=True, async_mode=async_mode)
    actor.train_step(_batches(0))
    at_save = _params_and_optimizer(actor)
    pending = actor.save_checkpoint(_step_path(root, 1), global_step=1, track=True)
    for where in ("model", "optimizer"):
        _poison(actor, where)
    committed = actor.finalize_checkpoint()
    actor.load_checkpoint(committed)
    return {"pending": pending, "committed": committed, "differ": _differing(at_save, _params_and_optimizer(actor))}


@pytest.mark.parametrize("async_mode", ["background_write", "snapshot"])
def test_a_non_finite_state_after_the_save_returned_does_not_reach_the_step(tiny_moe_path, tmp_path, async_mode):
    """The fork checks, plans and exports the state as it was when the save returned (its host copy or its
    copy-on-write image): training's later writes, a NaN included, neither fail nor change the committed step."""
    root = str(tmp_path)
    for result in run_on_ranks(_poisoned_once_the_save_returned, WORLD, LAYOUT, args=(tiny_moe_path, root, async_mode)):
        assert result["pending"] is True
        assert result["committed"] == _step_path(root, 1)
        assert result["differ"] == [], result["differ"][:5]
    verify_checkpoint(_step_path(root, 1))
    assert _tracked(root) == "1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_is_exact_where_a_sum_overflows(dtype):
    """The check screens with a sum: finite values whose sum overflows still pass, and every NaN/Inf fails."""
    largest = torch.finfo(dtype).max
    assert is_finite(torch.full((64,), largest / 4, dtype=dtype))  # the sum overflows; every value is finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.randn(100).to(dtype)
        tensor[37] = bad
        assert not is_finite(tensor), bad
    assert not is_finite(torch.tensor([float("inf"), float("-inf")], dtype=dtype))


def test_checkpoint_of_another_model_is_refused(base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)

    class OtherModel:  # the identity fields of a model with 6 layers and no experts
        num_layers = 6
        num_moe_experts = None

    with pytest.raises(CheckpointError, match="different model") as err:
        verify_checkpoint(_step_path(root, 1), transformer_config=OtherModel())
    assert "num_layers: checkpoint 4, this model 6" in str(err.value)

    with open(os.path.join(_step_path(root, 1), "transformer_config.json")) as handle:
        saved = json.load(handle)
    same = {field: saved[field] for field in MODEL_IDENTITY_FIELDS if field in saved}
    all_moe = [1] * saved["num_layers"]
    verify_checkpoint(_step_path(root, 1), transformer_config=SimpleNamespace(**same, moe_layer_freq=all_moe))  # = 1
    first_dense = [0] + all_moe[1:]  # the same model but its first layer dense (Qwen3-MoE's mlp_only_layers=[0])
    with pytest.raises(CheckpointError, match=re.escape(f"MoE layers (moe_layer_freq, 1 = routed experts): checkpoint {all_moe}, this model {first_dense}")):
        verify_checkpoint(_step_path(root, 1), transformer_config=SimpleNamespace(**same, moe_layer_freq=first_dense))


def test_tracker_problems(base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    atomic_write_text(get_checkpoint_tracker_filename(root), "7")
    with pytest.raises(CheckpointError, match="names step 7, but .*global_step_7/actor does not exist"):
        find_resume_checkpoint(root)
    atomic_write_text(get_checkpoint_tracker_filename(root), "seven")
    with pytest.raises(CheckpointError, match="tracker .* is corrupt"):
        find_resume_checkpoint(root)
    assert os.path.isdir(_step_path(root, 1))


def test_interrupted_staging_directory_is_reported_and_skipped(base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    os.makedirs(_step_path(root, 2) + ".incomplete/model")
    path, notes = find_resume_checkpoint(root)
    assert path == _step_path(root, 1)
    assert any("interrupted save of step 2" in note for note in notes)


def _load_damaged(src: str, step: str) -> str:
    actor = _actor(src)
    before = actor.parameters_snapshot()
    try:
        actor.load_checkpoint(step)
    except CheckpointError as exc:
        after = actor.parameters_snapshot()
        untouched = all(torch.equal(before[k], after[k]) for k in before)
        return f"{exc} | untouched={untouched}"
    return "loaded"


def test_manager_refuses_a_damaged_step_before_loading_anything(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    _truncate_shard(_step_path(root, 1))
    for message in run_on_ranks(_load_damaged, WORLD, LAYOUT, args=(tiny_moe_path, _step_path(root, 1))):
        assert "nothing was loaded" in message and "truncated" in message and message.endswith("untouched=True")


def test_verify_cli_reports_whole_and_damaged_checkpoints(base_root, tmp_path):
    import subprocess
    import sys

    root = _copy_run(base_root, tmp_path)
    ok = subprocess.run([sys.executable, "-m", "verl.model_merger", "verify", "--local_dir", root], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK:" in ok.stdout and "global_step_1/actor" in ok.stdout
    _delete_metadata(_step_path(root, 1))
    bad = subprocess.run([sys.executable, "-m", "verl.model_merger", "verify", "--local_dir", _step_path(root, 1)], capture_output=True, text=True)
    assert bad.returncode == 1 and ".metadata is missing" in bad.stderr


class _ForkDiesManager(MegatronCheckpointManager):
    """Rank 1's process forked for a save from the snapshot dies mid dist checkpoint (after the forks met)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_pid = os.getpid()

    def on_save_phase(self, phase: str) -> None:
        if phase == "dist_checkpoint_optimizer" and self.rank == 1 and os.getpid() != self._parent_pid:
            os._exit(3)
        super().on_save_phase(phase)


def _snapshot_save_whose_fork_dies(src: str, root: str) -> dict:
    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, manager_cls=_ForkDiesManager, async_save=True, async_mode="snapshot")
    actor.load_checkpoint(path)
    actor.train_step(_batches(1))
    for step in (2, 3):  # planned here: the first plan of this process, then its validation
        actor.save_checkpoint(_step_path(root, step), global_step=step, track=True)
        actor.finalize_checkpoint()
    actor.save_checkpoint(_step_path(root, 4), global_step=4)
    from_snapshot = actor.checkpoint_manager.last_save.planned_in_background
    actor.train_step(_batches(2))
    try:
        actor.finalize_checkpoint()
    except CheckpointError as exc:
        return {"from_snapshot": from_snapshot, "error": str(exc)}
    return {"from_snapshot": from_snapshot, "error": None}


def test_a_save_whose_fork_dies_fails_cleanly_and_keeps_the_previous_step(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    for result in run_on_ranks(_snapshot_save_whose_fork_dies, WORLD, LAYOUT, args=(tiny_moe_path, root), timeout_s=300):
        assert result["from_snapshot"]
        assert result["error"] and "saving step 4" in result["error"] and "previous checkpoint" in result["error"]
        assert "failed on 2 rank(s): rank 1: the background writer of rank 1 exited without a result" in result["error"]
    assert _tracked(root) == "3"
    assert not os.path.exists(_step_path(root, 4)) and not os.path.exists(_step_path(root, 4) + ".incomplete")
    verify_checkpoint(_step_path(root, 3))


def _writers_that_die_or_hang(pid_dir: str):
    """Fault injection: megatron's per-bucket writer processes record their pid; the first is SIGKILLed (as the
    OOM killer would), any other hangs, as a writer waiting on a dead peer would."""

    def write(*args, **kwargs):
        first = not os.listdir(pid_dir)
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        if first:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)

    return write


class _WriterDiesManager(MegatronCheckpointManager):
    """On rank 1, from the save of step ``kill_at`` on, megatron's writer processes die (see above)."""

    kill_at = 4
    pid_dir = ""

    def on_save_phase(self, phase: str) -> None:
        if phase == "dist_checkpoint_optimizer" and self.rank == 1 and self.previous_global_step == self.kill_at:
            from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

            FileSystemWriterAsync.write_preloaded_data = staticmethod(_writers_that_die_or_hang(self.pid_dir))
        super().on_save_phase(phase)


def _async_save_whose_writer_dies(src: str, root: str, kill_at: int, pid_dir: str, async_mode: str) -> dict:
    path, _ = find_resume_checkpoint(root)
    manager_cls = type("WriterDies", (_WriterDiesManager,), {"kill_at": kill_at, "pid_dir": pid_dir})
    actor = _actor(src, manager_cls=manager_cls, async_save=True, async_mode=async_mode)
    actor.load_checkpoint(path)
    for step in range(2, kill_at + 1):
        actor.train_step(_batches(step))
        start = time.monotonic()
        try:
            actor.save_checkpoint(_step_path(root, step), global_step=step, track=True)
            actor.finalize_checkpoint()
        except CheckpointError as exc:
            return {"step": step, "error": str(exc), "seconds": time.monotonic() - start}
    return {"step": None, "error": None}


@pytest.mark.parametrize(
    ("kill_at", "async_mode"),
    [(2, "background_write"), (2, "snapshot"), (4, "snapshot")],
    ids=["background_write", "snapshot-planned_in_the_rank", "snapshot-whole_save_in_the_fork"],
)
def test_a_killed_dist_checkpoint_writer_fails_the_save_fast_and_leaves_no_process(tiny_moe_path, base_root, tmp_path, kill_at, async_mode):
    root = _copy_run(base_root, tmp_path)
    pid_dir = tmp_path / "writer_pids"
    pid_dir.mkdir()
    results = run_on_ranks(_async_save_whose_writer_dies, WORLD, LAYOUT, args=(tiny_moe_path, root, kill_at, str(pid_dir), async_mode), timeout_s=300)
    for result in results:
        assert result["step"] == kill_at and f"saving step {kill_at}" in result["error"], result
        assert result["seconds"] < 30, result
    assert "died (signal 9)" in results[1]["error"] or kill_at == 2, results[1]["error"]
    writers = [int(name) for name in os.listdir(pid_dir)]
    assert writers and not [pid for pid in writers if _alive(pid)], "a writer outlived the failed save"
    assert _tracked(root) == str(kill_at - 1)
    assert not os.path.exists(os.path.join(root, f"global_step_{kill_at}")), "a failed save leaves no directory"
    verify_checkpoint(_step_path(root, kill_at - 1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is dead, only not yet reaped
        return handle.read().split(") ")[-1][0] != "Z"


def _writer_that_outlives_nothing(pid_file: str) -> None:
    with open(pid_file, "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(120)


def _rank_that_forks_a_writer(pid_file: str, from_thread: bool) -> None:
    import multiprocessing
    import threading

    from verl.utils import process_lifetime

    process_lifetime.install()  # as init_rank does
    writer = multiprocessing.get_context("fork").Process(target=_writer_that_outlives_nothing, args=(pid_file,))
    if from_thread:  # the kernel's parent-death signal would follow this thread, not the rank
        thread = threading.Thread(target=writer.start)
        thread.start()
        thread.join()
    else:
        writer.start()
    time.sleep(120)


@pytest.mark.parametrize("from_thread", [False, True], ids=["main_thread", "other_thread"])
def test_a_background_writer_dies_with_its_rank(tmp_path, from_thread):
    """A fork dies with its rank, whichever thread forked it; one from another thread must outlive that thread
    (the kernel's parent-death signal would follow the thread, not the rank)."""
    import multiprocessing

    pid_file = str(tmp_path / "writer.pid")
    rank = multiprocessing.get_context("fork").Process(target=_rank_that_forks_a_writer, args=(pid_file, from_thread))
    rank.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the forking thread has ended: the writer must still run
    with open(pid_file) as handle:
        writer = int(handle.read())
    assert _alive(writer), "the writer died with the thread that forked it, not with its rank"
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10)
    assert not _survivors([writer], within_s=10), "the forked writer outlived its killed rank"


def _survivors(pids: list[int], within_s: float) -> list[int]:
    """Of ``pids``, those still alive after ``within_s``; killed then, so that a failing test leaves nothing."""
    deadline = time.monotonic() + within_s
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _writers_outliving_their_rank(rank_pid: int, pid_dir: str, original):
    """Fault injection: each of megatron's per-bucket writer processes records its pid and its parent's, waits
    until the rank waits for it, SIGKILLs the rank and every process between (as a preemption kills the run)
    and goes on writing, as an orphaned writer would."""

    def write(*args, **kwargs):
        with open(os.path.join(pid_dir, str(os.getpid())), "w") as handle:
            handle.write(str(os.getppid()))
        time.sleep(1.0)
        for pid in dict.fromkeys([rank_pid, os.getppid()]):  # the rank first: with the fix this writer dies next
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return original(*args, **kwargs)

    return write


def _save_killed_while_writers_run(src: str, root: str, pid_dir: str, async_save: bool) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    actor = _actor(src, async_save=async_save)
    original = FileSystemWriterAsync.write_preloaded_data
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_writers_outliving_their_rank(os.getpid(), pid_dir, original))
    actor.save_checkpoint(_step_path(root, 1), global_step=1)
    actor.finalize_checkpoint()
    time.sleep(120)  # not reached: the writers kill this rank


@pytest.mark.parametrize("async_save", [True], ids=["async"])
def test_no_process_of_a_save_outlives_its_killed_rank(tiny_moe_path, tmp_path, async_save):
    """megatron's writers stayed blocked forever (in ``JoinableQueue.task_done`` on the dead
    rank's condition) when the rank was SIGKILLed mid-write. A sync save forks nothing any more (its writer is
    the rank's threads: tests/test_dist_writer.py), so only the async save's fork and writers remain."""
    pid_dir = tmp_path / "writers"
    pid_dir.mkdir()
    with pytest.raises(RankFailure, match="died with exit code -9"):
        run_on_ranks(_save_killed_while_writers_run, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path / "run"), str(pid_dir), async_save), timeout_s=240)
    writers = {int(name): int((pid_dir / name).read_text()) for name in os.listdir(pid_dir)}
    assert writers, "no writer process ran"
    # the async save's own fork (the writers' parent) too
    assert not _survivors([*writers, *writers.values()], within_s=10), "a save's process outlived its rank"


def _resume_config(root: str):
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "verl", "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, f"trainer.default_local_dir={root}"])


@pytest.mark.parametrize("damage", ["none", "truncated", "not_a_zip"])
def test_the_data_position_is_checked_before_any_rank_starts(base_root, tmp_path, damage):
    """``global_step_N/data.pt`` lies outside the actor's manifest: the pre-start check reads it whole, or a
    truncated one would fail only after every rank had loaded the step."""
    from verl.trainer.resume_step import check_resume_step
    from verl.trainer.run_config import ConfigError, build_run_config

    root = _copy_run(base_root, tmp_path)
    data = os.path.join(root, "global_step_1", "data.pt")
    torch.save({"epoch": 0, "position": 64, "order": torch.arange(512)}, data)
    if damage == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
    elif damage == "not_a_zip":
        open(data, "wb").write(b"\0" * 100)
    config = _resume_config(root)
    if damage == "none":
        found = check_resume_step(build_run_config(config))
        assert (found.step, found.step_dir) == (1, os.path.join(root, "global_step_1"))
        return
    with pytest.raises(ConfigError, match=re.escape(f"{data} is damaged")):
        check_resume_step(build_run_config(config))


def test_a_data_position_of_other_data_is_refused_before_ray(tiny_moe_path, base_root, tmp_path):
    """The sampler refuses another seed, order or prompt count only after every rank has loaded the step; the
    CLI's pre-start check does it before Ray starts, naming the setting (a step saved before ``shuffle`` was
    recorded is checked on the other two)."""
    import subprocess
    import sys

    from verl.trainer.resume_step import data_position_problems
    from verl.trainer.run_config import build_run_config

    root = _copy_run(base_root, tmp_path)
    step_dir = os.path.join(root, "global_step_1")
    torch.save({"epoch": 0, "position": 64, "batches_served": 4, "seed": 5, "shuffle": True, "num_rows": 1000}, os.path.join(step_dir, "data.pt"))
    config = _resume_config(root)
    assert data_position_problems(step_dir, build_run_config(config).data, 1000) == [
        f"{step_dir}/data.pt is the data position of a run with data.seed=5; this run has data.seed={config.data.seed}: "
        "resume with the data config the step was saved with, or set trainer.resume_mode=disable"
    ]
    torch.save({"epoch": 0, "position": 64, "batches_served": 4, "seed": int(config.data.seed), "num_rows": 1000}, os.path.join(step_dir, "data.pt"))
    assert data_position_problems(step_dir, build_run_config(config).data, 1000) == []  # no shuffle recorded
    assert "training prompts=1000; this run has training prompts=999" in data_position_problems(step_dir, build_run_config(config).data, 999)[0]
    torch.save({"epoch": 0, "position": 64, "batches_served": 4, "seed": 5, "shuffle": True, "num_rows": 1000}, os.path.join(step_dir, "data.pt"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH")) if p)}
    cli = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", MBRIDGE, HF_ROLLOUT, f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={root}", "trainer.resume_mode=auto"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    out = cli.stdout + cli.stderr
    assert cli.returncode == 2 and "data.pt is the data position of a run with data.seed=5" in out, out[-3000:]


def test_a_step_of_ours_stripped_of_manifest_and_commit_mark_is_refused_before_ray(tiny_moe_path, base_root, tmp_path):
    """Without manifest.json and committed.json a step would pass for upstream verl's and load unchecked; what
    else only this package writes (the per-rank RNG states, its own ckpt_contents.json words) gives it away:
    the CLI's pre-start check refuses it, naming those files, before Ray starts. Upstream's steps still load."""
    import subprocess
    import sys
    import warnings

    root = _copy_run(base_root, tmp_path)
    step = _step_path(root, 1)
    torch.save({"epoch": 0, "position": 64}, os.path.join(root, "global_step_1", "data.pt"))
    os.remove(os.path.join(step, "manifest.json"))
    os.remove(os.path.join(step, "committed.json"))
    named = [os.path.join(step, "extra", "dist_ckpt", ".metadata") + " holds rank_rng_state", os.path.join(step, "ckpt_contents.json")]
    with pytest.raises(CheckpointError, match="has neither manifest.json nor committed.json, yet it was saved by this package") as refused:
        verify_checkpoint(step)
    assert all(n in str(refused.value) for n in named), refused.value
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH")) if p)}
    started = time.monotonic()
    cli = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", MBRIDGE, HF_ROLLOUT, f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={root}", "trainer.resume_mode=auto"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    out = cli.stdout + cli.stderr
    assert cli.returncode == 2, out[-3000:]
    assert all(n in out for n in named) and "trainer.resume_from_path=<its global_step_N>" in out, out[-3000:]
    assert "Ray instance" not in out and "ranks up" not in out, out[-3000:]
    assert time.monotonic() - started < 120
    assert os.path.isdir(step)  # nothing deleted
    upstream = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "verl091", "tp1_pp1_ep1", "global_step_2", "actor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verify_checkpoint(upstream)
    assert any("saved by upstream verl" in str(w.message) for w in caught)


def _strip_our_marks(step: str, stripped: str) -> None:
    """What the CLI case below cannot see: a step of ours without manifest, commit mark, ``extra/`` (the
    per-rank RNG states) and the contents file's ``directories``, an optimizer shard flipped; ``notes``: its
    contents' notes gone as well, so only the contents file's ``integrity`` entry is left; ``integrity``: that
    entry gone instead, the notes left."""
    for name in ("manifest.json", "committed.json"):
        os.remove(os.path.join(step, name))
    shutil.rmtree(os.path.join(step, "extra"), ignore_errors=True)  # a step saved without 'extra' has none
    path = os.path.join(step, "ckpt_contents.json")
    contents = json.load(open(path))
    del contents["directories"]
    for entry in contents["contents"].values():
        if stripped == "notes":
            entry.pop("note", None)
    if stripped == "integrity":
        del contents["integrity"]
    json.dump(contents, open(path, "w"))
    _flip_optimizer_shard(step)


@pytest.mark.parametrize("stripped", ["marks", "notes", "integrity"], ids=["marks_stripped", "notes_stripped_too", "integrity_entry_stripped_too"])
def test_a_step_of_ours_stripped_of_every_mark_is_not_taken_for_upstreams(base_root, tmp_path, capsys, stripped):
    """Stripped of manifest, commit mark, ``extra/`` and ``directories``, a step of ours used to pass as
    upstream verl's (verify OK, resume accepted), a flipped shard and all. Its contents file still says whose
    it is: verify and the pre-start check refuse it in one line naming the missing files and the fix."""
    from verl.model_merger.__main__ import main as merger
    from verl.trainer.resume_step import check_resume_step
    from verl.trainer.run_config import ConfigError, build_run_config

    root = _copy_run(base_root, tmp_path)
    step = _step_path(root, 1)
    _strip_our_marks(step, stripped)
    refusal = re.compile(
        rf"checkpoint {re.escape(step)} has neither manifest\.json nor committed\.json, yet it was saved by this package "
        rf"\({re.escape(step)}/ckpt_contents\.json [^)]*\): .* resume an earlier step \(trainer\.resume_mode=resume_path "
        r"trainer\.resume_from_path=<its global_step_N>\) or restore both files from a copy of this step$"
    )
    assert merger(["verify", "--local_dir", step]) == 1
    err = capsys.readouterr().err.strip()
    assert refusal.fullmatch(err.removeprefix("DAMAGED: ")), err
    with pytest.raises(ConfigError) as refused:
        check_resume_step(build_run_config(_resume_config(root)))
    assert len(refused.value.problems) == 1 and refusal.search(refused.value.problems[0]), refused.value.problems
    assert os.path.isdir(os.path.join(step, "optimizer"))  # nothing deleted


# --------------------------------------------------------------------------- a checkpoint is data, not code


def _craft_bytes_item(step: str, marker: str) -> str:
    """The RNG state item of ``extra/dist_ckpt`` pointed at a crafted ``torch.save`` appended to its shard; the
    ``.metadata`` itself stays plain DCP metadata and the manifest is re-hashed. Returns the shard."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from verl.utils.checkpoint.data_only import read_dcp_metadata

    directory = os.path.join(step, "extra", "dist_ckpt")
    metadata = read_dcp_metadata(os.path.join(directory, ".metadata"))
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata) and i.fqn.startswith("rng_state"))
    info = metadata.storage_data[index]
    shard = os.path.join(directory, info.relative_path)
    buffer = io.BytesIO()
    torch.save(CreatesFile(marker), buffer)
    info.offset, info.length = os.path.getsize(shard), len(buffer.getvalue())
    with open(shard, "ab") as handle:
        handle.write(buffer.getvalue())
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    rewrite_manifest(step)
    return shard


def _load_without_the_checks(src: str, step: str) -> str:
    """The manager's own load, skipping the pre-load check: the reader itself must refuse."""
    actor = _actor(src)
    try:
        actor.checkpoint_manager.load_checkpoint(step)
    except BaseException as exc:  # noqa: BLE001 - torch DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _assert_refused_everywhere(tiny_moe_path: str, root: str, step: str, named: str, marker: str) -> None:
    from verl.utils.checkpoint.data_only import UntrustedContentError

    with pytest.raises(UntrustedContentError, match=re.escape(named)):
        verify_checkpoint(step)  # what the pre-start check and check_before_load run
    with pytest.raises(UntrustedContentError, match=re.escape(named)):
        find_resume_checkpoint(root)
    for message in run_on_ranks(_load_without_the_checks, WORLD, LAYOUT, args=(tiny_moe_path, step)):
        assert "UntrustedContentError" in message and named in message, message
    assert not os.path.exists(marker), "the crafted file ran"


def test_a_crafted_dcp_metadata_is_refused_and_nothing_of_it_runs(tiny_moe_path, base_root, tmp_path):
    from verl.model_merger.megatron_merge import saved_model_dtype
    from verl.utils.checkpoint.data_only import UntrustedContentError

    root = _copy_run(base_root, tmp_path)
    marker = str(tmp_path / "ran")
    path = craft_metadata(_step_path(root, 1), marker)
    _assert_refused_everywhere(tiny_moe_path, root, _step_path(root, 1), f"{path} names io.open", marker)
    with pytest.raises(UntrustedContentError, match=re.escape(path)):  # the merger reads a model's .metadata so
        saved_model_dtype(os.path.dirname(path))
    assert not os.path.exists(marker)


def test_a_crafted_bytes_item_in_a_shard_is_refused_and_nothing_of_it_runs(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    marker = str(tmp_path / "ran")
    shard = _craft_bytes_item(_step_path(root, 1), marker)
    _assert_refused_everywhere(tiny_moe_path, root, _step_path(root, 1), shard, marker)


def _craft_pickled_file(root: str, relative: str, marker: str) -> str:
    """``global_step_1/<relative>`` (a dist checkpoint's ``common.pt``, the step's ``data.pt``) replaced by a
    ``torch.save`` naming a function, the manifest re-hashed where the file is the actor's. Returns its path."""
    path = os.path.join(root, "global_step_1", relative)
    torch.save({"optimizer": CreatesFile(marker), "epoch": 0}, path)
    if relative.startswith("actor/"):
        rewrite_manifest(_step_path(root, 1))
    return path


@pytest.mark.parametrize("relative", ["actor/optimizer/dist_ckpt/common.pt", "actor/extra/dist_ckpt/common.pt", "data.pt"])
def test_a_crafted_pickled_step_file_is_refused_in_one_line_before_ray(base_root, tmp_path, capsys, relative):
    """megatron's ``common.pt`` and the driver's ``data.pt`` are loaded weights-only, so a crafted one runs
    nothing, but it used to pass ``verify`` and the pre-start check and fail only once every rank had started,
    in torch's traceback. Both now refuse it in one line naming the file and the global it names."""
    from verl.model_merger.__main__ import main as merger
    from verl.trainer.resume_step import check_resume_step, data_position_problems
    from verl.trainer.run_config import ConfigError, build_run_config

    root = _copy_run(base_root, tmp_path)
    marker = str(tmp_path / "ran")
    path = _craft_pickled_file(root, relative, marker)

    def names_the_file_and_the_global(line: str) -> bool:  # torch's own wording varies ("io.open", "_io.open")
        return f"{path} holds something" in line and "Unsupported global" in line and "io.open" in line

    assert merger(["verify", "--local_dir", root]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("DAMAGED: ") and names_the_file_and_the_global(err) and "\n" not in err and "safe_globals" not in err, err
    config = _resume_config(root)
    try:  # the driver's pre-start checks, in main_ppo's order
        step = check_resume_step(build_run_config(config))
        problems = data_position_problems(step.step_dir, build_run_config(config).data, 1000)
    except ConfigError as exc:
        problems = exc.problems
    assert len(problems) == 1 and names_the_file_and_the_global(problems[0]), problems
    assert not os.path.exists(marker), "the crafted file ran"


def _point_a_tensor_item_outside(step: str, elsewhere: str) -> str:
    """A tensor item of ``optimizer/dist_ckpt`` pointed at a copy of its shard outside the step (absolute path);
    the ``.metadata`` stays plain DCP metadata and the manifest is re-hashed. Returns the item's new path."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from verl.utils.checkpoint.data_only import read_dcp_metadata

    directory = os.path.join(step, "optimizer", "dist_ckpt")
    metadata = read_dcp_metadata(os.path.join(directory, ".metadata"))
    index = next(i for i in metadata.storage_data if not isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    info = metadata.storage_data[index]
    os.makedirs(elsewhere, exist_ok=True)
    target = shutil.copy(os.path.join(directory, info.relative_path), elsewhere)  # the same bytes: only the place differs
    info.relative_path = target
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    rewrite_manifest(step)
    return target


def test_a_tensor_item_pointed_outside_its_step_is_refused(tiny_moe_path, base_root, tmp_path):
    """torch's reader would read it from anywhere on the host, past the manifest; the check and the reader refuse."""
    root = _copy_run(base_root, tmp_path)
    target = _point_a_tensor_item_outside(_step_path(root, 1), str(tmp_path / "elsewhere"))
    _assert_refused_everywhere(tiny_moe_path, root, _step_path(root, 1), f"outside its directory: {target}", str(tmp_path / "ran"))


def _async_save_with_a_crafted_outcome(src: str, root: str, marker: str) -> str:
    import pickle

    from verl.utils.checkpoint import snapshot_save

    path, _ = find_resume_checkpoint(root)
    actor = _actor(src, async_save=True, async_mode="snapshot")  # the writer whose fork leaves an outcome file
    actor.load_checkpoint(path)
    actor.save_checkpoint(_step_path(root, 2), global_step=2)
    rank = actor.checkpoint_manager.rank
    if rank == 1:  # replaced once the fork has left its own, before the parent reads it
        outcome = snapshot_save.outcome_path(_step_path(root, 2) + ".incomplete", rank)
        deadline = time.monotonic() + 120
        while not os.path.exists(outcome) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(outcome, "wb") as handle:
            pickle.dump({"ok": True, "writes": CreatesFile(marker)}, handle)
    try:
        actor.finalize_checkpoint()
    except CheckpointError as exc:
        return str(exc)
    return "committed"


def test_a_crafted_outcome_file_fails_the_async_save_and_nothing_of_it_runs(tiny_moe_path, base_root, tmp_path):
    root = _copy_run(base_root, tmp_path)
    marker = str(tmp_path / "ran")
    for message in run_on_ranks(_async_save_with_a_crafted_outcome, WORLD, LAYOUT, args=(tiny_moe_path, root, marker), timeout_s=300):
        assert "rank 1: the outcome file" in message and "rank1.json is not a background save's JSON outcome" in message, message
    assert not os.path.exists(marker), "the crafted outcome ran"
    assert _tracked(root) == "1" and not os.path.exists(_step_path(root, 2))

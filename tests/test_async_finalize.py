"""An async save is committed only when the write it waited for completed, whoever finalized it; a failed one
leaves nothing tracked, and nothing behind that the next save of the process would take for its own.

Through the Python API (``MegatronEngine``, the manager, the step transaction), two ranks, the background write
(a CUDA host's path). A save's fork is killed in its first instant by a fork hook of the rank, as
tests/save_points does for a run.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.test_checkpoint_lifecycle import (
    LAYOUT,
    WORLD,
    _actor,
    _batches,
    _differing,
    _params_and_optimizer,
    _step_path,
    _tracked,
)
from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.checkpoint.integrity import CheckpointError, verify_checkpoint
from verl.utils.distributed import run_on_ranks
from verl.utils.internals import megatron_core

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "checkpoint.md")

_fork_dies = False  # set on a rank for one save: the process it forks dies at once (SIGKILL)


def _die_if_armed() -> None:
    if _fork_dies:
        os.kill(os.getpid(), signal.SIGKILL)


def _save_whose_fork_dies(actor, root: str, step: int, rank: int) -> None:
    """``actor``'s async save of ``step``, rank ``rank``'s fork killed as it starts (its peer's fork writes on)."""
    global _fork_dies
    _fork_dies = torch.distributed.get_rank() == rank
    try:
        actor.save_checkpoint(_step_path(root, step), global_step=step, track=True)
    finally:
        _fork_dies = False


def _failed_write_then_next_save(src: str, root: str) -> dict:
    """Step 1 saved and tracked; step 2's fork dies on rank 1, its failure taken by a direct call of the
    manager's finalize, then the engine's finalize; then step 3, saved after a training step (the optimizer
    gained state: a new checkpoint structure), in the same process."""
    os.register_at_fork(after_in_child=_die_if_armed)
    actor = _actor(src, async_save=True, async_mode="background_write")
    actor.save_checkpoint(_step_path(root, 1), global_step=1, track=True)
    actor.finalize_checkpoint()
    _save_whose_fork_dies(actor, root, 2, rank=1)
    result: dict = {}
    try:
        actor.checkpoint_manager.finalize_async_save()
    except CheckpointError as exc:
        result["direct"] = str(exc)
    try:
        result["engine"] = actor.finalize_checkpoint()
    except CheckpointError as exc:
        result["engine_error"] = str(exc)
    torch.distributed.barrier()
    step_dir = os.path.join(root, "global_step_2")
    result["after_failure"] = (_tracked(root), os.path.exists(step_dir), os.path.exists(_step_path(root, 2) + ".incomplete"))
    # what a writer SIGKILLed with the fork had already sent to the Manager server arrives after the drain
    megatron_core.WRITE_RESULTS_QUEUE.get()().put(RuntimeError("a write result sent after its failed save's drain"))
    torch.distributed.barrier()

    actor.train_step(_batches(1))
    at_save = _params_and_optimizer(actor)
    actor.save_checkpoint(_step_path(root, 3), global_step=3, track=True)
    actor.train_step(_batches(2))  # the state moves on: the load below must bring step 3's back
    result["step_3"] = actor.finalize_checkpoint()
    try:
        actor.load_checkpoint(_step_path(root, 3))
        result["step_3_vs_state_at_save"] = _differing(at_save, _params_and_optimizer(actor))
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException included; the test names it
        result["step_3_load_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
    return result


@pytest.fixture(scope="module")
def failed_then_next(tiny_moe_path, tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("failed_then_next") / "run")
    return root, run_on_ranks(_failed_write_then_next_save, WORLD, LAYOUT, args=(tiny_moe_path, root), timeout_s=300)


def test_a_failed_async_write_is_never_committed_nor_tracked(failed_then_next):
    """Was: the direct finalize raised, then the engine's finalize renamed step 2 into place and tracked it: it
    read "nothing pending" as "completed"."""
    root, results = failed_then_next
    for rank, result in enumerate(results):
        assert "rank 1: the background writer of rank 1 exited without a result" in result.get("direct", ""), result
        error = result.get("engine_error")  # one line, naming the step, saying nothing was committed
        assert error is not None, f"rank {rank}: the engine committed a failed write: {result.get('engine')}"
        assert "\n" not in error and "step 2" in error and "did not complete" in error, error
        assert "Nothing was committed; the previous checkpoint and the tracker are unchanged." in error, error
        assert result["after_failure"] == ("1", False, False), result["after_failure"]  # tracker, step, staging
    verified = subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "verify", "--local_dir", _step_path(root, 1)], capture_output=True, text=True
    )
    assert verified.returncode == 0 and "OK:" in verified.stdout, verified.stdout + verified.stderr


def test_the_next_async_save_after_a_failed_one_loads_equal_to_the_state_it_saved(failed_then_next):
    """Was: rank 0's fork, which had written, left its write results in the process's results queue, where step 3's
    finalize took them for its own: step 3's optimizer ``.metadata`` described step 2's writes (no Adam moments),
    and step 3 committed but failed to load."""
    root, results = failed_then_next
    for result in results:
        assert result["step_3"] == _step_path(root, 3)
        assert "step_3_load_error" not in result, result.get("step_3_load_error")
        assert result["step_3_vs_state_at_save"] == [], result["step_3_vs_state_at_save"][:5]
    verify_checkpoint(_step_path(root, 3))


# ------------------------------------------------------------------ docs/checkpoint.md's recipe


def _recipe() -> str:
    """The python block of docs/checkpoint.md that commits a deferred save (the one defining ``written``)."""
    with open(DOC, encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    (recipe,) = [block for block in blocks if "def written(" in block]
    return recipe


def _finalize_as_another_caller(manager) -> str:
    try:
        return manager.finalize_async_save(blocking=True).value
    except CheckpointError:
        return "raised"


def _recipe_with_a_second_caller(src: str, root: str, second_first: bool, fork_dies: bool) -> dict:
    """The recipe as written, on a save that another caller finalizes too: before the recipe's first call
    (``second_first``) or after it; ``fork_dies``: rank 1's fork killed, the failure then the other caller's.
    Once committed, a second caller that only follows the recipe runs it too (``again``)."""
    from verl.utils.checkpoint.megatron_state_dicts import current_parallel_layout
    from verl.utils.checkpoint.step_commit import StepCommit, StepSpec

    os.register_at_fork(after_in_child=_die_if_armed)
    global _fork_dies
    actor = _actor(src, async_save=True, async_mode="background_write")
    manager = actor.checkpoint_manager
    spec = StepSpec(role="actor", hf_config=manager.hf_config, parallel=current_parallel_layout(), retention=manager, track=True)
    transaction = StepCommit(_step_path(root, 1), 1, spec)
    _fork_dies = fork_dies and torch.distributed.get_rank() == 1
    try:
        with transaction as staging:
            manager.save_checkpoint(staging, global_step=1)
            if manager.async_save_pending:
                transaction.defer()
    finally:
        _fork_dies = False
    answers, error, record = [], None, None
    namespace = {"manager": manager, "transaction": transaction}
    if second_first:
        answers.append(_finalize_as_another_caller(manager))
    try:
        for _ in range(1200):  # polled as a trainer does between steps (as many times on every rank)
            exec(_recipe(), namespace)
            if namespace["record"] is not None:
                record = namespace["record"].path
                break
            time.sleep(0.1)
    except CheckpointError as exc:
        error = str(exc)
    if not second_first:
        answers.append(_finalize_as_another_caller(manager))
    again = None
    if record is not None:  # a second caller that only follows the recipe, once the save is committed
        follower = {"manager": manager, "transaction": transaction}
        exec(_recipe(), follower)
        again = follower["record"].path
    try:
        manager.completed_save(os.path.join(root, "elsewhere"))
        not_latest = None
    except CheckpointError as exc:
        not_latest = str(exc)
    return {"other_caller": answers, "record": record, "again": again, "error": error, "not_latest": not_latest}


def test_the_documented_async_recipe_commits_whoever_else_finalizes(tiny_moe_path, tmp_path):
    """Was: the recipe passed ``finalize_async_save`` itself, whose None meant both "still writing" and "nothing
    pending": once another caller had finalized the save, the recipe waited for ever."""
    for second_first in (True, False):
        root = str(tmp_path / f"second_first_{second_first}")
        results = run_on_ranks(_recipe_with_a_second_caller, WORLD, LAYOUT, args=(tiny_moe_path, root, second_first, False), timeout_s=300)
        for result in results:
            assert result["error"] is None, result["error"]
            assert result["record"] == _step_path(root, 1) == result["again"]  # the follower gets the same step
            assert result["other_caller"] == ["done" if second_first else "nothing_pending"]
            assert result["not_latest"].endswith("call engine.finalize_checkpoint() before saving through the manager directly")
        assert _tracked(root) == "1"
        verify_checkpoint(_step_path(root, 1))


def test_the_documented_async_recipe_commits_nothing_when_another_caller_met_the_failure(tiny_moe_path, tmp_path):
    root = str(tmp_path / "run")
    for result in run_on_ranks(_recipe_with_a_second_caller, WORLD, LAYOUT, args=(tiny_moe_path, root, True, True), timeout_s=300):
        assert result["other_caller"] == ["raised"] and result["record"] is None
        # the refusal quotes the failure the other caller met (its class and cause), not only that there was one
        assert re.search(r"did not complete: its write failed \(\w+: .+\)", result["error"]) and "Nothing was committed" in result["error"], result["error"]
    assert not os.path.exists(os.path.join(root, "global_step_1"))
    assert not os.path.exists(get_checkpoint_tracker_filename(root))

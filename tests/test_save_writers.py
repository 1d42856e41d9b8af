"""A writer is added in one place: a toy writer registered from this test (``save_writers.WRITERS``), with no
edit of the manager, runs a save's phases in an order of its own and commits a whole step.

The toy exports the HF folder before the dist checkpoints (the sync writer exports beside or after them). It is
also one of the writers the SIGKILL-per-phase matrix runs (``test_checkpoint_lifecycle``). Observed through the
phase hook (``on_save_phase``), the save's report (``last_save``) and the committed files.
"""

from __future__ import annotations

from verl.utils.checkpoint import save_writers
from verl.utils.checkpoint.async_modes import AsyncMode
from verl.utils.checkpoint.integrity import verify_checkpoint
from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
from verl.utils.distributed import run_on_ranks


class ToyWriter:
    """Everything in the rank, the HF export first (over the default group), then the dist checkpoints."""

    mode = AsyncMode.SYNC

    def run(self, job: save_writers.SaveJob) -> save_writers.WriterOutcome:
        job.check()
        job.prepare(True)
        exported = job.export_and_seal()
        job.plan_in_rank(False)
        job.sealer.seal(job.dist_written())
        return save_writers.WriterOutcome(hf_exported=exported)


def register_toy_writer() -> None:
    """In a rank: every sync save of a manager built after this takes the toy writer."""
    save_writers.WRITERS[AsyncMode.SYNC] = ToyWriter


class PhaseNotingManager(MegatronCheckpointManager):
    phases: list[str] = []

    def on_save_phase(self, phase: str) -> None:
        PhaseNotingManager.phases.append(phase)


def _save_with_the_toy(src: str, root: str) -> dict:
    from tests.test_checkpoint_lifecycle import _actor, _batches, _step_path

    register_toy_writer()
    actor = _actor(src, manager_cls=PhaseNotingManager)
    actor.train_step(_batches(0))
    actor.save_checkpoint(_step_path(root, 1), global_step=1, track=True)
    report = actor.checkpoint_manager.last_save
    return {"phases": PhaseNotingManager.phases, "hf_exported": report.hf_exported, "completed": report.completed}


def test_a_writer_registered_from_a_test_runs_its_own_order_and_commits_a_whole_step(tiny_moe_path, tmp_path):
    from tests.test_checkpoint_lifecycle import LAYOUT, WORLD, _step_path

    root = str(tmp_path / "run")
    for rank, result in enumerate(run_on_ranks(_save_with_the_toy, WORLD, LAYOUT, args=(tiny_moe_path, root), timeout_s=240)):
        phases = result["phases"]
        assert result["hf_exported"] and result["completed"], (rank, result)
        assert "hf_weights" in phases and "dist_checkpoint" in phases, (rank, phases)
        assert phases.index("hf_weights") < phases.index("dist_checkpoint"), f"rank {rank}: the toy's order was not kept: {phases}"
    verify_checkpoint(_step_path(root, 1))

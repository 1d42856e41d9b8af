"""The LR schedule survives a resume: the manager restores megatron's OptimizerParamScheduler on every load,
and ``use_checkpoint_opt_param_scheduler`` only says whose settings it keeps (verl #7953: upstream loads the
scheduler only with that flag, which defaults to False, so a resume restarts warmup and decay)."""

import os

import pytest
import torch

from tests.main_leg import actor_configs, override
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes
from verl.workers.config import McoreOptimizerConfig

STEPS = 6
COSINE = {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 2, "lr_decay_style": "cosine"}  # optim keys of a 6-step run


def _batches(step: int) -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(step))
    return [data[:2], data[2:]]


def _actor(src: str, optim: dict, distributed: bool, from_checkpoint: bool | None = None):
    """``from_checkpoint``: ``optim.use_checkpoint_opt_param_scheduler`` (None: the YAML leaves it out)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    overrides = [override(f"optim.{key}", value) for key, value in optim.items()]
    if from_checkpoint is not None:
        overrides.append(override("++optim.use_checkpoint_opt_param_scheduler", from_checkpoint))
    overrides += [override("megatron.use_distributed_optimizer", distributed), override("checkpoint.save_contents", ("model", "optimizer", "extra"))]
    return MegatronEngine(*actor_configs(src, *overrides, total_training_steps=STEPS))


def _train(actor, steps: range) -> list[float]:
    """The LR each optimizer step of ``steps`` ran with."""
    lrs = []
    for step in steps:
        lrs.append(actor.optimizer.param_groups[0]["lr"])
        actor.train_step(_batches(step))
    return lrs


def _stop_and_resume(src: str, root: str, distributed: bool) -> dict:
    config = COSINE
    whole = _actor(src, config, distributed)
    report = {"uninterrupted": _train(whole, range(STEPS)), "weights": whole.parameters_snapshot()}
    for stop in (1, 4):  # mid-warmup, mid-decay
        path = os.path.join(root, f"global_step_{stop}", "actor")
        first = _actor(src, config, distributed)
        lrs = _train(first, range(stop))
        first.save_checkpoint(path, global_step=stop)
        resumed = _actor(src, config, distributed)  # a fresh scheduler, built from the same config
        resumed.load_checkpoint(path)
        lrs += _train(resumed, range(stop, STEPS))
        report[f"stopped_at_{stop}"] = lrs
        report[f"differing_at_{stop}"] = [
            name for name, value in resumed.parameters_snapshot().items() if not torch.equal(value, report["weights"][name])
        ]
        if stop == 4:  # a later step loaded into a scheduler that already ran sets its position, not adds to it
            first.load_checkpoint(path)
            report["reloaded_into_a_used_scheduler"] = _train(first, range(stop, STEPS))

    # The flag: the step-4 checkpoint loaded by a run whose config doubles lr / min_lr.
    path = os.path.join(root, "global_step_4", "actor")
    for from_checkpoint in (True, False):
        actor = _actor(src, {**COSINE, "lr": 2e-3, "min_lr": 2e-4}, distributed, from_checkpoint)
        actor.load_checkpoint(path)
        report[f"from_checkpoint={from_checkpoint}"] = (_train(actor, range(4, STEPS)), actor.scheduler.max_lr)
    reference = _actor(src, {**COSINE, "lr": 2e-3, "min_lr": 2e-4}, distributed)
    report["changed_schedule"] = _train(reference, range(STEPS))
    report.pop("weights")
    return report


@pytest.mark.parametrize("distributed", [False, True], ids=["DO=False", "DO=True"])
def test_the_schedule_resumes_mid_warmup_and_mid_decay_whatever_the_flag(tiny_dense_path, tmp_path, distributed):
    report = run_on_ranks(_stop_and_resume, 1, ParallelSizes(), args=(tiny_dense_path, str(tmp_path), distributed))[0]
    uninterrupted = report["uninterrupted"]
    assert uninterrupted[0] < uninterrupted[1] < uninterrupted[2] == 1e-3 > uninterrupted[3] > uninterrupted[-1]  # warmup, cosine
    for stop in (1, 4):
        assert report[f"stopped_at_{stop}"] == uninterrupted  # bit for bit, the flag at its default (False)
        assert report[f"differing_at_{stop}"] == []
    assert report["reloaded_into_a_used_scheduler"] == uninterrupted[4:]
    # True: the checkpoint's settings (max_lr 1e-3) override the config's 2e-3
    lrs, max_lr = report["from_checkpoint=True"]
    assert (lrs, max_lr) == (uninterrupted[4:], 1e-3)
    # False: this config's settings, at the checkpoint's position (not from step 0)
    lrs, max_lr = report["from_checkpoint=False"]
    assert (lrs, max_lr) == (report["changed_schedule"][4:], 2e-3)


UPSTREAM_STEP = os.path.join(os.path.dirname(__file__), "fixtures", "verl091", "tp1_pp1_ep1", "global_step_2")


def test_a_resume_that_changes_the_schedule_length_is_warned_about_naming_both_keys():
    from verl.trainer.resume_step import schedule_length_warning

    # verl 0.9.1 saved this step from a 10-step cosine schedule with lr_decay_steps unset
    def optim(**changes) -> McoreOptimizerConfig:
        return McoreOptimizerConfig(**{"lr": 1e-2, "lr_decay_style": "cosine", "total_training_steps": 10, **changes})

    assert schedule_length_warning(UPSTREAM_STEP, optim()) is None  # the same length
    warning = schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20))
    assert "\n" not in warning
    assert "trainer.total_training_steps=20" in warning and "actor_rollout_ref.actor.optim.lr_decay_steps unset" in warning
    assert warning.endswith("set actor_rollout_ref.actor.optim.lr_decay_steps=10 to keep the saved schedule")
    assert "weight-decay" in schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20, weight_decay_incr_style="linear"))
    assert schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20, lr_decay_steps=10)) is None  # pinned
    # the checkpoint's settings are taken: the saved 10-step decay goes on whatever the step count
    assert schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20, use_checkpoint_opt_param_scheduler=True)) is None
    # a constant schedule with a fixed warmup has no length; a warmup given as a ratio of it has
    assert schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20, lr_decay_style="constant", lr_warmup_steps=1)) is None
    assert schedule_length_warning(UPSTREAM_STEP, optim(total_training_steps=20, lr_decay_style="constant", lr_warmup_steps_ratio=0.1))

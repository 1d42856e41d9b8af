"""The step a run resumes from, chosen and checked before Ray or any rank starts (``python -m
verl.trainer.main_ppo``): the checkpoint checks themselves are ``verl.utils.checkpoint.resume_check``'s; here
the trainer's part: which step, its data position (``data.pt``), and what a resume would change unasked."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any

from verl.trainer.config import DataConfig
from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.run_config import ConfigError, RunConfig
from verl.utils.checkpoint.layout import DATA_STATE_FILENAME, STEP_DIR_RE


@dataclass(frozen=True)
class ResumeStep:
    """The step a run resumes from, and what the pre-start check proved of it (handed to the ranks' load)."""

    step: int
    step_dir: str  # ``.../global_step_N``
    checked: Any  # ``verl.utils.checkpoint.resume_check.CheckedStep`` (torch: not imported at this module's top)


def check_resume_step(run: RunConfig, model_path: str | None = None) -> ResumeStep | None:
    """The step the run resumes from (the tracker's, or ``trainer.resume_from_path``), checked once before any
    rank starts as a load would check it (``resume_check.check_step``: every file at its size, the small files' checksums, the data-only
    metadata, HF export, contents, optimizer flag, dtype; with ``model_path`` also that it was saved from this
    model), plus the data position ``data.pt``; None to start fresh. Raises ConfigError, one line per problem."""
    from verl.models.mcore.bridge import checkpoint_bridge
    from verl.utils.checkpoint.errors import CheckpointError
    from verl.utils.checkpoint.integrity import tracked_step
    from verl.utils.checkpoint.resume_check import LoadTarget, StepDoesNotFitError, check_step

    trainer, actor = run.trainer, run.actor
    if trainer.resume_mode == "disable":
        return None
    target = LoadTarget(
        load_contents=tuple(actor.checkpoint.load_contents),
        use_distributed_optimizer=actor.megatron.use_distributed_optimizer,
        param_dtype=actor.megatron.dtype,
        bridge=checkpoint_bridge(actor.megatron.vanilla_mbridge),
    )
    problems = []
    try:
        if trainer.resume_mode == "resume_path":
            step_dir = os.path.abspath(os.path.expanduser(trainer.resume_from_path)).rstrip("/")
        else:
            actor_path, notes = tracked_step(os.path.abspath(os.path.expanduser(trainer.default_local_dir)), role="actor")
            for note in notes:
                print(f"[main_ppo] note: {note}", flush=True)
            if actor_path is None:
                return None
            step_dir = os.path.dirname(actor_path)
        identity = model_identity(model_path, actor.megatron.vanilla_mbridge) if model_path else (None, None)
        checked = check_step(os.path.join(step_dir, "actor"), target, *identity)
    except StepDoesNotFitError as exc:
        problems, checked = list(exc.problems), None
    except (CheckpointError, OSError) as exc:
        raise ConfigError([f"trainer.resume_mode={trainer.resume_mode}: {exc}"]) from exc
    problems += _data_state_problems(step_dir)
    if problems:
        raise ConfigError(problems)
    step = int(STEP_DIR_RE.match(os.path.basename(step_dir)).group(1))
    return ResumeStep(step, step_dir, checked)


def _data_state_problems(step_dir: str) -> list[str]:
    """``data.pt`` (the data position) exists and is whole. It lies outside the actor's manifest, so without
    this a truncated or flipped one would fail only after every rank had loaded, with a zip traceback: torch
    saves it as a zip archive, whose per-member CRC-32 ``testzip`` checks without importing torch."""
    path = os.path.join(step_dir, DATA_STATE_FILENAME)
    if not os.path.isfile(path):
        return [f"{step_dir} has no {DATA_STATE_FILENAME} (the data position; written by the GRPO trainer before the tracker): it was not saved by this trainer; set trainer.resume_mode=disable or choose another step"]
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        damaged = f"unreadable ({exc})"
    if damaged is None:
        return []
    return [f"{path} is damaged (truncated or changed since the save: {damaged}); restore it, or resume an earlier step with trainer.resume_mode=resume_path trainer.resume_from_path=<its global_step_N>"]


def data_position_problems(step_dir: str, data: DataConfig, train_prompts: int) -> list[str]:
    """The resumed step's data position was written for this run's data: the same ``data.seed``, ``data.shuffle``
    and number of training prompts. The sampler refuses other ones too, but only once every rank has loaded the
    step; a step saved before ``shuffle`` was recorded is checked on the other two."""
    from verl.utils.checkpoint.data_only import UntrustedContentError, load_weights_only

    path = os.path.join(step_dir, DATA_STATE_FILENAME)
    try:  # whole (checked by _data_state_problems before); data only, as the trainer's own load
        saved = load_weights_only(path, path)
    except UntrustedContentError as exc:
        return [str(exc)]
    if not isinstance(saved, dict):
        return [f"{path} holds a {type(saved).__name__}, not the data position a save writes (a dict): restore it, or set trainer.resume_mode=disable"]
    now = {"seed": data.seed, "shuffle": data.shuffle, "num_rows": train_prompts}
    differ = [key for key in now if key in saved and saved[key] != now[key]]
    if not differ:
        return []
    names = {"seed": "data.seed", "shuffle": "data.shuffle", "num_rows": "training prompts"}
    then = ", ".join(f"{names[key]}={saved[key]}" for key in differ)
    here = ", ".join(f"{names[key]}={now[key]}" for key in differ)
    return [f"{path} is the data position of a run with {then}; this run has {here}: resume with the data config the step was saved with, or set trainer.resume_mode=disable"]


def schedule_length_warning(step_dir: str, optim: Any) -> str | None:
    """One line when resuming ``step_dir`` would change the LR schedule's length unasked, else None.

    With ``optim.lr_decay_steps`` unset the decay runs over ``trainer.total_training_steps`` (the weight-decay
    increment always does), and a resume keeps this run's settings (``use_checkpoint_opt_param_scheduler`` False):
    a resume that changes the step count stretches or shrinks the rest of the schedule (a constant one, with a
    fixed warmup, has no length). The saved scheduler's own
    ``lr_decay_steps`` (upstream's too) is the length the interrupted run had. ``optim`` is the typed config,
    its ``total_training_steps`` filled in."""
    if optim.lr_decay_steps is not None or optim.use_checkpoint_opt_param_scheduler:
        return None
    warmup_from_ratio = optim.lr_warmup_steps_ratio and (optim.lr_warmup_steps is None or optim.lr_warmup_steps <= 0)
    if optim.lr_decay_style == "constant" and optim.weight_decay_incr_style == "constant" and not warmup_from_ratio:
        return None  # nothing of the schedule depends on its length
    path = os.path.join(step_dir, "actor", "optimizer", "dist_ckpt")
    if not os.path.isfile(os.path.join(path, "common.pt")):
        return None
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(path).get("lr_scheduler") or {}
    before, now = saved.get("lr_decay_steps"), int(optim.total_training_steps)
    if before is None or int(before) == now:
        return None
    also = " and the weight-decay increment" if optim.weight_decay_incr_style != "constant" else ""
    return (
        f"resuming {step_dir}, whose LR schedule decays over {before} steps, with trainer.total_training_steps={now} "
        f"and {_ACTOR}.optim.lr_decay_steps unset: the LR decay{also} from here on runs over {now} steps; "
        f"set {_ACTOR}.optim.lr_decay_steps={before} to keep the saved schedule"
    )


def model_identity(model_path: str, vanilla_mbridge: bool = False) -> tuple[Any, Any]:
    """(TransformerConfig, HF config) of ``model_path`` for the pre-start identity check of a resumed step, or
    (None, None) when it cannot be built here (the ranks then make the check after they start, as before).

    The mapping of the bridge the ranks build through (``vanilla_mbridge``), made without process groups (the
    compared fields do not depend on the layout).
    """
    from verl.models.mcore import load_hf_config
    from verl.models.mcore.bridge import transformer_config_without_ranks

    hf_config = load_hf_config(model_path)
    transformer_config = transformer_config_without_ranks(hf_config, vanilla_mbridge)
    return (None, None) if transformer_config is None else (transformer_config, hf_config)

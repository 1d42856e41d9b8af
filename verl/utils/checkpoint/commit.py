"""The check before a load, and the parallel layout a save records.

Saving is the step transaction's (``verl.utils.checkpoint.step_commit``); this module holds what a load of a
committed step checks first, on every rank together, before any tensor is read.
"""

from __future__ import annotations

import os
import warnings

import torch

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, list_step_dirs
from verl.utils.checkpoint.integrity import CheckpointError, read_ckpt_contents, read_manifest, verify_checkpoint
from verl.utils.checkpoint.megatron_state_dicts import current_parallel_layout
from verl.utils.checkpoint.step_commit import from_rank_zero


def check_before_load(manager: BaseCheckpointManager, local_path: str) -> None:
    """All ranks, before ``manager.load_checkpoint(local_path)``: rank 0 checks the step is whole, of this model,
    holds what ``load_contents`` asks for, and fits this run's optimizer; any problem fails every rank at once,
    before anything loads. Then the committed steps up to this one become ``previous_saved_paths`` (retention
    of a resumed run prunes them as it would have)."""

    def check() -> str | None:
        try:
            _check_step(manager, local_path)
        except (CheckpointError, FileNotFoundError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    problem = from_rank_zero(check, f"check {local_path}", local_path)
    if problem is not None:
        raise CheckpointError(f"cannot load {local_path}; nothing was loaded. {problem}")
    if not manager.should_load_optimizer and torch.distributed.get_rank() == 0:
        warnings.warn(
            f"loading {local_path} without its optimizer state (load_contents={manager.checkpoint_load_contents}): "
            "Adam's moments and step start from zero and the LR schedule from its start",
            stacklevel=2,
        )
    manager.previous_saved_paths = saved_steps_up_to(local_path)


def _check_step(manager: BaseCheckpointManager, local_path: str) -> None:
    verify_checkpoint(local_path, getattr(manager, "transformer_config", None), getattr(manager, "hf_config", None))
    saved = read_ckpt_contents(local_path)
    missing = [c for c in manager.checkpoint_load_contents if c != "hf_model" and c not in saved.get("save_contents", [])]
    if missing:
        raise CheckpointError(
            f"{local_path} holds {saved.get('save_contents')} but load_contents asks for {missing}; "
            "drop them from actor_rollout_ref.actor.checkpoint.load_contents"
        )
    manifest = read_manifest(local_path)
    if manifest is not None and manager.should_load_optimizer:
        _check_optimizer_fits(manager, local_path, manifest)


def _check_optimizer_fits(manager: BaseCheckpointManager, local_path: str, manifest: dict) -> None:
    saved_do, now_do = manifest.get("use_distributed_optimizer"), getattr(manager, "use_distributed_optimizer", False)
    if saved_do is not None and saved_do != now_do:
        raise CheckpointError(
            f"{local_path} optimizer state was saved with use_distributed_optimizer={saved_do}, this run uses {now_do}; "
            f"set actor_rollout_ref.actor.megatron.use_distributed_optimizer={saved_do} or drop 'optimizer' from "
            "actor_rollout_ref.actor.checkpoint.load_contents"
        )
    if not now_do:
        return
    saved = {k: v for k, v in manifest.get("parallel", {}).items() if k != "world_size"}
    now = {k: v for k, v in current_parallel_layout().items() if k != "world_size"}
    if saved != now:
        raise CheckpointError(
            f"{local_path} holds distributed-optimizer state saved at {saved}; it loads only at the same "
            f"TP/PP/EP/ETP/CP (and virtual pipeline size), this run is {now}. Load the model alone (drop 'optimizer' from "
            "actor_rollout_ref.actor.checkpoint.load_contents), or save with "
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False, whose optimizer state loads at any layout."
        )


def saved_steps_up_to(local_path: str) -> list[str]:
    """The committed ``global_step_N/<role>`` directories beside ``local_path`` up to its step, oldest first."""
    path = os.path.abspath(local_path.rstrip("/"))
    role, step_dir = os.path.basename(path), os.path.dirname(path)
    root = os.path.dirname(step_dir)
    found = [os.path.join(d, role) for _, d in list_step_dirs(root) if os.path.isdir(os.path.join(d, role))]
    return found[: found.index(path) + 1] if path in found else [path]

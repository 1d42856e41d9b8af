"""The commit step: what turns the parts a checkpoint manager wrote into a checkpoint, and the check before a load.

``MegatronCheckpointManager.save_checkpoint(path)`` writes upstream verl's parts into the directory it is
given, as upstream's does. The worker gives it a staging directory (``<step>/actor.incomplete``) and then
calls ``commit_checkpoint``: every rank takes part, rank 0 does the file work.

1. the HF folder is checked against every tensor the HF config implies (a missing MoE expert fails the save);
2. our commit mark and ``manifest.json`` (every file with its size, the parallel layout) are written;
3. everything is fsynced and the staging directory renamed into place in one step;
4. retention, with upstream's ``previous_saved_paths`` semantics, never removing the tracked step.

The tracker is the driver's to move, after this returned on every rank. A crash anywhere before the rename
leaves only the staging directory, which the next save of that step starts afresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings

import torch
from megatron.core import parallel_state as mpu

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, config_get, list_step_dirs
from verl.utils.checkpoint.hf_verify import HFCheckpointIncompleteError, verify_hf_checkpoint
from verl.utils.checkpoint.integrity import (
    COMMIT_MARK_FILENAME,
    FORMAT_VERSION,
    MANIFEST_FILENAME,
    STAGING_SUFFIX,
    CheckpointError,
    build_manifest,
    fsync_tree,
    read_ckpt_contents,
    read_manifest,
    verify_checkpoint,
)
from verl.utils.fs import atomic_write_text, fsync_path
from verl.utils.megatron_utils import get_hf_model_checkpoint_path


def current_parallel_layout() -> dict[str, int]:
    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
    }


def staging_path(local_path: str) -> str:
    """Where the parts of ``local_path`` are written before the commit renames them into place."""
    return local_path.rstrip("/") + STAGING_SUFFIX


def prepare_staging(local_path: str) -> str:
    """All ranks: a leftover staging directory is an interrupted attempt; start it afresh. Returns its path."""
    staging = staging_path(local_path)
    if torch.distributed.get_rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    torch.distributed.barrier()
    return staging


def discard_staging(local_path: str) -> None:
    """Rank 0: drop the staging directory of a save that failed, and its ``global_step_N`` directory when that is
    left empty (the committed steps stay as they are)."""
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(staging_path(local_path), ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty (another role's save, the data position) or already gone
            os.rmdir(os.path.dirname(os.path.abspath(local_path.rstrip("/"))))


def _agreed(check) -> str | None:
    """Rank 0 runs ``check`` (returns a problem or None); every rank learns the verdict."""
    verdict = [None]
    if torch.distributed.get_rank() == 0:
        verdict = [check()]
    torch.distributed.broadcast_object_list(verdict, src=0)
    return verdict[0]


def _verify_hf_export(manager: BaseCheckpointManager, staging: str) -> None:
    """Fix 2's proof: the bridge wrote every tensor the config implies. Strict (the default) fails the save."""
    if not getattr(manager, "should_save_hf_model", False):
        return

    def check() -> str | None:
        report = verify_hf_checkpoint(get_hf_model_checkpoint_path(staging), manager.hf_config)
        return None if report.ok else report.describe()

    problem = _agreed(check)
    if problem is None:
        return
    if config_get(manager.checkpoint_config, "strict_hf_verify", True):
        raise HFCheckpointIncompleteError(problem)
    if torch.distributed.get_rank() == 0:
        warnings.warn(problem, stacklevel=2)


def _sealed_checksums(manager: BaseCheckpointManager) -> dict[str, str]:
    """All ranks: the checksums every rank's ``Sealer`` computed during the save (none for a save without one)."""
    report = getattr(manager, "last_save", None)
    sealer = getattr(report, "sealer", None)
    everyone: list[dict[str, str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, sealer.results() if sealer is not None else {})
    return {relpath: checksum for share in everyone for relpath, checksum in share.items()}


def _write_marks(manager: BaseCheckpointManager, staging: str, global_step: int, sealed: dict[str, str]) -> None:
    """Rank 0: our commit mark, then the manifest, which covers every other file of the step."""
    mark = {"format_version": FORMAT_VERSION, "global_step": global_step, "role": getattr(manager, "role", None)}
    atomic_write_text(os.path.join(staging, COMMIT_MARK_FILENAME), json.dumps(mark, indent=2))
    do = getattr(manager, "use_distributed_optimizer", None)
    manifest = build_manifest(staging, current_parallel_layout(), do, known_checksums=sealed)
    atomic_write_text(os.path.join(staging, MANIFEST_FILENAME), json.dumps(manifest, indent=2))


def _rename_into_place(staging: str, local_path: str) -> None:
    """Make the staged step durable, then visible in one rename (an older copy of the step goes only after)."""
    fsync_tree(staging)
    superseded = None
    if os.path.exists(local_path):
        superseded = local_path.rstrip("/") + ".superseded"
        shutil.rmtree(superseded, ignore_errors=True)
        os.replace(local_path, superseded)
    os.replace(staging, local_path)
    fsync_path(os.path.dirname(os.path.abspath(local_path)))
    if superseded:
        shutil.rmtree(superseded, ignore_errors=True)


def commit_checkpoint(
    manager: BaseCheckpointManager, local_path: str, global_step: int, max_ckpt_to_keep: int | None = None
) -> str:
    """All ranks, once ``manager`` finished writing into ``staging_path(local_path)``: make it the checkpoint
    ``local_path``, then apply retention. Raises (and keeps every committed step) when the export is incomplete."""
    staging = staging_path(local_path)
    report = getattr(manager, "last_save", None)
    timed = report.phase_seconds if report is not None else {}
    start = time.monotonic()
    manager.on_save_phase("hf_verify")
    _verify_hf_export(manager, staging)
    timed["hf_verify"] = time.monotonic() - start
    start = time.monotonic()
    manager.on_save_phase("commit")
    sealed = _sealed_checksums(manager)
    if torch.distributed.get_rank() == 0:
        _write_marks(manager, staging, global_step, sealed)
        _rename_into_place(staging, local_path)
    torch.distributed.barrier()
    timed["commit"] = time.monotonic() - start
    paths = manager.previous_saved_paths
    if paths and paths[-1] == staging:  # the manager registered the directory it wrote into
        paths.pop()
    manager.register_checkpoint(local_path, max_ckpt_to_keep)
    torch.distributed.barrier()
    return local_path


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

    problem = _agreed(check)
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
            f"TP/PP/EP/ETP/CP, this run is {now}. Load the model alone (drop 'optimizer' from "
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

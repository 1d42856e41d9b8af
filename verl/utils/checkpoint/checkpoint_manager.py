"""The checkpoint manager base with upstream verl's names and semantics: contents, tracker file, retention, RNG."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
import warnings
from typing import Any

import numpy as np
import torch

from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.layout import STEP_DIR_FORMAT, STEP_DIR_RE, tracker_path
from verl.utils.checkpoint.tracker import read_tracker  # the one tracker reader; this import path kept for callers
from verl.utils.device import get_device_name, get_torch_device

ALL_CONTENTS = ("model", "optimizer", "extra", "hf_model")
DEFAULT_CONTENTS = ("model", "optimizer", "extra")


def config_get(config: Any, key: str, default: Any) -> Any:
    """``key`` of a dict, a DictConfig or a config object (attribute), or ``default``."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter) and not hasattr(type(config), key):
        return getter(key, default)
    return getattr(config, key, default)


def _contents(checkpoint_config: Any, key: str) -> list[str]:
    """``save_contents`` / ``load_contents``: upstream's default when unset (an empty list saves nothing)."""
    contents = config_get(checkpoint_config, key, None)
    contents = list(DEFAULT_CONTENTS if contents is None else contents)
    unknown = sorted(set(contents) - set(ALL_CONTENTS))
    if unknown:
        raise ValueError(f"checkpoint.{key} has unknown entries {unknown}; allowed: {list(ALL_CONTENTS)}")
    return contents


def not_implemented_unless_default(**given: Any) -> None:
    """Upstream options this overlay does not implement: refuse anything but their default, by name."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(
                f"MegatronCheckpointManager: {name}={value!r} is not supported by this overlay (PEFT, Megatron-FSDP, "
                f"Megatron-Bridge providers and HDFS copies are upstream-only); leave {name} at its default"
            )


class BaseCheckpointManager:
    """What every checkpoint manager shares, as upstream verl's base: which contents to save and load,
    retention over ``previous_saved_paths``, RNG state.

    ``checkpoint_config`` (a dict, DictConfig or ``CheckpointConfig``) holds ``save_contents`` /
    ``load_contents``: subsets of "model", "optimizer", "extra", "hf_model"; each defaults to the first three.
    """

    def __init__(self, model, optimizer, lr_scheduler=None, processing_class=None, checkpoint_config=None):
        self.checkpoint_config = checkpoint_config
        self.checkpoint_save_contents = _contents(checkpoint_config, "save_contents")
        self.checkpoint_load_contents = _contents(checkpoint_config, "load_contents")
        self.previous_global_step = None
        self.previous_saved_paths: list[str] = []
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    @property
    def should_save_model(self) -> bool:
        return "model" in self.checkpoint_save_contents

    @property
    def should_save_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_save_contents

    @property
    def should_save_extra(self) -> bool:
        return "extra" in self.checkpoint_save_contents

    @property
    def should_save_hf_model(self) -> bool:
        return "hf_model" in self.checkpoint_save_contents

    @property
    def should_load_model(self) -> bool:
        return "model" in self.checkpoint_load_contents

    @property
    def should_load_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_load_contents

    @property
    def should_load_extra(self) -> bool:
        return "extra" in self.checkpoint_load_contents

    @property
    def should_load_hf_model(self) -> bool:
        return "hf_model" in self.checkpoint_load_contents

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None):
        raise NotImplementedError

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        raise NotImplementedError

    def on_save_phase(self, phase: str) -> None:
        """Called as each save phase starts (by the manager and, handed it as ``StepSpec.on_phase``, the step transaction): a hook for subclasses
        that observe saves (the crash-injection tests, the benchmark). Does nothing here."""

    @staticmethod
    def checkpath(local_path: str | None, hdfs_path: str | None) -> tuple[bool, str]:
        if local_path is None and hdfs_path is None:
            raise ValueError("local_path and hdfs_path cannot both be None")
        return local_path is not None, local_path if local_path is not None else hdfs_path

    def remove_previous_save_local_path(self, path: str | list[str]) -> None:
        """Remove earlier saves, and a ``global_step_N`` directory that removing its role's save emptied.
        Every rank may call this on a shared filesystem: a path another rank removed first is not an error."""
        for one in [path] if isinstance(path, str) else path:
            if os.path.exists(one):
                shutil.rmtree(one, ignore_errors=True)
            parent = os.path.dirname(os.path.abspath(one.rstrip("/")))
            if STEP_DIR_RE.match(os.path.basename(parent)):
                with contextlib.suppress(OSError):  # not empty (another role's save), or already gone
                    os.rmdir(parent)

    def ensure_checkpoint_capacity(self, max_ckpt_to_keep: int | None) -> None:
        """Before a save: keep at most ``max_ckpt_to_keep - 1`` earlier saves (none removed when it is 1 or unset),
        so that with the new one there are ``max_ckpt_to_keep``. The tracked step is never removed."""
        if not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 1):
            return
        self._keep_newest(max_ckpt_to_keep - 1)

    def register_checkpoint(self, new_path: str, max_ckpt_to_keep: int | None) -> None:
        """After a save succeeded: remember it, then remove the oldest saves beyond ``max_ckpt_to_keep``
        (0 or None: keep all). The step the tracker names is never removed (it stays listed for later)."""
        self.previous_saved_paths.append(new_path)
        if isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0:
            self._keep_newest(max_ckpt_to_keep)

    def _keep_newest(self, count: int) -> None:
        if len(self.previous_saved_paths) <= count:
            return
        stale = self.previous_saved_paths[: len(self.previous_saved_paths) - count]
        tracked = {os.path.abspath(p) for p in stale if _is_tracked_step(p)}
        self.remove_previous_save_local_path([p for p in stale if os.path.abspath(p) not in tracked])
        self.previous_saved_paths = [p for p in stale if os.path.abspath(p) in tracked] + self.previous_saved_paths[-count:]

    @staticmethod
    def get_rng_state() -> dict:
        """Python, numpy, torch CPU and (where one is usable) accelerator RNG states of this process."""
        state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
        if get_device_name() != "cpu":
            state[get_device_name()] = get_torch_device().get_rng_state()
        return state

    @staticmethod
    def load_rng_state(rng_state: dict) -> None:
        torch.set_rng_state(rng_state["cpu"])
        np.random.set_state(rng_state["numpy"])
        random.setstate(rng_state["random"])
        if get_device_name() != "cpu" and get_device_name() in rng_state:
            get_torch_device().set_rng_state(rng_state[get_device_name()])


def _is_tracked_step(step_path: str) -> bool:
    """Whether the tracker above ``step_path`` (``.../global_step_N`` or ``.../global_step_N/<role>``) names it."""
    path = os.path.abspath(step_path.rstrip("/"))
    step_dir = path if STEP_DIR_RE.match(os.path.basename(path)) else os.path.dirname(path)
    match = STEP_DIR_RE.match(os.path.basename(step_dir))
    if not match:
        return False
    try:
        return read_tracker(os.path.dirname(step_dir)) == int(match.group(1))
    except CheckpointError:
        return False


def get_checkpoint_tracker_filename(root_path: str) -> str:
    """``<default_local_dir>/latest_checkpointed_iteration.txt``: the step a resume loads."""
    return tracker_path(root_path)


# Where a capacity block's end is announced (seconds since the epoch): Volcano Engine's MLP and AWS SageMaker.
ESI_EXPIRATION_ENV_MLP = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
ESI_EXPIRATION_ENV_AWS = "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60, redundant_time: float = 0) -> bool:
    """Whether the machines' reservation (an elastic server instance's capacity block) ends before one more step
    and a save would fit, so the trainer saves now, outside ``save_freq``: upstream verl's rule.

    The deadline comes from ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (checked first: True only while
    the deadline is ahead, ``max_steps_duration`` is known (> 0) and at most ``save_ckpt_duration +
    max_steps_duration + redundant_time`` seconds remain; an unreadable value is False) or
    ``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (True once less than that margin remains, a passed
    deadline included). Neither set: False."""
    margin = save_ckpt_duration + max_steps_duration + redundant_time
    mlp = os.environ.get(ESI_EXPIRATION_ENV_MLP)
    if mlp:
        try:
            remaining = float(mlp) - time.time()
        except ValueError:
            return False
        return 0 < remaining <= margin and max_steps_duration > 0
    aws = os.environ.get(ESI_EXPIRATION_ENV_AWS)
    if aws:
        try:
            remaining = int(aws) - time.time()
        except ValueError:
            return False
        return remaining < margin
    return False


def find_latest_ckpt_path(path: str | None, directory_format: str = STEP_DIR_FORMAT) -> str | None:
    """The step directory the tracker under ``path`` names; None without a tracker or when that directory is
    gone. Upstream verl's function, kept for its callers; this package resumes through
    ``integrity.find_resume_checkpoint``, which also verifies the step and reports interrupted saves."""
    step = read_tracker(path) if path is not None else None
    if step is None:
        return None
    step_dir = os.path.join(path, directory_format.format(step))
    if not os.path.isdir(step_dir):
        tracker = get_checkpoint_tracker_filename(path)
        warnings.warn(f"checkpoint tracker {tracker} names {step_dir}, which does not exist", stacklevel=2)
        return None
    return step_dir

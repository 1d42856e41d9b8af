"""The checkpoint manager base, with upstream verl's names: contents, tracker file, retention, RNG."""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from verl.utils.device import get_device_name, get_torch_device

ALL_CONTENTS = ("model", "optimizer", "extra", "hf_model")
DEFAULT_CONTENTS = ("model", "optimizer", "extra")
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _config_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _check_contents(contents: Iterable[str], key: str) -> list[str]:
    contents = list(contents)
    unknown = sorted(set(contents) - set(ALL_CONTENTS))
    if unknown:
        raise ValueError(f"checkpoint.{key} has unknown entries {unknown}; allowed: {list(ALL_CONTENTS)}")
    return contents


class BaseCheckpointManager:
    """What every checkpoint manager shares: which contents to save/load, retention, RNG state.

    ``checkpoint_config`` holds ``save_contents`` / ``load_contents`` (subsets of "model",
    "optimizer", "extra", "hf_model") as upstream's ``actor_rollout_ref.actor.checkpoint``.
    """

    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None, checkpoint_config=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_config = checkpoint_config
        self.checkpoint_save_contents = _check_contents(_config_get(checkpoint_config, "save_contents", DEFAULT_CONTENTS), "save_contents")
        self.checkpoint_load_contents = _check_contents(_config_get(checkpoint_config, "load_contents", self.checkpoint_save_contents), "load_contents")
        self.previous_global_step = None
        self.previous_saved_paths: list[str] = []
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

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

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None):
        raise NotImplementedError

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        raise NotImplementedError

    def remove_previous_save_local_path(self, path: str | list[str]) -> None:
        for one in [path] if isinstance(path, str) else path:
            if os.path.exists(one):
                shutil.rmtree(one, ignore_errors=True)

    @staticmethod
    def get_rng_state() -> dict:
        """Python, numpy, torch CPU and (where one exists) accelerator RNG states of this process."""
        state = {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }
        if get_device_name() != "cpu":
            state[f"{get_device_name()}_rng_state"] = get_torch_device().get_rng_state()
        return state

    @staticmethod
    def load_rng_state(state: dict) -> None:
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        if get_device_name() != "cpu":
            get_torch_device().set_rng_state(state[f"{get_device_name()}_rng_state"])


def get_checkpoint_tracker_filename(root_path: str) -> str:
    """``<default_local_dir>/latest_checkpointed_iteration.txt``: the step a resume loads."""
    return os.path.join(root_path, TRACKER_FILENAME)


def read_tracker(root_path: str) -> int | None:
    """The step the tracker under ``root_path`` names; None without a tracker; ValueError when corrupt."""
    tracker = get_checkpoint_tracker_filename(root_path)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker} is corrupt: expected a step number, found {text[:50]!r}")
    return int(text)


def find_latest_ckpt_path(path: str | None, directory_format: str = "global_step_{}") -> str | None:
    """The step directory the tracker under ``path`` names, or None when there is no tracker."""
    step = read_tracker(path) if path is not None else None
    if step is None:
        return None
    step_dir = os.path.join(path, directory_format.format(step))
    if not os.path.isdir(step_dir):
        raise FileNotFoundError(
            f"checkpoint tracker {get_checkpoint_tracker_filename(path)} names step {step}, but {step_dir} does not "
            "exist; restore that directory or set trainer.resume_mode=disable / trainer.resume_from_path"
        )
    return step_dir


def list_step_dirs(root_path: str) -> list[tuple[int, str]]:
    """All ``global_step_N`` directories under ``root_path``, oldest first."""
    if not os.path.isdir(root_path):
        return []
    steps = []
    for name in os.listdir(root_path):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root_path, name)):
            steps.append((int(match.group(1)), os.path.join(root_path, name)))
    return sorted(steps)

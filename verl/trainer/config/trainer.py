"""``TrainerConfig``: the ``trainer`` node of ppo_megatron_trainer.yaml, typed and checked where it is defined.

Upstream reads this node as a raw dict; here its fields are checked once, every problem at once
(``FieldChecks``), and its defaults are the YAML's (``tests/test_config_defaults.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.utils.checkpoint.layout import checkpoint_root_problem, resume_step_problem
from verl.utils.tracking import BACKEND_PACKAGES, BACKENDS

from .field_checks import FieldChecks

__all__ = ["TrainerConfig"]

DEVICES = ("auto", "cpu", "cuda", "npu")
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclasses.dataclass
class TrainerConfig(BaseConfig):
    """How long the run trains, where it runs, what it saves and logs, and what it resumes from.

    Args:
        total_epochs / total_training_steps: the run's length (null steps: total_epochs over the data).
        nnodes / n_gpus_per_node / device: the ranks (nnodes x n_gpus_per_node) and what they compute on.
        save_freq: save every N steps (and at the last; -1 never); esi_redundant_time: seconds of margin kept
            before a capacity block's end, when a save is forced. test_freq / val_before_train / val_only /
            log_val_generations: validation.
        default_local_dir: the checkpoint root; resume_mode / resume_from_path: what a run resumes from;
            max_actor_ckpt_to_keep: steps kept (null: all).
        logger: upstream's backend names; project_name / experiment_name: the run's names.
        ray_wait_register_center_timeout: seconds the ranks may take to start.
        the rest: upstream's keys, refused or ignored with a reason by the pre-start check.
    """

    _key: ClassVar[str] = "trainer"

    balance_batch: bool = True
    total_epochs: int = 30
    nnodes: int = 1
    n_gpus_per_node: int = 8
    device: str = "auto"
    total_training_steps: int | None = 150
    save_freq: int = 50
    esi_redundant_time: float = 0
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    log_val_generations: int = 0
    default_hdfs_dir: str | None = None
    del_local_ckpt_after_load: bool = False
    critic_warmup: int = 0
    project_name: str = "verl_megatron_ckpt"
    experiment_name: str = "tiny_moe_tp2_pp2_ep2"
    default_local_dir: str = "checkpoints/verl_megatron_ckpt/tiny_moe_tp2_pp2_ep2"
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    max_actor_ckpt_to_keep: int | None = None
    logger: Any = dataclasses.field(default_factory=lambda: ["console", "file"])
    ray_wait_register_center_timeout: int = 300

    def __post_init__(self) -> None:
        checks = FieldChecks(self, self._key)
        checks.integers("nnodes", "n_gpus_per_node", "save_freq", "total_epochs", "test_freq", "log_val_generations", "critic_warmup", "ray_wait_register_center_timeout")
        checks.integers("max_actor_ckpt_to_keep", "total_training_steps", optional=True)
        checks.numbers("esi_redundant_time")
        checks.booleans("balance_batch", "val_before_train", "val_only", "del_local_ckpt_after_load")
        checks.at_least_one("nnodes", "n_gpus_per_node", "total_epochs")
        checks.at_least_one("total_training_steps", null_means="trainer.total_epochs over the data")
        checks.at_least_one("max_actor_ckpt_to_keep", null_means="keep all")
        checks.choice("device", DEVICES, "auto")
        checks.choice("resume_mode", RESUME_MODES, "auto")
        if isinstance(self.log_val_generations, int) and self.log_val_generations < 0:
            checks.add(f"trainer.log_val_generations={self.log_val_generations} must be >= 0")
        if isinstance(self.esi_redundant_time, (int, float)) and self.esi_redundant_time < 0:
            checks.add(f"trainer.esi_redundant_time={self.esi_redundant_time} must be >= 0 (seconds); set trainer.esi_redundant_time=0")
        if self.default_hdfs_dir is not None:
            checks.add(f"trainer.default_hdfs_dir={self.default_hdfs_dir}: copying checkpoints to HDFS is not supported here; set trainer.default_hdfs_dir=null and copy trainer.default_local_dir yourself")
        if self.del_local_ckpt_after_load is True:
            checks.add("trainer.del_local_ckpt_after_load=True: a resume never deletes its checkpoint here (it is the tracked, verified step); set it to False")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            checks.add("trainer.resume_mode=resume_path needs trainer.resume_from_path=<default_local_dir>/global_step_N")
        checks.strings("project_name", "experiment_name", "default_local_dir")
        checks.strings("resume_from_path", "default_hdfs_dir", optional=True)
        loggers = [self.logger] if isinstance(self.logger, str) else self.logger
        if not isinstance(loggers, (list, tuple)) or not all(isinstance(name, str) for name in loggers):
            checks.add(f"trainer.logger={self.logger} must be a list of backend names, e.g. trainer.logger=[console,file]")
            checks.raise_problems()
        self._normalize("logger", list(loggers))
        unknown = [name for name in self.logger if name not in BACKENDS]
        if unknown:
            checks.add(f"trainer.logger has {unknown}, which this trainer does not provide; use a subset of {list(BACKENDS)}, e.g. trainer.logger=[console,file]")
        checks.raise_problems()

    @property
    def world_size(self) -> int:
        """Ranks of the run: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node

    def validate(self, data_has_val_files: bool) -> list[str]:
        """What this host, the data or the disk rule out: a logger's package missing, ``val_only`` with nothing to
        validate, a checkpoint root or a resumed step that is not one."""
        problems = [
            f"trainer.logger has {name} but the {package} package is not installed; pip install {package}, or drop {name} from trainer.logger"
            for name, package in BACKEND_PACKAGES.items()
            if name in self.logger and importlib.util.find_spec(package) is None
        ]
        if self.val_only and not data_has_val_files:
            problems.append("trainer.val_only=True needs data.val_files")
        problems.append(checkpoint_root_problem(str(self.default_local_dir), "trainer.default_local_dir"))
        if self.resume_mode == "resume_path" and self.resume_from_path:
            problems.append(resume_step_problem(str(self.resume_from_path), "trainer.resume_from_path"))
        return [problem for problem in problems if problem]

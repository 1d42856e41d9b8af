"""``DataConfig``: the ``data`` node of ppo_megatron_trainer.yaml, typed and checked where it is defined.

Upstream's keys for its parquet prompts, plus ours for the embedded task (``task``, ``max_operand``) that a run
without ``train_files`` trains on. Every problem of the node at once (``FieldChecks``); the files themselves
are read by ``validate``, before any rank starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.utils.dataset.rl_dataset import TRUNCATIONS, as_file_list, parquet_problems

from .field_checks import FieldChecks

__all__ = ["DataConfig"]

TASKS = ("add", "first")  # verl.utils.dataset.arithmetic.TASKS (not imported: it pulls in torch)


@dataclasses.dataclass
class DataConfig(BaseConfig):
    """The run's prompts.

    Args:
        train_files / val_files: parquet files in upstream's RLHFDataset format (null train_files: the embedded
            task, ``task`` over single-digit operands up to ``max_operand``).
        prompt_key / reward_fn_key: the columns of the prompt and of the data source a reward rule is chosen by.
        train_batch_size / val_batch_size: prompts per step (null val: all at once); *_max_samples: rows used (-1 all).
        max_prompt_length / max_response_length / truncation: tokens of a prompt and a response, and what a
            longer prompt gets.
        shuffle / seed: the sampler's order.
        the rest: upstream's keys, refused or ignored with a reason by the pre-start check.
    """

    _key: ClassVar[str] = "data"

    train_files: Any = None
    val_files: Any = None
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    train_batch_size: int = 8
    val_batch_size: int | None = None
    max_prompt_length: int = 8
    max_response_length: int = 2
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    shuffle: bool = True
    validation_shuffle: bool = False
    seed: int = 1
    return_raw_input_ids: bool = False
    return_raw_chat: bool = True
    return_full_prompt: bool = False
    dataloader_num_workers: int = 8
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    custom_cls: dict[str, Any] = dataclasses.field(default_factory=lambda: {"path": None, "name": None})
    task: str = "first"
    max_operand: int = 2

    def __post_init__(self) -> None:
        checks = FieldChecks(self, self._key)
        checks.integers("train_max_samples", "val_max_samples", "seed", "train_batch_size", "max_prompt_length", "max_response_length")
        checks.integers("val_batch_size", optional=True)
        checks.booleans("filter_overlong_prompts", "shuffle")
        checks.at_least_one("train_batch_size", "max_prompt_length", "max_response_length")
        checks.at_least_one("val_batch_size", null_means="all prompts at once")
        checks.choice("truncation", TRUNCATIONS, "error")
        checks.strings("prompt_key", "reward_fn_key")
        if self.custom_cls is not None and not isinstance(self.custom_cls, Mapping):
            checks.add(f"data.custom_cls={self.custom_cls} must be a mapping with path and name (both null here)")
        elif (self.custom_cls or {}).get("path") is not None:
            checks.add(f"data.custom_cls.path={self.custom_cls['path']}: custom dataset classes are not supported; write the data as parquet in RLHFDataset's format")
        if not self.train_files:
            if not isinstance(self.max_operand, int) or isinstance(self.max_operand, bool) or not 0 <= self.max_operand <= 9:
                checks.add(f"data.max_operand={self.max_operand}: the task's operands are single digits; set data.max_operand to 0..9")
            checks.choice("task", TASKS, "first")
        checks.raise_problems()

    def validate(self, custom_reward: bool) -> list[str]:
        """The parquet files' problems, and data sources no reward rule knows (``custom_reward``: the user's
        ``custom_reward_function`` scores them), found before the run rather than at its first reward."""
        problems = []
        for key in ("train_files", "val_files"):
            files = as_file_list(getattr(self, key))
            found = parquet_problems(files, f"data.{key}", str(self.prompt_key), str(self.reward_fn_key))
            problems += found
            if files and not found and not custom_reward:
                problems += self._unknown_data_sources(files, f"data.{key}")
        return problems

    def _unknown_data_sources(self, files: list[str], key: str) -> list[str]:
        import pyarrow.parquet as pq

        from verl.utils.reward_score import KNOWN_DATA_SOURCES

        column, sources = str(self.reward_fn_key), set()
        for path in files:
            sources.update(str(value) for value in pq.read_table(path, columns=[column]).column(column).unique().to_pylist())
        unknown = sorted(sources - set(KNOWN_DATA_SOURCES))
        if unknown:
            return [f"{key}: {column} {unknown} has no reward rule here (known: {list(KNOWN_DATA_SOURCES)}); set custom_reward_function.path to a file with compute_score"]
        return []

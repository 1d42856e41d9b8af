"""The run's prompts, read and tokenized on the driver before Ray starts (so a bad file is a pre-start error).

``data.train_files=null`` means the embedded task: it is first written as a parquet file in RLHFDataset's
format (``verl.utils.dataset.arithmetic.write_task_parquet``, the same file ``scripts/make_task_parquet.py``
writes) and then read like a user's file. The step count follows upstream: ``trainer.total_training_steps``
when set, else ``trainer.total_epochs x (train rows // data.train_batch_size)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from verl.trainer.run_config import ConfigError, RunConfig
from verl.utils.dataset.rl_dataset import DatasetError, RLHFDataset, as_file_list, padded_prompt_length


@dataclass
class RunData:
    train: RLHFDataset
    val: RLHFDataset | None
    prompt_length: int  # every prompt of the run is left-padded to this many tokens
    total_training_steps: int
    steps_per_epoch: int
    train_files: list[str]
    notes: list[str]  # one line each for the start-up report


def embedded_task_root() -> str:
    """Where the embedded task's parquet files are written (next to the embedded model's cache)."""
    root = os.environ.get("VERL_TINY_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verl_tiny")
    return os.path.join(root, "tasks")


def load_tokenizer(run: RunConfig, model_path: str) -> Any:
    """The model's tokenizer, with ``actor_rollout_ref.model.custom_chat_template`` when one is given."""
    from verl.utils.custom_code import CustomCodeError
    from verl.utils.custom_code import load_tokenizer as load_folder_tokenizer

    try:
        tokenizer = load_folder_tokenizer(model_path, f"actor_rollout_ref.model.path={model_path}")
    except CustomCodeError as exc:
        raise ConfigError([str(exc)]) from None
    template = run.model.custom_chat_template
    if template:
        tokenizer.chat_template = str(template)
    return tokenizer


def template_source(run: RunConfig, tokenizer: Any) -> str:
    """Where the chat template came from, for its error messages: the config key, or the tokenizer's file."""
    if run.model.custom_chat_template:
        return "actor_rollout_ref.model.custom_chat_template"
    folder = str(getattr(tokenizer, "name_or_path", "") or "")
    jinja = os.path.join(folder, "chat_template.jinja")
    return f"the chat template of {jinja if os.path.isfile(jinja) else os.path.join(folder, 'tokenizer_config.json')}"


def load_run_data(run: RunConfig, tokenizer: Any) -> RunData:
    """Both datasets, the run's prompt length and its step count; ConfigError (one line) when they cannot train."""
    from verl.utils.dataset.arithmetic import write_task_parquet

    data, trainer = run.data, run.trainer
    notes = []
    train_files = as_file_list(data.train_files)
    if not train_files:
        path = write_task_parquet(embedded_task_root(), data.seed, data.max_operand, data.task)
        train_files = [path]
        notes.append(f"data.train_files=null: the embedded task (data.task={data.task}, operands 0..{data.max_operand}) from {path}")
    source = template_source(run, tokenizer)
    try:
        train = RLHFDataset(train_files, tokenizer, data, max_samples=data.train_max_samples, key="data.train_files", template_source=source)
        val_files = as_file_list(data.val_files)
        val = RLHFDataset(val_files, tokenizer, data, max_samples=data.val_max_samples, key="data.val_files", template_source=source) if val_files else None
    except DatasetError as exc:
        raise ConfigError([str(exc)]) from None
    for name, dataset in (("train", train), ("val", val)):
        if dataset is not None and (dataset.filtered or dataset.truncated):
            notes.append(f"data.{name}_files: {dataset.filtered} prompt(s) over data.max_prompt_length={data.max_prompt_length} dropped, {dataset.truncated} truncated ({data.truncation})")
    batch = data.train_batch_size
    steps_per_epoch = len(train) // batch
    if trainer.total_training_steps is not None:
        total = trainer.total_training_steps
    elif steps_per_epoch == 0:
        raise ConfigError([f"data.train_files has {len(train)} prompt(s), fewer than data.train_batch_size={batch}: an epoch has no step; lower data.train_batch_size or set trainer.total_training_steps"])
    else:
        total = steps_per_epoch * trainer.total_epochs
    longest = max(train.longest_prompt, val.longest_prompt if val is not None else 0)
    prompt_length = padded_prompt_length(longest, data.max_response_length, run.actor.megatron.tensor_model_parallel_size)
    notes.append(
        f"data: {len(train)} train prompt(s)" + (f", {len(val)} validation prompt(s)" if val is not None else ", no validation")
        + f"; prompts left-padded to {prompt_length} tokens; {total} steps"
        + ("" if trainer.total_training_steps is not None else f" (trainer.total_epochs={trainer.total_epochs} x {steps_per_epoch} per epoch)")
    )
    return RunData(train, val, prompt_length, total, steps_per_epoch, train_files, notes)

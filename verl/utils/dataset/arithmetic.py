"""The synthetic tasks the project generates itself, on prompts ``"a+b="`` with single-digit a, b:

- ``first``: answer ``a`` (copy the first operand): ``"2+1="`` -> ``"2"``; the default of the main job,
  because the tiny random-init model learns it by GRPO in about a hundred steps (with operands 0..2 a
  policy that ignores the prompt scores at most 1/3);
- ``add``: answer ``a + b``: ``"3+4="`` -> ``"7"``; not learned by the tiny model in a few hundred steps
  (docs/grpo.md), kept for bigger models.

Prompts are single-digit operands on purpose: every prompt of a dataset then has the same length in
characters (and tokens, with the char-level tokenizer), so a batch needs no padding on the ranks.
"""

from __future__ import annotations

import torch

DATA_SOURCE = "arithmetic"
_MAX_SINGLE_DIGIT = 9
TASKS = {"add": lambda a, b: a + b, "first": lambda a, b: a}


def make_arithmetic_dataset(seed: int, size: int | None = None, max_operand: int = 9, task: str = "add") -> list[dict]:
    """Every pair ``a + b`` with ``a, b`` in ``0..max_operand``, shuffled by ``seed``; the first ``size`` rows
    (None: all), answered by ``task`` (``TASKS``). Rows carry upstream verl's keys (``prompt``,
    ``ground_truth``, ``data_source``, ``index``)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {sorted(TASKS)}; set data.task")
    if not 0 <= max_operand <= _MAX_SINGLE_DIGIT:
        raise ValueError(
            f"max_operand={max_operand}: operands must be single digits (0..{_MAX_SINGLE_DIGIT}) so all prompts "
            "have the same length; pick max_operand in that range"
        )
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if size is None:
        size = len(pairs)
    if not 1 <= size <= len(pairs):
        raise ValueError(
            f"size={size}: max_operand={max_operand} gives {len(pairs)} distinct pairs; use 1..{len(pairs)} or None"
        )
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = []
    for i, pair_idx in enumerate(order[:size]):
        a, b = pairs[pair_idx]
        rows.append({"prompt": f"{a}+{b}=", "ground_truth": str(TASKS[task](a, b)), "data_source": DATA_SOURCE, "index": i})
    return rows


def task_parquet_rows(seed: int, max_operand: int = 2, task: str = "first", split: str = "train") -> list[dict]:
    """The task as rows of upstream's RLHFDataset format (one user message, ``reward_model.ground_truth``,
    ``extra_info``), in ``make_arithmetic_dataset``'s order, so a run reading them sees the same prompts."""
    return [
        {
            "data_source": row["data_source"],
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
            "extra_info": {"split": split, "index": row["index"], "task": task},
        }
        for row in make_arithmetic_dataset(seed, max_operand=max_operand, task=task)
    ]


def task_parquet_path(root: str, seed: int, max_operand: int, task: str) -> str:
    """Where the embedded task's parquet file for these settings lives under ``root``."""
    import os

    return os.path.join(root, f"arithmetic_{task}_max{max_operand}_seed{seed}.parquet")


def write_task_parquet(root: str, seed: int, max_operand: int = 2, task: str = "first") -> str:
    """Write the task's parquet file under ``root`` (once: an existing file for the same settings is reused)."""
    import os

    from verl.utils.dataset.rl_dataset import write_rlhf_parquet

    path = task_parquet_path(root, seed, max_operand, task)
    if not os.path.isfile(path):
        write_rlhf_parquet(task_parquet_rows(seed, max_operand, task), path)
    return path


def prompt_length(rows: list[dict]) -> int:
    """The common prompt length in characters; ValueError if the prompts differ (the ranks do not pad)."""
    lengths = {len(row["prompt"]) for row in rows}
    if len(lengths) != 1:
        raise ValueError(f"prompts must all have one length (no padding), got lengths {sorted(lengths)}")
    return lengths.pop()


def _epoch_seed(seed: int, epoch: int) -> int:
    """A distinct 64-bit generator seed per (seed, epoch)."""
    return ((seed & 0xFFFFFFFF) << 32) | (epoch & 0xFFFFFFFF)


class PromptSampler:
    """Endless batches of prompts, reshuffled every epoch from (seed, epoch) alone (``shuffle=False``: file order).

    Batches may straddle an epoch boundary and are never short. The state is three plain ints (plus the
    seed and dataset size, checked on load), so a checkpoint can restore the exact data position.
    """

    def __init__(self, rows: list[dict], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("PromptSampler needs at least one row")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r} (set data.train_batch_size)")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self.batches_served = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows, continuing into the next epoch's order when this one runs out."""
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.rows[self._order[self.position]])
            self.position += 1
        self.batches_served += 1
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_served": self.batches_served,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the sampler that wrote ``state`` was; refuses a different seed, order (``shuffle``;
        a state saved before it was recorded has none) or dataset size."""
        shuffle = state.get("shuffle", self.shuffle)
        if state["seed"] != self.seed or state["num_rows"] != len(self.rows) or shuffle != self.shuffle:
            raise ValueError(
                f"sampler state is for seed={state['seed']}, shuffle={shuffle}, {state['num_rows']} rows; this sampler has "
                f"seed={self.seed}, shuffle={self.shuffle}, {len(self.rows)} rows: resume with the data config the run was saved with"
            )
        if not 0 <= state["position"] <= len(self.rows):
            raise ValueError(f"sampler state position {state['position']} outside 0..{len(self.rows)}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batches_served = int(state["batches_served"])
        self._order = self._epoch_order(self.epoch)

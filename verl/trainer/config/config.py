"""``CheckpointConfig``: what a checkpoint holds, with upstream verl's fields and defaults.

Validated here, where it is defined, so every layer below (the worker, the checkpoint manager) can
trust it instead of re-checking a dict. Backend-specific fields live on subclasses in
``verl.workers.config.checkpoint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from verl.base_config import BaseConfig

__all__ = ["CheckpointConfig"]

# What a checkpoint may hold (upstream's names): Megatron dist checkpoint of the model, optimizer
# state, scheduler + RNG ("extra"), and the model as an HF folder.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _contents_list(owner: str, name: str, value: Any) -> list[str]:
    """``value`` as a list of known content names; a clear error naming the field otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{owner}.{name} must be a list of {list(CHECKPOINT_CONTENTS)}, got {value!r}")
    contents = [str(item) for item in value]
    for item in contents:
        if item not in CHECKPOINT_CONTENTS:
            raise ValueError(f"{owner}.{name} has unknown entry {item!r}; allowed: {list(CHECKPOINT_CONTENTS)}")
    return contents


def _check_bool(owner: str, name: str, value: Any) -> None:
    # bool("false") is True: a string that reached here would silently mean the opposite.
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be true or false, got {value!r}")


@dataclasses.dataclass
class CheckpointConfig(BaseConfig):
    """What a checkpoint saves and loads.

    Args:
        save_contents: subset of "model", "optimizer", "extra", "hf_model" to save.
        load_contents: what to load back; the same choices (upstream's YAML defaults it to save_contents).
        async_save: write the dist checkpoint in the background while training goes on (Megatron only).
        strict: upstream's: Megatron-Bridge's HF export (``save_hf_weights(strict=...)``) fails on a tensor it
            cannot map; mbridge's export takes no such flag. Either export is then verified (``strict_hf_verify``).
        save_lora_only: upstream's LoRA-adapter-only save; no effect without LoRA adapters (none here).
        strict_hf_verify: ours, not upstream's. After every save the HF folder is checked against every
            tensor its config implies; True fails the save on a missing or misshapen tensor, False only warns.
    """

    save_contents: list[str] = dataclasses.field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] = dataclasses.field(default_factory=lambda: ["model", "optimizer", "extra"])
    async_save: bool = False
    strict: bool = True
    save_lora_only: bool = False
    strict_hf_verify: bool = True

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("save_contents", "load_contents"):
            self._normalize(name, _contents_list(owner, name, getattr(self, name)))
        for name in ("async_save", "strict", "save_lora_only", "strict_hf_verify"):
            _check_bool(owner, name, getattr(self, name))

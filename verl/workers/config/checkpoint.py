"""``McoreCheckpointConfig``: the Megatron backend's checkpoint settings (upstream verl's name and fields)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.trainer.config import CheckpointConfig

__all__ = ["McoreCheckpointConfig"]


@dataclasses.dataclass
class McoreCheckpointConfig(CheckpointConfig):
    """``CheckpointConfig`` plus what only the Megatron backend reads.

    Args:
        mbridge_config: keyword arguments for the bridge's HF weight save (e.g. mbridge's
            ``memory_efficient``); a key the bridge's ``save_weights`` does not take is refused, naming it.
    """

    mbridge_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.mbridge_config, dict):
            raise ValueError(f"{type(self).__name__}.mbridge_config must be a mapping, got {self.mbridge_config!r}")

"""``McoreCheckpointConfig``: the Megatron backend's checkpoint settings (upstream verl's name and fields, plus ours)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.trainer.config import CheckpointConfig
from verl.utils.checkpoint.async_modes import AsyncMode, mode_refusal
from verl.utils.checkpoint.mbridge_config import save_weights_kwargs

__all__ = ["McoreCheckpointConfig"]


@dataclasses.dataclass
class McoreCheckpointConfig(CheckpointConfig):
    """``CheckpointConfig`` plus what only the Megatron backend reads.

    Args:
        mbridge_config: keyword arguments for the bridge's HF weight save (e.g. mbridge's
            ``memory_efficient``); a key the bridge's ``save_weights`` does not take is refused, naming it.
        async_mode: ours, not upstream's. With ``async_save``, which writer runs in the background:
            ``background_write`` (every host; the rank copies what of the state lives in device memory into host
            memory, then a forked process checks, plans, writes and exports from that copy) or ``snapshot`` (host
            memory only: the forked process checks, plans, writes and exports from the live tensors' image).
            Chosen once for the run; ``validate(device)`` refuses ``snapshot`` on an accelerator.
    """

    mbridge_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    async_mode: str = AsyncMode.BACKGROUND_WRITE.value

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.mbridge_config, dict):
            raise ValueError(f"{type(self).__name__}.mbridge_config must be a mapping, got {self.mbridge_config!r}")
        refusal = mode_refusal(self.async_save, self.async_mode, "cpu", key=f"{type(self).__name__}.async_mode")
        if refusal is not None:  # the device is not known here: only the value is checked
            raise ValueError(refusal)

    def validate(self, device: str, key: str = "checkpoint.async_mode") -> None:
        """Refuse a mode the run's ``device`` ("cpu", "cuda", "npu") cannot take, in one line naming ``key``."""
        refusal = mode_refusal(self.async_save, self.async_mode, device, key=key)
        if refusal is not None:
            raise ValueError(refusal)

    def mbridge_config_problems(self, model_type: str, vanilla_mbridge: bool, key: str = "checkpoint.mbridge_config") -> list[str]:
        """``mbridge_config``: every entry must be an argument of the HF save of the bridge a ``model_type`` model
        gets (mbridge's with ``vanilla_mbridge``, else Megatron-Bridge's); one line naming ``key.<entry>`` if not.
        Imports that bridge."""
        if not self.mbridge_config:
            return []
        if vanilla_mbridge:
            from verl.models.mcore.mbridge import bridge_class_for

            save_weights, save_name = bridge_class_for(model_type).save_weights, "mbridge's save_weights"
        else:
            from verl.models.mcore.megatron_bridge import MegatronBridgeWeights

            save_weights, save_name = MegatronBridgeWeights.save_weights, "Megatron-Bridge's save_hf_weights"
        try:
            save_weights_kwargs(save_weights, self.mbridge_config, key=key, save_name=save_name, strict=self.strict)
        except ValueError as exc:
            return [str(exc)]
        return []

"""``HFModelConfig`` with upstream verl's name and defaults: the ``actor_rollout_ref.model`` node.

Only the fields this trainer's YAML has are here, and upstream's ``target_modules`` (its type is part of
upstream's contract: a CLI override merges a list or a string into it); upstream's others (tokenizer and config
paths, LoRA details beyond the ``lora`` node, ...) are set by no key of this trainer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from verl.base_config import BaseConfig
from verl.utils.custom_code import oversized_file_problem, read_json

from .optimizer import _boolean, _integer

__all__ = ["HFModelConfig", "read_hf_config"]


@dataclasses.dataclass
class HFModelConfig(BaseConfig):
    """The HF model a run trains.

    Args:
        path: a local HF model directory (the trainer resolves null to the embedded tiny model).
        custom_chat_template: a Jinja chat template used instead of the tokenizer's.
        override_config: HF config overrides.
        trust_remote_code / external_lib: upstream's switches for a model's own code.
        lora_rank / lora: LoRA adapters (rank 0: none; the only rank here).
        target_modules: upstream's LoRA target modules: "all-linear", a list of module names, or None
            (typed Any so that OmegaConf merges either form; checked here, TypeError otherwise).
        the rest: upstream's memory and kernel switches.
    """

    path: str | None = None
    custom_chat_template: str | None = None
    override_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True
    use_fused_kernels: bool = False
    use_liger: bool = False
    trust_remote_code: bool = False
    external_lib: Any = None
    lora_rank: int = 0
    lora: dict[str, Any] = dataclasses.field(default_factory=dict)
    target_modules: Any = "all-linear"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.path is not None and not isinstance(self.path, str):
            raise ValueError(f"{owner}.path must be a directory path or null, got {self.path!r}")
        for name in ("enable_gradient_checkpointing", "enable_activation_offload", "use_remove_padding", "use_fused_kernels", "use_liger", "trust_remote_code"):
            _boolean(owner, name, getattr(self, name))
        _integer(owner, "lora_rank", self.lora_rank)
        modules = self.target_modules
        if isinstance(modules, (list, tuple)) and all(isinstance(name, str) for name in modules):
            self._normalize("target_modules", list(modules))
        elif modules is not None and not isinstance(modules, str):
            raise TypeError(f"{owner}.target_modules must be a string, a list of strings or null, got {modules!r}")


def read_hf_config(path: str) -> tuple[dict | None, list[str]]:
    """The ``config.json`` of the HF model directory ``path`` (``HFModelConfig.path``), or None and one line
    naming ``HFModelConfig.path`` that says why it cannot be read (the pre-start check names the Hydra key)."""
    key, config_json = f"{HFModelConfig.__name__}.path={path}", os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return None, [f"{key} does not exist; set {HFModelConfig.__name__}.path to a local HF model directory (or null for the embedded tiny model)"]
    if not os.path.isfile(config_json):
        return None, [f"{key} has no config.json; it is not an HF model directory"]
    oversized = oversized_file_problem(config_json)
    if oversized:
        return None, [f"{key}: {oversized}; point it at an HF model directory"]
    try:
        return read_json(config_json), []
    except OSError as exc:
        return None, [f"{key}: config.json is unreadable ({exc})"]
    except ValueError as exc:
        return None, [f"{key}: {exc}; point it at an HF model directory"]

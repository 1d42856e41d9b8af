"""``RunConfig``: every node of the trainer's Hydra config that a run reads, typed, built once.

``main_ppo`` builds it from the composed config after the pre-start check passed (``build_run_config``) and
hands it down: the trainer, the data plan, the resume check and, through ``actor_rollout_ref``, every worker
read checked fields, never the Hydra config. A node's defaults are the YAML's; a refused value is a
``ConfigError``, one line per problem, naming the key and its fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from verl.base_config import BaseConfig
from verl.trainer.config import AlgoConfig, DataConfig, TrainerConfig
from verl.workers.config import HFModelConfig, McoreActorConfig, RolloutConfig, megatron_worker_config

__all__ = ["ConfigError", "CustomRewardFunctionConfig", "RunConfig", "build_run_config", "trainer_config_or_none", "typed_node"]


class ConfigError(ValueError):
    """The config cannot run; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _plain(node: Any) -> dict:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})


def typed_node(cls: type, node: Any) -> tuple[Any, list[str]]:
    """``cls`` built from ``node``'s keys that are its fields (the others are the upstream-key check's), with the
    lines it refuses: (None, problems) when it does not build."""
    fields = {f.name for f in dataclasses.fields(cls)} - {"_target_"}
    try:
        return cls(**{k: v for k, v in _plain(node).items() if k in fields}), []
    except ValueError as exc:
        return None, str(exc).splitlines()
    except (TypeError, AttributeError) as exc:  # a node of another shape than its fields': still one line, not a traceback
        return None, [f"{getattr(cls, '_key', cls.__name__)}: {exc}"]


@dataclasses.dataclass
class CustomRewardFunctionConfig(BaseConfig):
    """Upstream's ``custom_reward_function``: ``compute_score`` (or ``name``) from the file at ``path``."""

    path: str | None = None
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run's typed nodes. ``actor_rollout_ref``: the worker's config (``megatron_worker_config``: ``model``,
    ``actor``, ``rollout``, ``ref`` typed); ``ray_init``: ``ray.init``'s keyword arguments, as the user gave them."""

    trainer: TrainerConfig
    data: DataConfig
    algorithm: AlgoConfig
    actor_rollout_ref: dict
    custom_reward_function: CustomRewardFunctionConfig
    ray_init: dict

    @property
    def actor(self) -> McoreActorConfig:
        return self.actor_rollout_ref["actor"]

    @property
    def rollout(self) -> RolloutConfig:
        return self.actor_rollout_ref["rollout"]

    @property
    def model(self) -> HFModelConfig:
        return self.actor_rollout_ref["model"]

    def set_training_steps(self, total: int) -> None:
        """The run's length, once the data plan knows it: the actor's LR schedule runs over it unless
        ``optim.total_training_steps`` was set (upstream's trainer fills it in the same way)."""
        if self.actor.optim.total_training_steps < 0:
            self.actor.optim.total_training_steps = int(total)


def trainer_config_or_none(config: Any) -> TrainerConfig | None:
    """The ``trainer`` node typed, or None when it does not build (the pre-start check says why)."""
    return typed_node(TrainerConfig, config.trainer)[0]


def build_run_config(config: Any) -> RunConfig:
    """The typed ``RunConfig`` of a composed trainer config (a DictConfig or a RunConfig, returned as it is)."""
    if isinstance(config, RunConfig):
        return config
    problems: list[str] = []
    nodes = {}
    for name, cls in (("trainer", TrainerConfig), ("data", DataConfig), ("algorithm", AlgoConfig), ("custom_reward_function", CustomRewardFunctionConfig)):
        nodes[name], found = typed_node(cls, config[name])
        problems += found
    try:
        worker = megatron_worker_config(_plain(config.actor_rollout_ref))
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    return RunConfig(**nodes, actor_rollout_ref=worker, ray_init=_plain(config.ray_kwargs.ray_init))

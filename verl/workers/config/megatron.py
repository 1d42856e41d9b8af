"""The one place a Megatron worker's Hydra node becomes typed configs.

Every consumer (pre-start validation, the trainer, the worker) builds them through
:func:`build_megatron_actor_configs` / :func:`megatron_worker_config` from the same ``actor_rollout_ref``
node, so each key is parsed and checked once, by the class that defines it, and its default lives in the
YAML and the class only (``tests/test_config_defaults.py`` holds the two together).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.utils.config import omega_conf_to_dataclass

from .actor import McoreActorConfig
from .checkpoint import McoreCheckpointConfig
from .engine import McoreEngineConfig
from .model import HFModelConfig
from .optimizer import McoreOptimizerConfig, _number
from .ref import RefConfig
from .rollout import RolloutConfig

__all__ = [
    "build_megatron_actor_configs",
    "megatron_actor_configs_from_yaml",
    "megatron_worker_config",
    "checked_worker_config",
]

ACTOR_KEY = "actor_rollout_ref.actor"


def _require(node: Mapping, keys: tuple[str, ...], path: str) -> None:
    """A hand-built node missing a key the worker reads is one line naming the Hydra key, not a KeyError on a rank."""
    missing = [f"{path}.{key}" for key in keys if key not in node]
    if missing:
        raise ValueError(f"missing {missing}: the worker reads them (ppo_megatron_trainer.yaml has their defaults)")


def _build(node: Any, cls: type, path: str) -> Any:
    """``cls`` from ``node``; its errors name the Hydra key (``actor_rollout_ref.actor.optim.lr``), not the class."""
    try:
        return omega_conf_to_dataclass(node if node is not None else {}, cls)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for klass in cls.__mro__:
            message = message.replace(f"{klass.__name__}.", f"{path}.")
        if message == str(exc):
            message = f"{path}: {message}"
        raise ValueError(message) from exc


def build_megatron_actor_configs(
    actor: Mapping, total_training_steps: int | None = None, path: str = ACTOR_KEY
) -> McoreActorConfig:
    """The typed config of a Megatron actor node, its ``megatron``, ``optim`` and ``checkpoint`` nodes included.

    ``actor`` is the ``actor_rollout_ref.actor`` node as a DictConfig or a plain dict, or the config already
    built (returned as it is). ``total_training_steps``, when given and the node leaves
    ``optim.total_training_steps`` unset (-1), is filled in, as upstream's trainer does before the
    workers build their schedulers. Raises ValueError naming the offending key.
    """
    config = _build(actor, McoreActorConfig, path)
    if total_training_steps is not None and config.optim.total_training_steps < 0:
        config.optim.total_training_steps = int(total_training_steps)
    return config


def megatron_worker_config(node: Mapping, actor: McoreActorConfig | None = None, path: str = "actor_rollout_ref") -> dict:
    """The ``actor_rollout_ref`` node as the worker reads it: a dict whose ``model``, ``actor``, ``rollout`` and
    ``ref`` are typed configs (``HFModelConfig``, ``McoreActorConfig``, ``RolloutConfig``, ``RefConfig``) and
    ``nccl_timeout`` is seconds as a float.
    ``actor``: the one the trainer built (its schedule's length filled in); nodes already typed pass through,
    so the worker's own call on what the trainer sent builds nothing again. Raises ValueError naming the key."""
    _require(node, ("model", "actor", "rollout", "ref", "nccl_timeout"), path)
    config = dict(node)
    config["nccl_timeout"] = _number(path, "nccl_timeout", node["nccl_timeout"], minimum=0.0)
    config["model"] = _build(node["model"], HFModelConfig, f"{path}.model")
    config["actor"] = actor if actor is not None else build_megatron_actor_configs(node["actor"], path=f"{path}.actor")
    config["rollout"] = _build(node["rollout"], RolloutConfig, f"{path}.rollout")
    config["ref"] = _build(node["ref"], RefConfig, f"{path}.ref")
    return config


def megatron_actor_configs_from_yaml(
    model_path: str, overrides: Sequence[str] = (), *, total_training_steps: int
) -> tuple[HFModelConfig, McoreEngineConfig, McoreOptimizerConfig, McoreCheckpointConfig]:
    """The four configs a ``MegatronEngine`` is built from (model, engine, optimizer, checkpoint), composed from
    ppo_megatron_trainer.yaml and built as the trainer builds them, for code that builds an engine without the
    trainer (tests, benchmarks, scripts/gpu_check.py): every default then comes from the YAML, so none of them
    states one of its own that could drift from what a run gets.

    ``overrides``: Hydra overrides under ``actor_rollout_ref.actor`` (``"optim.lr=3e-3"``,
    ``"megatron.vanilla_mbridge=True"``; ``"++optim.<key>=..."`` for a key the YAML leaves out); ``total_training_steps``: the run's length, which the trainer fills
    into the LR schedule. Raises ValueError naming the key of a value the configs refuse.
    """
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    actor_overrides = []
    for override in overrides:
        key = override.lstrip("+~")
        actor_overrides.append(f"{override[: len(override) - len(key)]}{ACTOR_KEY}.{key}")
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_megatron_trainer", overrides=[*actor_overrides, f"actor_rollout_ref.model.path={model_path}"])
    node = OmegaConf.to_container(config.actor_rollout_ref, resolve=True)
    actor = build_megatron_actor_configs(node["actor"], total_training_steps=total_training_steps)
    worker = megatron_worker_config(node, actor=actor)
    return worker["model"], actor.megatron, actor.optim, actor.checkpoint


def checked_worker_config(node: Mapping, path: str = "actor_rollout_ref") -> tuple[dict | None, list[str]]:
    """:func:`megatron_worker_config` of ``node`` with each typed node built once, and what it refuses as one line
    per node that does not build, each naming the Hydra key (None then): the pre-start check reports them all at
    once instead of the worker raising the first one after Ray starts. The actor's ``checkpoint`` and ``optim``
    are built on their own so a problem in each is reported next to one in the rest of the actor."""
    actor = dict(node.get("actor") or {})
    built: dict[str, Any] = {}
    problems: list[str] = []

    def build(name: str, value: Any, cls: type, key: str) -> None:
        try:
            built[name] = _build(value, cls, key)
        except ValueError as exc:
            if str(exc) not in problems:
                problems.append(str(exc))

    for name in ("checkpoint", "optim"):  # built as a field of the actor (its errors name the actor's key)
        build(name, {name: actor.get(name)}, McoreActorConfig, f"{path}.actor")
    parts = {name: getattr(built.pop(name), name) for name in ("checkpoint", "optim") if name in built}
    rest = {k: v for k, v in actor.items() if k not in ("checkpoint", "optim")}
    build("actor", {**rest, **parts}, McoreActorConfig, f"{path}.actor")
    for name, cls in (("model", HFModelConfig), ("rollout", RolloutConfig), ("ref", RefConfig)):
        build(name, node.get(name), cls, f"{path}.{name}")
    if problems:
        return None, problems
    try:
        return megatron_worker_config({**node, **built}, actor=built["actor"], path=path), []
    except ValueError as exc:  # a key missing, nccl_timeout
        return None, [str(exc)]

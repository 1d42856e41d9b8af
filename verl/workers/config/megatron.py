"""The one place a Megatron actor's Hydra node becomes typed configs.

Every consumer (pre-start validation, the trainer, the worker) calls :func:`build_megatron_actor_configs`
on the same ``actor_rollout_ref.actor`` node, so the ``checkpoint.*`` and ``optim.*`` keys are parsed
and checked once, by the classes that define them, instead of by hand in each layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from verl.utils.config import omega_conf_to_dataclass

from .checkpoint import McoreCheckpointConfig
from .optimizer import McoreOptimizerConfig

__all__ = ["MegatronActorConfigs", "build_megatron_actor_configs", "megatron_param_dtype"]

ACTOR_KEY = "actor_rollout_ref.actor"


class MegatronActorConfigs(NamedTuple):
    checkpoint: McoreCheckpointConfig
    optim: McoreOptimizerConfig


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
) -> MegatronActorConfigs:
    """The typed ``checkpoint`` and ``optim`` configs of a Megatron actor node.

    ``actor`` is the ``actor_rollout_ref.actor`` node as a DictConfig or a plain dict (what the trainer
    hands the Ray workers). ``total_training_steps``, when given and the node leaves
    ``optim.total_training_steps`` unset (-1), is filled in, as upstream's trainer does before the
    workers build their schedulers. Raises ValueError naming the offending key.
    """
    checkpoint = _build(actor.get("checkpoint"), McoreCheckpointConfig, f"{path}.checkpoint")
    optim = _build(actor.get("optim"), McoreOptimizerConfig, f"{path}.optim")
    if total_training_steps is not None and optim.total_training_steps < 0:
        optim.total_training_steps = int(total_training_steps)
    return MegatronActorConfigs(checkpoint=checkpoint, optim=optim)


# ``megatron.dtype``: the spellings upstream's ``PrecisionType.to_dtype`` accepts, by the dtype they name.
_DTYPE_SPELLINGS = {
    "bfloat16": ("bfloat16", "bf16"),
    "float16": ("float16", "fp16", "16", 16),
    "float32": ("float32", "fp32", "32", 32),
}


def megatron_param_dtype(value: Any, key: str = f"{ACTOR_KEY}.megatron.dtype") -> str:
    """The parameters' dtype ``megatron.dtype`` names (``bfloat16`` or ``float32``), as a torch dtype name.

    bf16 parameters train with fp32 master weights in megatron's optimizer (upstream's meaning of the key).
    ``float16`` is refused: megatron's fp16 path needs its loss scaling in the pipeline schedule, which the
    update step here does not wire up, so gradients would be unscaled by a scale never applied. Raises
    ValueError naming ``key``.
    """
    name = next((name for name, spellings in _DTYPE_SPELLINGS.items() if value in spellings and not isinstance(value, bool)), None)
    if name is None:
        raise ValueError(f"{key}={value} is not a dtype here; set {key}=bfloat16 (bf16 parameters, fp32 master weights) or float32")
    if name == "float16":
        raise ValueError(
            f"{key}={value}: float16 training needs megatron's loss scaling, which the update step here does not apply; "
            f"set {key}=bfloat16 or float32"
        )
    return name

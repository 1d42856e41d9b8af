"""Engine configs with upstream verl's names and defaults: ``EngineConfig`` and the Megatron one,
``McoreEngineConfig`` (the ``actor_rollout_ref.actor.megatron`` and ``ref.megatron`` nodes).

Each checks its own fields when it is built. Only the fields this trainer's YAML has are here; upstream's
others (dynamic batch sizes on the engine, QAT, Megatron-FSDP tuning, ...) are set by no key of this trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.base_config import BaseConfig
from verl.utils.config import omega_conf_to_dataclass

from .optimizer import _boolean, _choice, _integer

__all__ = ["EngineRouterReplayConfig", "EngineConfig", "McoreEngineConfig", "megatron_param_dtype"]

# ``dtype``: the spellings upstream's ``PrecisionType.to_dtype`` accepts, by the dtype they name.
_DTYPE_SPELLINGS = {
    "bfloat16": ("bfloat16", "bf16"),
    "float16": ("float16", "fp16", "16", 16),
    "float32": ("float32", "fp32", "32", 32),
}


def megatron_param_dtype(value: Any, key: str = "actor_rollout_ref.actor.megatron.dtype") -> str:
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


def nested_config(owner: str, name: str, value: Any, cls: type) -> Any:
    """Field ``name`` of ``owner`` as ``cls`` (a node or an already built config); its errors name
    ``owner.name.<field>``, so the builder of ``owner`` can turn them into the Hydra key."""
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{owner}.{name} must be a mapping of {cls.__name__}'s fields, got {value!r}")
    try:
        return omega_conf_to_dataclass(value or {}, cls)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for klass in cls.__mro__:
            message = message.replace(f"{klass.__name__}.", f"{owner}.{name}.")
        raise ValueError(message if message != str(exc) else f"{owner}.{name}: {message}") from exc


def _positive(owner: str, name: str, value: Any, optional: bool = False) -> None:
    number = _integer(owner, name, value, optional=optional)
    if number is not None and number < 1:
        raise ValueError(f"{owner}.{name} must be >= 1{' or null' if optional else ''}, got {value!r}")


@dataclasses.dataclass
class EngineRouterReplayConfig(BaseConfig):
    """MoE routing replay (upstream's): ``disabled`` (the only mode this trainer runs), ``R2`` or ``R3``."""

    mode: str = "disabled"
    record_file: str | None = None
    replay_file: str | None = None

    def __post_init__(self) -> None:
        _choice(type(self).__name__, "mode", self.mode, ("disabled", "R2", "R3"))


@dataclasses.dataclass
class EngineConfig(BaseConfig):
    """What every training engine shares.

    Args:
        param_offload / grad_offload / optimizer_offload: keep the weights / grads / optimizer state in host
            copies between the calls that need them.
        forward_only: the engine is never trained (a reference policy).
        strategy: the backend ("megatron" here).
        dtype: the parameters' dtype; upstream's default is bfloat16 (``megatron_param_dtype`` says which
            spellings are accepted here: float32 is, float16 is not). Normalised to the torch dtype's name.
        seed: the parameters' initial random state and megatron's RNG.
        router_replay: MoE routing replay.
    """

    param_offload: bool = False
    optimizer_offload: bool = False
    grad_offload: bool = False
    forward_only: bool = False
    strategy: str | None = None
    dtype: str = "bfloat16"
    seed: int = 42
    router_replay: EngineRouterReplayConfig = dataclasses.field(default_factory=EngineRouterReplayConfig)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("param_offload", "optimizer_offload", "grad_offload", "forward_only"):
            _boolean(owner, name, getattr(self, name))
        _integer(owner, "seed", self.seed)
        self._normalize("dtype", megatron_param_dtype(self.dtype, key=f"{owner}.dtype"))
        self._normalize("router_replay", nested_config(owner, "router_replay", self.router_replay, EngineRouterReplayConfig))


@dataclasses.dataclass
class McoreEngineConfig(EngineConfig):
    """Megatron's parallel layout and model build (upstream's ``megatron`` node of an actor or reference).

    Args:
        tensor_model_parallel_size, expert_model_parallel_size, pipeline_model_parallel_size,
            context_parallel_size: the parallel sizes (>= 1).
        expert_tensor_parallel_size: None: the tensor-parallel size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (the interleaved schedule); None: 1.
        sequence_parallel: megatron's sequence parallelism (with TP > 1).
        use_distributed_optimizer: shard the optimizer state over data parallel.
        use_dist_checkpointing / dist_checkpointing_path: checkpoint the model as a Megatron dist checkpoint
            (False: HF weights only, through the bridge) / initial weights from one.
        override_ddp_config, override_transformer_config, override_mcore_model_config: keyword arguments
            for megatron's configs.
        use_mbridge: build the model through a bridge; vanilla_mbridge: through the mbridge package (True)
            instead of Megatron-Bridge (False).
        use_megatron_fsdp: Megatron's FSDP instead of its DDP.
    """

    strategy: str = "megatron"
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = True
    use_distributed_optimizer: bool = True
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    override_ddp_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    override_transformer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    override_mcore_model_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    use_mbridge: bool = True
    vanilla_mbridge: bool = False
    use_megatron_fsdp: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _choice(owner, "strategy", self.strategy, ("megatron",))
        for name in ("tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _positive(owner, name, getattr(self, name))
        for name in ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):
            _positive(owner, name, getattr(self, name), optional=True)
        for name in ("sequence_parallel", "use_distributed_optimizer", "use_dist_checkpointing", "use_mbridge", "vanilla_mbridge", "use_megatron_fsdp"):
            _boolean(owner, name, getattr(self, name))
        for name in ("override_ddp_config", "override_transformer_config", "override_mcore_model_config"):
            if getattr(self, name) is None:  # null overrides nothing (upstream accepts it the same way)
                self._normalize(name, {})
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"{owner}.{name} must be a mapping, got {getattr(self, name)!r}")

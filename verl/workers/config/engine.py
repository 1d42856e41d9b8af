"""Engine configs with upstream verl's names and defaults: ``EngineConfig``, the Megatron one,
``McoreEngineConfig`` (the ``actor_rollout_ref.actor.megatron`` and ``ref.megatron`` nodes), and upstream's
FSDP one, ``FSDPEngineConfig`` (a config type only: this package trains with Megatron, so code and configs
written for upstream's FSDP workers load and validate, and no FSDP engine reads them).

Each checks its own fields when it is built. Only the fields this trainer's YAML has are here; upstream's
others (dynamic batch sizes on the engine, QAT, Megatron-FSDP tuning, ...) are set by no key of this trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.utils.config import nested_config

from .optimizer import _boolean, _choice, _integer

__all__ = ["EngineRouterReplayConfig", "EngineConfig", "McoreEngineConfig", "FSDPEngineConfig", "megatron_param_dtype"]

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
        sequence_parallel: megatron's sequence parallelism; turned off at TP 1, where megatron has no such
            mode (hence settable afterwards, as upstream's).
        use_distributed_optimizer: shard the optimizer state over data parallel.
        use_dist_checkpointing / dist_checkpointing_path: checkpoint the model as a Megatron dist checkpoint
            (False: HF weights only, through the bridge) / initial weights from one.
        override_ddp_config, override_transformer_config, override_mcore_model_config: keyword arguments
            for megatron's configs.
        use_mbridge: build the model through a bridge; vanilla_mbridge: through the mbridge package (True)
            instead of Megatron-Bridge (False).
        use_megatron_fsdp: Megatron's FSDP instead of its DDP.
    """

    _mutable_fields: ClassVar[set[str]] = {"sequence_parallel"}

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
        if self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False

    def validate(self, owner: str = "McoreEngineConfig") -> list[str]:
        """What the update step here does not run, one line each named ``<owner>.<field>`` (the pre-start check
        names the Hydra key): a model built without a bridge, grads offloaded without their weights, context
        parallelism, TP without sequence parallelism."""
        problems = []
        if not self.use_mbridge:
            problems.append(f"{owner}.use_mbridge=False: models are built only through a bridge here (mbridge or Megatron-Bridge, chosen by {owner}.vanilla_mbridge); set {owner}.use_mbridge=True")
        if self.grad_offload and not self.param_offload:
            problems.append(f"{owner}.grad_offload=True without param_offload: grads are offloaded together with the weights; set {owner}.param_offload=True or grad_offload=False")
        if self.context_parallel_size > 1:
            problems.append(f"{owner}.context_parallel_size={self.context_parallel_size}: the update step does not split sequences over context-parallel ranks yet; set {owner}.context_parallel_size=1")
        if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            problems.append(f"{owner}.sequence_parallel=False with tensor_model_parallel_size={self.tensor_model_parallel_size}: both bridges build with sequence parallelism when TP > 1 (MoE requires it); set {owner}.sequence_parallel=True")
        return problems


@dataclasses.dataclass
class FSDPEngineConfig(EngineConfig):
    """Upstream's FSDP engine settings (the ``fsdp_config`` node of an FSDP actor), with its defaults.

    Args:
        strategy: "fsdp", "fsdp2" or "fsdp_turbo".
        wrap_policy: which modules FSDP wraps (e.g. ``{"transformer_layer_cls_to_wrap": [...]}``).
        offload_policy / reshard_after_forward / forward_prefetch / use_orig_params: FSDP's own switches.
        fsdp_size: ranks a parameter is sharded over; -1: all.
        model_dtype: the dtype the HF model is loaded in; mixed_precision: FSDP's mixed-precision node.
        ulysses_sequence_parallel_size: Ulysses sequence parallelism (settable afterwards, as upstream's).
        entropy_from_logits_with_chunking / entropy_from_logits_chunk_size / entropy_checkpointing /
            use_torch_compile: the entropy computation's memory and speed switches.
        pad_to_length / pad_to_length_bucket: pad packed micro batches up to a multiple of the bucket.
        turbo_config: the ``fsdp_turbo`` strategy's settings.
    """

    _mutable_fields: ClassVar[set[str]] = {"ulysses_sequence_parallel_size"}

    strategy: str = "fsdp"
    wrap_policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    use_orig_params: bool = False
    mixed_precision: dict[str, Any] | None = None
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    use_torch_compile: bool = True
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    turbo_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _choice(owner, "strategy", self.strategy, ("fsdp", "fsdp2", "fsdp_turbo"))
        fsdp_size = _integer(owner, "fsdp_size", self.fsdp_size)
        if fsdp_size == 0 or fsdp_size < -1:
            raise ValueError(f"{owner}.fsdp_size must be -1 (all ranks) or >= 1, got {self.fsdp_size!r}")
        for name in ("ulysses_sequence_parallel_size", "entropy_from_logits_chunk_size", "pad_to_length_bucket"):
            _positive(owner, name, getattr(self, name))
        for name in (
            "offload_policy", "reshard_after_forward", "forward_prefetch", "use_orig_params", "entropy_from_logits_with_chunking",
            "use_torch_compile", "entropy_checkpointing", "pad_to_length",
        ):  # fmt: skip
            _boolean(owner, name, getattr(self, name))
        for name in ("wrap_policy", "turbo_config"):
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"{owner}.{name} must be a mapping, got {getattr(self, name)!r}")

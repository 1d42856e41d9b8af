"""Critic configs with upstream verl's names, fields and defaults: ``CriticConfig`` and its Megatron and FSDP
forms, ``McoreCriticConfig`` and ``FSDPCriticConfig``.

Config types only: GRPO trains no critic, and this trainer's ``critic`` keys have no effect (they are listed at
start); the types are here so that code and configs written for upstream's critic workers load and validate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.trainer.config import CheckpointConfig
from verl.utils.config import nested_config
from verl.utils.profiler import ProfilerConfig

from .actor import LOSS_AGG_MODES, check_micro_batch_sizes
from .checkpoint import McoreCheckpointConfig
from .engine import FSDPEngineConfig, McoreEngineConfig, _positive
from .optimizer import McoreOptimizerConfig, OptimizerConfig, _boolean, _choice, _number

__all__ = ["CriticConfig", "McoreCriticConfig", "FSDPCriticConfig"]


@dataclasses.dataclass
class CriticConfig(BaseConfig):
    """The value model's PPO update.

    Args:
        strategy: the training backend; enable: train a critic (None: the algorithm decides).
        rollout_n: responses per prompt.
        ppo_mini_batch_size / ppo_micro_batch_size (deprecated global form) / ppo_micro_batch_size_per_gpu:
            batch sizes (settable afterwards: upstream's workers scale them to a rank's share).
        use_dynamic_bsz / *_max_token_len_per_gpu: micro batches by a token budget instead.
        ppo_infer_micro_batch_size_per_gpu: micro batch of the value computation.
        ppo_epochs / shuffle / data_loader_seed: passes over each batch and their order.
        cliprange_value: the value clip; loss_agg_mode / loss_scale_factor: how the loss is aggregated.
        optim / checkpoint / profiler: the optimizer, checkpoint and profiler settings.
        model: the value model's node (upstream's FSDP critic reads ``use_remove_padding`` from it).
    """

    _mutable_fields: ClassVar[set[str]] = {"ppo_micro_batch_size_per_gpu", "ppo_mini_batch_size", "ppo_micro_batch_size", "model"}
    _nested: ClassVar[dict[str, type]] = {"optim": OptimizerConfig, "checkpoint": CheckpointConfig, "profiler": ProfilerConfig}

    strategy: str | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    enable: bool | None = None
    rollout_n: int = 1
    ppo_mini_batch_size: int = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_infer_micro_batch_size_per_gpu: int | None = None
    ppo_infer_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1
    data_loader_seed: int = 42
    shuffle: bool = True
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    ppo_micro_batch_size: int | None = None
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    model: Any = None
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    profiler: ProfilerConfig = dataclasses.field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name, cls in type(self)._nested.items():
            self._normalize(name, nested_config(owner, name, getattr(self, name), cls))
        for name in ("use_dynamic_bsz", "shuffle"):
            _boolean(owner, name, getattr(self, name))
        for name in ("rollout_n", "ppo_mini_batch_size", "ppo_epochs", "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu", "ppo_infer_max_token_len_per_gpu"):
            _positive(owner, name, getattr(self, name))
        for name in ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_infer_micro_batch_size_per_gpu"):
            _positive(owner, name, getattr(self, name), optional=True)
        if not self.use_dynamic_bsz:
            check_micro_batch_sizes(owner, self.ppo_micro_batch_size, self.ppo_micro_batch_size_per_gpu)
            if self.ppo_micro_batch_size is not None and self.ppo_mini_batch_size % self.ppo_micro_batch_size:
                raise ValueError(
                    f"{owner}.ppo_mini_batch_size={self.ppo_mini_batch_size} must be divisible by "
                    f"ppo_micro_batch_size={self.ppo_micro_batch_size}"
                )
        self._normalize("cliprange_value", _number(owner, "cliprange_value", self.cliprange_value, minimum=0.0))
        _choice(owner, "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)

    def validate(self, n_gpus: int, train_batch_size: int) -> None:
        """Upstream's check against the run's size: a step's prompts hold a mini-batch. Raises ValueError."""
        if not self.use_dynamic_bsz and train_batch_size < self.ppo_mini_batch_size:
            raise ValueError(f"train_batch_size={train_batch_size} is below {type(self).__name__}.ppo_mini_batch_size={self.ppo_mini_batch_size}")


@dataclasses.dataclass
class McoreCriticConfig(CriticConfig):
    """A Megatron critic: the Megatron engine (``megatron``), optimizer and checkpoint, and the collective
    timeout ``nccl_timeout`` (seconds)."""

    _nested: ClassVar[dict[str, type]] = {
        **CriticConfig._nested, "optim": McoreOptimizerConfig, "checkpoint": McoreCheckpointConfig, "megatron": McoreEngineConfig,
    }  # fmt: skip

    strategy: str = "megatron"
    nccl_timeout: int = 600
    optim: McoreOptimizerConfig = dataclasses.field(default_factory=McoreOptimizerConfig)
    megatron: McoreEngineConfig = dataclasses.field(default_factory=McoreEngineConfig)
    checkpoint: McoreCheckpointConfig = dataclasses.field(default_factory=McoreCheckpointConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice(type(self).__name__, "strategy", self.strategy, ("megatron",))
        _positive(type(self).__name__, "nccl_timeout", self.nccl_timeout)


@dataclasses.dataclass
class FSDPCriticConfig(CriticConfig):
    """Upstream's FSDP critic.

    Args:
        fsdp: the FSDP engine; its strategy follows this one's.
        forward_micro_batch_size / forward_micro_batch_size_per_gpu: micro batch of the value computation
            (settable afterwards).
        ulysses_sequence_parallel_size: Ulysses sequence parallelism (needs the model's use_remove_padding).
        grad_clip: the gradient-norm clip.
    """

    _mutable_fields: ClassVar[set[str]] = CriticConfig._mutable_fields | {"forward_micro_batch_size", "forward_micro_batch_size_per_gpu"}
    _nested: ClassVar[dict[str, type]] = {**CriticConfig._nested, "fsdp": FSDPEngineConfig}

    strategy: str = "fsdp"
    fsdp: FSDPEngineConfig = dataclasses.field(default_factory=FSDPEngineConfig)
    forward_micro_batch_size: int = 1
    forward_micro_batch_size_per_gpu: int = 1
    ulysses_sequence_parallel_size: int = 1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _choice(owner, "strategy", self.strategy, ("fsdp", "fsdp2", "fsdp_turbo"))
        for name in ("forward_micro_batch_size", "forward_micro_batch_size_per_gpu", "ulysses_sequence_parallel_size"):
            _positive(owner, name, getattr(self, name))
        self._normalize("grad_clip", _number(owner, "grad_clip", self.grad_clip, minimum=0.0))
        self.fsdp._normalize("strategy", self.strategy)
        if self.ulysses_sequence_parallel_size > 1 and not (self.model or {}).get("use_remove_padding", False):
            raise ValueError(
                f"{owner}.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}: When using sequence "
                "parallelism for critic, you must enable use_remove_padding in the critic's model"
            )

    def validate(self, n_gpus: int, train_batch_size: int) -> None:
        """``CriticConfig.validate``, and a global micro batch gives every GPU a sequence."""
        super().validate(n_gpus, train_batch_size)
        micro = self.ppo_micro_batch_size
        if not self.use_dynamic_bsz and micro is not None and micro * self.ulysses_sequence_parallel_size < n_gpus:
            raise ValueError(
                f"{type(self).__name__}.ppo_micro_batch_size={micro} x ulysses_sequence_parallel_size="
                f"{self.ulysses_sequence_parallel_size} must be >= n_gpus={n_gpus}"
            )

"""Actor configs with upstream verl's names and defaults: ``PolicyLossConfig``, ``ActorConfig`` (the PPO
settings every backend shares) and ``McoreActorConfig`` (the ``actor_rollout_ref.actor`` node of a Megatron
actor: its ``megatron``, ``optim`` and ``checkpoint`` nodes typed too).

Each checks its own fields when it is built; which values this trainer supports (loss modes, KL estimators,
...) is checked before start by ``verl.trainer.validation``, naming the key. Only the fields this trainer's
YAML has are here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.trainer.config import CheckpointConfig

from .checkpoint import McoreCheckpointConfig
from .engine import McoreEngineConfig, _positive, nested_config
from .optimizer import McoreOptimizerConfig, OptimizerConfig, _boolean, _number

__all__ = ["PolicyLossConfig", "ActorConfig", "McoreActorConfig"]


@dataclasses.dataclass
class PolicyLossConfig(BaseConfig):
    """The policy loss: ``loss_mode`` (upstream's default and this trainer's only one: "vanilla", PPO-clip)."""

    loss_mode: str = "vanilla"


@dataclasses.dataclass
class ActorConfig(BaseConfig):
    """The PPO update of an actor.

    Args:
        strategy: the training backend.
        ppo_mini_batch_size: prompts per optimizer step (times the rollout's n responses).
        ppo_micro_batch_size: upstream's deprecated global form of ppo_micro_batch_size_per_gpu.
        ppo_micro_batch_size_per_gpu: sequences per micro batch on a rank.
        use_dynamic_bsz / ppo_max_token_len_per_gpu: micro batches by a token budget instead.
        ppo_epochs: passes over each batch; shuffle: reshuffle between them.
        clip_ratio: PPO's clip; clip_ratio_low / clip_ratio_high: its two sides (None: clip_ratio).
        clip_ratio_c: the dual-clip bound for negative advantages.
        policy_loss: the policy loss; loss_agg_mode / loss_scale_factor: how it is aggregated.
        use_kl_loss / kl_loss_coef / kl_loss_type: the KL loss to the reference policy.
        entropy_coeff: the entropy bonus.
        use_torch_compile: upstream's torch.compile switch.
        checkpoint / optim: the checkpoint and optimizer configs.
        profiler: upstream's profiler switches (a mapping here: no profiler is wired in).
    """

    # field -> its typed config class; a node given for one is built into it
    _nested: ClassVar[dict[str, type]] = {"policy_loss": PolicyLossConfig, "checkpoint": CheckpointConfig, "optim": OptimizerConfig}

    strategy: str | None = None
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    policy_loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0
    use_torch_compile: bool = True
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    profiler: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name, cls in type(self)._nested.items():
            self._normalize(name, nested_config(owner, name, getattr(self, name), cls))
        for name in ("ppo_mini_batch_size", "ppo_epochs"):
            _positive(owner, name, getattr(self, name))
        for name in ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"):
            _positive(owner, name, getattr(self, name), optional=True)
        for name in ("use_dynamic_bsz", "shuffle", "use_kl_loss", "use_torch_compile"):
            _boolean(owner, name, getattr(self, name))
        for name in ("clip_ratio", "clip_ratio_c"):
            self._normalize(name, _number(owner, name, getattr(self, name), minimum=0.0))
        coef = _number(owner, "kl_loss_coef", self.kl_loss_coef)
        if coef < 0:  # the value as given (-1, not -1.0) in the message
            raise ValueError(f"{owner}.kl_loss_coef={self.kl_loss_coef} must be >= 0: the KL loss would reward drifting from the reference")
        self._normalize("kl_loss_coef", coef)
        self._normalize("entropy_coeff", _number(owner, "entropy_coeff", self.entropy_coeff))
        for name in ("clip_ratio_low", "clip_ratio_high", "loss_scale_factor"):
            if getattr(self, name) is not None:
                self._normalize(name, _number(owner, name, getattr(self, name), minimum=0.0))


@dataclasses.dataclass
class McoreActorConfig(ActorConfig):
    """A Megatron actor: ``ActorConfig`` with the Megatron engine (``megatron``), optimizer and checkpoint."""

    _nested: ClassVar[dict[str, type]] = {
        **ActorConfig._nested, "checkpoint": McoreCheckpointConfig, "optim": McoreOptimizerConfig, "megatron": McoreEngineConfig,
    }  # fmt: skip

    strategy: str = "megatron"
    checkpoint: McoreCheckpointConfig = dataclasses.field(default_factory=McoreCheckpointConfig)
    optim: McoreOptimizerConfig = dataclasses.field(default_factory=McoreOptimizerConfig)
    megatron: McoreEngineConfig = dataclasses.field(default_factory=McoreEngineConfig)

"""Actor configs with upstream verl's names and defaults: ``PolicyLossConfig``, ``ActorConfig`` (the PPO
settings every backend shares) and ``McoreActorConfig`` (the ``actor_rollout_ref.actor`` node of a Megatron
actor: its ``megatron``, ``optim`` and ``checkpoint`` nodes typed too).

Each checks its own fields when it is built; which values this trainer supports (loss modes, KL estimators,
...) ``McoreActorConfig.unsupported`` says, which the pre-start check (``verl.trainer.validation``) reports by key. Only the fields this trainer's
YAML has are here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from verl.base_config import BaseConfig
from verl.trainer.config import CheckpointConfig
from verl.utils.config import nested_config
from verl.utils.megatron.parallel import ParallelSizes

from .checkpoint import McoreCheckpointConfig
from .engine import FSDPEngineConfig, McoreEngineConfig, _positive
from .optimizer import McoreOptimizerConfig, OptimizerConfig, _boolean, _choice, _number

__all__ = ["PolicyLossConfig", "ActorConfig", "McoreActorConfig", "FSDPActorConfig", "KL_LOSS_TYPES", "token_budget_problems"]

# The loss aggregations upstream's losses know (this trainer's pre-start check accepts token-mean only).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl.trainer.ppo.core_algos.kl_penalty_types() (not imported: it pulls in torch): upstream's estimator names
# and their straight-through "+" forms; upstream's "full" is not implemented (upstream raises for it too).
KL_LOSS_TYPES = tuple(f"{name}{plus}" for plus in ("", "+") for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"))


def token_budget_problems(key: str, dynamic: bool, budget: int | None, longest: int) -> list[str]:
    """Dynamic batch sizes need room for one whole sequence of ``longest`` tokens, as upstream requires."""
    if dynamic and (budget is None or budget < longest):
        return [f"{key}={budget} is below one sequence (data.max_prompt_length + max_response_length = {longest}); raise it to {longest} or more"]
    return []


def check_micro_batch_sizes(role: str, micro: int | None, micro_per_gpu: int | None, require_one: bool = True) -> None:
    """Upstream's rule for a role trained without dynamic batch sizes: exactly one of the deprecated global
    ``ppo_micro_batch_size`` and ``ppo_micro_batch_size_per_gpu`` (``require_one=False``: at most one).
    Raises ValueError naming ``role``'s keys."""
    if micro is not None and micro_per_gpu is not None:
        raise ValueError(
            f"You have set both {role}.ppo_micro_batch_size AND {role}.ppo_micro_batch_size_per_gpu: "
            "keep only the per-GPU one (the global form is deprecated)"
        )
    if require_one and micro is None and micro_per_gpu is None:
        raise ValueError(
            f"Please set at least one of {role}.ppo_micro_batch_size or {role}.ppo_micro_batch_size_per_gpu "
            "(or use_dynamic_bsz=True)"
        )


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
        rollout_n: responses per prompt, which upstream's workers read here; this trainer reads
            ``actor_rollout_ref.rollout.n``.

    The batch sizes stay settable after the build (upstream's workers scale them to a rank's share).
    """

    _mutable_fields: ClassVar[set[str]] = {"ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"}
    # field -> its typed config class; a node given for one is built into it
    _nested: ClassVar[dict[str, type]] = {"policy_loss": PolicyLossConfig, "checkpoint": CheckpointConfig, "optim": OptimizerConfig}
    # whether a build without dynamic batch sizes needs one of the two micro batch sizes (check_micro_batch_sizes)
    _needs_micro_batch_size: ClassVar[bool] = True

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
    rollout_n: int = 1

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _boolean(owner, "use_dynamic_bsz", self.use_dynamic_bsz)
        if not self.use_dynamic_bsz:
            check_micro_batch_sizes(owner, self.ppo_micro_batch_size, self.ppo_micro_batch_size_per_gpu, type(self)._needs_micro_batch_size)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"Invalid loss_agg_mode: {owner}.loss_agg_mode={self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        for name, cls in type(self)._nested.items():
            self._normalize(name, nested_config(owner, name, getattr(self, name), cls))
        for name in ("ppo_mini_batch_size", "ppo_epochs", "rollout_n"):
            _positive(owner, name, getattr(self, name))
        for name in ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"):
            _positive(owner, name, getattr(self, name), optional=True)
        for name in ("shuffle", "use_kl_loss", "use_torch_compile"):
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

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """Upstream's check against the run's size: a step's prompts hold a mini-batch, and a global micro
        batch (the deprecated ``ppo_micro_batch_size``) divides it and gives every GPU a sequence. Raises
        ValueError. ``model_config``: the model node, for the subclasses' checks."""
        if self.use_dynamic_bsz:
            return
        owner = type(self).__name__
        if train_batch_size < self.ppo_mini_batch_size:
            raise ValueError(f"train_batch_size={train_batch_size} is below {owner}.ppo_mini_batch_size={self.ppo_mini_batch_size}")
        micro = self.ppo_micro_batch_size
        if micro is None:
            return
        if self.ppo_mini_batch_size % micro:
            raise ValueError(f"{owner}.ppo_mini_batch_size={self.ppo_mini_batch_size} must be divisible by ppo_micro_batch_size={micro}")
        sequence_parallel = getattr(self, "ulysses_sequence_parallel_size", 1)
        if micro * sequence_parallel < n_gpus:
            raise ValueError(
                f"{owner}.ppo_micro_batch_size={micro} x ulysses_sequence_parallel_size={sequence_parallel} must be >= n_gpus={n_gpus}"
            )


@dataclasses.dataclass
class McoreActorConfig(ActorConfig):
    """A Megatron actor: ``ActorConfig`` with the Megatron engine (``megatron``), optimizer and checkpoint.

    A build needs no micro batch size: the trainer's pre-start check names a missing
    ``ppo_micro_batch_size_per_gpu`` by its key, and builds this class from parts of the actor node.
    """

    _needs_micro_batch_size: ClassVar[bool] = False
    _nested: ClassVar[dict[str, type]] = {
        **ActorConfig._nested, "checkpoint": McoreCheckpointConfig, "optim": McoreOptimizerConfig, "megatron": McoreEngineConfig,
    }  # fmt: skip

    strategy: str = "megatron"
    checkpoint: McoreCheckpointConfig = dataclasses.field(default_factory=McoreCheckpointConfig)
    optim: McoreOptimizerConfig = dataclasses.field(default_factory=McoreOptimizerConfig)
    megatron: McoreEngineConfig = dataclasses.field(default_factory=McoreEngineConfig)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """How a step splits over Megatron's layout, then upstream's rules: ``train_batch_size`` prompts x
        ``rollout_n`` responses into mini-batches, data-parallel ranks and whole micro batches, and for the
        interleaved schedule (virtual pipeline stages) micro batches in groups of PP. Raises ValueError."""
        owner, mini, n = type(self).__name__, self.ppo_mini_batch_size, self.rollout_n
        if self.ppo_micro_batch_size_per_gpu is None and not self.use_dynamic_bsz:
            raise ValueError(f"{owner}.ppo_micro_batch_size_per_gpu=None: set it (sequences per micro batch on a rank), or use_dynamic_bsz=True")
        if train_batch_size % mini:
            raise ValueError(f"data.train_batch_size={train_batch_size} is not a multiple of {owner}.ppo_mini_batch_size={mini}; set ppo_mini_batch_size to a divisor of it")
        dp = self.data_parallel_size(n_gpus)
        if dp is not None:  # else the layout check names it
            self._check_split(mini * n, dp)
        super().validate(n_gpus, train_batch_size, model_config)

    def data_parallel_size(self, n_gpus: int) -> int | None:
        """Data-parallel ranks of ``n_gpus`` in this layout; None where its model-parallel size does not divide them."""
        model_parallel = ParallelSizes.from_megatron(self.megatron).model_parallel_size
        return None if n_gpus % model_parallel else n_gpus // model_parallel

    def clip_ratios(self) -> tuple[float, float]:
        """PPO's (low, high) clip: ``clip_ratio_low`` / ``clip_ratio_high``, None meaning ``clip_ratio`` (the YAML's null)."""
        low, high = self.clip_ratio_low, self.clip_ratio_high
        return (self.clip_ratio if low is None else low), (self.clip_ratio if high is None else high)

    def unsupported(self, rollout_n: int) -> list[str]:
        """What the update step here does not implement, one line each named ``McoreActorConfig.<field>`` (the
        pre-start check names the Hydra key): the strategy, the engine's settings, the KL estimator, the loss
        aggregation, the clip ratios, and a ``rollout_n`` other than the rollout's ``n`` (``rollout_n``)."""
        owner = type(self).__name__
        problems = [] if self.strategy == "megatron" else [f"{owner}.strategy={self.strategy}: only megatron is implemented; set {owner}.strategy=megatron"]
        problems += self.megatron.validate(f"{owner}.megatron")
        if self.use_kl_loss and self.kl_loss_type not in KL_LOSS_TYPES:
            problems.append(f"{owner}.kl_loss_type={self.kl_loss_type} is not implemented here (one of {list(KL_LOSS_TYPES[:7])}, or one of them with '+'); set {owner}.kl_loss_type=low_var_kl")
        if self.loss_agg_mode != "token-mean":
            problems.append(f"{owner}.loss_agg_mode={self.loss_agg_mode}: only token-mean is implemented; set {owner}.loss_agg_mode=token-mean")
        if self.rollout_n != rollout_n:
            problems.append(f"{owner}.rollout_n={self.rollout_n} differs from RolloutConfig.n={rollout_n}; leave it at its default (${{actor_rollout_ref.rollout.n}})")
        low, high = self.clip_ratios()
        if not (0 < low < 1 and high > 0):
            problems.append(f"{owner}.clip_ratio (low {low}, high {high}) must be > 0 (low < 1)")
        if not self.clip_ratio_c > 1:
            problems.append(f"{owner}.clip_ratio_c={self.clip_ratio_c} must be > 1")
        return problems

    def token_budget_problems(self, longest: int) -> list[str]:
        """``ppo_max_token_len_per_gpu`` with dynamic batch sizes holds a sequence of ``longest`` tokens."""
        return token_budget_problems(f"{type(self).__name__}.ppo_max_token_len_per_gpu", self.use_dynamic_bsz, self.ppo_max_token_len_per_gpu, longest)

    def _check_split(self, sequences: int, dp: int) -> None:
        owner, mini, micro, n = type(self).__name__, self.ppo_mini_batch_size, self.ppo_micro_batch_size_per_gpu, self.rollout_n
        if sequences % dp:
            raise ValueError(f"a mini-batch of {owner}.ppo_mini_batch_size={mini} prompts x {owner}.rollout_n={n} = {sequences} sequences does not split into {dp} data-parallel ranks; make it a multiple of {dp}")
        rows = sequences // dp
        if not self.use_dynamic_bsz and rows % micro:
            raise ValueError(f"{rows} sequences per data-parallel rank and mini-batch (ppo_mini_batch_size={mini} x {owner}.rollout_n={n} / {dp} ranks) do not split into microbatches of {owner}.ppo_micro_batch_size_per_gpu={micro}; set it to a divisor of {rows}")
        pp, vpp = self.megatron.pipeline_model_parallel_size, self.megatron.virtual_pipeline_model_parallel_size
        if vpp is None or vpp <= 1 or pp < 2:
            return
        # the interleaved schedule runs a mini-batch's micro batches in groups of PP per model chunk
        needs = f"which {owner}.megatron.virtual_pipeline_model_parallel_size={vpp} needs"
        if self.use_dynamic_bsz and rows % pp:
            raise ValueError(f"{rows} sequences per data-parallel rank and mini-batch cannot make a multiple of pipeline_model_parallel_size={pp} microbatches, {needs}; make {owner}.ppo_mini_batch_size x rollout_n / data-parallel size a multiple of {pp}")
        if not self.use_dynamic_bsz and (rows // micro) % pp:
            raise ValueError(f"{rows // micro} microbatches per data-parallel rank and mini-batch ({rows} sequences / {owner}.ppo_micro_batch_size_per_gpu={micro}) is not a multiple of pipeline_model_parallel_size={pp}, {needs}; set ppo_micro_batch_size_per_gpu so that {rows} / it is a multiple of {pp}")


@dataclasses.dataclass
class FSDPActorConfig(ActorConfig):
    """Upstream's FSDP actor (a config type only: this package trains with Megatron).

    Args:
        fsdp_config: the FSDP engine; its strategy follows this one's.
        grad_clip: the gradient-norm clip.
        ulysses_sequence_parallel_size: Ulysses sequence parallelism (needs the model's use_remove_padding);
            above 1 it is also set on fsdp_config.
        entropy_from_logits_with_chunking / entropy_from_logits_chunk_size / entropy_checkpointing: the entropy
            computation's memory switches.
        pad_to_length: pad packed micro batches (fsdp_config's setting is what upstream's engine reads).
        use_remove_padding / use_rollout_log_probs: upstream's switches.
    """

    _nested: ClassVar[dict[str, type]] = {**ActorConfig._nested, "fsdp_config": FSDPEngineConfig}

    strategy: str = "fsdp"
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    fsdp_config: FSDPEngineConfig = dataclasses.field(default_factory=FSDPEngineConfig)
    use_remove_padding: bool = False
    use_rollout_log_probs: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _choice(owner, "strategy", self.strategy, ("fsdp", "fsdp2", "fsdp_turbo"))
        self._normalize("grad_clip", _number(owner, "grad_clip", self.grad_clip, minimum=0.0))
        _positive(owner, "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        _positive(owner, "entropy_from_logits_chunk_size", self.entropy_from_logits_chunk_size)
        for name in ("entropy_from_logits_with_chunking", "entropy_checkpointing", "pad_to_length", "use_remove_padding", "use_rollout_log_probs"):
            _boolean(owner, name, getattr(self, name))
        # the engine runs this actor's strategy and sequence parallelism
        self.fsdp_config._normalize("strategy", self.strategy)
        if self.ulysses_sequence_parallel_size > 1:
            self.fsdp_config.ulysses_sequence_parallel_size = self.ulysses_sequence_parallel_size

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """``ActorConfig.validate``, and Ulysses sequence parallelism needs the model's ``use_remove_padding``."""
        super().validate(n_gpus, train_batch_size, model_config)
        if self.ulysses_sequence_parallel_size > 1 and model_config and not model_config.get("use_remove_padding", False):
            raise ValueError(
                f"{type(self).__name__}.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}: with sequence "
                "parallelism you must enable `use_remove_padding` in the model config"
            )

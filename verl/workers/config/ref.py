"""``RefConfig``: the reference policy's node (``actor_rollout_ref.ref``), typed (upstream reads it as a dict).

The reference runs on the actor's ranks, in the actor's layout and dtype, built from the HF model the actor
starts from; ``validate`` names every setting of the node that says otherwise.
"""

from __future__ import annotations

import dataclasses

from verl.base_config import BaseConfig
from verl.utils.config import nested_config

from .actor import McoreActorConfig
from .engine import McoreEngineConfig, _positive
from .optimizer import _boolean
from .rollout import LogProbPass

__all__ = ["RefConfig"]

# The layout keys a reference shares with its actor.
SHARED_LAYOUT = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
)  # fmt: skip


@dataclasses.dataclass
class RefConfig(BaseConfig, LogProbPass):
    """The reference's forward-only pass and its Megatron engine.

    Args:
        log_prob_micro_batch_size_per_gpu / log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu: the
            pass's micro batches (None per gpu: the actor's ppo_micro_batch_size_per_gpu).
        log_prob_micro_batch_size: upstream's deprecated global form (refused with the KL loss on).
        megatron: the reference's engine; its layout and dtype follow the actor's in the YAML.
    """

    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int | None = 16384
    megatron: McoreEngineConfig = dataclasses.field(default_factory=McoreEngineConfig)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"):
            _positive(owner, name, getattr(self, name), optional=True)
        _boolean(owner, "log_prob_use_dynamic_bsz", self.log_prob_use_dynamic_bsz)
        self._normalize("megatron", nested_config(owner, "megatron", self.megatron, McoreEngineConfig))

    def validate(self, actor: McoreActorConfig) -> list[str]:
        """What would make this reference other than the actor's starting point, one line each, named by the
        field (``RefConfig.megatron.<key>``; the builder names the Hydra key)."""
        owner, ours, theirs = type(self).__name__, self.megatron, actor.megatron
        problems = []
        for key in SHARED_LAYOUT:
            mine, actors = getattr(ours, key), getattr(theirs, key)
            if key == "expert_tensor_parallel_size":  # None: the tensor-parallel size (both None: its line says it)
                if mine is None and actors is None:
                    continue
                mine = ours.tensor_model_parallel_size if mine is None else mine
                actors = theirs.tensor_model_parallel_size if actors is None else actors
            if mine != actors:
                problems.append(f"{owner}.megatron.{key}={getattr(ours, key)} differs from the actor's ({getattr(theirs, key)}): the reference runs on the actor's ranks in the actor's layout here; set it to {getattr(theirs, key)} (its default follows the actor)")
        if ours.dtype != theirs.dtype:  # both normalised to torch's name
            problems.append(f"{owner}.megatron.dtype={ours.dtype} differs from the actor's ({theirs.dtype}): the reference runs in the actor's dtype here; set it to {theirs.dtype} (its default follows the actor)")
        if ours.use_dist_checkpointing:
            problems.append(f"{owner}.megatron.use_dist_checkpointing=True: the reference is built from the HF actor_rollout_ref.model.path only; set it to False")
        if self.log_prob_micro_batch_size is not None:
            problems.append(f"{owner}.log_prob_micro_batch_size={self.log_prob_micro_batch_size}: upstream's deprecated global form; set {owner}.log_prob_micro_batch_size_per_gpu instead")
        return problems

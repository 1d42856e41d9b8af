"""Parallel sizes (TP/PP/EP/ETP/CP, and the virtual pipeline size): validation before any rank starts, and
Megatron initialisation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_KEY = "actor_rollout_ref.actor.megatron."
# Each MoE family names its routed-expert count differently: Qwen MoE, Mixtral, DeepSeek.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_routed_experts(hf_config: Any) -> int:
    """The routed-expert count of an HF config (object or config.json dict); 0 for a dense model.

    One reader for every family, so the EP checks cannot miss experts a family names differently.
    """
    for key in EXPERT_COUNT_KEYS:
        value = hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


class ParallelConfigError(ValueError):
    """Parallel sizes that cannot work with this world size or model; raised before any work starts.

    ``problems`` holds one line per problem, so callers can report them with others of the same config.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems) if problems is not None else [message]
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: same as tp, as in upstream verl's config
    cp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved schedule); None or 1: one chunk

    @classmethod
    def from_megatron(cls, megatron: Any) -> ParallelSizes:
        """The sizes upstream's ``actor_rollout_ref.actor.megatron`` node names (a Hydra node or ``McoreEngineConfig``)."""
        etp, vpp = megatron.expert_tensor_parallel_size, megatron.virtual_pipeline_model_parallel_size
        return cls(
            tp=int(megatron.tensor_model_parallel_size),
            pp=int(megatron.pipeline_model_parallel_size),
            ep=int(megatron.expert_model_parallel_size),
            etp=None if etp is None else int(etp),
            cp=int(megatron.context_parallel_size),
            vpp=None if vpp is None else int(vpp),
        )

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans (TP x PP x CP); the world divides into this many data-parallel groups."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def virtual_stages(self) -> int | None:
        """Megatron's virtual pipeline size: None for one model chunk per pipeline rank, as upstream treats 1."""
        return self.vpp if self.vpp is not None and self.vpp > 1 else None

    def validate(
        self,
        world_size: int,
        num_layers: int | None = None,
        num_experts: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ) -> None:
        """Raise ParallelConfigError naming every problem and the override that fixes it.

        Model sizes left as None are not checked; ``num_experts=0`` means a dense model.
        """
        problems = []
        for name, value in (("tensor", self.tp), ("pipeline", self.pp), ("expert", self.ep), ("context", self.cp)):
            if value < 1:
                problems.append(f"{name}_model_parallel_size={value} must be >= 1")
        if self.expert_tp < 1:
            problems.append(f"expert_tensor_parallel_size={self.expert_tp} must be >= 1")
        if self.vpp is not None and self.vpp < 1:
            problems.append(f"virtual_pipeline_model_parallel_size={self.vpp} must be >= 1 (or null)")
        elif self.virtual_stages and self.pp < 2:
            problems.append(
                f"virtual_pipeline_model_parallel_size={self.vpp} needs pipeline_model_parallel_size >= 2 (it is {self.pp}); "
                f"set {_KEY}virtual_pipeline_model_parallel_size=null or raise {_KEY}pipeline_model_parallel_size"
            )
        if problems:
            raise ParallelConfigError("; ".join(problems), problems)
        if world_size % self.model_parallel_size:
            problems.append(
                f"world size {world_size} is not divisible by TP x PP x CP = {self.tp}x{self.pp}x{self.cp}; "
                f"set {_KEY}tensor_model_parallel_size / pipeline_model_parallel_size / context_parallel_size "
                f"so their product divides the world size (trainer.nnodes x trainer.n_gpus_per_node)"
            )
        if world_size % (self.expert_tp * self.ep * self.pp):
            problems.append(
                f"world size {world_size} is not divisible by ETP x EP x PP = {self.expert_tp}x{self.ep}x{self.pp}; "
                f"set {_KEY}expert_tensor_parallel_size / expert_model_parallel_size accordingly"
            )
        if num_experts and num_experts % self.ep:
            problems.append(
                f"num_experts={num_experts} is not divisible by expert_model_parallel_size={self.ep}; "
                f"set {_KEY}expert_model_parallel_size to a divisor of {num_experts}"
            )
        if num_experts == 0 and self.ep > 1:
            problems.append(f"expert_model_parallel_size={self.ep} but the model has no experts; set {_KEY}expert_model_parallel_size=1")
        if num_layers is not None and num_layers % self.pp:
            problems.append(
                f"num_hidden_layers={num_layers} is not divisible by pipeline_model_parallel_size={self.pp}; "
                f"set {_KEY}pipeline_model_parallel_size to a divisor of {num_layers}"
            )
        elif num_layers is not None and self.virtual_stages and self.pp >= 2 and num_layers % (self.pp * self.vpp):
            problems.append(
                f"num_hidden_layers={num_layers} does not split into pipeline_model_parallel_size={self.pp} x "
                f"virtual_pipeline_model_parallel_size={self.vpp} equal model chunks; set "
                f"{_KEY}virtual_pipeline_model_parallel_size so that {self.pp} x it divides {num_layers} (or null)"
            )
        if num_attention_heads is not None and num_attention_heads % self.tp:
            problems.append(
                f"num_attention_heads={num_attention_heads} is not divisible by tensor_model_parallel_size={self.tp}; "
                f"set {_KEY}tensor_model_parallel_size to a divisor of {num_attention_heads}"
            )
        if num_key_value_heads is not None and num_key_value_heads % self.tp:
            problems.append(
                f"num_key_value_heads={num_key_value_heads} is not divisible by tensor_model_parallel_size={self.tp}; "
                f"set {_KEY}tensor_model_parallel_size to a divisor of {num_key_value_heads}"
            )
        if problems:
            raise ParallelConfigError("invalid parallel configuration:\n  - " + "\n  - ".join(problems), problems)

    def validate_for_hf_config(self, world_size: int, hf_config: Any) -> None:
        """``validate`` with the model's sizes read from its HF config (an object or config.json's dict, as
        ``num_routed_experts`` reads it; None: the layout alone, the model not known yet)."""
        if hf_config is None:
            return self.validate(world_size)

        def get(key: str) -> Any:
            return hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)

        self.validate(
            world_size,
            num_layers=get("num_hidden_layers"),
            num_experts=num_routed_experts(hf_config),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
        )

    def initialize_megatron(self, seed: int = 1234) -> None:
        """Initialise megatron-core parallel state and its RNG tracker on this (already joined) rank."""
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.virtual_stages,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

"""The trainer config's keys: the prefixes messages name (one spelling for every module that names them), the
YAML's own leaves, and the tables of keys the upstream-key policy reads."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

ACTOR = "actor_rollout_ref.actor"
MEGATRON = f"{ACTOR}.megatron."
CHECKPOINT = f"{ACTOR}.checkpoint."
REF = "actor_rollout_ref.ref"
ROLLOUT = "actor_rollout_ref.rollout."
PARITY = "actor_rollout_ref.rollout.log_prob_parity_check"  # verl.trainer.ppo.log_prob_parity.GATE_KEY
_YAML = os.path.join(os.path.dirname(__file__), "ppo_megatron_trainer.yaml")
# override_transformer_config fields that change memory or speed only; any other field would change the model.
PERF_ONLY_TRANSFORMER_FIELDS = (
    "recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers", "attention_backend",
    "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm", "moe_grouped_gemm",
    "moe_permute_fusion", "cross_entropy_loss_fusion", "moe_token_dispatcher_type",
)  # fmt: skip
# Nodes whose entries are free-form keyword arguments (a `+key=value` below them is not a misspelling).
OPEN_NODES = (
    f"{MEGATRON}override_transformer_config", f"{MEGATRON}override_ddp_config", f"{MEGATRON}override_mcore_model_config",
    f"{ACTOR}.optim.override_optimizer_config", f"{CHECKPOINT}mbridge_config", "reward_model.reward_kwargs",
    f"{ROLLOUT}engine_kwargs", "ray_kwargs.ray_init", "data.apply_chat_template_kwargs", "actor_rollout_ref.model.override_config",
    f"{PARITY}.tolerance", "actor_rollout_ref.model.lora", "critic.optim.override_optimizer_config",
)  # fmt: skip
# Keys upstream's rollout has and this YAML does not list, accepted with `+` (the run script adds some).
EXTRA_ENGINE_KEYS = ("moe_tensor_parallel_size", "quantization", "quantization_config_file", "cudagraph_capture_sizes", "layered_summon")


def raw_yaml() -> dict:
    """The YAML's nodes as written (interpolations unresolved), without Hydra's own."""
    raw = OmegaConf.to_container(OmegaConf.load(_YAML), resolve=False)
    return {key: value for key, value in raw.items() if key not in ("defaults", "hydra")}


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested dict by its dotted key (an empty node is a leaf)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for name, value in node.items():
            out.update(leaves(value, f"{prefix}.{name}" if prefix else str(name)))
        return out
    return {prefix: node}

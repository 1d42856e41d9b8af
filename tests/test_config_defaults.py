"""Every default of a typed config against the YAML the trainer loads: a key the YAML sets to another value than
its class's default must be listed in ``DIFFERENT`` with the reason, so no default can differ silently. The
classes keep upstream verl's defaults (code that builds them by hand gets upstream's meaning); the YAML holds
this trainer's. No torch needed."""

import dataclasses
from typing import Any

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl.base_config import BaseConfig
from verl.trainer.config import AlgoConfig, DataConfig, KLControlConfig, TrainerConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    CheckpointEngineConfig,
    EngineRouterReplayConfig,
    HFModelConfig,
    LogProbParityCheckConfig,
    McoreActorConfig,
    McoreCheckpointConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    PolicyLossConfig,
    RefConfig,
    RolloutConfig,
    SamplingConfig,
)

# The trainer's YAML node -> the typed config the trainer builds from it.
NODES: dict[str, type] = {
    "actor_rollout_ref.model": HFModelConfig,
    "actor_rollout_ref.actor": McoreActorConfig,
    "actor_rollout_ref.actor.checkpoint": McoreCheckpointConfig,
    "actor_rollout_ref.actor.optim": McoreOptimizerConfig,
    "actor_rollout_ref.actor.megatron": McoreEngineConfig,
    "actor_rollout_ref.actor.megatron.router_replay": EngineRouterReplayConfig,
    "actor_rollout_ref.actor.policy_loss": PolicyLossConfig,
    "actor_rollout_ref.ref": RefConfig,
    "actor_rollout_ref.ref.megatron": McoreEngineConfig,
    "actor_rollout_ref.rollout": RolloutConfig,
    "actor_rollout_ref.rollout.val_kwargs": SamplingConfig,
    "actor_rollout_ref.rollout.checkpoint_engine": CheckpointEngineConfig,
    "actor_rollout_ref.rollout.log_prob_parity_check": LogProbParityCheckConfig,
    "algorithm": AlgoConfig,
    "algorithm.kl_ctrl": KLControlConfig,
    "trainer": TrainerConfig,
    "data": DataConfig,
}

# (node, field) -> why the trainer's YAML sets another value than the class's (upstream's) default.
_ACTOR, _MEGATRON, _REF, _ROLLOUT = (
    "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "actor_rollout_ref.rollout",
)  # fmt: skip
_LAYOUT = "the embedded default job's layout: TP2 PP2 EP2 ETP2 on 8 ranks"
_REF_FOLLOWS = "follows the actor's (the reference runs on the actor's ranks and layout)"
_TINY_TASK = "the embedded tiny task: 8 prompts a step, 16 responses each, 4-token prompts, 2-token answers"
DIFFERENT: dict[tuple[str, str], str] = {
    (f"{_ACTOR}.checkpoint", "save_contents"): "the trainer saves the HF weights with every step (verified by fix 2)",
    (f"{_ACTOR}.checkpoint", "load_contents"): "follows save_contents (${.save_contents}), as upstream's YAML",
    (f"{_ACTOR}.optim", "weight_decay"): "the embedded tiny task trains without weight decay",
    (f"{_ACTOR}.optim", "lr_decay_style"): "upstream's YAML says constant too; its class says linear",
    (_ACTOR, "ppo_mini_batch_size"): _TINY_TASK,
    (_ACTOR, "rollout_n"): "follows rollout.n (${actor_rollout_ref.rollout.n}), as upstream's YAML",
    (_ACTOR, "ppo_micro_batch_size_per_gpu"): "the tiny task's 64 rows per data-parallel rank (8 prompts x 16 over DP 2) in 2 micro batches",
    ("actor_rollout_ref.model", "lora"): "upstream's LoRA node with rank 0 (off), so launch scripts that set its keys compose",
    (_ACTOR, "clip_ratio_low"): "null: clip_ratio, so that one clip_ratio override sets both sides",
    (_ACTOR, "clip_ratio_high"): "null: clip_ratio, so that one clip_ratio override sets both sides",
    (_ACTOR, "profiler"): "upstream's profiler keys, so launch scripts that set them compose (no profiler is wired here)",
    (_MEGATRON, "dtype"): "float32 is this package's default (docs/upstream-differences.md); bfloat16 is upstream's",
    (_MEGATRON, "tensor_model_parallel_size"): _LAYOUT,
    (_MEGATRON, "expert_model_parallel_size"): _LAYOUT,
    (_MEGATRON, "pipeline_model_parallel_size"): _LAYOUT,
    (_MEGATRON, "sequence_parallel"): "on with the layout's TP2; the class's default TP 1 turns it off (upstream's rule)",
    (_MEGATRON, "use_distributed_optimizer"): "the job fix 1 is about: MoE layouts such as PP4 EP2 TP2 ETP2 run without it",
    (_MEGATRON, "override_transformer_config"): "upstream's YAML's recompute / attention settings (memory and speed only)",
    (_REF, "dtype"): _REF_FOLLOWS,
    (_REF, "tensor_model_parallel_size"): _REF_FOLLOWS,
    (_REF, "expert_model_parallel_size"): _REF_FOLLOWS,
    (_REF, "pipeline_model_parallel_size"): _REF_FOLLOWS,
    ("algorithm", "adv_estimator"): "grpo, the only estimator here; upstream's class defaults to gae",
    (_ROLLOUT, "n"): _TINY_TASK,
    (_ROLLOUT, "prompt_length"): "follows data.max_prompt_length (" + _TINY_TASK + ")",
    (_ROLLOUT, "response_length"): "follows data.max_response_length (" + _TINY_TASK + ")",
    (_ROLLOUT, "calculate_log_probs"): "the hf rollout always returns its log-probs (the parity gate and log_prob_diff read them)",
    (_ROLLOUT, "max_num_seqs"): "an inference-engine setting with no effect here; upstream's YAML value",
    (_ROLLOUT, "engine_kwargs"): "upstream's YAML lists one node per inference engine",
    (f"{_ROLLOUT}.val_kwargs", "temperature"): "validation decodes greedily, as upstream's YAML",
    (f"{_ROLLOUT}.val_kwargs", "do_sample"): "validation decodes greedily, as upstream's YAML",
}


def _composed() -> Any:
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer")


def _differences(config: Any, nodes: dict[str, type]) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(node, field) -> (the YAML's value, the class default) for every field the node sets to another value.
    Both sides go through the class, so a list and the tuple it is normalised to compare equal. A field that
    is itself a typed config is compared under its own node."""
    found = {}
    for node, cls in nodes.items():
        yaml_node = OmegaConf.to_container(OmegaConf.select(config, node), resolve=True)
        built, default = omega_conf_to_dataclass(yaml_node, cls), cls()
        for field in dataclasses.fields(cls):
            if field.name == "_target_" or field.name not in yaml_node:
                continue
            ours, theirs = getattr(built, field.name), getattr(default, field.name)
            if not isinstance(theirs, BaseConfig) and ours != theirs:
                found[(node, field.name)] = (ours, theirs)
    return found


def test_every_yaml_default_equals_its_typed_default_or_is_listed_with_why():
    found = _differences(_composed(), NODES)
    unlisted = {key: values for key, values in found.items() if key not in DIFFERENT}
    assert not unlisted, f"the YAML and the typed config disagree (YAML, class default); make them agree or list why: {unlisted}"
    stale = sorted(set(DIFFERENT) - set(found))
    assert not stale, f"listed as different but equal now; remove from DIFFERENT: {stale}"
    assert all(reason.strip() for reason in DIFFERENT.values())


def test_a_changed_default_is_found():
    """The comparison sees a YAML value that differs from the class default (here: optim.lr)."""
    config = _composed()
    config.actor_rollout_ref.actor.optim.lr = 5e-4
    found = _differences(config, NODES)
    assert found[("actor_rollout_ref.actor.optim", "lr")] == (5e-4, McoreOptimizerConfig().lr)

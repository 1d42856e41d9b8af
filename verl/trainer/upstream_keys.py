"""Upstream verl's config keys: each one is honoured, refused in one line with its reason, or (no effect here)
listed at start. A launch script written for upstream composes with this package's config; what it sets that
this package does not do is said, never silently dropped."""

from __future__ import annotations

import os
import shutil
from typing import Any

from omegaconf import OmegaConf

from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.config.keys import CHECKPOINT as _CHECKPOINT
from verl.trainer.config.keys import MEGATRON as _MEGATRON
from verl.trainer.config.keys import PARITY as PARITY_KEY
from verl.trainer.config.keys import REF as _REF

_YAML = os.path.join(os.path.dirname(__file__), "config", "ppo_megatron_trainer.yaml")
_ROLLOUT = "actor_rollout_ref.rollout."
_ENGINE_WHY = "an inference-engine setting (vLLM / SGLang / TensorRT-LLM); the hf rollout (transformers generate on each data-parallel group's output rank) has none"
_NO_REF_WHY = "no reference model is built: actor.use_kl_loss is off"
_PROFILER_WHY = "no profiler (nsys, npu, torch) is wired into this trainer; the run is not profiled"
_REF_BUILD_WHY = "the reference is built like the actor, through the actor's bridge (actor.megatron.vanilla_mbridge) from the HF actor_rollout_ref.model.path (its weights, not a seed)"
_TRANSFORMER_WHY = "a memory / speed setting of Megatron's TransformerConfig; not applied here (the model is built from its HF config through the bridge) and the model computes the same function without it"
# override_transformer_config fields that change memory or speed only; any other field would change the model.
PERF_ONLY_TRANSFORMER_FIELDS = (
    "recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers", "attention_backend",
    "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm", "moe_grouped_gemm",
    "moe_permute_fusion", "cross_entropy_loss_fusion", "moe_token_dispatcher_type",
)  # fmt: skip
# Nodes whose entries are free-form keyword arguments (a `+key=value` below them is not a misspelling).
_OPEN_NODES = (
    f"{_MEGATRON}override_transformer_config", f"{_MEGATRON}override_ddp_config", f"{_MEGATRON}override_mcore_model_config",
    f"{_ACTOR}.optim.override_optimizer_config", f"{_CHECKPOINT}mbridge_config", "reward_model.reward_kwargs",
    f"{_ROLLOUT}engine_kwargs", "ray_kwargs.ray_init", "data.apply_chat_template_kwargs", "actor_rollout_ref.model.override_config",
    f"{PARITY_KEY}.tolerance", "actor_rollout_ref.model.lora", "critic.optim.override_optimizer_config",
)  # fmt: skip
# Keys upstream's rollout has and this YAML does not list, accepted with `+` (the run script adds some).
_EXTRA_ENGINE_KEYS = ("moe_tensor_parallel_size", "quantization", "quantization_config_file", "cudagraph_capture_sizes", "layered_summon")

_ONE_ENGINE_WHY = "one vLLM engine per data-parallel group, in its output rank's process, at tensor-parallel 1"
# With rollout.name=vllm the engine reads max_num_batched_tokens, max_model_len, max_num_seqs, enable_chunked_prefill,
# enable_prefix_caching, enforce_eager, load_format and engine_kwargs.vllm; these it does not (docs/grpo.md).
_VLLM_INERT = {
    "mode": "the engine is vLLM's offline LLM in the rank's own process (no server)",
    **{key: _ONE_ENGINE_WHY for key in (
        "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
        "moe_tensor_parallel_size")},
    "gpu_memory_utilization": "vLLM's CPU backend reads it as the share of the host's memory each engine reserves; the KV cache is sized to max_num_seqs sequences of max_model_len tokens instead",
    "free_cache_engine": "the engine keeps its KV cache between steps (vLLM's sleep mode is not wired in)",
    "dtype": "the engine runs in the actor's dtype (actor.megatron.dtype), as the log-prob parity gate needs",
    "engine_kwargs.sglang": "read by the sglang rollout only",
    "engine_kwargs.trtllm": "read by the TensorRT-LLM rollout only",
    "checkpoint_engine": "the actor's weights go into the engine in memory every step",
    **{key: "not passed to the engine" for key in ("quantization", "quantization_config_file", "cudagraph_capture_sizes", "layered_summon")},
}  # fmt: skip


def _inert_rules(config: Any) -> list[tuple[str, str]]:
    """(key, why) of every key that has no effect in this config; a key set away from its default is listed at start."""
    if config.actor_rollout_ref.rollout.name == "vllm":
        rules = [(f"{_ROLLOUT}{key}", why) for key, why in _VLLM_INERT.items()]
    else:
        rules = [(f"{_ROLLOUT}{key}", _ENGINE_WHY) for key in (
            "mode", "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
            "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "enable_chunked_prefill",
            "enable_prefix_caching", "enforce_eager", "free_cache_engine", "load_format", "dtype", "engine_kwargs",
            "checkpoint_engine", *_EXTRA_ENGINE_KEYS)]  # fmt: skip
    rules += [
        (f"{_ROLLOUT}calculate_log_probs", "the hf rollout always returns its log-probs (logged as rollout/log_prob_diff_*)"),
        ("actor_rollout_ref.hybrid_engine", "the actor and the rollout always share the ranks here"),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", "activation memory only; the actor does not recompute here"),
        ("actor_rollout_ref.model.enable_activation_offload", "activation memory only; not implemented here"),
        ("actor_rollout_ref.model.use_fused_kernels", "fused loss kernels change speed only; the actor computes log-probs from vocab-parallel logits"),
        ("actor_rollout_ref.model.use_liger", "Liger kernels are for the FSDP backend"),
        ("actor_rollout_ref.model.use_remove_padding", "no sequence packing here: a run's prompts are left-padded to one length, the padding masked (docs/trainer.md)"),
        ("actor_rollout_ref.model.trust_remote_code", "no folder's code is ever run here: built-in transformers families only (docs/models.md), and a model folder naming custom code is refused (docs/operations.md)"),
        (f"{_ACTOR}.use_torch_compile", "no torch.compile on this path"),
        ("algorithm.gamma", "GAE's discount; GRPO's advantages do not read it"),
        ("algorithm.lam", "GAE's lambda; GRPO's advantages do not read it"),
        ("trainer.balance_batch", "balancing reorders sequences by length across data-parallel ranks; here every sequence has one length"),
        ("trainer.critic_warmup", "GRPO has no critic"),
        ("data.return_raw_input_ids", "the trainer tokenizes prompts itself"),
        ("data.return_raw_chat", "the trainer tokenizes prompts itself"),
        ("data.return_full_prompt", "the trainer tokenizes prompts itself"),
        ("data.dataloader_num_workers", "prompts are tokenized once on the driver"),
        ("data.filter_overlong_prompts_workers", "prompts are tokenized once on the driver"),
        ("data.validation_shuffle", "validation scores every prompt; the order changes nothing"),
        ("ray_kwargs.timeline_json_file", "no Ray timeline is written"),
        (f"{_MEGATRON}override_transformer_config", _TRANSFORMER_WHY),
        (f"{_REF}.megatron.dist_checkpointing_path", "read by upstream only with use_dist_checkpointing, which the reference does not take here"),
    ]
    if not config.actor_rollout_ref.actor.megatron.use_dist_checkpointing:
        rules.append((f"{_MEGATRON}dist_checkpointing_path", "read by upstream only with use_dist_checkpointing (initial weights from a dist checkpoint)"))
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    if not actor.use_kl_loss:
        rules.append(("actor_rollout_ref.ref", _NO_REF_WHY))
    else:
        rules += [(f"{_REF}.megatron.{key}", _REF_BUILD_WHY) for key in ("seed", "use_mbridge", "vanilla_mbridge")]
    if not actor.use_kl_loss:
        rules += [(f"{_ACTOR}.{key}", "actor.use_kl_loss is off") for key in ("kl_loss_coef", "kl_loss_type")]
    if not algorithm.use_kl_in_reward:
        rules += [(f"algorithm.{key}", "algorithm.use_kl_in_reward is off") for key in ("kl_penalty", "kl_ctrl")]
    if config.reward_model.reward_manager in (None, "naive"):
        rules.append(("reward_model.reward_kwargs", "read only by other reward managers (dapo, prime, ...); the naive manager calls default_compute_score"))
    rules += [
        ("critic", "GRPO trains no critic"),
        ("reward.num_workers", "rule-based rewards are computed on the driver"),
        ("reward.reward_model", "no reward model is built (reward.reward_model.enable is off)"),
        (f"{_ACTOR}.profiler", _PROFILER_WHY),
        ("global_profiler", _PROFILER_WHY),
    ]
    if int(config.actor_rollout_ref.model.lora.rank or 0) == 0:
        rules.append(("actor_rollout_ref.model.lora", "LoRA is off (lora.rank 0)"))
    return rules


def _raw_yaml() -> dict:
    raw = OmegaConf.to_container(OmegaConf.load(_YAML), resolve=False)
    return {key: value for key, value in raw.items() if key not in ("defaults", "hydra")}


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for name, value in node.items():
            out.update(_leaves(value, f"{prefix}.{name}" if prefix else str(name)))
        return out
    return {prefix: node}


def ignored_settings(config: Any) -> list[str]:
    """One line per key that has no effect here and is set to anything but its default: ``key=value: why``.

    A default written as an interpolation (the ``ref`` node follows the actor's) is compared as it resolves in
    this config, so ``ref.megatron.tensor_model_parallel_size`` set equal to the actor's is not listed.
    """
    current = _leaves(OmegaConf.to_container(config, resolve=True))
    defaults_raw = _leaves(_raw_yaml())
    probe = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    interpolated = [key for key, value in defaults_raw.items() if isinstance(value, str) and value.startswith("${")]
    for key in interpolated:
        OmegaConf.update(probe, key, defaults_raw[key], force_add=True)
    resolved_defaults = {**defaults_raw, **{key: OmegaConf.select(probe, key) for key in interpolated}}
    lines, seen = [], set()
    for prefix, why in _inert_rules(config):
        for key in sorted(k for k in current if k == prefix or k.startswith(prefix + ".")):
            value, default = current[key], resolved_defaults.get(key)
            if key in seen or value == default or (value in ({}, None) and key not in resolved_defaults):
                continue
            seen.add(key)
            lines.append(f"{key}={value!r}: {why}")
    return lines


def check_upstream_keys(config: Any) -> list[str]:
    """Upstream keys whose value would change what is trained and is not implemented here, and `+key`s that are no key."""
    actor, rollout, megatron = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor.megatron
    model, reward = config.actor_rollout_ref.model, config.reward_model
    problems = []
    engine = config.get("model_engine", "megatron")
    if engine != "megatron":
        problems.append(f"model_engine={engine}: only the Megatron backend trains here; set model_engine=megatron")
    if megatron.use_dist_checkpointing and megatron.dist_checkpointing_path is not None:
        problems.append(f"{_MEGATRON}dist_checkpointing_path={megatron.dist_checkpointing_path}: initial weights are read from the HF actor_rollout_ref.model.path only; set it to null")
    for node in ("override_ddp_config", "override_mcore_model_config"):
        if megatron[node]:
            problems.append(f"{_MEGATRON}{node}={OmegaConf.to_container(megatron[node])}: not applied here, and it would change the update or the model; remove it")
    for name, value in (megatron.override_transformer_config or {}).items():
        if name not in PERF_ONLY_TRANSFORMER_FIELDS and value is not None:
            problems.append(f"{_MEGATRON}override_transformer_config.{name}={value}: only memory / speed fields {list(PERF_ONLY_TRANSFORMER_FIELDS[:4])}... are accepted (and ignored) here; a model field is read from the HF config; remove it")
    if model.override_config:
        problems.append(f"actor_rollout_ref.model.override_config={OmegaConf.to_container(model.override_config)}: the model is built from its config.json as is; edit a copy of the model's config.json instead")
    for key, rank in (("lora_rank", model.lora_rank), ("lora.rank", model.lora.rank)):
        if int(rank or 0) > 0:
            problems.append(f"actor_rollout_ref.model.{key}={rank}: LoRA is not supported here; set it to 0")
    for role in (_MEGATRON, *([f"{_REF}.megatron."] if actor.use_kl_loss else [])):  # a reference is built for the KL loss only
        if OmegaConf.select(config, f"{role}use_megatron_fsdp"):
            problems.append(f"{role}use_megatron_fsdp=True: Megatron's FSDP is not supported here (its DDP is); set it to False")
    if megatron.router_replay.mode != "disabled":
        problems.append(f"{_MEGATRON}router_replay.mode={megatron.router_replay.mode}: MoE routing replay is not implemented; set it to disabled")
    if rollout.enable_rollout_routing_replay:
        problems.append(f"{_ROLLOUT}enable_rollout_routing_replay=True: MoE routing replay is not implemented; set it to False")
    if config.reward.reward_model.enable:
        problems.append("reward.reward_model.enable=True: a model-based reward is not available here (rule-based rewards only); set it to False")
    if model.external_lib is not None:
        problems.append(f"actor_rollout_ref.model.external_lib={model.external_lib}: external model code is not imported here; set it to null")
    for key, value in ((f"{_ACTOR}.ppo_micro_batch_size", actor.ppo_micro_batch_size), (f"{_ROLLOUT}log_prob_micro_batch_size", rollout.log_prob_micro_batch_size)):
        if value is not None:
            problems.append(f"{key}={value}: upstream's deprecated global form; set its *_per_gpu key instead")
    if actor.shuffle:
        problems.append(f"{_ACTOR}.shuffle=True: mini-batches are taken in rollout order here; set it to False")
    if actor.loss_scale_factor is not None:
        problems.append(f"{_ACTOR}.loss_scale_factor={actor.loss_scale_factor}: the loss is a token mean over the mini-batch here; set it to null")
    if actor.policy_loss.loss_mode != "vanilla":
        problems.append(f"{_ACTOR}.policy_loss.loss_mode={actor.policy_loss.loss_mode}: only vanilla (PPO-clip) is implemented; set it to vanilla")
    for key in ("top_k", "val_kwargs.top_k"):
        if OmegaConf.select(rollout, key) not in (-1, 0, None):
            problems.append(f"{_ROLLOUT}{key}={OmegaConf.select(rollout, key)}: the hf rollout samples from the full distribution (top-p only); set it to -1")
    if rollout.ignore_eos:
        problems.append(f"{_ROLLOUT}ignore_eos=True: the hf rollout stops at EOS; set it to False")
    if reward.enable:
        problems.append("reward_model.enable=True: a model-based reward is not available here (rule-based rewards only); set it to False")
    if reward.reward_manager not in (None, "naive"):
        problems.append(f"reward_model.reward_manager={reward.reward_manager}: only the naive manager (default_compute_score per response) is implemented; set reward_model.reward_manager=naive")
    custom = config.custom_reward_function
    if custom.path is not None and not os.path.isfile(os.path.expanduser(str(custom.path))):
        problems.append(f"custom_reward_function.path={custom.path} does not exist")
    problems += _check_ray_kwargs(config)
    return problems + _unknown_keys(config)


def _check_ray_kwargs(config: Any) -> list[str]:
    ray_init = config.ray_kwargs.ray_init
    python = (ray_init.get("runtime_env") or {}).get("py_executable")
    if python and shutil.which(str(python).split()[0]) is None:
        return [f"ray_kwargs.ray_init.runtime_env.py_executable={python}: {str(python).split()[0]!r} is not on PATH on this host; set it to null (this interpreter)"]
    return []


def _unknown_keys(config: Any) -> list[str]:
    """Keys added with Hydra's `+` that this config does not have (outside the free-form nodes): a misspelling
    that `+` let through would otherwise be ignored without a word."""
    known = set(_leaves(_raw_yaml())) | {"model_engine"}
    extra_engine = tuple(f"{_ROLLOUT}{key}" for key in _EXTRA_ENGINE_KEYS)
    problems = []
    for key in _leaves(OmegaConf.to_container(config, resolve=False)):
        if key.split(".", 1)[0] in ("defaults", "hydra"):  # a config loaded from the YAML file without Hydra
            continue
        if key in known or any(key == node or key.startswith(node + ".") for node in (*_OPEN_NODES, *extra_engine)):
            continue
        if any(k.startswith(key + ".") for k in known):  # a node emptied by an override
            continue
        problems.append(f"{key} is not a key of this trainer's config (added with +?); remove it or check its spelling")
    return problems

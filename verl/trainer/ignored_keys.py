"""The upstream keys that have no effect in this trainer's config: ``ignored_settings`` lists each one set away
from its default at start, with why (the keys that would change what is trained are refused instead, by
``verl.trainer.upstream_keys``)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.config.keys import EXTRA_ENGINE_KEYS, ROLLOUT, leaves, raw_yaml
from verl.trainer.config.keys import MEGATRON as _MEGATRON
from verl.trainer.config.keys import REF as _REF

__all__ = ["ignored_settings"]

_ENGINE_WHY = "an inference-engine setting (vLLM / SGLang / TensorRT-LLM); the hf rollout (transformers generate on each data-parallel group's output rank) has none"
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
_NO_REF_WHY = "no reference model is built: actor.use_kl_loss is off"
_PROFILER_WHY = "no profiler (nsys, npu, torch) is wired into this trainer; the run is not profiled"
_REF_BUILD_WHY = "the reference is built like the actor, through the actor's bridge (actor.megatron.vanilla_mbridge) from the HF actor_rollout_ref.model.path (its weights, not a seed)"
_TRANSFORMER_WHY = "a memory / speed setting of Megatron's TransformerConfig; not applied here (the model is built from its HF config through the bridge) and the model computes the same function without it"


def _inert_rules(config: Any) -> list[tuple[str, str]]:
    """(key, why) of every key that has no effect in this config; a key set away from its default is listed at start."""
    if config.actor_rollout_ref.rollout.name == "vllm":
        rules = [(f"{ROLLOUT}{key}", why) for key, why in _VLLM_INERT.items()]
    else:
        rules = [(f"{ROLLOUT}{key}", _ENGINE_WHY) for key in (
            "mode", "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
            "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "enable_chunked_prefill",
            "enable_prefix_caching", "enforce_eager", "free_cache_engine", "load_format", "dtype", "engine_kwargs",
            "checkpoint_engine", *EXTRA_ENGINE_KEYS)]  # fmt: skip
    rules += [
        (f"{ROLLOUT}calculate_log_probs", "the hf rollout always returns its log-probs (logged as rollout/log_prob_diff_*)"),
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


def ignored_settings(config: Any) -> list[str]:
    """One line per key that has no effect here and is set to anything but its default: ``key=value: why``.

    A default written as an interpolation (the ``ref`` node follows the actor's) is compared as it resolves in
    this config, so ``ref.megatron.tensor_model_parallel_size`` set equal to the actor's is not listed.
    """
    current = leaves(OmegaConf.to_container(config, resolve=True))
    defaults_raw = leaves(raw_yaml())
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

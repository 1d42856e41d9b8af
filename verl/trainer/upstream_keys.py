"""Upstream verl's config keys: each one is honoured, refused here in one line with its reason, or (no effect
here) listed at start (``verl.trainer.ignored_keys``). A launch script written for upstream composes with this
package's config; what it sets that this package does not do is said, never silently dropped."""

from __future__ import annotations

import os
import shutil
from typing import Any

from omegaconf import OmegaConf

from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.config.keys import (
    EXTRA_ENGINE_KEYS,
    OPEN_NODES,
    PERF_ONLY_TRANSFORMER_FIELDS,
    ROLLOUT,
    leaves,
    raw_yaml,
)
from verl.trainer.config.keys import MEGATRON as _MEGATRON
from verl.trainer.config.keys import REF as _REF


def _refusal_rules(config: Any) -> list[tuple[str, tuple, str]]:
    """(key, the values it may take, why any other is refused and its fix) of each upstream key whose value would
    change what is trained and is not implemented here."""
    off, deprecated = (None, False), "upstream's deprecated global form; set its *_per_gpu key instead"
    fsdp_roles = (_MEGATRON, *([f"{_REF}.megatron."] if config.actor_rollout_ref.actor.use_kl_loss else []))  # a reference is built for the KL loss only
    rules = [
        ("model_engine", (None, "megatron"), "only the Megatron backend trains here; set model_engine=megatron"),
        *[(f"{_MEGATRON}{node}", ({}, None), "not applied here, and it would change the update or the model; remove it") for node in ("override_ddp_config", "override_mcore_model_config")],
        ("actor_rollout_ref.model.override_config", ({}, None), "the model is built from its config.json as is; edit a copy of the model's config.json instead"),
        *[(f"actor_rollout_ref.model.{key}", (0, None), "LoRA is not supported here; set it to 0") for key in ("lora_rank", "lora.rank")],
        *[(f"{role}use_megatron_fsdp", off, "Megatron's FSDP is not supported here (its DDP is); set it to False") for role in fsdp_roles],
        (f"{_MEGATRON}router_replay.mode", ("disabled",), "MoE routing replay is not implemented; set it to disabled"),
        (f"{ROLLOUT}enable_rollout_routing_replay", off, "MoE routing replay is not implemented; set it to False"),
        *[(f"{key}.enable", off, "a model-based reward is not available here (rule-based rewards only); set it to False") for key in ("reward.reward_model", "reward_model")],
        ("actor_rollout_ref.model.external_lib", (None,), "external model code is not imported here; set it to null"),
        (f"{_ACTOR}.ppo_micro_batch_size", (None,), deprecated),
        (f"{ROLLOUT}log_prob_micro_batch_size", (None,), deprecated),
        (f"{_ACTOR}.shuffle", off, "mini-batches are taken in rollout order here; set it to False"),
        (f"{_ACTOR}.loss_scale_factor", (None,), "the loss is a token mean over the mini-batch here; set it to null"),
        (f"{_ACTOR}.policy_loss.loss_mode", ("vanilla",), "only vanilla (PPO-clip) is implemented; set it to vanilla"),
        *[(f"{ROLLOUT}{key}", (-1, 0, None), "the hf rollout samples from the full distribution (top-p only); set it to -1") for key in ("top_k", "val_kwargs.top_k")],
        (f"{ROLLOUT}ignore_eos", off, "the hf rollout stops at EOS; set it to False"),
        ("reward_model.reward_manager", (None, "naive"), "only the naive manager (default_compute_score per response) is implemented; set reward_model.reward_manager=naive"),
    ]
    if config.actor_rollout_ref.actor.megatron.use_dist_checkpointing:
        rules.append((f"{_MEGATRON}dist_checkpointing_path", (None,), "initial weights are read from the HF actor_rollout_ref.model.path only; set it to null"))
    return rules


def check_upstream_keys(config: Any) -> list[str]:
    """Upstream keys whose value would change what is trained and is not implemented here, and `+key`s that are no key."""
    problems = []
    for key, accepted, why in _refusal_rules(config):
        value = OmegaConf.select(config, key)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        if value not in accepted:
            problems.append(f"{key}={value}: {why}")
    for name, value in (config.actor_rollout_ref.actor.megatron.override_transformer_config or {}).items():
        if name not in PERF_ONLY_TRANSFORMER_FIELDS and value is not None:
            problems.append(f"{_MEGATRON}override_transformer_config.{name}={value}: only memory / speed fields {list(PERF_ONLY_TRANSFORMER_FIELDS[:4])}... are accepted (and ignored) here; a model field is read from the HF config; remove it")
    custom = config.custom_reward_function
    if custom.path is not None and not os.path.isfile(os.path.expanduser(str(custom.path))):
        problems.append(f"custom_reward_function.path={custom.path} does not exist")
    return problems + _check_ray_kwargs(config) + _unknown_keys(config)


def _check_ray_kwargs(config: Any) -> list[str]:
    ray_init = config.ray_kwargs.ray_init
    python = (ray_init.get("runtime_env") or {}).get("py_executable")
    if python and shutil.which(str(python).split()[0]) is None:
        return [f"ray_kwargs.ray_init.runtime_env.py_executable={python}: {str(python).split()[0]!r} is not on PATH on this host; set it to null (this interpreter)"]
    return []


def _unknown_keys(config: Any) -> list[str]:
    """Keys added with Hydra's `+` that this config does not have (outside the free-form nodes): a misspelling
    that `+` let through would otherwise be ignored without a word."""
    known = set(leaves(raw_yaml())) | {"model_engine"}
    extra_engine = tuple(f"{ROLLOUT}{key}" for key in EXTRA_ENGINE_KEYS)
    problems = []
    for key in leaves(OmegaConf.to_container(config, resolve=False)):
        if key.split(".", 1)[0] in ("defaults", "hydra"):  # a config loaded from the YAML file without Hydra
            continue
        if key in known or any(key == node or key.startswith(node + ".") for node in (*OPEN_NODES, *extra_engine)):
            continue
        if any(k.startswith(key + ".") for k in known):  # a node emptied by an override
            continue
        problems.append(f"{key} is not a key of this trainer's config (added with +?); remove it or check its spelling")
    return problems

"""The typed configs: upstream's names, fields, defaults and dict-like access; validation where they are
defined; one builder from the Hydra node that the trainer's checks and the workers share. No torch needed."""

import dataclasses
import pickle
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from tests.main_leg import MBRIDGE
from verl.trainer.config import CheckpointConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    HFModelConfig,
    McoreActorConfig,
    McoreCheckpointConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
    RefConfig,
    RolloutConfig,
    build_megatron_actor_configs,
    checked_worker_config,
    megatron_worker_config,
)

ACTOR = "actor_rollout_ref.actor"


def _hydra(*overrides: str):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


def test_checkpoint_config_is_upstreams_and_reads_both_ways():
    cfg = CheckpointConfig(save_contents=["model", "optimizer"], load_contents=["model"], async_save=False)
    assert cfg.get("save_contents") == ["model", "optimizer"] and cfg["load_contents"] == ["model"]
    assert cfg.async_save is False and cfg.get("no_such_key", 7) == 7
    assert "strict_hf_verify" in cfg and dict(cfg)["strict"] is True
    default = CheckpointConfig()
    assert default.save_contents == ["model", "optimizer", "extra"] == default.load_contents
    assert (default.async_save, default.strict, default.save_lora_only, default.strict_hf_verify) == (False, True, False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.async_save = True
    assert issubclass(McoreCheckpointConfig, CheckpointConfig) and McoreCheckpointConfig().mbridge_config == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"save_contents": ["model", "weights"]}, r"save_contents has unknown entry 'weights'; allowed: \['model', 'optimizer', 'extra', 'hf_model'\]"),
        ({"load_contents": "model"}, r"load_contents must be a list"),
        ({"async_save": "false"}, r"async_save must be true or false, got 'false'"),
        ({"strict_hf_verify": 0}, r"strict_hf_verify must be true or false"),
        ({"mbridge_config": ["memory_efficient"]}, r"mbridge_config must be a mapping"),
    ],
)
def test_checkpoint_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        McoreCheckpointConfig(**kwargs)


def test_optimizer_config_defaults_are_upstreams_and_lr_zero_is_allowed():
    base, mcore = OptimizerConfig(), McoreOptimizerConfig(lr=0)
    assert (base.lr, base.weight_decay, base.clip_grad, base.betas, base.total_training_steps) == (1e-3, 0.01, 1.0, (0.9, 0.999), -1)
    assert (mcore.lr, mcore.optimizer, mcore.lr_decay_style, mcore.use_checkpoint_opt_param_scheduler) == (0.0, "adam", "linear", False)
    assert McoreOptimizerConfig(lr="3e-3").lr == 0.003  # a YAML 1.1 float that arrives as a string
    mcore.total_training_steps = 50  # the trainer fills this in after construction, as upstream's does
    with pytest.raises(dataclasses.FrozenInstanceError):
        mcore.lr = 1.0
    with pytest.warns(DeprecationWarning):
        assert McoreOptimizerConfig(grad_clip=0.5).clip_grad == 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1e-3}, r"McoreOptimizerConfig.lr must be >= 0.0"),
        ({"lr": "fast"}, r"lr must be a number, got 'fast'"),
        ({"clip_grad": -1}, r"clip_grad must be >= 0.0"),
        ({"weight_decay": -0.1}, r"weight_decay must be >= 0.0"),
        ({"betas": [0.9]}, r"betas must be two numbers"),
        ({"betas": [0.9, 1.0]}, r"betas must each be in \[0, 1\)"),
        ({"lr_warmup_steps_ratio": 1.5}, r"lr_warmup_steps_ratio must be in \[0, 1\]"),
        ({"lr": 1e-3, "min_lr": 1e-2}, r"min_lr=0.01 exceeds lr=0.001"),
        ({"lr_decay_style": "inverse_square_root"}, r"lr_decay_style='inverse_square_root' is not one of"),
        ({"lr_decay_style": "WSD"}, r"'WSD' needs lr_wsd_decay_steps"),
        ({"lr_decay_steps": 0}, r"lr_decay_steps must be a positive integer or null"),
        ({"optimizer": "adagrad"}, r"optimizer='adagrad' is not one of"),
        ({"exp_avg_dtype": "fp8"}, r"exp_avg_dtype='fp8' is not one of"),
        ({"total_training_steps": 1.5}, r"total_training_steps must be an integer"),
    ],
)
def test_optimizer_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        McoreOptimizerConfig(**kwargs)


def test_omega_conf_to_dataclass_follows_target_and_names_unknown_keys():
    built = omega_conf_to_dataclass({"_target_": "verl.workers.config.McoreOptimizerConfig", "lr": 0.5})
    assert type(built) is McoreOptimizerConfig and built.lr == 0.5
    assert omega_conf_to_dataclass(built) is built  # already built: passed through, not re-parsed
    assert omega_conf_to_dataclass(built, OptimizerConfig) is built  # a subclass is one
    with pytest.raises(ValueError, match=re.escape("got a built McoreOptimizerConfig where a RolloutConfig is expected")):
        omega_conf_to_dataclass(built, RolloutConfig)
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.rollout: got a built McoreEngineConfig where a RolloutConfig is expected")):
        megatron_worker_config({**OmegaConf.to_container(_hydra().actor_rollout_ref, resolve=True), "rollout": McoreEngineConfig()})
    assert omega_conf_to_dataclass({}, CheckpointConfig) == CheckpointConfig()
    with pytest.raises(ValueError, match=r"McoreOptimizerConfig has no field\(s\) \['lrr'\]"):
        omega_conf_to_dataclass({"lrr": 1.0}, McoreOptimizerConfig)


def test_hydra_node_builds_the_typed_configs_once():
    config = _hydra(f"{ACTOR}.checkpoint.strict_hf_verify=false", f"{ACTOR}.optim.lr=0")
    built = build_megatron_actor_configs(config.actor_rollout_ref.actor, total_training_steps=120)
    assert type(built.checkpoint) is McoreCheckpointConfig and built.checkpoint.strict_hf_verify is False
    assert built.checkpoint.load_contents == built.checkpoint.save_contents == ["model", "optimizer", "extra", "hf_model"]
    assert built.optim.lr == 0.0 and built.optim.total_training_steps == 120 and built.optim.lr_decay_style == "constant"
    # What the workers receive (a plain dict with the typed configs in place) builds the same objects.
    again = build_megatron_actor_configs({"checkpoint": built.checkpoint, "optim": built.optim})
    assert again.checkpoint is built.checkpoint and again.optim is built.optim
    assert pickle.loads(pickle.dumps(built)) == built  # they travel to the Ray workers


def test_the_worker_configs_are_built_once_from_the_hydra_node():
    node = OmegaConf.to_container(_hydra(f"{ACTOR}.kl_loss_coef=0.05", "actor_rollout_ref.rollout.n=4").actor_rollout_ref, resolve=True)
    worker = megatron_worker_config(node)
    actor, rollout = worker["actor"], worker["rollout"]
    assert (type(actor), type(actor.megatron), type(rollout), type(worker["model"])) == (McoreActorConfig, McoreEngineConfig, RolloutConfig, HFModelConfig)
    assert type(worker["ref"]["megatron"]) is McoreEngineConfig and worker["ref"]["megatron"].param_offload is False
    assert (actor.kl_loss_coef, actor.kl_loss_type, rollout.n) == (0.05, "low_var_kl", 4)
    assert (actor.megatron.tensor_model_parallel_size, actor.megatron.dtype, actor.megatron.use_distributed_optimizer) == (2, "float32", False)
    # The worker's own call on what the trainer sent rebuilds nothing.
    again = megatron_worker_config(worker)
    assert all(again[key] is worker[key] for key in ("model", "actor", "rollout")) and again["ref"]["megatron"] is worker["ref"]["megatron"]
    assert pickle.loads(pickle.dumps(worker)) == worker  # they travel to the Ray workers
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.rollout.n must be >= 1, got 0")):
        megatron_worker_config({**node, "rollout": {**node["rollout"], "n": 0}})



def test_the_checked_build_names_every_node_it_refuses_and_builds_each_once():
    node = OmegaConf.to_container(_hydra().actor_rollout_ref, resolve=True)
    bad = {**node, "actor": {**node["actor"], "checkpoint": {"async_save": "later"}, "optim": {"lr": -1}}, "rollout": {**node["rollout"], "n": 0}}
    worker, problems = checked_worker_config(bad)
    assert worker is None
    assert [p.split(" ", 1)[0] for p in problems] == [f"{ACTOR}.checkpoint.async_save", f"{ACTOR}.optim.lr", "actor_rollout_ref.rollout.n"]
    worker, problems = checked_worker_config(node)
    assert problems == [] and worker["actor"] == megatron_worker_config(node)["actor"]
    again = megatron_worker_config(worker)  # what the trainer sends on: nothing is built again
    assert all(again[key] is worker[key] for key in ("model", "actor", "rollout", "ref"))


def test_each_config_names_what_this_trainer_does_not_run_by_its_field():
    assert McoreActorConfig().unsupported(rollout_n=1) == [] and RolloutConfig(name="hf", n=2).unsupported() == []
    actor = McoreActorConfig(megatron={"use_mbridge": False, "context_parallel_size": 2}, loss_agg_mode="token-sum", clip_ratio_c=1.0)
    assert [p.split(":")[0].split(" ")[0] for p in actor.unsupported(rollout_n=4)] == [
        "McoreActorConfig.megatron.use_mbridge=False", "McoreActorConfig.megatron.context_parallel_size=2",
        "McoreActorConfig.loss_agg_mode=token-sum", "McoreActorConfig.rollout_n=1", "McoreActorConfig.clip_ratio_c=1.0",
    ]  # fmt: skip
    assert [p.split(":")[0] for p in RolloutConfig(name="sglang", n=1).unsupported()] == ["RolloutConfig.name=sglang", "RolloutConfig.n=1"]
    assert RolloutConfig(log_prob_micro_batch_size_per_gpu=3).log_prob_problems(rows=8, longest=100) == [
        "RolloutConfig.log_prob_micro_batch_size_per_gpu=3 does not divide the 8 sequences of a step on each data-parallel rank; set it to a divisor of 8"
    ]
    assert RefConfig(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=50).log_prob_problems(rows=None, longest=100) == [
        "RefConfig.log_prob_max_token_len_per_gpu=50 is below one sequence (data.max_prompt_length + max_response_length = 100); raise it to 100 or more"
    ]


def test_a_hand_built_worker_node_missing_or_mistyping_a_plain_key_is_one_line_naming_it():
    """``nccl_timeout`` is in no typed config; the worker reads it, so the builder checks it rather than a rank
    raising a bare KeyError. The reference's node is typed (``RefConfig``): a bad value is named by its key."""
    node = OmegaConf.to_container(_hydra().actor_rollout_ref, resolve=True)
    assert megatron_worker_config(node)["nccl_timeout"] == 600.0
    without_timeout = {k: v for k, v in node.items() if k != "nccl_timeout"}
    with pytest.raises(ValueError, match=re.escape("missing ['actor_rollout_ref.nccl_timeout']")):
        megatron_worker_config(without_timeout)
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.nccl_timeout must be a number, got 'long'")):
        megatron_worker_config({**node, "nccl_timeout": "long"})
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.ref.log_prob_use_dynamic_bsz must be true or false, got 'yes'")):
        megatron_worker_config({**node, "ref": {**node["ref"], "log_prob_use_dynamic_bsz": "yes"}})
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.ref.megatron.seed must be an integer, got 1.5")):
        megatron_worker_config({**node, "ref": {**node["ref"], "megatron": {**node["ref"]["megatron"], "seed": 1.5}}})


@pytest.mark.parametrize(
    "node, message",
    [
        ({"megatron": {"tensor_model_parallel_size": 0}}, f"{ACTOR}.megatron.tensor_model_parallel_size must be >= 1, got 0"),
        ({"megatron": {"dtype": "float16"}}, f"{ACTOR}.megatron.dtype=float16: float16 training needs megatron's loss scaling"),
        ({"megatron": {"router_replay": {"mode": "R9"}}}, f"{ACTOR}.megatron.router_replay.mode='R9' is not one of"),
        ({"megatron": {"param_offload": "yes"}}, f"{ACTOR}.megatron.param_offload must be true or false, got 'yes'"),
        ({"kl_loss_coef": "big"}, f"{ACTOR}.kl_loss_coef must be a number, got 'big'"),
        ({"ppo_micro_batch_size_per_gpu": 0}, f"{ACTOR}.ppo_micro_batch_size_per_gpu must be >= 1 or null, got 0"),
        ({"policy_loss": {"loss_mode": "vanilla", "typo": 1}}, f"{ACTOR}.policy_loss: PolicyLossConfig has no field(s) ['typo']"),
    ],
)
def test_the_actor_config_refuses_bad_values_by_hydra_key(node, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_megatron_actor_configs(node)


def test_pre_start_validation_reports_typed_config_errors_by_hydra_key():
    from verl.trainer.validation import check_config

    assert check_config(_hydra(f"{ACTOR}.optim.lr=0"), None) == []
    problems = check_config(_hydra(f"{ACTOR}.checkpoint.async_save=later", f"{ACTOR}.optim.lr=-1"), None)
    assert f"{ACTOR}.checkpoint.async_save must be true or false, got 'later'" in problems  # what the CLI test expects
    assert f"{ACTOR}.optim.lr must be >= 0.0, got -1" in problems
    problems = check_config(_hydra(f"{ACTOR}.checkpoint.save_contents=[model,weights]"), None)
    assert any(f"{ACTOR}.checkpoint.save_contents has unknown entry 'weights'" in p for p in problems), problems


def test_typed_configs_import_without_torch():
    """The pre-start checks run before torch is imported (a bad command line fails in about a second)."""
    code = "import sys, verl.workers.config, verl.trainer.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

"""Upstream's e2e launch script, ``tests/special_e2e/run_ppo_trainer_megatron.sh``, against this trainer's config.

``E2E_ARGV`` is the trainer command line that script builds at upstream ``E2E_COMMIT``, as ``interop/upstream_e2e.py``
drives it (GRPO, TP1 PP2 EP2 ETP1 on 4 ranks, no VPP / CP / offload, two steps saving each, 16 + 8 tokens), with
the harness's three trailing arguments. The harness records the command line on each run and fails when it
differs from this list, so what the suite composes here is what that run trained with. Placeholders: ``{model}``,
``{data}``, ``{ckpt}``, ``{home}`` (the script's ``${HOME}`` defaults), ``{vanilla_mbridge}`` (``--bridge``) and
``{engine}`` (the script's ``ENGINE``: ``hf``, or ``vllm``, its default).
"""

from __future__ import annotations

import importlib.util

import pytest
from hydra import compose, initialize_config_module

from interop.upstream_e2e import as_placeholders
from interop.upstream_tests import PINNED_COMMIT
from verl.trainer.cli_overrides import CONFIG_MODULE, CONFIG_NAME, config_arguments, override_key, override_problems
from verl.trainer.ignored_keys import ignored_settings
from verl.trainer.validation import check_config

E2E_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
E2E_ARGV = [
    "--config-path=config",
    "--config-name=ppo_megatron_trainer.yaml",
    "algorithm.adv_estimator=grpo",
    "data.train_files={data}",
    "data.val_files={data}",
    "data.train_batch_size=16",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "data.return_raw_chat=True",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path={model}",
    "actor_rollout_ref.model.use_fused_kernels=False",
    "actor_rollout_ref.model.use_remove_padding=False",
    "actor_rollout_ref.model.lora.rank=0",
    "actor_rollout_ref.model.lora.alpha=0",
    "actor_rollout_ref.model.lora.target_modules=['linear_qkv','linear_proj','linear_fc1','linear_fc2']",
    "actor_rollout_ref.model.lora.merge=False",
    "+actor_rollout_ref.model.lora.fully_sharded_loras=True",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=null",
    "actor_rollout_ref.actor.megatron.router_replay.mode=disabled",
    "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=False",
    "+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=False",
    "+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=False",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2400",
    "actor_rollout_ref.actor.megatron.use_mbridge=True",
    "actor_rollout_ref.actor.megatron.vanilla_mbridge={vanilla_mbridge}",
    "actor_rollout_ref.actor.megatron.use_megatron_fsdp=False",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
    "actor_rollout_ref.actor.megatron.context_parallel_size=1",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
    "actor_rollout_ref.actor.megatron.param_offload=False",
    "actor_rollout_ref.actor.megatron.optimizer_offload=False",
    "actor_rollout_ref.actor.megatron.grad_offload=False",
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing=False",
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path={home}/dist_ckpt/tiny/qwen3-moe",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model,optimizer,extra]",
    "actor_rollout_ref.actor.profiler.enable=False",
    "actor_rollout_ref.actor.profiler.ranks=[0,1,2,3]",
    "actor_rollout_ref.actor.profiler.all_ranks=True",
    "actor_rollout_ref.rollout.name={engine}",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=4",
    "++actor_rollout_ref.rollout.quantization=null",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=False",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.megatron.use_mbridge=True",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge={vanilla_mbridge}",
    "actor_rollout_ref.ref.megatron.use_megatron_fsdp=False",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=null",
    "actor_rollout_ref.ref.megatron.context_parallel_size=1",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1",
    "actor_rollout_ref.ref.megatron.param_offload=False",
    "actor_rollout_ref.ref.megatron.use_dist_checkpointing=False",
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path={home}/dist_ckpt/tiny/qwen3-moe",
    "critic.optim.lr=2e-5",
    "critic.optim.lr_warmup_steps=null",
    "+critic.optim.override_optimizer_config.optimizer_cpu_offload=False",
    "+critic.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=False",
    "+critic.optim.override_optimizer_config.use_precision_aware_optimizer=False",
    "critic.model.path={model}",
    "critic.model.lora.rank=0",
    "critic.model.lora.alpha=0",
    "critic.model.lora.target_modules=['linear_qkv','linear_proj','linear_fc1','linear_fc2']",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_max_token_len_per_gpu=4800",
    "critic.megatron.use_mbridge=True",
    "critic.megatron.vanilla_mbridge={vanilla_mbridge}",
    "critic.megatron.use_megatron_fsdp=False",
    "critic.megatron.pipeline_model_parallel_size=2",
    "critic.megatron.virtual_pipeline_model_parallel_size=null",
    "critic.megatron.context_parallel_size=1",
    "critic.megatron.tensor_model_parallel_size=1",
    "critic.megatron.expert_model_parallel_size=2",
    "critic.megatron.expert_tensor_parallel_size=1",
    "critic.megatron.param_offload=False",
    "critic.megatron.optimizer_offload=False",
    "critic.megatron.grad_offload=False",
    "critic.megatron.use_dist_checkpointing=False",
    "critic.megatron.dist_checkpointing_path={home}/dist_ckpt/tiny/qwen3-moe",
    "critic.checkpoint.save_contents=[model,hf_model,optimizer,extra]",
    "critic.profiler.enable=False",
    "critic.profiler.ranks=[0,1,2,3]",
    "critic.profiler.all_ranks=True",
    "reward.num_workers=8",
    "reward.reward_model.enable=True",
    "reward.reward_model.model_path={home}/models/Skywork/Skywork-Reward-V2-Llama-3.2-1B",
    "reward.reward_model.rollout.name={engine}",
    "reward.reward_model.rollout.gpu_memory_utilization=0.6",
    "reward.reward_model.rollout.tensor_model_parallel_size=1",
    "reward.reward_model.rollout.prompt_length=24",
    "reward.reward_model.rollout.response_length=8",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_penalty=kl",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.critic_warmup=0",
    "trainer.logger=console",
    "trainer.project_name=verl-test",
    "trainer.experiment_name=qwen3-moe-megatron-gsm8k-minimal",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=4",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.save_freq=1",
    "trainer.resume_mode=disable",
    "trainer.total_epochs=2",
    "trainer.total_training_steps=2",
    "global_profiler.profile_continuous_steps=True",
    "global_profiler.tool=nsys",
    "global_profiler.steps=[1]",
    "global_profiler.global_tool_config.nsys.discrete=True",
    "ray_kwargs.ray_init.runtime_env.py_executable=null",
    "reward.reward_model.enable=False",
    "trainer.logger=[console,file]",
    "trainer.default_local_dir={ckpt}",
]
HARNESS_ARGS = E2E_ARGV[-3:]  # reward.reward_model.enable=False, the file logger, the checkpoint directory
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
# The keys whose value the script takes from ENGINE, and those it sets only for an inference engine.
ENGINE_KEYS = ("actor_rollout_ref.rollout.name", "reward.reward_model.rollout.name")
VLLM_INERT = ("tensor_model_parallel_size", "gpu_memory_utilization")  # set away from their defaults; the engine does not read them


def _filled(tmp_path, model: str, engine: str, bridge: str = "True") -> list[str]:
    from verl.utils.dataset.arithmetic import write_task_parquet

    data = write_task_parquet(str(tmp_path / "data"), 1, 2, "first")
    values = {"model": model, "data": data, "ckpt": str(tmp_path / "ckpt"), "home": str(tmp_path / "home")}
    return [a.format(**values, vanilla_mbridge=bridge, engine=engine) if "{" in a.split("=", 1)[-1] else a for a in E2E_ARGV]


def _config(argv: list[str]):
    overrides, _, _ = config_arguments(argv)
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        return compose(CONFIG_NAME, overrides=overrides)


def test_the_list_is_recorded_at_the_pinned_commit_in_the_harness_placeholders(tmp_path, tiny_moe_path):
    assert E2E_COMMIT == PINNED_COMMIT
    filled = _filled(tmp_path, tiny_moe_path, "vllm", "True")
    paths = {"model": tiny_moe_path, "data": filled[E2E_ARGV.index("data.train_files={data}")].split("=", 1)[1],
             "ckpt": str(tmp_path / "ckpt"), "home": str(tmp_path / "home")}  # fmt: skip
    assert as_placeholders(filled, paths, "mbridge", "vllm") == E2E_ARGV


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_main_ppo_first_check_takes_every_override(tmp_path, tiny_moe_path, engine):
    """main_ppo's pre-Hydra check: all of the script's overrides (``++`` and ``+`` ones included) compose."""
    assert override_problems(_filled(tmp_path, tiny_moe_path, engine)) == []


def test_the_vllm_branch_passes_the_pre_start_checks(tmp_path, tiny_moe_path):
    config = _config(_filled(tmp_path, tiny_moe_path, "vllm"))
    problems = check_config(config, tiny_moe_path)
    if VLLM_INSTALLED:
        assert problems == []
    else:  # the vllm rollout where vLLM is not installed: one line naming the key, never a fallback to hf
        assert len(problems) == 1 and problems[0].startswith("actor_rollout_ref.rollout.name=vllm"), problems
    assert config.actor_rollout_ref.rollout.name == "vllm" and config.actor_rollout_ref.rollout.quantization is None
    listed = {line.split("=", 1)[0]: line for line in ignored_settings(config)}
    for key in VLLM_INERT:  # what the vLLM engine here does not read is listed at start, with its reason
        line = listed.get(f"actor_rollout_ref.rollout.{key}", "")
        assert ": " in line, (key, sorted(listed))
    assert listed["reward.reward_model.rollout.name"].split(": ", 1)[1].startswith("no reward model is built"), listed
    assert "actor_rollout_ref.rollout.name" not in listed and "actor_rollout_ref.rollout.n" not in listed


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_without_the_harness_arguments_the_reward_model_is_refused_in_one_line(tmp_path, tiny_moe_path, engine):
    """The script turns on a model-based reward (run by its ENGINE); this trainer refuses it in one line, and only it."""
    script_only = _filled(tmp_path, tiny_moe_path, engine)[: -len(HARNESS_ARGS)]
    assert all(override_key(a) != "trainer.default_local_dir" for a in script_only)
    problems = check_config(_config(script_only), tiny_moe_path)
    if engine == "vllm" and not VLLM_INSTALLED:
        problems = [p for p in problems if not p.startswith("actor_rollout_ref.rollout.name=vllm")]
    assert len(problems) == 1 and problems[0].startswith("reward.reward_model.enable=True"), problems
    assert all(key not in problems[0] for key in ENGINE_KEYS)

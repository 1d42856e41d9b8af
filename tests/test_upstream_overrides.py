"""Upstream's ``examples/grpo_trainer/run_qwen3_30b_a3b_megatron.sh`` against this trainer's config.

``SCRIPT_OVERRIDES`` is that script's command line (upstream HEAD 1dda039, its default knobs: vLLM backend,
no FP8, no MCORE_MODEL_PATH, ``VERL_USE_UV=0``), written out by reading it. Only the model path, the sizes
(batch, lengths, parallel sizes) and the node / GPU counts are changed, to fit 8 CPU ranks and the tiny model.
Every override must compose with real Hydra on its own; all of them together then pass the pre-start checks
except a few, each refused by one line naming its key; the rest are honoured or listed at start as ignored.
"""

from __future__ import annotations

import importlib.util

import pytest
from hydra import compose, initialize_config_module

from tests.main_leg import MBRIDGE
from verl.trainer.ignored_keys import ignored_settings
from verl.trainer.validation import check_config

DATA_DIR = "__DATA__"  # replaced by a temporary directory holding hand-made parquet files

SCRIPT_OVERRIDES = [
    # ALGORITHM
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0",
    # REWARD
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward_model.reward_kwargs.max_resp_len=16",  # ${max_response_length}
    # DATA (sizes: train_batch_size 512, max_prompt_length 2048, max_response_length 8192 upstream)
    f"data.train_files={DATA_DIR}/dapo-math-17k.parquet",
    f"data.val_files={DATA_DIR}/aime-2024.parquet",
    "data.train_batch_size=8",
    "data.prompt_key=prompt",
    "data.return_raw_chat=True",
    "data.max_prompt_length=64",
    "data.max_response_length=16",
    "data.filter_overlong_prompts=False",
    "data.truncation=left",
    # MODEL (path: the tiny model)
    "actor_rollout_ref.model.path=__MODEL__",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    # ACTOR (sizes: ppo_mini_batch_size 16, TP4 PP2 VPP2 EP2 upstream)
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30720",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.context_parallel_size=1",
    "actor_rollout_ref.actor.megatron.param_offload=True",
    "actor_rollout_ref.actor.megatron.optimizer_offload=True",
    "actor_rollout_ref.actor.megatron.grad_offload=True",
    "actor_rollout_ref.actor.megatron.use_mbridge=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.masked_softmax_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.deallocate_pipeline_outputs=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.persist_layer_norm=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion=True",
    # ROLLOUT
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40960",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.max_num_seqs=1024",
    "actor_rollout_ref.rollout.max_num_batched_tokens=10240",
    "actor_rollout_ref.rollout.max_model_len=10240",
    "actor_rollout_ref.rollout.prompt_length=64",
    "actor_rollout_ref.rollout.response_length=16",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    # REF
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=40960",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.context_parallel_size=1",
    "actor_rollout_ref.ref.megatron.param_offload=True",
    "actor_rollout_ref.ref.megatron.use_mbridge=True",
    # TRAINER
    "trainer.balance_batch=True",
    "trainer.logger=[console,wandb]",
    "trainer.project_name=verl_grpo_dapo_math",
    "trainer.experiment_name=qwen3_30b_a3b_vllm_megatron",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=50",
    "trainer.test_freq=5",
    "trainer.total_epochs=1000",
    "trainer.resume_mode=auto",
    "trainer.val_before_train=False",
    "trainer.log_val_generations=10",
    # EXTRA
    "model_engine=megatron",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
    "+actor_rollout_ref.rollout.moe_tensor_parallel_size=2",
    "actor_rollout_ref.rollout.expert_parallel_size=2",
    # RAY (VERL_USE_UV=0: this interpreter)
    "ray_kwargs.ray_init.runtime_env.py_executable=null",
]

# What the pre-start checks refuse, each with its own line: the vllm rollout where vLLM is not installed, a reward
# manager not implemented here, and the wandb logger where the wandb package is not installed (it is not in this
# project's requirements; installed, wandb runs offline and is accepted). The interleaved pipeline is accepted.
WANDB_INSTALLED = importlib.util.find_spec("wandb") is not None
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
EXPECTED_REFUSED = {
    *(() if VLLM_INSTALLED else ("actor_rollout_ref.rollout.name",)),
    "reward_model.reward_manager",
    *(() if WANDB_INSTALLED else ("trainer.logger",)),
}


def _key(override: str) -> str:
    return override.lstrip("+").split("=", 1)[0]


def _compose(overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


def _gsm8k_rows(count: int, data_source: str = "openai/gsm8k") -> list[dict]:
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"What is {i} plus {i}? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


@pytest.fixture()
def concrete(tmp_path, tiny_moe_path) -> list[str]:
    from verl.utils.dataset.rl_dataset import write_rlhf_parquet

    write_rlhf_parquet(_gsm8k_rows(16), str(tmp_path / "dapo-math-17k.parquet"))
    write_rlhf_parquet(_gsm8k_rows(4), str(tmp_path / "aime-2024.parquet"))
    return [
        o.replace(DATA_DIR, str(tmp_path)).replace("__MODEL__", tiny_moe_path) for o in SCRIPT_OVERRIDES
    ] + [f"trainer.default_local_dir={tmp_path / 'ckpt'}"]


def test_every_override_composes_alone():
    failures = []
    for override in SCRIPT_OVERRIDES:
        try:
            _compose([override])
        except Exception as exc:  # noqa: BLE001 - Hydra's refusal is what is being counted
            failures.append(f"{override}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    assert failures == []


def test_script_is_accepted_except_a_few_refusals_with_one_line_each(concrete, tiny_moe_path):
    config = _compose(concrete)
    problems = check_config(config, tiny_moe_path)
    keys = {_key(o) for o in SCRIPT_OVERRIDES}
    refused = {key for key in keys if any(p.startswith((f"{key}=", f"{key} ")) for p in problems)}
    assert refused == EXPECTED_REFUSED, problems
    assert len(problems) == len(EXPECTED_REFUSED), problems  # one line each, nothing else
    assert all("\n" not in p and "; " in p for p in problems), problems  # the reason, then the fix
    accepted = sum(1 for o in SCRIPT_OVERRIDES if _key(o) not in refused)
    assert accepted / len(SCRIPT_OVERRIDES) >= 0.9, (accepted, len(SCRIPT_OVERRIDES))

    # Replacing the refused values with what this trainer provides leaves a config that passes.
    fixed = [o for o in concrete if _key(o) not in EXPECTED_REFUSED] + ["trainer.logger=[console]"]
    config = _compose(fixed)
    assert check_config(config, tiny_moe_path) == []

    ignored = {line.split("=", 1)[0]: line for line in ignored_settings(config)}
    # engine, kernel, reference and KL settings have no effect here: listed once, each with its reason
    for key in (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.moe_tensor_parallel_size",
        "actor_rollout_ref.model.use_fused_kernels",
        "actor_rollout_ref.actor.kl_loss_coef",
        "algorithm.kl_ctrl.kl_coef",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method",
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable",
    ):
        assert key in ignored and ": " in ignored[key], (key, sorted(ignored))
    # what changes training is honoured, never listed as ignored
    for key in (
        "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.clip_ratio_high", "data.truncation",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "trainer.test_freq", "trainer.total_epochs",
        "actor_rollout_ref.rollout.val_kwargs.top_p",
    ):  # fmt: skip
        assert key not in ignored
    # ref settings equal to the actor's (the default follows it) and upstream defaults are not listed
    assert "actor_rollout_ref.ref.megatron.tensor_model_parallel_size" not in ignored
    assert "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size" not in ignored
    assert "trainer.balance_batch" not in ignored and "data.return_raw_chat" not in ignored


def test_script_with_the_kl_loss_on_honours_the_reference_keys(concrete, tiny_moe_path):
    """The script with actor.use_kl_loss=True (upstream's GRPO examples set it): the KL loss and the reference's
    keys are honoured, the reference's interleaved pipeline (equal to the actor's) with them."""
    with_kl = [o for o in concrete if _key(o) != "actor_rollout_ref.actor.use_kl_loss"] + ["actor_rollout_ref.actor.use_kl_loss=True"]
    problems = check_config(_compose(with_kl), tiny_moe_path)
    keys = {_key(o) for o in with_kl}
    refused = {key for key in keys if any(p.startswith((f"{key}=", f"{key} ")) for p in problems)}
    assert refused == EXPECTED_REFUSED, problems
    assert len(problems) == len(refused), problems

    config = _compose([o for o in with_kl if _key(o) not in refused] + ["trainer.logger=[console]"])
    assert check_config(config, tiny_moe_path) == []
    ignored = {line.split("=", 1)[0] for line in ignored_settings(config)}
    for key in (
        "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.ref.megatron.param_offload",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    ):  # fmt: skip
        assert key not in ignored, key


@pytest.mark.parametrize(
    "override,expected",
    [
        ("actor_rollout_ref.actor.kl_loss_type=full", "actor_rollout_ref.actor.kl_loss_type=full is not implemented here"),
        ("actor_rollout_ref.actor.kl_loss_coef=-1", "actor_rollout_ref.actor.kl_loss_coef=-1 must be >= 0"),
        ("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1", "tensor_model_parallel_size=1 differs from the actor's (2)"),
        ("actor_rollout_ref.ref.megatron.use_dist_checkpointing=True", "the reference is built from the HF actor_rollout_ref.model.path only"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5", "ref.log_prob_micro_batch_size_per_gpu=5 does not divide the 64 sequences"),
        ("algorithm.use_kl_in_reward=True", "algorithm.use_kl_in_reward=True: the KL penalty in the reward is not implemented here"),
    ],
)
def test_kl_loss_refusals_name_the_key(tiny_moe_path, tmp_path, override, expected):
    config = _compose([f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.actor.use_kl_loss=True", override])
    problems = check_config(config, tiny_moe_path)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_misspelled_key_is_still_refused(tiny_moe_path, tmp_path):
    with pytest.raises(Exception, match="Could not override 'trainer.total_epoch'"):
        _compose(["trainer.total_epoch=3"])
    # `+` lets a new key through Hydra; the pre-start checks name it
    config = _compose([f"actor_rollout_ref.model.path={tiny_moe_path}", "+trainer.total_epoch=3", f"trainer.default_local_dir={tmp_path}"])
    assert check_config(config, tiny_moe_path) == [
        "trainer.total_epoch is not a key of this trainer's config (added with +?); remove it or check its spelling"
    ]


@pytest.mark.parametrize(
    "override,expected",
    [
        ("+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers=2", "override_transformer_config.num_layers=2: only memory / speed fields"),
        ("ray_kwargs.ray_init.runtime_env.py_executable='no-such-python -x'", "'no-such-python' is not on PATH"),
        ("model_engine=dp", "model_engine=dp: only the Megatron backend trains here"),
        ("data.train_files=/nonexistent/train.parquet", "data.train_files: /nonexistent/train.parquet does not exist"),
        ("actor_rollout_ref.rollout.response_length=4", "actor_rollout_ref.rollout.response_length=4 differs from data.max_response_length=2"),
        ("actor_rollout_ref.actor.use_dynamic_bsz=True", None),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5", "does not divide the 64 sequences"),
        ("trainer.logger=[console,mlflow]", "trainer.logger has ['mlflow'], which this trainer does not provide"),
        ("actor_rollout_ref.rollout.log_prob_parity_check.tolerance.float32=0", "tolerance.float32=0 must be a number > 0"),
        ("trainer.logger=[console,tensorboard]", ""),  # the tensorboard package is a requirement: accepted
        # upstream's e2e launch script (tests/special_e2e/run_ppo_trainer_megatron.sh) sets these keys
        ("actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.rank=8: LoRA is not supported here; set it to 0"),
        ("actor_rollout_ref.actor.megatron.use_megatron_fsdp=True", "use_megatron_fsdp=True: Megatron's FSDP is not supported here"),
        ("actor_rollout_ref.ref.megatron.use_megatron_fsdp=True", ""),  # no reference is built without the KL loss
        ("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "router_replay.mode=R3: MoE routing replay is not implemented"),
        ("actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "enable_rollout_routing_replay=True: MoE routing replay"),
        ("reward.reward_model.enable=True", "reward.reward_model.enable=True: a model-based reward is not available here"),
        ("actor_rollout_ref.actor.megatron.dist_checkpointing_path=/some/dist", ""),  # read by upstream only with use_dist_checkpointing
        ("critic.megatron.pipeline_model_parallel_size=4", ""),  # GRPO trains no critic: listed at start, never refused
        *(() if WANDB_INSTALLED else (
            ("trainer.logger=[wandb]", "trainer.logger has wandb but the wandb package is not installed; pip install wandb, or drop wandb from trainer.logger"),
        )),
    ],
)
def test_refusals_name_the_key(tiny_moe_path, tmp_path, override, expected):
    extra = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5"] if expected is None else []
    config = _compose([f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={tmp_path}", override, *extra])
    problems = check_config(config, tiny_moe_path)
    if expected is None:  # the log-prob pass's budget follows the actor's (upstream's interpolation): both named
        assert [p.split("=", 1)[0] for p in problems] == [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
        ] and all("is below one sequence" in p for p in problems), problems
        return
    if expected == "":
        assert problems == []
        return
    assert len(problems) == 1 and expected in problems[0], problems


def test_script_interleaved_pipeline_limits_are_refused_in_one_line_each(concrete, tiny_moe_path):
    """The script's VPP2 at PP2: an update of one microbatch per data-parallel rank cannot run the interleaved
    schedule (a multiple of PP is needed), and a reference with another VPP than the actor's is not its layout."""
    accepted = [o for o in concrete if _key(o) not in EXPECTED_REFUSED] + ["trainer.logger=[console]"]
    fixed_micro = [*accepted, "actor_rollout_ref.actor.use_dynamic_bsz=False"]
    assert check_config(_compose([*fixed_micro, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]), tiny_moe_path) == []
    problems = check_config(_compose([*fixed_micro, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"]), tiny_moe_path)
    assert problems == [
        "1 microbatches per data-parallel rank and mini-batch (32 sequences / actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32) "
        "is not a multiple of pipeline_model_parallel_size=2, which actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2 "
        "needs; set ppo_micro_batch_size_per_gpu so that 32 / it is a multiple of 2"
    ]
    with_kl = [o for o in accepted if _key(o) != "actor_rollout_ref.actor.use_kl_loss"] + ["actor_rollout_ref.actor.use_kl_loss=True"]
    problems = check_config(_compose([*with_kl, "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=null"]), tiny_moe_path)
    assert len(problems) == 1 and problems[0].startswith(
        "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=None differs from the actor's (2)"
    ), problems


def test_upstream_e2e_script_keys_are_refused_or_listed_as_inert(tiny_moe_path, tmp_path):
    """Keys upstream's e2e launch script (tests/special_e2e/run_ppo_trainer_megatron.sh) sets: with the KL loss on,
    the reference's FSDP and an actor dist-checkpoint path it would read are refused in one line each; the
    critic, profiler, LoRA (rank 0) and reward-model keys are listed at start as having no effect."""
    base = [f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={tmp_path}"]
    refused = _compose([
        *base, "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.ref.megatron.use_megatron_fsdp=True",
        "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True", "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/some/dist",
    ])  # fmt: skip
    problems = check_config(refused, tiny_moe_path)
    assert len(problems) == 2, problems
    assert any(p.startswith("actor_rollout_ref.ref.megatron.use_megatron_fsdp=True: Megatron's FSDP is not supported here") for p in problems)
    assert any(p.startswith("actor_rollout_ref.actor.megatron.dist_checkpointing_path=/some/dist: initial weights are read from the HF") for p in problems)
    inert = _compose([
        *base, "critic.megatron.pipeline_model_parallel_size=4", "actor_rollout_ref.actor.profiler.enable=True",
        "global_profiler.tool=nsys", "actor_rollout_ref.model.lora.alpha=16", "reward.reward_model.model_path=/rm",
        "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/some/dist", "actor_rollout_ref.actor.profiler.save_path=/prof",
    ])  # fmt: skip
    assert check_config(inert, tiny_moe_path) == []
    listed = {line.split("=", 1)[0]: line.split(": ", 1)[1] for line in ignored_settings(inert)}
    assert listed["critic.megatron.pipeline_model_parallel_size"] == "GRPO trains no critic"
    assert listed["actor_rollout_ref.actor.profiler.enable"].startswith("no profiler")
    assert listed["global_profiler.tool"].startswith("no profiler")
    assert listed["actor_rollout_ref.actor.profiler.save_path"].startswith("no profiler")
    assert "actor_rollout_ref.actor.profiler.tool" not in listed  # it follows global_profiler.tool, as upstream's does
    assert listed["actor_rollout_ref.model.lora.alpha"] == "LoRA is off (lora.rank 0)"
    assert listed["reward.reward_model.model_path"].startswith("no reward model is built")
    assert listed["actor_rollout_ref.actor.megatron.dist_checkpointing_path"].startswith("read by upstream only with use_dist_checkpointing")

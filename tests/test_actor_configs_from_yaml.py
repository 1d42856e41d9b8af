"""``megatron_actor_configs_from_yaml``: the engine's four configs outside the trainer take every default the
engine reads from ppo_megatron_trainer.yaml, so a default changed there reaches tests, benchmarks and scripts
too. No torch needed."""

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl.workers.config import McoreCheckpointConfig, megatron_actor_configs_from_yaml


@pytest.fixture(scope="module")
def yaml_actor() -> dict:
    """The actor node of the composed YAML, resolved (``load_contents`` follows ``save_contents``)."""
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_megatron_trainer")
    return OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple:
    return megatron_actor_configs_from_yaml(str(tmp_path_factory.mktemp("model")), total_training_steps=7)


def test_the_optimizer_defaults_are_the_yamls(yaml_actor, built):
    optim = built[2]
    read = {key: getattr(optim, key) for key in ("lr", "clip_grad", "weight_decay", "min_lr", "lr_decay_style")}
    assert read == {key: yaml_actor["optim"][key] for key in read}


def test_the_engine_defaults_are_the_yamls(yaml_actor, built):
    engine = built[1]
    keys = ("dtype", "use_distributed_optimizer", "use_dist_checkpointing", "vanilla_mbridge")
    assert {key: getattr(engine, key) for key in keys} == {key: yaml_actor["megatron"][key] for key in keys}


def test_the_checkpoint_defaults_are_the_yamls(yaml_actor, built):
    checkpoint = built[3]
    assert isinstance(checkpoint, McoreCheckpointConfig)
    keys = ("async_save", "async_mode", "strict_hf_verify")
    assert {key: getattr(checkpoint, key) for key in keys} == {key: yaml_actor["checkpoint"][key] for key in keys}
    assert list(checkpoint.save_contents) == yaml_actor["checkpoint"]["save_contents"]
    assert list(checkpoint.load_contents) == yaml_actor["checkpoint"]["load_contents"]


def test_the_run_length_fills_the_schedule_the_yaml_leaves_to_the_trainer(yaml_actor, built):
    assert yaml_actor["optim"]["total_training_steps"] == -1
    assert built[2].total_training_steps == 7


def test_the_model_is_the_path_given(tmp_path):
    model = megatron_actor_configs_from_yaml(str(tmp_path), total_training_steps=1)[0]
    assert model.path == str(tmp_path)


def test_an_override_changes_only_its_key(yaml_actor, tmp_path):
    _, engine, optim, _ = megatron_actor_configs_from_yaml(str(tmp_path), ("optim.lr=3e-3",), total_training_steps=1)
    assert optim.lr == 3e-3 != yaml_actor["optim"]["lr"]
    assert optim.clip_grad == yaml_actor["optim"]["clip_grad"]
    assert engine.dtype == yaml_actor["megatron"]["dtype"]


def test_a_key_the_yaml_leaves_out_is_added_with_plus_plus(tmp_path):
    overrides = ("++optim.use_checkpoint_opt_param_scheduler=True",)
    optim = megatron_actor_configs_from_yaml(str(tmp_path), overrides, total_training_steps=1)[2]
    assert optim.use_checkpoint_opt_param_scheduler is True


def test_a_refused_value_names_its_key(tmp_path):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.optim\.lr"):
        megatron_actor_configs_from_yaml(str(tmp_path), ("optim.lr=-1",), total_training_steps=1)

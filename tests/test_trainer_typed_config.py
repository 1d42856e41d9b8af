"""The trainer's own nodes (``trainer``, ``data``) as typed configs: each holds every key of its YAML node and
reports every bad field of the node at once, one line each, naming the key and its fix."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import DataConfig, TrainerConfig
from verl.trainer.run_config import typed_node

YAML = "verl/trainer/config/ppo_megatron_trainer.yaml"


@pytest.mark.parametrize("node, cls", [("trainer", TrainerConfig), ("data", DataConfig)])
def test_the_typed_config_holds_every_key_of_its_yaml_node(node, cls):
    keys = set(OmegaConf.load(YAML)[node])
    assert {f.name for f in dataclasses.fields(cls)} - {"_target_"} == keys


def test_every_bad_trainer_field_is_one_line_and_all_come_at_once():
    built, problems = typed_node(TrainerConfig, {"save_freq": "abc", "nnodes": 0, "device": "tpu", "logger": ["console", "mlflow"], "resume_mode": "resume_path"})
    assert built is None
    assert problems == [
        "trainer.save_freq=abc must be an integer; set trainer.save_freq=<n>",
        "trainer.nnodes=0 must be an integer >= 1; set trainer.nnodes=<n>",
        "trainer.device=tpu is not one of ['auto', 'cpu', 'cuda', 'npu']; set trainer.device=auto",
        "trainer.resume_mode=resume_path needs trainer.resume_from_path=<default_local_dir>/global_step_N",
        "trainer.logger has ['mlflow'], which this trainer does not provide; use a subset of ['console', 'file', 'tensorboard', 'wandb'], e.g. trainer.logger=[console,file]",
    ]


def test_every_bad_data_field_is_one_line_and_all_come_at_once():
    built, problems = typed_node(DataConfig, {"seed": 1.5, "val_batch_size": 0, "truncation": "cut", "task": "reverse", "max_operand": 10})
    assert built is None
    assert problems == [
        "data.seed=1.5 must be an integer; set data.seed=<n>",
        "data.val_batch_size=0 must be null (all prompts at once) or >= 1",
        "data.truncation=cut is not one of ['error', 'left', 'right', 'middle']; set data.truncation=error",
        "data.max_operand=10: the task's operands are single digits; set data.max_operand to 0..9",
        "data.task=reverse is not one of ['add', 'first']; set data.task=first",
    ]


def test_a_string_that_reads_as_false_is_refused_not_taken_as_true():
    _, problems = typed_node(TrainerConfig, {"val_only": "false"})
    assert problems == ["trainer.val_only=false must be true or false; set trainer.val_only=<true|false>"]


def test_keys_the_class_does_not_hold_are_left_to_the_upstream_key_check():
    built, problems = typed_node(TrainerConfig, {"rollout_data_dir": "/x", "save_freq": 5})
    assert problems == [] and built.save_freq == 5 and "rollout_data_dir" not in built


def _composed(*overrides: str):
    from hydra import compose, initialize_config_module

    from tests.main_leg import MBRIDGE

    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


def test_the_run_config_holds_every_node_typed_and_the_schedule_length_once():
    from verl.trainer.config import AlgoConfig
    from verl.trainer.run_config import build_run_config
    from verl.workers.config import McoreActorConfig, RefConfig, RolloutConfig

    run = build_run_config(_composed("trainer.nnodes=2", "trainer.n_gpus_per_node=4"))
    assert (type(run.trainer), type(run.data), type(run.algorithm), type(run.actor), type(run.rollout)) == (
        TrainerConfig, DataConfig, AlgoConfig, McoreActorConfig, RolloutConfig,
    )  # fmt: skip
    assert type(run.actor_rollout_ref["ref"]) is RefConfig and run.trainer.world_size == 8
    assert build_run_config(run) is run
    run.set_training_steps(40)
    assert run.actor.optim.total_training_steps == 40
    pinned = build_run_config(_composed("actor_rollout_ref.actor.optim.total_training_steps=7"))
    pinned.set_training_steps(40)
    assert pinned.actor.optim.total_training_steps == 7, "a length the user set is kept"


def test_the_run_config_refuses_every_bad_node_at_once():
    from verl.trainer.run_config import ConfigError, build_run_config

    with pytest.raises(ConfigError) as refused:
        build_run_config(_composed("trainer.save_freq=abc", "data.seed=1.5", "actor_rollout_ref.rollout.top_p=-1"))
    assert refused.value.problems == [
        "trainer.save_freq=abc must be an integer; set trainer.save_freq=<n>",
        "data.seed=1.5 must be an integer; set data.seed=<n>",
        "actor_rollout_ref.rollout.top_p must be >= 0.0, got -1",
    ]


def test_a_refused_node_hides_no_problem_of_the_others(tmp_path):
    """A bad trainer key is one line; the cross-node problems of the nodes that built are reported beside it."""
    from verl.trainer.validation import check_config

    config = _composed(f"trainer.default_local_dir={tmp_path}", "trainer.logger=[mlflow]", "actor_rollout_ref.rollout.n=1")
    problems = check_config(config, None)
    assert any(p.startswith("trainer.logger has ['mlflow']") for p in problems), problems
    assert any(p.startswith("actor_rollout_ref.rollout.n=1: GRPO compares responses within a group") for p in problems), problems


def test_a_number_given_for_a_text_key_is_taken_as_its_text():
    built, problems = typed_node(TrainerConfig, {"experiment_name": 2024, "default_local_dir": 7})
    assert problems == [] and (built.experiment_name, built.default_local_dir) == ("2024", "7")
    _, problems = typed_node(TrainerConfig, {"logger": 5, "project_name": ["a"]})
    assert problems == ["trainer.project_name=['a'] must be text; set trainer.project_name=<text>", "trainer.logger=5 must be a list of backend names, e.g. trainer.logger=[console,file]"]

"""The rollout a run takes when ``actor_rollout_ref.rollout.name`` is left null (the YAML's default): vllm where
``import vllm`` works, hf otherwise, said in one line; a named rollout is never replaced. The probe is replaced
here by each answer it can give (tests/test_vllm_rollout.py runs the real one on the stack with vLLM)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from tests.main_leg import MBRIDGE
from verl.trainer.config import rollout_choice
from verl.trainer.config.rollout_choice import ROLLOUT_NAME_KEY, choose_rollout, with_rollout_named

NO_VLLM = "ModuleNotFoundError: No module named 'vllm'"


def _composed(*overrides: str):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


def test_the_yaml_leaves_the_rollout_to_the_run():
    assert _composed().actor_rollout_ref.rollout.name is None


@pytest.mark.parametrize("problem, chosen", [(None, "vllm"), (NO_VLLM, "hf")])
def test_an_unnamed_rollout_is_vllm_where_it_imports_else_hf_in_one_line(monkeypatch, problem, chosen):
    monkeypatch.setattr(rollout_choice, "vllm_import_problem", lambda: problem)
    config = _composed()
    line = choose_rollout(config)
    assert config.actor_rollout_ref.rollout.name == chosen
    assert "\n" not in line and line.startswith(f"rollout: {chosen}, the default where `import vllm` ")
    if chosen == "vllm":
        assert f"set {ROLLOUT_NAME_KEY}=hf" in line  # how to take the other
    else:
        assert NO_VLLM in line and "install vLLM" in line
    assert choose_rollout(config) == f"rollout: {chosen} ({ROLLOUT_NAME_KEY}={chosen})"  # chosen once


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_a_named_rollout_is_kept_whatever_the_probe_says(monkeypatch, name):
    """An explicit vllm without vLLM stays vllm here: the pre-start check refuses it (never a silent hf)."""

    def probe() -> str:
        raise AssertionError("a named rollout needs no probe")

    monkeypatch.setattr(rollout_choice, "vllm_import_problem", probe)
    config = _composed(f"{ROLLOUT_NAME_KEY}={name}")
    assert choose_rollout(config) == f"rollout: {name} ({ROLLOUT_NAME_KEY}={name})"
    assert config.actor_rollout_ref.rollout.name == name


def test_prepare_says_the_rollout_first_and_checks_the_one_it_took(monkeypatch, capsys, tmp_path):
    """``prepare`` (what the CLI runs first) fills the key before its checks: a refused value elsewhere still
    comes after the line naming the rollout, and the run's typed config would read it."""
    from verl.trainer.main_ppo import prepare
    from verl.trainer.run_config import ConfigError

    monkeypatch.setattr(rollout_choice, "vllm_import_problem", lambda: NO_VLLM)
    config = _composed(f"trainer.default_local_dir={tmp_path}", "trainer.device=cpu", "actor_rollout_ref.actor.use_torch_compile=0")
    with pytest.raises(ConfigError):
        prepare(config)
    assert capsys.readouterr().out.splitlines()[0].startswith("[main_ppo] rollout: hf, the default where `import vllm` fails (")
    assert config.actor_rollout_ref.rollout.name == "hf"


@pytest.mark.parametrize("head_dim, chosen", [(16, "hf"), (32, "vllm")])
def test_an_unnamed_rollout_is_hf_for_a_model_vllm_cannot_serve(monkeypatch, tmp_path, head_dim, chosen):
    """With vLLM importable, a model whose head size vLLM's CPU attention lacks gets hf by default, said with
    its head size; a named ``vllm`` for it is refused by the pre-start check instead
    (tests/test_vllm_rollout.py)."""
    import json

    from verl.workers.config import rollout

    monkeypatch.setattr(rollout_choice, "vllm_import_problem", lambda: None)
    monkeypatch.setattr(rollout, "_vllm_cpu_build", lambda: True)  # vLLM's CPU build, as on the main leg
    sizes = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "head_dim": head_dim}
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    config = _composed(f"actor_rollout_ref.model.path={tmp_path}")
    line = choose_rollout(config)
    assert config.actor_rollout_ref.rollout.name == chosen
    assert "\n" not in line and line.startswith(f"rollout: {chosen}, the default ")
    if chosen == "hf":
        assert "head_dim=16" in line and "vLLM's CPU attention" in line, line


def test_the_resume_command_of_a_run_that_named_no_rollout_names_the_one_it_took():
    """A stop line's resume command (``run_control.resume_command`` of these overrides) keeps the rollout the run
    sampled with, so a resume on a host where ``import vllm`` differs does not switch rollouts."""
    from verl.trainer.run_control import resume_command

    assert resume_command(with_rollout_named(["data.seed=2"], "vllm")).split()[-2:] == [f"{ROLLOUT_NAME_KEY}=vllm", "trainer.resume_mode=auto"]
    assert with_rollout_named([f"{ROLLOUT_NAME_KEY}=hf", "data.seed=2"], "hf") == [f"{ROLLOUT_NAME_KEY}=hf", "data.seed=2"]

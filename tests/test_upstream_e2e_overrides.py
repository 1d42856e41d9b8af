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
from interop.upstream_e2e_argv import E2E_ARGV, E2E_COMMIT
from interop.upstream_tests import PINNED_COMMIT
from verl.trainer.cli_overrides import CONFIG_MODULE, CONFIG_NAME, config_arguments, override_key, override_problems
from verl.trainer.ignored_keys import ignored_settings
from verl.trainer.validation import check_config

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

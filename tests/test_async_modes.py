"""The save writer is chosen once, by capability: ``checkpoint.async_mode`` and its refusal; no save phase tests the host.

The refusal of ``snapshot`` on an accelerator is the decision function the driver (before Ray) and every rank's
checkpoint manager (when built) call with the device the run computes on; here it is fed "cuda" / "npu", the
device name a GPU host gives it.
"""

import ast
import os
import pathlib

import pytest
from hydra import compose, initialize_config_module

from tests.main_leg import MBRIDGE
from verl.utils.checkpoint.async_modes import AsyncMode, choose_mode, mode_refusal
from verl.workers.config import McoreCheckpointConfig

ACTOR = "actor_rollout_ref.actor"
KEY = f"{ACTOR}.checkpoint.async_mode"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _hydra(*overrides: str):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_snapshot_is_refused_on_an_accelerator_in_one_line_naming_the_key_and_the_fix(device):
    refusal = mode_refusal(True, "snapshot", device, key=KEY)
    assert refusal == (
        f"{KEY}=snapshot needs the parameters in host memory, but this run computes on {device} (a forked writer "
        f"sees no device memory); set {KEY}=background_write"
    )
    with pytest.raises(ValueError, match=f"this run computes on {device}"):
        choose_mode(True, "snapshot", device)  # the rank's backstop, when the manager is built


@pytest.mark.parametrize(
    ("async_save", "async_mode", "device", "mode"),
    [
        (False, "background_write", "cuda", AsyncMode.SYNC),
        (False, "snapshot", "cuda", AsyncMode.SYNC),  # async_mode means nothing without async_save
        (True, "background_write", "cuda", AsyncMode.BACKGROUND_WRITE),
        (True, "background_write", "cpu", AsyncMode.BACKGROUND_WRITE),
        (True, "snapshot", "cpu", AsyncMode.SNAPSHOT),
    ],
)
def test_each_host_gets_the_mode_it_asked_for_where_it_can_take_it(async_save, async_mode, device, mode):
    assert mode_refusal(async_save, async_mode, device) is None
    assert choose_mode(async_save, async_mode, device) is mode


def test_the_default_is_the_mode_every_host_takes():
    assert McoreCheckpointConfig().async_mode == "background_write"
    assert _hydra().actor_rollout_ref.actor.checkpoint.async_mode == "background_write"
    McoreCheckpointConfig(async_save=True).validate("cuda")  # no refusal


def test_an_unknown_mode_is_refused_by_the_typed_config_naming_the_hydra_key():
    from verl.trainer.validation import check_config

    with pytest.raises(ValueError, match=r"McoreCheckpointConfig.async_mode=later is not one of \['background_write', 'snapshot'\]"):
        McoreCheckpointConfig(async_mode="later")
    problems = check_config(_hydra(f"{KEY}=later"), None)
    assert f"{KEY}=later is not one of ['background_write', 'snapshot']; set {KEY}=background_write" in problems, problems


def test_the_driver_refuses_snapshot_on_the_device_the_run_computes_on():
    """``main_ppo.prepare`` passes ``check_device``'s answer (cuda on a GPU host with trainer.device=auto)."""
    from verl.trainer.validation import check_async_mode

    config = _hydra(f"{ACTOR}.checkpoint.async_save=true", f"{KEY}=snapshot")
    assert check_async_mode(config, "cuda") == [mode_refusal(True, "snapshot", "cuda", key=KEY)]
    assert check_async_mode(config, "cpu") == []
    assert check_async_mode(config, None) == []  # a cluster's device: checked once the cluster answered
    assert check_async_mode(_hydra(f"{ACTOR}.checkpoint.async_save=true"), "cuda") == []


# Where a save's phases may look at the host: only where the manager chooses its writer, when it is built.
SAVE_MODULES = ["megatron_checkpoint_manager", "forked_save", "save_writers", "snapshot_save", "async_modes"]
HOST_TESTS = {"get_device_name", "on_host", "is_cuda", "device_count", "is_available"}
CHOOSER = ("megatron_checkpoint_manager", "_choose_writer")


def _host_tests(module: str) -> list[str]:
    tree = ast.parse((ROOT / "verl" / "utils" / "checkpoint" / f"{module}.py").read_text())
    found = []
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        if (module, function.name) == CHOOSER:
            continue
        for node in ast.walk(function):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in HOST_TESTS or (isinstance(node, ast.Attribute) and node.attr == "device"):
                found.append(f"{module}.{function.name}:{node.lineno}: {name}")
    return found


def test_no_save_phase_tests_a_host_flag():
    found = [hit for module in SAVE_MODULES for hit in _host_tests(module)]
    assert found == [], found
    chooser = [n for n in ast.walk(ast.parse((ROOT / "verl/utils/checkpoint/megatron_checkpoint_manager.py").read_text())) if getattr(n, "name", None) == CHOOSER[1]]
    assert chooser and any(getattr(n, "id", None) == "get_device_name" for n in ast.walk(chooser[0])), "the writer is chosen by the device"


# ------------------------------------------------------------------ what the snapshot's fork may plan


def _fully_reshardable_manager():
    """Upstream's way to ask for the format: the actor config's ``megatron.dist_ckpt_optim_fully_reshardable``."""
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    class FullyReshardable(MegatronCheckpointManager):
        def __init__(self, config, *args, **kwargs):
            super().__init__({**config, "megatron": {"dist_ckpt_optim_fully_reshardable": True}}, *args, **kwargs)

    return FullyReshardable


def _snapshot_saves_of_a_fully_reshardable_optimizer(src: str, root: str, calls_dir: str) -> dict:
    """Three snapshot saves (the third is the one a fork would plan); every process that builds the distributed
    optimizer's gathered state (megatron's ``get_parameter_state_dp_zero``, collectives over the data-parallel
    group) leaves its pid in ``calls_dir``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from tests.main_leg import TRAINING_STEPS, actor_configs
    from tests.test_checkpoint_lifecycle import _batches, _step_path
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    gather = DistributedOptimizer.get_parameter_state_dp_zero

    def recorded(self, *args, **kwargs):
        open(os.path.join(calls_dir, str(os.getpid())), "w").close()
        return gather(self, *args, **kwargs)

    DistributedOptimizer.get_parameter_state_dp_zero = recorded
    configs = actor_configs(
        src, "megatron.use_distributed_optimizer=True", "checkpoint.async_save=True", "checkpoint.async_mode=snapshot", total_training_steps=TRAINING_STEPS
    )
    actor = MegatronEngine(*configs, manager_cls=_fully_reshardable_manager())
    actor.train_step(_batches(0))
    planned_in_fork = []
    for step in (1, 2, 3):
        actor.save_checkpoint(_step_path(root, step), global_step=step)
        planned_in_fork.append(actor.checkpoint_manager.last_save.planned_in_background)
        assert actor.finalize_checkpoint() == _step_path(root, step)
    return {"pid": os.getpid(), "planned_in_fork": planned_in_fork}


def test_the_snapshot_plans_a_fully_reshardable_optimizer_in_the_rank(tiny_moe_path, tmp_path):
    """Was: from the third save on the fork planned it, running megatron's gather over the rank's data-parallel
    group (DP 2 here) from a forked process. Now every save of that format is planned in the rank; the rest of
    the snapshot (check, write, HF export) still runs in the fork."""
    from tests.test_checkpoint_lifecycle import LAYOUT, WORLD, _step_path
    from verl.utils.checkpoint.integrity import verify_checkpoint
    from verl.utils.distributed import run_on_ranks

    root, calls = tmp_path / "run", tmp_path / "gathered_by"
    calls.mkdir()
    results = run_on_ranks(_snapshot_saves_of_a_fully_reshardable_optimizer, WORLD, LAYOUT, args=(tiny_moe_path, str(root), str(calls)), timeout_s=240)
    assert [r["planned_in_fork"] for r in results] == [[False, False, False]] * WORLD
    assert {int(pid) for pid in os.listdir(calls)} == {r["pid"] for r in results}  # no fork gathered
    for step in (1, 2, 3):
        verify_checkpoint(_step_path(str(root), step))

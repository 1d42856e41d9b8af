"""``checkpoint.mbridge_config`` reaches the bridge's HF weight save (it was once accepted and ignored); an
entry the save does not take is refused, naming the key, in the manager and before the run starts."""

import os

import pytest
from hydra import compose, initialize_config_dir

from tests.main_leg import MBRIDGE, TRAINING_STEPS, actor_configs
from verl.trainer.validation import check_model_build
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes
from verl.workers.config import McoreCheckpointConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "verl", "trainer", "config")


class RecordingBridge:
    """The real bridge, plus the keyword arguments each HF weight save was called with."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.calls: list[dict] = []

    def save_weights(self, models, weights_path, memory_efficient=False, comm=None):
        self.calls.append({"memory_efficient": memory_efficient})
        return self.bridge.save_weights(models, weights_path, memory_efficient=memory_efficient, comm=comm)


def _save_with(src: str, root: str, mbridge_config: dict) -> list[dict] | str:
    checkpoint = McoreCheckpointConfig(save_contents=["model", "optimizer", "extra"], mbridge_config=mbridge_config)
    recording = []
    try:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine

        model, engine, optim, _ = actor_configs(src, total_training_steps=TRAINING_STEPS)
        actor = MegatronEngine(model, engine, optim, checkpoint, wrap_bridge=lambda bridge: recording.append(RecordingBridge(bridge)) or recording[0])
    except ValueError as exc:
        return str(exc)
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)
    return recording[0].calls


def test_mbridge_config_reaches_the_hf_save_or_is_refused_by_name(tiny_dense_path, tmp_path):
    calls = run_on_ranks(_save_with, 1, ParallelSizes(), args=(tiny_dense_path, str(tmp_path / "a"), {"memory_efficient": True}))[0]
    assert calls == [{"memory_efficient": True}]
    assert os.path.isfile(tmp_path / "a" / "global_step_1" / "actor" / "model" / "huggingface" / "model.safetensors.index.json")
    refusal = run_on_ranks(_save_with, 1, ParallelSizes(), args=(tiny_dense_path, str(tmp_path / "b"), {"distributed_filesystem": True}))[0]
    assert refusal == (
        "checkpoint.mbridge_config.distributed_filesystem: the bridge's HF save (mbridge's save_weights) takes no such "
        "argument (it takes: memory_efficient); remove checkpoint.mbridge_config.distributed_filesystem"
    )


@pytest.mark.parametrize(("entry", "refused"), [(None, False), ("memory_efficient", False), ("distributed_filesystem", True)])
def test_the_pre_start_check_names_an_entry_the_bridge_does_not_take(tiny_moe_path, entry, refused):
    overrides = [f"+actor_rollout_ref.actor.checkpoint.mbridge_config.{entry}=True"] if entry else []  # None: the YAML's {}
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, *overrides])
    problems = check_model_build(tiny_moe_path, config)
    key = f"actor_rollout_ref.actor.checkpoint.mbridge_config.{entry}"
    assert problems == ([f"{key}: the bridge's HF save (mbridge's save_weights) takes no such argument (it takes: memory_efficient); remove {key}"] if refused else [])


def test_checkpoint_strict_reaches_a_save_that_takes_it_and_no_other():
    """upstream's ``checkpoint.strict`` goes to Megatron-Bridge's HF save (a ``strict`` parameter), never to a save
    without one (mbridge's); ``mbridge_config`` naming ``strict`` for such a save is refused, naming the key to set."""
    from verl.utils.checkpoint.mbridge_config import save_weights_kwargs

    def takes_strict(models, weights_path, strict: bool = True) -> None: ...

    def takes_memory_efficient(models, weights_path, memory_efficient: bool = False) -> None: ...

    assert save_weights_kwargs(takes_strict, {}, strict=False) == {"strict": False}
    with pytest.raises(ValueError, match=r"^checkpoint.mbridge_config.strict: .*; set actor_rollout_ref.actor.checkpoint.strict instead and remove checkpoint.mbridge_config.strict$"):
        save_weights_kwargs(takes_strict, {"strict": True}, strict=False)
    assert save_weights_kwargs(takes_memory_efficient, {}, strict=False) == {}
    assert save_weights_kwargs(takes_memory_efficient, {"memory_efficient": True}, strict=True) == {"memory_efficient": True}

"""The bridge every trainer run and composed config of the main legs names.

The main legs (Python 3.11) have no Megatron-Bridge (Megatron-Bridge 0.6 and megatron-core 0.18 declare Python 3.12), and upstream's
default ``vanilla_mbridge=False`` is refused there in one line (tests/test_validation.py shows it): so each run
chooses mbridge explicitly, as a user on such a host does. The Python 3.12 leg runs the default (tests/py312).
"""

from typing import Any

from verl.utils.internals.megatron_bridge import VANILLA_MBRIDGE_KEY

MBRIDGE = f"{VANILLA_MBRIDGE_KEY}=True"


def main_leg_settings(model_path: str, **settings: Any) -> Any:
    """The engine's ``ActorSettings``, building through mbridge unless ``settings`` names the bridge (as the
    Python 3.12 leg's tests do)."""
    from verl.workers.engine.megatron.transformer_impl import ActorSettings

    return ActorSettings(model_path=model_path, **{"vanilla_mbridge": True, **settings})


def actor_configs(model_path: str, *overrides: str, total_training_steps: int) -> tuple:
    """Upstream's four engine configs (model, engine, optimizer, checkpoint: ``MegatronEngine``'s arguments) as the
    trainer builds them from its YAML, so that no test states a default of its own; building through mbridge
    unless an override names the bridge. ``overrides``: Hydra overrides under ``actor_rollout_ref.actor``
    (``"optim.lr=3e-3"``); ``total_training_steps``: the run's length, which the trainer fills in."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from verl.workers.config import build_megatron_actor_configs, megatron_worker_config

    actor_overrides = [f"actor_rollout_ref.actor.{override}" for override in overrides]
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_megatron_trainer", overrides=[MBRIDGE, *actor_overrides, f"actor_rollout_ref.model.path={model_path}"])
    node = OmegaConf.to_container(config.actor_rollout_ref, resolve=True)
    actor = build_megatron_actor_configs(node["actor"], total_training_steps=total_training_steps)
    worker = megatron_worker_config(node, actor=actor)
    return worker["model"], actor.megatron, actor.optim, actor.checkpoint

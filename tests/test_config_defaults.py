"""Every default of a typed config against the YAML the trainer loads: a key the YAML sets to another value than
its class's default must be listed in ``DIFFERENT`` with the reason, so no default can differ silently. The
classes keep upstream verl's defaults (code that builds them by hand gets upstream's meaning); the YAML holds
this trainer's. No torch needed."""

import dataclasses
from typing import Any

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl.base_config import BaseConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import McoreCheckpointConfig, McoreOptimizerConfig

# The trainer's YAML node -> the typed config the trainer builds from it.
NODES: dict[str, type] = {
    "actor_rollout_ref.actor.checkpoint": McoreCheckpointConfig,
    "actor_rollout_ref.actor.optim": McoreOptimizerConfig,
}

# (node, field) -> why the trainer's YAML sets another value than the class's (upstream's) default.
DIFFERENT: dict[tuple[str, str], str] = {
    ("actor_rollout_ref.actor.checkpoint", "save_contents"): "the trainer saves the HF weights with every step (verified by fix 2)",
    ("actor_rollout_ref.actor.checkpoint", "load_contents"): "follows save_contents (${.save_contents}), as upstream's YAML",
    ("actor_rollout_ref.actor.optim", "weight_decay"): "the embedded tiny task trains without weight decay",
    ("actor_rollout_ref.actor.optim", "lr_decay_style"): "upstream's YAML says constant too; its class says linear",
}


def _composed() -> Any:
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer")


def _differences(config: Any, nodes: dict[str, type]) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(node, field) -> (the YAML's value, the class default) for every field the node sets to another value.
    Both sides go through the class, so a list and the tuple it is normalised to compare equal. A field that
    is itself a typed config is compared under its own node."""
    found = {}
    for node, cls in nodes.items():
        yaml_node = OmegaConf.to_container(OmegaConf.select(config, node), resolve=True)
        built, default = omega_conf_to_dataclass(yaml_node, cls), cls()
        for field in dataclasses.fields(cls):
            if field.name == "_target_" or field.name not in yaml_node:
                continue
            ours, theirs = getattr(built, field.name), getattr(default, field.name)
            if not isinstance(theirs, BaseConfig) and ours != theirs:
                found[(node, field.name)] = (ours, theirs)
    return found


def test_every_yaml_default_equals_its_typed_default_or_is_listed_with_why():
    found = _differences(_composed(), NODES)
    unlisted = {key: values for key, values in found.items() if key not in DIFFERENT}
    assert not unlisted, f"the YAML and the typed config disagree (YAML, class default); make them agree or list why: {unlisted}"
    stale = sorted(set(DIFFERENT) - set(found))
    assert not stale, f"listed as different but equal now; remove from DIFFERENT: {stale}"
    assert all(reason.strip() for reason in DIFFERENT.values())


def test_a_changed_default_is_found():
    """The comparison sees a YAML value that differs from the class default (here: optim.lr)."""
    config = _composed()
    config.actor_rollout_ref.actor.optim.lr = 5e-4
    found = _differences(config, NODES)
    assert found[("actor_rollout_ref.actor.optim", "lr")] == (5e-4, McoreOptimizerConfig().lr)

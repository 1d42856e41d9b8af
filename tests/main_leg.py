"""The bridge every trainer run and composed config of the main legs names.

The main legs (Python 3.11) have no Megatron-Bridge (Megatron-Bridge 0.6 and megatron-core 0.18 declare Python 3.12), and upstream's
default ``vanilla_mbridge=False`` is refused there in one line (tests/test_validation.py shows it): so each run
chooses mbridge explicitly, as a user on such a host does. The Python 3.12 leg runs the default (tests/py312).
"""

from verl.utils.internals.megatron_bridge import VANILLA_MBRIDGE_KEY
from verl.workers.config import megatron_actor_configs_from_yaml

MBRIDGE = f"{VANILLA_MBRIDGE_KEY}=True"
# The run length (the trainer's total_training_steps) of the engines tests build: the YAML's LR schedule is
# constant, so the length changes no step's LR, only what the schedule's saved state records.
TRAINING_STEPS = 1000


def actor_configs(model_path: str, *overrides: str, total_training_steps: int) -> tuple:
    """``megatron_actor_configs_from_yaml`` (the engine's four configs from the trainer's YAML) building through
    mbridge unless an override names the bridge (as the Python 3.12 leg's tests do). ``overrides``: Hydra
    overrides under ``actor_rollout_ref.actor`` (``"optim.lr=3e-3"``)."""
    bridge = MBRIDGE.removeprefix("actor_rollout_ref.actor.")
    return megatron_actor_configs_from_yaml(model_path, (bridge, *overrides), total_training_steps=total_training_steps)


def override(key: str, value: object) -> str:
    """One Hydra override of ``key`` (under ``actor_rollout_ref.actor``) to a Python value: a tuple or list
    as a Hydra list (``checkpoint.save_contents=[model,optimizer]``), anything else as its ``str``."""
    if isinstance(value, (tuple, list)):
        return f"{key}=[{','.join(str(item) for item in value)}]"
    return f"{key}={value}"

"""The bridge every trainer run and composed config of the main legs names.

The main legs (Python 3.11) have no Megatron-Bridge (Megatron-Bridge 0.6 and megatron-core 0.18 declare Python 3.12), and upstream's
default ``vanilla_mbridge=False`` is refused there in one line (tests/test_validation.py shows it): so each run
chooses mbridge explicitly, as a user on such a host does. The Python 3.12 leg runs the default (tests/py312).
"""

from verl.utils.internals.megatron_bridge import VANILLA_MBRIDGE_KEY
from verl.workers.config import megatron_actor_configs_from_yaml

MBRIDGE = f"{VANILLA_MBRIDGE_KEY}=True"
# The rollout every trainer run of the tests samples with unless its overrides name one: the run's own default
# is vllm where vLLM is installed, whose engines cost each run seconds and memory; one CLI test runs that default
# (tests/test_vllm_rollout.py), the others keep the cheap hf rollout.
ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
HF_ROLLOUT = f"{ROLLOUT_KEY}=hf"


def with_rollout(overrides: list[str], rollout: str | None = HF_ROLLOUT) -> list[str]:
    """``overrides`` with ``rollout`` (an override of ``ROLLOUT_KEY``) first, unless one of them names the rollout
    or ``rollout`` is None (the run's own default)."""
    named = any(item.lstrip("+~").split("=", 1)[0] == ROLLOUT_KEY for item in overrides)
    return list(overrides) if named or rollout is None else [rollout, *overrides]


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

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

"""The bridge every trainer run and composed config of the main legs names.

The main legs (Python 3.11) have no Megatron-Bridge (megatron-core >= 0.17 needs Python 3.12), and upstream's
default ``vanilla_mbridge=False`` is refused there in one line (tests/test_validation.py shows it): so each run
chooses mbridge explicitly, as a user on such a host does. The Python 3.12 leg runs the default (tests/py312).
"""

MBRIDGE = "actor_rollout_ref.actor.megatron.vanilla_mbridge=True"

"""Typed worker configs (upstream verl's ``verl.workers.config``): actor, critic, engine, rollout, model,
checkpoint, optimizer (with upstream's FSDP config types, which no code here trains with).

Importing this needs neither torch nor megatron, so the pre-start validation can use it.
"""

from . import actor, checkpoint, critic, engine, megatron, model, optimizer, ref, rollout
from .actor import *  # noqa: F401,F403
from .checkpoint import *  # noqa: F401,F403
from .critic import *  # noqa: F401,F403
from .engine import *  # noqa: F401,F403
from .megatron import *  # noqa: F401,F403
from .model import *  # noqa: F401,F403
from .optimizer import *  # noqa: F401,F403
from .ref import *  # noqa: F401,F403
from .rollout import *  # noqa: F401,F403

__all__ = checkpoint.__all__ + optimizer.__all__ + engine.__all__ + actor.__all__ + critic.__all__ + rollout.__all__ + ref.__all__ + model.__all__ + megatron.__all__

"""Typed worker configs (upstream verl's ``verl.workers.config``): checkpoint and optimizer.

Importing this needs neither torch nor megatron, so the pre-start validation can use it.
"""

from . import checkpoint, megatron, optimizer
from .checkpoint import *  # noqa: F401,F403
from .megatron import *  # noqa: F401,F403
from .optimizer import *  # noqa: F401,F403

__all__ = checkpoint.__all__ + optimizer.__all__ + megatron.__all__

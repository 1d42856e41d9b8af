"""The import path of one rank's actor before the engine layout (``verl.workers.engine.megatron.transformer_impl``).

Kept for older callers; nothing is defined here. ``MegatronActor`` is ``MegatronEngine``.
"""

from verl.workers.engine.megatron.transformer_impl import MegatronEngine as MegatronActor
from verl.workers.engine.megatron.transformer_impl import MegatronReference

__all__ = ["MegatronActor", "MegatronReference"]

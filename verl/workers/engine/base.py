"""Upstream's training-engine interface (``verl.workers.engine.base.BaseEngine``), as far as this overlay has it.

Only the checkpoint methods are here: they are what ``MegatronEngine`` implements with upstream's
signatures and meaning. Upstream's other methods (``initialize``, ``train_mode`` / ``eval_mode``,
``forward_backward_batch``, ``to``, the data-parallel queries, the per-tensor exports) and its
``EngineRegistry`` are left out rather than given another meaning: an upstream caller that needs them
fails at the name, not at a different behaviour.
"""

from __future__ import annotations

from typing import Any


class BaseEngine:
    """What a training engine offers its worker; a subclass implements each method."""

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save the model, optimizer and LR scheduler state of ``global_step`` to ``local_path``, keeping at
        most ``max_ckpt_to_keep`` saves (None: all); ``hdfs_path``: a remote copy."""
        raise NotImplementedError

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """Load the state saved at ``local_path`` (``hdfs_path``: fetched from there; ``del_local_after_load``:
        the local copy of a remote checkpoint is removed after the load)."""
        raise NotImplementedError

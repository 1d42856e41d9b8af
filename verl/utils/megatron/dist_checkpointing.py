"""Megatron dist-checkpoint save and load, as upstream verl's module of the same name exposes them.

The checkpoint manager calls these two functions (and tests may patch them): one place decides
the strategies. Beyond upstream's arguments the save takes a ``sharded_strategy`` the caller keeps
across saves (megatron then reuses its validated save plan) and whether to validate access integrity;
an async save asks for megatron's built-in writer where the release offers others (``async_save_options``).
"""

from __future__ import annotations

from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from verl.utils.checkpoint.data_only import check_dist_checkpoint, data_only_torch_dist_load
from verl.utils.checkpoint.errors import CheckpointError, ChecksumMismatchError
from verl.utils.internals import megatron_core
from verl.utils.internals import torch as torch_internals


def save_dist_checkpointing(
    sharded_state_dict: dict,
    ckpt_path: str,
    async_save: bool = False,
    content_metadata: dict | None = None,
    sharded_strategy: TorchDistSaveShardedStrategy | None = None,
    validate_access_integrity: bool = True,
) -> Any:
    """Write ``sharded_state_dict`` as a torch_dist checkpoint at ``ckpt_path``.

    Returns megatron's ``AsyncRequest`` when ``async_save`` (the write is still to run), else None.
    """
    strategy = sharded_strategy or TorchDistSaveShardedStrategy("torch_dist", 1)
    torch_internals.check_grid_shards_directly()
    megatron_core.count_shard_access_at_once()
    return dist_checkpointing.save(
        sharded_state_dict,
        ckpt_path,
        sharded_strategy=strategy,
        async_sharded_save=async_save,
        validate_access_integrity=validate_access_integrity,
        content_metadata=content_metadata,
        **(megatron_core.async_save_options() if async_save else {}),
    )


def load_dist_checkpointing(
    sharded_state_dict: dict, ckpt_dir: str, checksums: dict[str, str] | None = None, own_targets: bool = False
) -> dict:
    """Load the entries of ``sharded_state_dict`` from the torch_dist checkpoint at ``ckpt_dir``.

    Its ``.metadata`` and bytes items are read as data only (``verl.utils.checkpoint.data_only``): a file
    that names any other class or function is refused, naming it, and nothing of it runs. Checked first
    for a plain ``UntrustedContentError`` (torch's load would wrap it per rank), then read by the data-only
    reader and planner, so a file replaced in between is refused too. ``checksums`` (the step manifest's, by
    file name in ``ckpt_dir``): each file the load reads is checksummed from the bytes it loads, and a file that
    differs is refused (``ChecksumMismatchError``, one line naming it) with none of its bytes in the state; with
    ``own_targets`` (the state dict's tensors are the caller's own buffers, discarded on a refusal) a file is read
    straight into them, checksummed there, so they may hold part of a refused file."""
    check_dist_checkpoint(ckpt_dir, bytes_items=checksums is None)  # with checksums: checked as the load reads them
    torch_internals.check_grid_shards_directly()
    megatron_core.count_shard_access_at_once()
    with data_only_torch_dist_load(ckpt_dir, checksums, own_targets) as mismatches:
        try:
            loaded = dist_checkpointing.load(sharded_state_dict, ckpt_dir)
        except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
            if mismatches:  # a file refused above left its items unread: the mismatch is the cause to report
                loaded = {}
            else:
                raise _refusal_inside(exc) or exc from None
    if mismatches:
        raise ChecksumMismatchError(f"checkpoint {ckpt_dir} is damaged: " + "; ".join(sorted(set(mismatches))))
    return loaded


def _refusal_inside(exc: BaseException) -> CheckpointError | None:
    """The data-only refusal a rank raised inside torch's collective load (``CheckpointException`` holds each
    rank's error with its traceback), so the caller gets the one line naming the file, as before the load."""
    for failure in exc.failures.values() if isinstance(exc, CheckpointException) else ():
        inner = failure[0] if isinstance(failure, tuple) else failure  # (the rank's exception, its traceback)
        if isinstance(inner, CheckpointError):
            return inner
    return None

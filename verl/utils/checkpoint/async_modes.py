"""Which writer a Megatron save takes, decided once from the config and the device the run computes on.

``checkpoint.async_save`` (upstream's key, upstream's meaning) turns the background save on; ``checkpoint.async_mode``
(ours) says which one:

- ``background_write`` (default, every host): the rank copies what of the state lives in device memory into host
  memory (nothing on a host-memory run) and forks; the forked process runs the snapshot's pipeline on that copy.
  The path a CUDA host takes.
- ``snapshot``: the forked process sees the tensors (its copy-on-write image of the rank is the snapshot), so it
  checks, plans (once megatron's plan is reusable), writes and exports. Needs the state in host memory: refused on
  a run whose parameters live on an accelerator, where the fork would see no device memory.

Pure and torch-free: the driver's config check calls ``mode_refusal`` before Ray starts, the manager again on
each rank when it is built (``choose_mode``).
"""

from __future__ import annotations

import enum

ASYNC_MODE_KEY = "checkpoint.async_mode"


class AsyncMode(str, enum.Enum):
    """Where a save's dist checkpoints, NaN/Inf check and HF export run; one per manager (``choose_mode``)."""

    SYNC = "sync"  # everything in the rank before save_checkpoint returns
    BACKGROUND_WRITE = "background_write"  # a host copy in the rank; a forked process checks, plans, writes, exports
    SNAPSHOT = "snapshot"  # a forked process checks, plans (from the third save), writes and exports


ASYNC_MODES = (AsyncMode.BACKGROUND_WRITE.value, AsyncMode.SNAPSHOT.value)  # the values of checkpoint.async_mode


def mode_refusal(async_save: bool, async_mode: str, device: str, key: str = ASYNC_MODE_KEY) -> str | None:
    """The one-line refusal of ``async_mode`` on a run computing on ``device`` ("cpu", "cuda", "npu"), or None.

    ``snapshot`` needs every tensor in host memory: a process forked from a rank shares its host pages, never its
    accelerator's memory. ``async_mode`` is ignored without ``async_save``."""
    if async_mode not in ASYNC_MODES:
        return f"{key}={async_mode} is not one of {list(ASYNC_MODES)}; set {key}=background_write"
    if async_save and async_mode == AsyncMode.SNAPSHOT.value and device != "cpu":
        return (
            f"{key}=snapshot needs the parameters in host memory, but this run computes on {device} (a forked "
            f"writer sees no device memory); set {key}=background_write"
        )
    return None


def choose_mode(async_save: bool, async_mode: str, device: str, key: str = ASYNC_MODE_KEY) -> AsyncMode:
    """The mode of every save of a manager on ``device``; ValueError (``mode_refusal``'s line) for one it cannot take."""
    refusal = mode_refusal(async_save, async_mode, device, key)
    if refusal is not None:
        raise ValueError(refusal)
    return AsyncMode(async_mode) if async_save else AsyncMode.SYNC

"""Which accelerator this process runs on, with upstream verl's names and kinds.

Everything else asks here instead of calling ``torch.cuda`` directly, so a CPU-only host (these CI
machines) and a CUDA host run the same code. As upstream, ``is_cuda_available`` and ``is_npu_available``
are booleans decided once at import (``if is_npu_available:`` must be False on a host without an NPU);
the rest are functions. The CPU runtime (``verl.utils.megatron.cpu_runtime``) never patches
``torch.cuda.is_available``, so these stay truthful after it is enabled.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from verl.utils.internals import torch as torch_internals

logger = logging.getLogger(__name__)

__all__ = [
    "is_torch_npu_available",
    "is_cuda_available",
    "is_npu_available",
    "is_device_available",
    "get_device_name",
    "get_torch_device",
    "get_device_id",
    "get_nccl_backend",
    "get_resource_name",
    "get_visible_devices_keyword",
    "get_device_capability",
    "set_expandable_segments",
    "auto_set_device",
    "manual_seed",
    "manual_seed_all",
]


def is_torch_npu_available(check_device: bool = True) -> bool:
    """Whether torch_npu is loaded (``check_device=False``) and, by default, an NPU is usable."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    try:
        return bool(npu.is_available()) if check_device else True
    except (ImportError, RuntimeError):
        return False


is_cuda_available: bool = torch.cuda.is_available()
is_npu_available: bool = is_torch_npu_available()


def is_device_available() -> bool:
    """Whether this host has an accelerator (False: every rank is a CPU process)."""
    return is_cuda_available or is_npu_available


def get_device_name() -> str:
    """"cuda", "npu" or "cpu": the device type this process computes on."""
    if is_cuda_available:
        return "cuda"
    if is_npu_available:
        return "npu"
    return "cpu"


def get_torch_device() -> types.ModuleType:
    """The torch submodule for the current device (``torch.cuda``, ``torch.npu`` or ``torch.cpu``)."""
    return getattr(torch, get_device_name())


def get_device_id() -> int:
    """Index of the current device; 0 on a CPU host."""
    if get_device_name() == "cpu":
        return 0
    return get_torch_device().current_device()


def get_nccl_backend() -> str:
    """The torch.distributed backend that fits the device: nccl, hccl or gloo."""
    return {"cuda": "nccl", "npu": "hccl"}.get(get_device_name(), "gloo")


def get_resource_name() -> str:
    """The Ray resource a rank asks for: "GPU", "NPU", or "CPU" on a host without an accelerator."""
    return {"cuda": "GPU", "npu": "NPU"}.get(get_device_name(), "CPU")


def get_visible_devices_keyword() -> str:
    """The environment variable that selects visible devices."""
    return "ASCEND_RT_VISIBLE_DEVICES" if get_device_name() == "npu" else "CUDA_VISIBLE_DEVICES"


def get_device_capability(device_id: int = 0) -> tuple[int | None, int | None]:
    """(major, minor) compute capability of a CUDA device; (None, None) elsewhere."""
    if get_device_name() != "cuda":
        return None, None
    return torch.cuda.get_device_capability(device_id)


def set_expandable_segments(enable: bool) -> None:
    """Turn the CUDA caching allocator's expandable segments on or off; nothing to do elsewhere."""
    if get_device_name() == "cuda":
        torch_internals.set_allocator_expandable_segments(enable)


def auto_set_device(config: Any) -> None:
    """Set ``config.trainer.device`` to the accelerator found here when it names another one (upstream's
    behaviour). On a host without an accelerator the config is left alone."""
    trainer = getattr(config, "trainer", None) if config is not None else None
    if trainer is None or not hasattr(trainer, "device"):
        return
    detected = get_device_name()
    if detected != "cpu" and trainer.device != detected:
        if trainer.device != "cpu":
            logger.warning("trainer.device=%s on a %s host: using %s", trainer.device, detected, detected)
        trainer.device = detected


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (the CPU generator on a CPU host)."""
    if get_device_name() == "cpu":
        torch.manual_seed(seed)
    else:
        get_torch_device().manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (the CPU generator on a CPU host)."""
    if get_device_name() == "cpu":
        torch.manual_seed(seed)
    else:
        get_torch_device().manual_seed_all(seed)

"""Which accelerator this process runs on, with upstream verl's names.

Everything else asks here instead of calling ``torch.cuda`` directly, so a CPU-only host
(these CI machines) and a CUDA host run the same code.
"""

from __future__ import annotations

import types

import torch


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_npu_available() -> bool:
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def get_device_name() -> str:
    """"cuda", "npu" or "cpu": the device type this process computes on."""
    if is_cuda_available():
        return "cuda"
    if is_npu_available():
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

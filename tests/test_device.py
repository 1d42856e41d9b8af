"""verl.utils.device: upstream's names and kinds (the availability flags are booleans, not functions)."""

import torch

from verl.utils import device


def test_availability_flags_are_booleans_as_upstreams():
    assert type(device.is_cuda_available) is bool and type(device.is_npu_available) is bool
    assert device.is_cuda_available == torch.cuda.is_available()
    # Upstream code writes `if is_npu_available:`; a function here would always take the NPU branch.
    assert device.is_npu_available == device.is_torch_npu_available()
    assert device.is_device_available() == (device.is_cuda_available or device.is_npu_available)


def test_names_agree_with_the_host():
    name = device.get_device_name()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert name == expected and device.get_torch_device() is getattr(torch, name)
    assert device.get_nccl_backend() == {"cuda": "nccl", "cpu": "gloo"}[name]
    assert device.get_resource_name() == {"cuda": "GPU", "cpu": "CPU"}[name]
    assert device.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
    if name == "cpu":
        assert device.get_device_id() == 0 and device.get_device_capability() == (None, None)


def test_manual_seed_seeds_the_compute_generator():
    device.manual_seed(7)
    first = torch.rand(3, device=device.get_device_name())
    device.manual_seed_all(7)
    assert torch.equal(first, torch.rand(3, device=device.get_device_name()))

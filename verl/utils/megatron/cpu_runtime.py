"""Answers megatron-core's and mbridge's CUDA-only calls on a host without an accelerator.

megatron-core 0.16 and mbridge 0.15 assume CUDA in a handful of places (see docs/cpu.md).
On a CPU-only host those calls cannot do anything useful, so this module answers each one with
its CPU meaning: "the current CUDA device" becomes the CPU, synchronisation and streams become
no-ops, the CUDA RNG becomes the CPU generator. ``enable()`` is called once at rank start-up;
it does nothing where CUDA (or NPU) exists, so a GPU host never runs any of this.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from verl.utils.device import get_device_name
from verl.utils.internals import torch as torch_internals

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_enabled = False

# torch factory functions that megatron-core calls with a literal device="cuda".
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "randn", "rand", "arange", "empty_like", "zeros_like", "ones_like")


def is_enabled() -> bool:
    return _enabled


def enable() -> bool:
    """Install the CPU answers; idempotent. Returns True when the runtime is active."""
    global _enabled
    if _enabled:
        return True
    if get_device_name() != "cpu":
        return False
    _patch_devices()
    _patch_streams_and_sync()
    _patch_rng()
    _patch_tensor_types()
    _patch_megatron()
    _patch_gloo_scatter()
    torch_internals.disable_dynamo()  # megatron's jit_fuser is torch.compile: minutes of C++ for microsecond kernels
    _enabled = True
    logger.info("megatron-core CPU runtime enabled (no accelerator on this host)")
    return True


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


def _patch_devices() -> None:
    """A CUDA device named anywhere (literal, index, current device) means the CPU here."""
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda device=None: 0
    torch.cuda.max_memory_allocated = lambda device=None: 0
    torch.cuda.reset_peak_memory_stats = lambda device=None: None

    _build_device_context_table()
    for name in _FACTORIES:
        original = getattr(torch, name)
        setattr(torch, name, _device_mapping_factory(original))
    _check_device_context()

    def module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        return self

    torch.nn.Module.cuda = module_cuda

    def tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = tensor_cuda

    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and _is_cuda_device(args[0]):
            args = (_CPU, *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to


def _build_device_context_table() -> None:
    """Let ``with torch.device(...)`` see torch's own factory functions before they are wrapped.

    The context recognises a factory by identity, in a table torch builds once, on the context's first use
    (``torch/utils/_device.py``). Built after the wrappers are installed, it would hold the wrappers, never
    match the torch functions they call, and the context would silently stop placing tensors: transformers 5
    then no longer sees its meta-device context in ``from_pretrained``, initialises the model before loading,
    and leaves the RoPE ``inv_freq`` buffers as uninitialised memory (docs/cpu.md, "The CPU runtime and
    device contexts"). Using the context once first builds the table with the originals.
    """
    with torch.device("meta"):
        torch.empty(0)


def _check_device_context() -> None:
    """Refuse to run on with a device context that no longer places tensors (see above)."""
    with torch.device("meta"):
        placed = {name: getattr(torch, name)(1).device.type for name in ("tensor", "zeros", "ones", "empty")}
    if set(placed.values()) != {"meta"}:
        raise RuntimeError(
            f"the CPU runtime's torch factories escape `with torch.device('meta')` ({placed}); enable() must "
            "run before anything else wraps torch's factory functions"
        )


def _device_mapping_factory(original):
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any):
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
        return original(*args, **kwargs)

    return factory


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: on the CPU all work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NullStream:
        return _NullStream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *args: Any) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_streams_and_sync() -> None:
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None


def _patch_rng() -> None:
    """The CUDA generator is the CPU generator: megatron's RNG tracker forks and restores it."""
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_types() -> None:
    """megatron's optimizers accept only ``torch.cuda.*Tensor`` types; CPU tensors stand in for them."""
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original_type(self, *args, **kwargs)

    torch.Tensor.type = tensor_type


def _patch_megatron() -> None:
    """Module-level names inside megatron-core that the torch patches above cannot reach."""
    from verl.utils.internals import megatron_core

    megatron_core.replace_cuda_rng_state(torch.get_rng_state, torch.set_rng_state)

    # The alltoall dispatcher turns its split sizes into host numpy arrays only when they are CUDA
    # tensors; CPU tensors would reach all_to_all_single as tensors, which it rejects.
    def move_splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    megatron_core.replace_split_sizes_to_host(move_splits_to_host)
    _patch_uneven_collectives()
    megatron_core.define_missing_te_general_gemm()


def _patch_uneven_collectives() -> None:
    """gloo's all_gather/reduce_scatter need equal sizes; the MoE dispatcher (TP > 1) sends uneven ones."""
    from verl.utils.internals import megatron_core

    equal_gather, equal_reduce_scatter = megatron_core.first_dim_collectives()

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return equal_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return equal_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].contiguous()

    megatron_core.replace_first_dim_collectives(gather_along_first_dim, reduce_scatter_along_first_dim)


def _patch_gloo_scatter() -> None:
    """Make ``torch.distributed.scatter`` send the right elements for non-contiguous tensors on gloo.

    torch 2.13's gloo scatter reads a non-contiguous input (e.g. ``weight.chunk(2, dim=1)[0]``) as if it
    were contiguous from its first element, and writes a non-contiguous output the same way, with no
    error: a TP split along columns would load the wrong weights. Every input is made contiguous (a
    copy only where it is not) and a non-contiguous output receives into a contiguous buffer first.
    """
    import torch.distributed as dist

    original = dist.scatter
    if getattr(original, "_contiguous_on_gloo", False):
        return

    @functools.wraps(original)
    def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, *args: Any, **kwargs: Any):
        if scatter_list is not None:
            scatter_list = [t if t.is_contiguous() else t.contiguous() for t in scatter_list]
        if tensor.is_contiguous():
            return original(tensor, scatter_list, *args, **kwargs)
        received = tensor.contiguous()
        work = original(received, scatter_list, *args, **kwargs)
        if work is not None:  # async_op=True: the copy must wait for the data
            work.wait()
        tensor.copy_(received)
        return work

    scatter._contiguous_on_gloo = True
    dist.scatter = scatter

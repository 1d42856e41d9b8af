"""Megatron helpers with upstream verl's names: where a model lives, offload and reload of model and
optimizer, and the checkpoint layout paths.

Offload works on *storages*, not on Python tensors. Offloading one storage copies its bytes into a
host copy and resizes the working storage to zero; reloading resizes it back and copies the bytes
in. Every tensor that views the storage (``param.data`` views into a DDP flat buffer, ``param.main_grad``
and ``param.grad`` views into ``buffer.grad_data``, bucket views, optimizer references to the
parameter objects) stays the same object and is valid again after the reload, bit for bit.

This covers both layouts of Megatron DDP:

- ``use_distributed_optimizer=True``: one flat ``buffer.param_data`` per DDP buffer;
  the parameters are views into it.
- ``use_distributed_optimizer=False`` (MoE runs such as PP4 EP2 TP2 ETP2): ``buffer.param_data is
  None``; every parameter owns its storage and is offloaded by itself.

The grads live in ``buffer.grad_data`` in both layouts. Dense (``buffers``) and expert-parallel
(``expert_parallel_buffers``) buffers are treated alike.

On a GPU host "device" is the accelerator and the host copies are pinned; on a CPU-only host the
device is the CPU itself, so an offload moves the bytes into a separate host copy and frees the
working storage. The state is observable on both: an offloaded storage has zero bytes
(:func:`is_megatron_module_offloaded`, :func:`get_megatron_module_device`).

Each offloaded storage keeps one host copy (an attribute of the tensor that roots the storage),
allocated on the first offload and reused afterwards, so repeated offloads never hold two host
copies. A root tensor whose dtype, shape or storage size changed since its host copy was made is
refused loudly instead of silently allocating a second copy.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from verl.utils.checkpoint import layout
from verl.utils.device import get_device_id, get_device_name, get_torch_device
from verl.utils.fs import local_mkdir_safe
from verl.utils.host_memory import malloc_trim
from verl.utils.internals import torch as torch_internals

logger = logging.getLogger(__name__)

# Attributes set on the tensor that roots an offloaded storage.
_HOST_COPY_ATTR = "_verl_host_copy"  # uint8 host tensors holding, in order, the bytes of the whole storage
_HOST_LAYOUT_ATTR = "_verl_host_layout"  # (dtype, shape, storage bytes) the host copy was made for


# ---------------------------------------------------------------------------
# One storage at a time
# ---------------------------------------------------------------------------


def _storage_nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor``; stable across resizes and shared by all its views."""
    return torch_internals.storage_id(tensor)


def _is_released(tensor: torch.Tensor) -> bool:
    """True when the tensor has elements but its storage holds no bytes (it was offloaded)."""
    return tensor.numel() > 0 and _storage_nbytes(tensor) == 0


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the *whole* storage behind ``tensor`` (every view of it included)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def _layout(tensor: torch.Tensor, nbytes: int) -> tuple:
    return (tensor.dtype, tuple(tensor.shape), nbytes)


# Pinned host memory comes from torch's caching host allocator, which rounds every request up to a
# power of two: one pinned copy of a 5 GiB flat buffer would take 8 GiB. So where the copy is pinned
# it is split into power-of-two pieces (the binary digits of its size, down to one page), which the
# allocator serves without rounding. None (the default): split exactly when pinning; True / False force it
# either way (on a CPU host, True exercises the pieces; ``describe_megatron_storages`` shows them).
SPLIT_HOST_COPIES: bool | None = None
_PAGE = 4096


def host_copy_piece_sizes(nbytes: int, split: bool) -> list[int]:
    """Sizes of the host pieces an offload of ``nbytes`` makes: one piece, or, with ``split``, powers of two
    (>= one page) plus a tail smaller than a page; they add up to exactly ``nbytes``."""
    if not split or nbytes <= _PAGE:
        return [nbytes]
    sizes = [1 << bit for bit in range(nbytes.bit_length() - 1, -1, -1) if nbytes & (1 << bit) and (1 << bit) >= _PAGE]
    tail = nbytes - sum(sizes)
    return sizes + ([tail] if tail else [])


def _allocate_host_copy(nbytes: int) -> list[torch.Tensor]:
    pinned = get_device_name() != "cpu"
    split = pinned if SPLIT_HOST_COPIES is None else SPLIT_HOST_COPIES
    return [
        torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pinned)
        for size in host_copy_piece_sizes(nbytes, split)
    ]


def _copy_pieces(flat: torch.Tensor, pieces: list[torch.Tensor], to_host: bool) -> None:
    """Copy between a flat uint8 tensor and its host pieces, in order."""
    offset = 0
    for piece in pieces:
        segment = flat[offset : offset + piece.numel()]
        if to_host:
            # Synchronous: the device bytes must be on the host before the storage is freed.
            piece.copy_(segment, non_blocking=False)
        else:
            # The host pieces stay alive (the next offload reuses them), so this may run asynchronously.
            segment.copy_(piece, non_blocking=True)
        offset += piece.numel()


def _host_nbytes(tensor: torch.Tensor) -> int:
    return sum(piece.numel() for piece in getattr(tensor, _HOST_COPY_ATTR))


def _offload_storage(tensor: torch.Tensor, what: str) -> int:
    """Copy the storage behind ``tensor`` into its host copy and free it; return the bytes moved."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return 0  # already offloaded (or an empty tensor)
    layout = _layout(tensor, nbytes)
    if getattr(tensor, _HOST_COPY_ATTR, None) is None:
        setattr(tensor, _HOST_COPY_ATTR, _allocate_host_copy(nbytes))
        setattr(tensor, _HOST_LAYOUT_ATTR, layout)
    elif getattr(tensor, _HOST_LAYOUT_ATTR) != layout:
        raise RuntimeError(
            f"offload of {what}: its layout (dtype, shape, storage bytes) changed from "
            f"{getattr(tensor, _HOST_LAYOUT_ATTR)} to {layout} since its host copy was made. Allocating a "
            "second host copy would hold the weights twice on the host; whatever replaced this tensor's "
            f"storage must keep its layout or delete its {_HOST_COPY_ATTR!r} attribute."
        )
    _copy_pieces(_storage_bytes(tensor), getattr(tensor, _HOST_COPY_ATTR), to_host=True)
    storage.resize_(0)
    return nbytes


def _reload_storage(tensor: torch.Tensor, what: str) -> int:
    """Give an offloaded storage its bytes back from the host copy; return the bytes moved."""
    if not _is_released(tensor):
        return 0  # resident
    if getattr(tensor, _HOST_COPY_ATTR, None) is None:
        raise RuntimeError(
            f"reload of {what}: its storage is empty but it has no host copy, so it was freed by something "
            "other than offload_megatron_model_to_cpu / offload_megatron_optimizer and its contents are lost"
        )
    nbytes = _host_nbytes(tensor)
    layout = _layout(tensor, nbytes)
    if getattr(tensor, _HOST_LAYOUT_ATTR) != layout:
        raise RuntimeError(
            f"reload of {what}: its layout changed from {getattr(tensor, _HOST_LAYOUT_ATTR)} to {layout} "
            "while it was offloaded; its host copy no longer fits"
        )
    tensor.untyped_storage().resize_(nbytes)
    _copy_pieces(_storage_bytes(tensor), getattr(tensor, _HOST_COPY_ATTR), to_host=False)
    return nbytes


def _on_compute_device(tensor: torch.Tensor) -> bool:
    """Only what lives on the compute device is offloaded; host-resident tensors are left alone."""
    return tensor.device.type == get_device_name()


def _empty_cache() -> None:
    """Return freed working memory: the accelerator's cache, or on a CPU-only host the C heap, where
    the freed storages of many small tensors would otherwise stay in the process's RSS."""
    empty_cache = getattr(get_torch_device(), "empty_cache", None)
    if empty_cache is not None:
        empty_cache()
    if get_device_name() == "cpu":
        malloc_trim()


def _synchronize() -> None:
    synchronize = getattr(get_torch_device(), "synchronize", None)
    if synchronize is not None:
        synchronize()


# ---------------------------------------------------------------------------
# What a model chunk owns
# ---------------------------------------------------------------------------


def _is_ddp(model_chunk: Any) -> bool:
    """Megatron DDP (and its FSDP adapter) keep their buffers in a list; a plain nn.Module's
    ``buffers`` is a method."""
    return isinstance(getattr(model_chunk, "buffers", None), list)


def _ddp_buffers(model_chunk: Any) -> list:
    """Dense then expert-parallel DDP buffers of a chunk; empty for a chunk without DDP."""
    if not _is_ddp(model_chunk):
        return []
    return list(model_chunk.buffers) + list(getattr(model_chunk, "expert_parallel_buffers", None) or [])


def _param_roots(model_chunk: Any, include_frozen: bool = True) -> list[tuple[str, torch.Tensor]]:
    """One tensor per parameter storage: the flat ``param_data`` of each DDP buffer that has one, then
    every parameter whose storage is not inside such a buffer (all of them with
    ``use_distributed_optimizer=False``; frozen ones and non-DDP chunks always)."""
    roots: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for index, buffer in enumerate(_ddp_buffers(model_chunk)):
        if buffer.param_data is not None and _storage_key(buffer.param_data) not in seen:
            seen.add(_storage_key(buffer.param_data))
            roots.append((f"DDP buffer {index} param_data", buffer.param_data))
    for name, param in model_chunk.named_parameters():
        key = _storage_key(param)
        if key in seen:
            continue
        seen.add(key)
        if include_frozen or param.requires_grad:
            roots.append((name, param))
    return roots


def _grad_roots(model_chunk: Any, exclude: set[int]) -> list[tuple[str, torch.Tensor, Any]]:
    """One tensor per grad storage not in ``exclude``: each DDP buffer's ``grad_data`` (where
    ``param.main_grad`` and, after an optimizer step, ``param.grad`` are views), then any
    ``main_grad`` / ``grad`` with a storage of its own (non-DDP chunks). The third item is the DDP
    buffer a ``grad_data`` belongs to, else None."""
    roots: list[tuple[str, torch.Tensor, Any]] = []
    seen = set(exclude)
    for index, buffer in enumerate(_ddp_buffers(model_chunk)):
        grad = getattr(buffer, "grad_data", None)
        if isinstance(grad, torch.Tensor) and _storage_key(grad) not in seen:
            seen.add(_storage_key(grad))
            roots.append((f"DDP buffer {index} grad_data", grad, buffer))
    for name, param in model_chunk.named_parameters():
        for attr in ("main_grad", "grad"):
            grad = getattr(param, attr, None)
            if isinstance(grad, torch.Tensor) and _storage_key(grad) not in seen:
                seen.add(_storage_key(grad))
                roots.append((f"{name}.{attr}", grad, None))
    return roots


# ---------------------------------------------------------------------------
# Where the model lives
# ---------------------------------------------------------------------------


def _inspect_residence(models: list) -> tuple[str, bool]:
    """(device type while resident, whether the inspected storage is offloaded) for the model chunks.

    Looks at what upstream's get_megatron_module_device looks at: the first chunk's first DDP buffer
    when it has a flat param buffer, else the chunk's first parameter.
    """
    if not models:
        return "cpu", False
    model_chunk = models[0]
    buffers = getattr(model_chunk, "buffers", None)
    if isinstance(buffers, list) and buffers and buffers[0].param_data is not None:
        param_data = buffers[0].param_data
        return get_device_name(), _storage_nbytes(param_data) == 0
    # No DDP buffers, or use_distributed_optimizer=False (param_data is None): the module's own parameters.
    module = getattr(model_chunk, "module", model_chunk)
    param = next(iter(module.parameters()), None)
    if param is None:
        return "cpu", False
    return param.device.type, _is_released(param)


def get_megatron_module_device(models: list) -> str:
    """The device type the model chunks' weights are on: "cpu" once offloaded, else the device.

    - empty list: "cpu";
    - a chunk without DDP buffers: the device type of its first parameter ("cpu" if it has none);
    - DDP with ``use_distributed_optimizer=False`` (``buffers[0].param_data is None``): the same
      fallback to the module's own parameters;
    - DDP with a flat param buffer: "cpu" when its storage is empty (offloaded), else
      ``get_device_name()``.

    A parameter whose storage was released by :func:`offload_megatron_model_to_cpu` counts as "cpu"
    even though its tensor still names the device.
    """
    device, offloaded = _inspect_residence(models)
    return "cpu" if offloaded else device


def is_megatron_module_offloaded(models: list) -> bool:
    """Whether the storage :func:`get_megatron_module_device` inspects has been offloaded.

    On a CPU-only host the device *is* "cpu", so this is the only way to tell the two states apart.
    """
    return _inspect_residence(models)[1]


# ---------------------------------------------------------------------------
# Model offload / reload
# ---------------------------------------------------------------------------


@torch.no_grad()
def offload_megatron_model_to_cpu(models: Iterable, offload_grad: bool = True) -> None:
    """Move the model chunks' parameters (and, with ``offload_grad``, their grads) to host copies.

    Works with and without the DDP flat param buffer, for dense and expert-parallel buffers, and for
    chunks without DDP (e.g. a reference model). Grad contents are kept, so ``param.main_grad`` views
    read the same values after :func:`load_megatron_model_to_gpu`. Idempotent.
    """
    moved = 0
    for model_chunk in models:
        params = _param_roots(model_chunk)
        # Grads first: on a host whose allocator keeps freed small blocks, the large grad buffer's host
        # copy then never adds to what the parameters' copies left behind.
        if offload_grad:
            for name, grad, _ in _grad_roots(model_chunk, exclude={_storage_key(t) for _, t in params}):
                if _on_compute_device(grad):
                    moved += _offload_storage(grad, name)
        for name, tensor in params:
            if _on_compute_device(tensor):
                moved += _offload_storage(tensor, name)
        if get_device_name() == "cpu":
            malloc_trim()
    gc.collect()
    _empty_cache()
    logger.debug("offloaded %.1f MiB of model parameters and grads", moved / 2**20)


@torch.no_grad()
def load_megatron_model_to_gpu(models: Iterable, load_grad: bool = True, load_frozen_params: bool = True) -> None:
    """Bring offloaded parameters (and grads, with ``load_grad``) back to the device, bit for bit.

    The name is upstream's; on a CPU-only host "the device" is the CPU. With ``load_frozen_params=False``
    frozen parameters of DDP chunks (those outside the DDP buffers, e.g. a LoRA base model) stay
    offloaded. Parameters that sit on the host while the device is an accelerator (a model built on
    CPU, frozen parameters moved by hand) are moved to the device. A grad buffer that Megatron's own
    ``offload_grad_buffers`` freed is re-allocated zeroed. Idempotent.
    """
    device = get_device_name()
    moved = 0
    for model_chunk in models:
        include_frozen = load_frozen_params or not _is_ddp(model_chunk)
        params = _param_roots(model_chunk, include_frozen=include_frozen)
        for name, tensor in params:
            if _is_released(tensor):
                moved += _reload_storage(tensor, name)
            elif device != "cpu" and tensor.device.type == "cpu" and isinstance(tensor, torch.nn.Parameter):
                tensor.data = tensor.data.to(get_device_id(), non_blocking=True)
        if not load_grad:
            continue
        for name, grad, buffer in _grad_roots(model_chunk, exclude={_storage_key(t) for _, t in params}):
            if not _is_released(grad):
                continue
            if getattr(buffer, "grad_data_size", 0) > 0:
                # Freed by megatron's own DDP.offload_grad_buffers (which records the size and drops the
                # contents; a host copy of ours would be older than that), so it comes back zeroed.
                grad.untyped_storage().resize_(buffer.grad_data_size * grad.element_size())
                grad.zero_()
                buffer.grad_data_size = 0
            else:
                moved += _reload_storage(grad, name)
    _synchronize()
    gc.collect()
    _empty_cache()
    logger.debug("reloaded %.1f MiB of model parameters and grads", moved / 2**20)


# ---------------------------------------------------------------------------
# Optimizer offload / reload
#
# Upstream's observable result: after an offload every tensor the optimizer owns (its Adam moments, any
# master_param, the fp32 main parameter copies) *is* a CPU tensor holding its values. Each place that
# holds one (a state-dict entry, a main parameter's ``.data``) is therefore pointed at a CPU view of a
# host copy, and the working tensor's storage is freed. The working tensor object itself is kept and put
# back on reload, so it stays the same object (views, state-dict keys and anything else holding it stay
# valid), and its host copy is reused by every later offload, as for the model.
# ---------------------------------------------------------------------------

_DEVICE_TENSOR_ATTR = "_verl_device_tensor"  # while offloaded: the working tensor a CPU stand-in replaces
_STATE_HOST_ATTR = "_verl_state_host_copy"  # a uint8 CPU tensor holding the bytes of the working storage


class _Slot:
    """One place the optimizer keeps a tensor: a state-dict entry, or a main parameter's ``.data``."""

    def __init__(self, name: str, current: torch.Tensor, put, param: torch.Tensor | None = None) -> None:
        self.name, self.current, self.put, self.param = name, current, put, param

    def marked(self, stand_in: torch.Tensor) -> Any:
        """Where the offloaded working tensor is recorded: the parameter (whose ``.data`` is a fresh
        alias at every read), else the stand-in the state dict now holds."""
        return self.param if self.param is not None else stand_in

    def offloaded(self) -> torch.Tensor | None:
        return getattr(self.param if self.param is not None else self.current, _DEVICE_TENSOR_ATTR, None)

    def keeper(self, working: torch.Tensor) -> Any:
        """The object that keeps the host copy between cycles (the parameter, or the state tensor)."""
        return self.param if self.param is not None else working


def _iter_opts(optimizers: Any) -> list:
    """The underlying Megatron optimizers of a ChainedOptimizer, or the optimizer itself."""
    if optimizers is None:
        return []
    if hasattr(optimizers, "chained_optimizers"):
        return list(optimizers.chained_optimizers)
    return [optimizers]


def _main_param_slots(opt: Any) -> list[_Slot]:
    """fp32 main copies the optimizer owns: ``shard_fp32_from_float16_groups`` (distributed optimizer)
    and ``fp32_from_float16_groups`` (Float16OptimizerWithFloat16Params). ``shard_fp32_groups`` and
    ``fp32_from_fp32_groups`` are the model's own parameters (or views of them) and belong to the model."""
    slots = []
    for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
        for group_index, group in enumerate(getattr(opt, attr, None) or []):
            for index, param in enumerate(group or []):
                if isinstance(param, torch.Tensor):
                    slots.append(
                        _Slot(f"{attr}[{group_index}][{index}]", param.data, functools.partial(setattr, param, "data"), param)
                    )
    return slots


def _state_slots(opt: Any) -> list[_Slot]:
    inner = getattr(opt, "optimizer", None)
    if inner is None:  # a rank that holds no parameters (custom pipeline layouts)
        return []
    slots = []
    for index, state in enumerate(inner.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                slots.append(_Slot(f"optimizer state {index} {key!r}", value, functools.partial(state.__setitem__, key)))
    return slots


def _pin_state_copy(nbytes: int) -> bool:
    """Pin a state's host copy on an accelerator host unless torch's caching host allocator, which rounds
    pinned requests up to a power of two, would waste more than an eighth of it; a pageable copy is
    exact (its transfers are synchronous)."""
    if get_device_name() == "cpu" or nbytes == 0:
        return False
    return (1 << (nbytes - 1).bit_length()) - nbytes <= nbytes // 8


def _state_host_copy(slots: list[_Slot], workings: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """The host copy of one working storage: the one made at the first offload, else a new one."""
    keepers = [slot.keeper(working) for slot, working in zip(slots, workings, strict=True)]
    host = next((getattr(k, _STATE_HOST_ATTR) for k in keepers if getattr(k, _STATE_HOST_ATTR, None) is not None), None)
    if host is None:
        host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=_pin_state_copy(nbytes))
    elif host.numel() != nbytes:
        raise RuntimeError(
            f"offload of {slots[0].name}: its storage is {nbytes} bytes, its host copy {host.numel()}; whatever "
            f"replaced this tensor must keep its size or delete its {_STATE_HOST_ATTR!r} attribute"
        )
    for keeper in keepers:
        setattr(keeper, _STATE_HOST_ATTR, host)
    return host


def _offload_slots(slots: list[_Slot]) -> int:
    """Point every slot at a CPU view of its host copy; free the working storages. Returns bytes moved."""
    groups: dict[int, list[_Slot]] = {}
    for slot in slots:
        tensor = slot.current
        if slot.offloaded() is not None or not _on_compute_device(tensor) or _storage_nbytes(tensor) == 0:
            continue  # offloaded already, host-resident (Adam's step on a GPU host), or empty
        groups.setdefault(_storage_key(tensor), []).append(slot)
    moved = 0
    for group in groups.values():
        workings = [slot.current for slot in group]
        nbytes = _storage_nbytes(workings[0])
        host = _state_host_copy(group, workings, nbytes)
        host.copy_(_storage_bytes(workings[0]), non_blocking=False)  # on the host before the storage is freed
        for slot, working in zip(group, workings, strict=True):
            stand_in = torch.empty(0, dtype=working.dtype).set_(
                host.untyped_storage(), working.storage_offset(), working.size(), working.stride()
            )
            slot.put(stand_in)
            setattr(slot.marked(stand_in), _DEVICE_TENSOR_ATTR, working)
        workings[0].untyped_storage().resize_(0)
        moved += nbytes
    return moved


def _reload_slots(slots: list[_Slot]) -> int:
    """Give each offloaded working tensor its bytes back and put it back in its slot. Returns bytes moved."""
    moved = 0
    for slot in slots:
        working = slot.offloaded()
        if working is None:
            continue
        if _is_released(working):  # the first slot of a shared storage brings it back for all
            host = getattr(slot.keeper(working), _STATE_HOST_ATTR)
            working.untyped_storage().resize_(host.numel())
            _storage_bytes(working).copy_(host, non_blocking=True)  # the host copy stays alive for the next offload
            moved += host.numel()
        setattr(slot.param if slot.param is not None else slot.current, _DEVICE_TENSOR_ATTR, None)
        slot.put(working)
    return moved


@torch.no_grad()
def offload_megatron_copy_params(optimizers: Any) -> None:
    """Offload the optimizer's fp32 main parameter copies (ChainedOptimizer or a single optimizer):
    afterwards each is a CPU tensor holding its values."""
    for opt in _iter_opts(optimizers):
        _offload_slots(_main_param_slots(opt))


@torch.no_grad()
def load_megatron_copy_params(optimizers: Any) -> None:
    """Reload the optimizer's fp32 main parameter copies onto the device, bit for bit."""
    for opt in _iter_opts(optimizers):
        _reload_slots(_main_param_slots(opt))


@torch.no_grad()
def offload_megatron_optimizer(optimizers: Any) -> None:
    """Offload the optimizer's main parameter copies and every tensor in its state (exp_avg, exp_avg_sq,
    master_param, ...) that lives on the device: afterwards each is a CPU tensor holding its values, as
    upstream's. Model parameters and grads the optimizer references are left to
    :func:`offload_megatron_model_to_cpu`. Idempotent."""
    moved = 0
    for opt in _iter_opts(optimizers):
        moved += _offload_slots(_main_param_slots(opt) + _state_slots(opt))
    try:
        from megatron.core.parallel_state import get_global_memory_buffer

        # Megatron's scratch buffer is refilled on demand.
        get_global_memory_buffer().buffer.clear()
    except (ImportError, AssertionError):  # megatron absent or not initialised
        pass
    gc.collect()
    _empty_cache()
    logger.debug("offloaded %.1f MiB of optimizer state", moved / 2**20)


@torch.no_grad()
def load_megatron_optimizer(optimizers: Any) -> None:
    """Reload what :func:`offload_megatron_optimizer` offloaded, bit for bit, into the same tensor objects.
    Idempotent."""
    for opt in _iter_opts(optimizers):
        _reload_slots(_main_param_slots(opt) + _state_slots(opt))
    _synchronize()
    gc.collect()
    _empty_cache()


# ---------------------------------------------------------------------------
# What an offload moves, and where it is now
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StorageResidence:
    """One storage the offload functions move. ``kind``: "param", "grad" or "optimizer"; ``nbytes``: its size;
    ``resident``: whether its bytes are in working (device) memory now; ``host_copy_addresses`` /
    ``host_copy_sizes``: the pieces of the host copy an offload keeps for it (empty before its first offload;
    the same addresses at every later offload, since the copy is reused)."""

    name: str
    kind: str
    nbytes: int
    resident: bool
    host_copy_addresses: tuple[int, ...]
    host_copy_sizes: tuple[int, ...]


def _residence(name: str, kind: str, working: torch.Tensor, host: list[torch.Tensor]) -> StorageResidence:
    resident = not _is_released(working)
    nbytes = _storage_nbytes(working) if resident else sum(piece.numel() for piece in host)
    return StorageResidence(name, kind, nbytes, resident, tuple(p.data_ptr() for p in host), tuple(p.numel() for p in host))


def describe_megatron_storages(models: Iterable, optimizers: Any = None) -> list[StorageResidence]:
    """Every storage :func:`offload_megatron_model_to_cpu` (params, grads) and :func:`offload_megatron_optimizer`
    (fp32 main copies, Adam moments) move, one entry each: where a model's memory is at any moment, how much
    of it an offload frees, and whether repeated offloads reuse their host copies. Changes nothing."""
    found: list[StorageResidence] = []
    for model_chunk in models:
        params = _param_roots(model_chunk)
        for name, tensor in params:
            found.append(_residence(name, "param", tensor, getattr(tensor, _HOST_COPY_ATTR, None) or []))
        for name, grad, _ in _grad_roots(model_chunk, exclude={_storage_key(t) for _, t in params}):
            found.append(_residence(name, "grad", grad, getattr(grad, _HOST_COPY_ATTR, None) or []))
    for opt in _iter_opts(optimizers):
        for slot in _main_param_slots(opt) + _state_slots(opt):
            working = slot.offloaded()
            working = slot.current if working is None else working
            host = getattr(slot.keeper(working), _STATE_HOST_ATTR, None)
            found.append(_residence(slot.name, "optimizer", working, [] if host is None else [host]))
    return found


# ---------------------------------------------------------------------------
# Checkpoint layout (upstream verl's helpers over ``verl.utils.checkpoint.layout``, which defines the names)
# ---------------------------------------------------------------------------
#
# Like upstream, each directory helper creates the directory it names; none checks its contents. Each one
# takes its path from the layout module and creates it (parents included) in one step, so a caller enters
# the one helper it calls.


def get_model_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/model``."""
    return local_mkdir_safe(os.path.join(checkpoint_path, layout.MODEL_DIR))


def get_optimizer_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/optimizer``."""
    return local_mkdir_safe(os.path.join(checkpoint_path, layout.OPTIMIZER_DIR))


def get_extra_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/extra``."""
    return local_mkdir_safe(os.path.join(checkpoint_path, layout.EXTRA_DIR))


def get_model_dist_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/model/dist_ckpt``: Megatron sharded model state."""
    return local_mkdir_safe(layout.dist_path(checkpoint_path, layout.MODEL_DIR))


def get_optimizer_dist_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/optimizer/dist_ckpt``: optimizer state and lr scheduler."""
    return local_mkdir_safe(layout.dist_path(checkpoint_path, layout.OPTIMIZER_DIR))


def get_extra_dist_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/extra/dist_ckpt``: RNG state."""
    return local_mkdir_safe(layout.dist_path(checkpoint_path, layout.EXTRA_DIR))


def get_hf_model_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/model/huggingface``: HF config, tokenizer and weights."""
    return local_mkdir_safe(layout.hf_path(checkpoint_path))


def get_transformer_config_checkpoint_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/transformer_config.json`` (the checkpoint directory is created)."""
    return os.path.join(local_mkdir_safe(checkpoint_path), layout.TRANSFORMER_CONFIG_FILENAME)


def get_checkpoint_contents_manifest_path(checkpoint_path: str) -> str:
    """``<checkpoint_path>/ckpt_contents.json``, the contents file (the checkpoint directory is created)."""
    return os.path.join(local_mkdir_safe(checkpoint_path), layout.CONTENTS_FILENAME)


def get_legacy_dist_checkpoint_path(checkpoint_path: str) -> str:
    """Pre-v2 layout ``<checkpoint_path>/dist_ckpt``; for detecting old checkpoints only (not created)."""
    return os.path.join(checkpoint_path, layout.DIST_CKPT_DIRNAME)


def get_legacy_hf_model_checkpoint_path(checkpoint_path: str) -> str:
    """Pre-v2 layout ``<checkpoint_path>/huggingface``; for detecting old checkpoints only (not created)."""
    return os.path.join(checkpoint_path, layout.HF_DIRNAME)


def get_dist_checkpoint_path(checkpoint_path: str) -> str:
    """Removed in upstream's v2 layout; kept so a stale caller fails with directions, not a wrong path."""
    raise RuntimeError(
        "get_dist_checkpoint_path is gone: the checkpoint layout keeps model, optimizer and extra state in "
        "separate directories. Use get_model_dist_checkpoint_path, get_optimizer_dist_checkpoint_path or "
        "get_extra_dist_checkpoint_path."
    )

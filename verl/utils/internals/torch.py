"""The private torch internals this package touches, for torch 2.13.0 only (``require_version``).

Each function names the internal it reads and why no public API serves. Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.utils.internals import require_version

WRITTEN_FOR = "2.13.0"
require_version("torch", WRITTEN_FOR, __name__)


def disable_dynamo() -> None:
    """``torch._dynamo.config.disable = True``: megatron's ``jit_fuser`` is ``torch.compile``, and on a CPU
    host inductor spends minutes compiling C++ for kernels that run in microseconds eagerly; there is no
    public switch that reaches decorators applied at megatron's import."""
    torch._dynamo.config.disable = True


def default_store() -> dist.Store:
    """``distributed_c10d._get_default_store()``: the store the default group met through, which a forked
    process connects to again to form its own group (``rank_comm.ForkedRankComm``); torch has no public getter."""
    return dist.distributed_c10d._get_default_store()


def storage_id(tensor: torch.Tensor) -> int:
    """``untyped_storage()._cdata``: the identity of a tensor's storage, shared by all its views and stable
    when the storage is resized to 0 and back (offload); ``data_ptr()`` changes on resize."""
    return tensor.untyped_storage()._cdata


def dcp_storage_info() -> type:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where a file-system write put one item (file,
    offset, length), inside DCP's write results; a background save's outcome file rebuilds them from JSON."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def set_allocator_expandable_segments(enable: bool) -> None:
    """``torch.cuda.memory._set_allocator_settings``: expandable segments on or off at run time (upstream
    verl's ``set_expandable_segments``); the public ``PYTORCH_CUDA_ALLOC_CONF`` is read only at start."""
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enable}")

"""The private torch internals this package touches, each checked where first used (``Internal``).

Each function names the internal it reads, why no public API serves, and what happens where it is gone:
a fallback through a public path, or an ``InternalsChangedError`` for that feature only.
Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import io
import os
import pickle
import struct
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from verl.utils.internals import Internal, InternalsChangedError, warn_if_untested

warn_if_untested("torch")

DYNAMO_DISABLE = Internal("torch", "torch._dynamo.config:disable", "the CPU runtime's switch-off of torch.compile")
DEFAULT_STORE = Internal(
    "torch", "torch.distributed.distributed_c10d:_get_default_store", "the forked processes' gloo group", params=()
)
STORAGE_CDATA = Internal("torch", "torch:UntypedStorage._cdata", "fix 1's offload (a storage's identity)")
ALLOCATOR_SETTINGS = Internal(
    "torch", "torch.cuda.memory:_set_allocator_settings", "set_expandable_segments (CUDA)", params=("env",)
)
DCP_STORAGE_INFO = Internal(
    "torch", "torch.distributed.checkpoint.filesystem:_StorageInfo", "checkpoint.async_save's outcome files"
)
DCP_STORAGE_PREFIX = Internal(
    "torch", "torch.distributed.checkpoint.filesystem:_StoragePrefix", "the sync dist-checkpoint save's in-rank writer"
)
ZIP_WRITER = Internal("torch", "torch._C:PyTorchFileWriter", "the in-rank writer's tensor items without a record CRC")
ZIP_SAVE = Internal(
    "torch",
    "torch.serialization:_save",
    "the in-rank writer's tensor items without a record CRC",
    params=("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"),
)
CHUNK_READ_ITEMS = Internal(
    "torch",
    "torch.distributed.checkpoint.planner_helpers:create_read_items_for_chunk_list",
    "a dist-checkpoint load's plan for chunks saved as they are requested",
    params=("fqn", "checkpoint_md", "local_chunks"),
)
SHARD_OVERLAP_CHECK = Internal(
    "torch",
    "torch.distributed._shard.sharding_spec._internals:validate_non_overlapping_shards_metadata",
    "megatron's ShardedTensor conversion without a pairwise overlap check of grid shards",
    params=("shards",),
)
# the modules that call it by the name they imported and megatron's conversion reaches (sharded_tensor.utils
# imports it too; megatron's conversion does not reach that one)
SHARD_OVERLAP_CALLERS = ("torch.distributed._shard.sharding_spec.api", "torch.distributed._shard.sharded_tensor.api")
IN_RANK_WRITER = (DCP_STORAGE_INFO, DCP_STORAGE_PREFIX, ZIP_WRITER, ZIP_SAVE)  # what dist_writer's write needs
INTERNALS = (
    DYNAMO_DISABLE,
    DEFAULT_STORE,
    STORAGE_CDATA,
    ALLOCATOR_SETTINGS,
    DCP_STORAGE_INFO,
    DCP_STORAGE_PREFIX,
    ZIP_WRITER,
    ZIP_SAVE,
    CHUNK_READ_ITEMS,
    SHARD_OVERLAP_CHECK,
)


def disable_dynamo() -> None:
    """``torch._dynamo.config.disable = True``: megatron's ``jit_fuser`` is ``torch.compile``, and on a CPU
    host inductor spends minutes compiling C++ for kernels that run in microseconds eagerly; there is no
    public switch that reaches decorators applied at megatron's import. Where the switch is gone, a warning
    names the public one read at start, ``TORCH_COMPILE_DISABLE=1`` (unless it is set): compiled kernels
    are correct, only slow to build."""
    try:
        DYNAMO_DISABLE.get()
    except InternalsChangedError as exc:
        if os.environ.get("TORCH_COMPILE_DISABLE") != "1":
            warnings.warn(f"{exc} torch.compile stays on; set TORCH_COMPILE_DISABLE=1 at start instead.", stacklevel=2)
        return
    torch._dynamo.config.disable = True


def default_store_address() -> tuple[str, int] | None:
    """(host, port) of the TCP store the default group met through, which a forked process connects to again
    to form its own group (``rank_comm.ForkedRankComm``); None when it met through another kind of store.

    Reads ``distributed_c10d._get_default_store()`` (torch has no public getter) and unwraps its
    ``PrefixStore``s. Where that internal is gone or changed, falls back, with a warning, to the public
    env:// rendezvous address ``MASTER_ADDR`` / ``MASTER_PORT`` (what torchrun, the Ray workers and
    ``run_on_ranks`` set); None when they are unset."""
    try:
        store = DEFAULT_STORE.get()()
    except InternalsChangedError as exc:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        warnings.warn(f"{exc} Using the env:// rendezvous address MASTER_ADDR:MASTER_PORT instead.", stacklevel=2)
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def storage_id(tensor: torch.Tensor) -> int:
    """``untyped_storage()._cdata``: the identity of a tensor's storage, shared by all its views and stable
    when the storage is resized to 0 and back (offload); the public ``data_ptr()`` changes on resize, so
    there is no fallback: without it the offload raises ``InternalsChangedError``."""
    return STORAGE_CDATA.get(tensor.untyped_storage())


def dcp_storage_info() -> type:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where a file-system write put one item (file,
    offset, length), inside DCP's write results; a background save's outcome file rebuilds them from JSON.
    Without it: ``InternalsChangedError`` for the async save (its outcome cannot be rebuilt otherwise)."""
    return DCP_STORAGE_INFO.get()


def dcp_storage_prefix(prefix: str) -> object:
    """``torch.distributed.checkpoint.filesystem._StoragePrefix(prefix)``: a save plan's file-name prefix, which a
    rank that plans without a collective sets itself (``__<rank>_``, as megatron's writer does). Without it:
    ``InternalsChangedError``, and the in-rank writer falls back to megatron's (dist_writer.py)."""
    return DCP_STORAGE_PREFIX.get()(prefix)


def save_without_record_crc(tensor: torch.Tensor, stream: BinaryIO) -> None:
    """``torch.save(tensor, stream)`` with no CRC-32 computed for its zip records: the same archive ``torch.load``
    reads (it does not check record CRCs; the fields are 0), ~40% less CPU for a dist-checkpoint item, where
    the step's manifest holds a CRC-32 of the whole file anyway. torch's only public switch,
    ``set_crc32_options``, is process-wide, and would reach every other thread's ``torch.save`` during a save;
    this builds the writer ``torch.save`` builds (``torch._C.PyTorchFileWriter``, then
    ``torch.serialization._save``) with the flag off for this call alone. Raises ``InternalsChangedError``
    before writing anything where either is gone (the in-rank writer then writes through DCP's own)."""
    writer_type, save = ZIP_WRITER.get(), ZIP_SAVE.get()
    writer = writer_type(stream, False, serialization_config.save.storage_alignment)
    try:
        save(tensor, writer, pickle, 2, False)
    except BaseException:
        # finished even so (torch.save does too: an unfinished writer's destructor aborts the process); the
        # write's own error (ENOSPC, EFBIG) is the one raised, not the writer's complaint about the short archive
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy. Not through ``Tensor.numpy()``: that marks the
    storage non-resizable for good, and the offload (``megatron_utils``) then fails to free it."""
    return memoryview((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())).cast("B")


def archive_around_data(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes ``save_without_record_crc(tensor)`` writes before and after the tensor's data: with record CRCs
    off, its archive depends on the data only there (its serialization id is made of the record CRCs), so
    the archive of any tensor of the same type, dtype, shape and strides is ``before + data + after``, the
    same bytes, with no pickling or archive writer per item (``dist_writer.write_archive``). None for a
    tensor whose archive is not one storage record holding exactly its bytes (then it is saved as a whole).
    Raises ``InternalsChangedError`` like ``save_without_record_crc``. Holds one copy of the tensor's bytes at
    most (the probe archive's; the data is compared in place): the first tensor of a kind may be gigabytes."""
    data = host_bytes(tensor)
    stream = io.BytesIO()
    save_without_record_crc(tensor, stream)
    records = [info for info in zipfile.ZipFile(stream).infolist() if "/data/" in info.filename and not info.filename.endswith("/serialization_id")]
    if len(records) != 1 or records[0].file_size != len(data):
        return None
    with stream.getbuffer() as archive:
        header = records[0].header_offset
        name_length, extra_length = struct.unpack_from("<HH", archive, header + 26)  # the zip local header's lengths
        start = header + 30 + name_length + extra_length
        if len(data) and not torch.equal(torch.frombuffer(archive[start : start + len(data)], dtype=torch.uint8), torch.frombuffer(data, dtype=torch.uint8)):
            return None
        return bytes(archive[:start]), bytes(archive[start + len(data) :])


def set_allocator_expandable_segments(enable: bool) -> None:
    """``torch.cuda.memory._set_allocator_settings``: expandable segments on or off at run time (upstream
    verl's ``set_expandable_segments``); the public ``PYTORCH_CUDA_ALLOC_CONF`` is read only at start, so
    without the internal this raises ``InternalsChangedError``."""
    ALLOCATOR_SETTINGS.get()(f"expandable_segments:{enable}")


@contextlib.contextmanager
def chunks_matched_by_place() -> Iterator[None]:
    """While inside: torch's load planning (``_create_read_items``, by the module-global name
    ``create_read_items_for_chunk_list``) gives a tensor whose every requested chunk was saved with the very same
    offsets and sizes one whole-chunk read each, found by its place, instead of its sweep over the saved chunks: a
    sweep along one dimension checks every pair when the chunks differ in another (the optimizer state's
    experts: 656k overlap checks, ~0.5 s at the benchmark's model). Any other tensor (resharded, a chunk of no
    extent) is planned by torch's own function. Saved chunks do not overlap, so the reads are the ones torch's
    sweep makes. Where the internal is gone, torch plans as it does. Main thread only: the swap is module-wide."""
    try:
        sweep = CHUNK_READ_ITEMS.get()
    except InternalsChangedError:
        yield
        return
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    def by_place(fqn: str, checkpoint_md: Any, local_chunks: list) -> list:
        saved = {(tuple(chunk.offsets), tuple(chunk.sizes)): index for index, chunk in enumerate(checkpoint_md.chunks)}
        found = [saved.get((tuple(chunk.offsets), tuple(chunk.sizes))) for chunk in local_chunks]
        if None in found or any(0 in tuple(chunk.sizes) for chunk in local_chunks):
            return sweep(fqn, checkpoint_md, local_chunks)
        return [
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, chunk.offsets, index),
                dest_offsets=torch.Size([0] * len(chunk.sizes)),
                storage_index=MetadataIndex(fqn, checkpoint_md.chunks[stored].offsets, stored),
                storage_offsets=torch.Size([0] * len(chunk.sizes)),
                lengths=torch.Size(chunk.sizes),
            )
            for index, (chunk, stored) in enumerate(zip(local_chunks, found, strict=True))
        ]

    module = importlib.import_module(CHUNK_READ_ITEMS.path.partition(":")[0])
    module.create_read_items_for_chunk_list = by_place
    try:
        yield
    finally:
        module.create_read_items_for_chunk_list = sweep


@functools.cache  # decided once per process
def check_grid_shards_directly() -> None:
    """Install, once per process, a ``validate_non_overlapping_shards_metadata`` that accepts shards of one size,
    each at a multiple of it, all at distinct offsets, without comparing them pairwise, and hands any other
    list to torch's own. Such shards cannot overlap (two cells of an aligned grid overlap only where their
    offsets are equal), so it raises exactly where torch's would. megatron converts every sharded tensor of a
    load (and of a save's fresh plan) to a torch ``ShardedTensor`` over the whole grid of its shards, where
    torch's sweep compares each pair that shares a layer: a MoE's experts make that quadratic (docs/perf.md).
    Nothing is installed where the internal changed or a caller no longer holds torch's own."""
    try:
        original = SHARD_OVERLAP_CHECK.get()
        callers = [importlib.import_module(name) for name in SHARD_OVERLAP_CALLERS]
    except (InternalsChangedError, ImportError):
        return
    if any(getattr(module, "validate_non_overlapping_shards_metadata", None) is not original for module in callers):
        return

    def validate_non_overlapping_shards_metadata(shards: list) -> None:
        if not _distinct_cells_of_one_grid(shards):
            original(shards)

    for module in callers:
        module.validate_non_overlapping_shards_metadata = validate_non_overlapping_shards_metadata


def _distinct_cells_of_one_grid(shards: list) -> bool:
    """Whether every shard has the first one's (non-empty) sizes, offsets that are multiples of them, and an
    offset no other shard has."""
    if len(shards) < 2:
        return False
    sizes = tuple(shards[0].shard_sizes)
    if not sizes or min(sizes) <= 0:
        return False
    seen = set()
    for shard in shards:
        offsets = tuple(shard.shard_offsets)
        if tuple(shard.shard_sizes) != sizes or len(offsets) != len(sizes) or any(o % s for o, s in zip(offsets, sizes, strict=True)):
            return False
        seen.add(offsets)
    return len(seen) == len(shards)

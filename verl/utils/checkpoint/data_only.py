"""A checkpoint is data, not code: every file a load deserialises is read through an allow-list.

torch's distributed checkpoint reads its ``.metadata`` with a plain ``pickle.load`` and each bytes item of a
``.distcp`` shard (megatron's ``ShardedObject``: our RNG states) with ``torch.load(weights_only=False)``, so a
crafted file runs whatever its ``__reduce__`` names in every rank that loads it. Here ``.metadata`` is
unpickled admitting only DCP's own metadata classes and the torch types they hold, and a bytes item only
with ``weights_only=True`` plus numpy's array reconstruction (numpy's RNG state is an array); megatron's
``common.pt`` and the driver's ``data.pt`` with ``weights_only=True``, as their loads do. Two places use
it: the checks before a load (``check_step``: every ``common.pt``, ``.metadata`` and bytes item of the step,
naming the file that holds anything else) and the load itself (``DataOnlyFileSystemReader`` / ``DataOnlyLoadPlanner``,
put in place of megatron's by ``verl.utils.megatron.dist_checkpointing``), so a file swapped after the check
is refused too. docs/operations.md, "What loading a checkpoint trusts".
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np
import torch
from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from verl.utils.checkpoint.checksum import CHUNK, RunningChecksum, checksum_of
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.internals import InternalsChangedError
from verl.utils.internals import torch as torch_internals

METADATA_FILENAME = ".metadata"  # torch DCP's global metadata file in a dist-checkpoint directory
COMMON_STATE_FILENAME = "common.pt"  # megatron's non-sharded state (optimizer param groups, content metadata)

# What torch DCP (and megatron, which keeps every rank's save plan in it) pickles into ``.metadata``.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},  # _StoragePrefix: an async write's plan
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}
_NUMPY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float16, np.float32, np.float64)
# numpy's RNG state (``np.random.get_state()``) holds a uint32 array; torch's weights-only unpickler admits
# numpy arrays only with these named.
_NUMPY_ARRAY_GLOBALS = [np.ndarray(0).__reduce__()[0], np.ndarray, np.dtype, *(type(np.dtype(t)) for t in _NUMPY_DTYPES)]


class UntrustedContentError(CheckpointError):
    """A checkpoint file holds something other than data (a class or function outside the allow-list)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: io.BufferedIOBase, path: str) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedContentError(
            f"{self._path} names {module}.{name}, which is not part of torch's dist-checkpoint metadata; refusing to "
            "load it (unpickling it could run code). A checkpoint is data: replace the file from a copy you trust."
        )


def read_dcp_metadata(path: str) -> Metadata:
    """torch DCP's ``.metadata`` at ``path``, unpickled admitting only DCP's metadata classes and torch sizes,
    dtypes and layouts; anything else is refused, naming the file and the class, before it is called.

    Parsed once per process while the file stays the same (its inode, size and mtime): the pre-load check, each
    reader megatron makes and the planner share one parse; a replaced file is parsed (and checked) again."""
    stat = os.stat(path)
    return _parsed_dcp_metadata(os.path.realpath(path), path, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _parsed_dcp_metadata(real_path: str, path: str, identity: tuple[int, ...]) -> Metadata:
    """``read_dcp_metadata``'s parse, cached by the file's real path and identity (a refusal is never cached)."""
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle, path).load()
        except UntrustedContentError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed stream is one refusal
            raise UntrustedContentError(f"{path} is not torch dist-checkpoint metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise UntrustedContentError(f"{path} holds a {type(metadata).__name__}, not torch dist-checkpoint metadata")
    return metadata


def load_weights_only(source: str | io.BytesIO, where: str, allowed: list | tuple = ()) -> Any:
    """A ``torch.save`` file or buffer loaded with ``weights_only=True`` (tensors, numbers, strings, tuples,
    lists, dicts; plus the ``allowed`` globals); anything else, or a stream torch cannot read, is one
    ``UntrustedContentError`` naming ``where`` and what it holds, never torch's traceback."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError for a refused global
        # torch's first line says what it refused; its advice to allow-list that global is no advice for a checkpoint
        reason = (str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines() or [type(exc).__name__])[0].split(". Please use")[0]
        raise UntrustedContentError(
            f"{where} holds something other than tensors and plain data ({reason}); refusing to load it (unpickling it "
            "could run code). A checkpoint is data: replace the file from a copy you trust."
        ) from exc


def load_bytes_item(data: bytes, where: str) -> Any:
    """A bytes item of a ``.distcp`` shard, loaded with ``weights_only=True`` plus numpy arrays (numpy's RNG
    state); ``where`` names the item and its file in the refusal."""
    return load_weights_only(io.BytesIO(data), where, _NUMPY_ARRAY_GLOBALS)


@functools.lru_cache(maxsize=256)
def tensor_archive_parts(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """The bytes this package's dist-checkpoint writer puts before and after a contiguous tensor's data in its
    ``torch.save`` archive (``torch_internals.archive_around_data``), for ``dtype`` and ``sizes``: an item that is
    exactly ``before + data + after`` is that tensor, its data read in place with nothing unpickled. None where
    the torch internals that make the archive are gone (each item is then ``torch.load``ed, as torch's reader does)."""
    try:
        return torch_internals.archive_around_data(torch.empty(sizes, dtype=dtype))
    except (InternalsChangedError, RuntimeError, ValueError):  # a dtype torch cannot save this way: torch's read
        return None


def check_items_inside(directory: str, metadata: Metadata) -> None:
    """Every item of ``directory``'s ``.metadata`` lies in a file of that directory: torch's reader joins an item's
    path to the directory unchecked, so an absolute or ``../`` path would load a tensor from elsewhere on the host,
    past the manifest that vouches for the step's files. Each file is resolved once, not once per item."""
    first_item_of: dict[str, Any] = {}  # each file once (a shard holds thousands of items): its first item names it
    for index, info in (metadata.storage_data or {}).items():
        first_item_of.setdefault(info.relative_path, index)
    real_directory = os.path.realpath(directory)
    for relative, index in first_item_of.items():
        if os.path.dirname(os.path.realpath(os.path.join(directory, relative))) != real_directory:
            raise UntrustedContentError(f"{os.path.join(directory, METADATA_FILENAME)} points item {index.fqn} outside its directory: {relative}")


def check_dist_checkpoint(directory: str, bytes_items: bool = True) -> None:
    """``directory``'s ``common.pt`` (megatron's non-sharded state), ``.metadata`` and every bytes item its
    shards hold are data (read, never run); each file is parsed once. ``bytes_items=False`` leaves the bytes
    items to a load that checksums their shards first and parses them as data as it reads them.

    megatron loads ``common.pt`` with torch's default, ``weights_only=True``: the same load here refuses a
    crafted one before any rank starts, naming it. torch's own switch ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    would turn megatron's load into a plain unpickle, so it is refused here."""
    common = os.path.join(directory, COMMON_STATE_FILENAME)
    if os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise UntrustedContentError(
            f"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch would unpickle {common} and could "
            "run code from it; unset it to load a checkpoint (a checkpoint is data)"
        )
    if os.path.isfile(common):
        load_weights_only(common, common)
    metadata = read_dcp_metadata(os.path.join(directory, METADATA_FILENAME))
    check_items_inside(directory, metadata)
    if not bytes_items:
        return
    items_by_shard: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            items_by_shard.setdefault(os.path.join(directory, info.relative_path), []).append((index, info))
    for shard, items in sorted(items_by_shard.items()):
        with open(shard, "rb") as handle:  # once per shard, however many bytes items it holds
            for index, info in sorted(items, key=lambda item: item[1].offset):
                handle.seek(info.offset)
                load_bytes_item(handle.read(info.length), f"item {index.fqn} of {shard}")


def check_step(step_path: str) -> None:
    """Every dist checkpoint of a step holds only data: the pre-start and pre-load check. A directory with a
    ``common.pt`` but no ``.metadata`` is checked too (the missing ``.metadata`` is then the refusal)."""
    for directory, _, names in sorted(os.walk(step_path)):
        if METADATA_FILENAME in names or COMMON_STATE_FILENAME in names:
            check_dist_checkpoint(directory)


class DataOnlyFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` goes through ``read_dcp_metadata`` (read once, kept), and
    which, given the manifest's ``checksums`` (file name in the directory -> ``crc32:...``), reads each file it loads
    whole, one file at a time, checksums those very bytes and serves the load's items from them only when they match: a file
    that does not match is named in ``mismatches`` and none of its items reaches the state being loaded. A tensor item
    this package's writer wrote is copied from those bytes into its target with nothing unpickled
    (``tensor_archive_parts``); any other item goes through torch's read, one ``torch.load`` each.

    ``own_targets``: the load's targets are buffers of the caller's own, used by nothing until the load returned
    with no mismatch (the manager's ``into_own_buffers``). A file whose items are all such tensor items, each its
    target's whole contiguous chunk, is then read straight into the targets and checksummed there: one read of
    each byte and no copy. A file that differs is still named in ``mismatches``, but its targets may hold part
    of it, so the caller must discard them."""

    def __init__(
        self,
        path: str | os.PathLike,
        checksums: dict[str, str] | None = None,
        mismatches: list[str] | None = None,
        own_targets: bool = False,
    ) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None
        self._kinds: dict | None = None
        self.checksums = checksums
        self.mismatches = mismatches if mismatches is not None else []
        self.own_targets = own_targets

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.checksums is None:  # a step without our manifest (saved by upstream verl): nothing to compare with
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in per_file.items():
            self._serve_file(relative, LoadPlan(items, plan.storage_data, plan.planner_data), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _serve_file(self, relative: str, plan: LoadPlan, planner: LoadPlanner) -> None:
        """``plan``'s items from the file ``relative``, read whole and checksummed; its bytes are dropped on return,
        before the next file is read, so at most one whole file is held at a time."""
        path = os.path.join(str(self.path), relative)
        if self.own_targets and self._read_into_targets(relative, path, plan, planner):
            return
        with open(path, "rb") as handle:
            data = handle.read()
        if not self._matches(relative, path, checksum_of(data, path)):
            return
        planner.reading = path  # a refused bytes item is named with its file
        rest = [item for item in plan.items if not self._serve_from_archive(item, data, planner)]
        if rest:
            with _serving_from_memory(self, path, data):
                super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data), planner)

    def _serve_from_archive(self, item: ReadItem, data: bytes, planner: LoadPlanner) -> bool:
        """Copy tensor ``item`` from the file's ``data`` straight into its target when its ``torch.save`` archive is
        byte for byte the one this package's writer makes for a contiguous tensor of the dtype and shape the
        metadata gives (``tensor_archive_parts``: its bytes around the data); nothing is unpickled. False, and
        nothing copied, for any other item (a bytes item, a transformed one, an archive written by torch's own
        writer with record CRCs): torch's read then loads it as before."""
        archive = self._writer_archive(item, len(data))
        if archive is None:
            return False
        info, dtype, sizes, nbytes, parts = archive
        start, end = info.offset + len(parts[0]), info.offset + info.length
        with memoryview(data) as view:
            if view[info.offset : start] != parts[0] or view[end - len(parts[1]) : end] != parts[1]:
                return False
        with warnings.catch_warnings():  # the file's bytes are only ever copied from, never written through
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else torch.empty(0, dtype=torch.uint8)
        target = planner.resolve_tensor(item).detach()
        if list(target.size()) != list(item.lengths):
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {item.lengths}")
        if list(item.lengths) == list(sizes) and target.is_contiguous() and target.dtype == dtype and type(target) is torch.Tensor:
            target.reshape(-1).view(torch.uint8).copy_(raw)  # the whole chunk, saved in the target's dtype: one copy
        else:
            chunk = torch.empty(sizes, dtype=dtype)
            chunk.reshape(-1).view(torch.uint8).copy_(raw)
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                chunk = chunk.narrow(dim, offset, length)
            target.copy_(chunk)
        planner.commit_tensor(item, target)
        return True

    def _matches(self, relative: str, path: str, got: str) -> bool:
        """Whether the file's checksum is the manifest's; if not, the file is named in ``mismatches``."""
        want = self.checksums.get(relative)
        if got == want:
            return True
        self.mismatches.append(
            f"{path}: its content checksum differs from the manifest's {want} (changed or corrupted since the save)"
            if want
            else f"{path} is not listed in the step's manifest (added after the save?); remove it or restore the step"
        )
        return False

    def _writer_archive(self, item: ReadItem, file_size: int) -> tuple[Any, torch.dtype, tuple[int, ...], int, tuple[bytes, bytes]] | None:
        """(storage info, dtype, sizes, data bytes, archive parts) of a tensor ``item`` whose bytes in its file of
        ``file_size`` bytes can be this package's writer's archive of the chunk the metadata gives; else None."""
        info = self.storage_data[item.storage_index]
        kind = self._chunk_kinds().get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
        if item.type != LoadItemType.TENSOR or info.transform_descriptors or kind is None:
            return None
        dtype, sizes = kind
        nbytes = math.prod(sizes) * dtype.itemsize
        # The sizes come from .metadata: an item whose data could not fit in its own bytes of this file is not
        # probed (the probe allocates a tensor of that shape), it goes to torch's read, which refuses it.
        if info.offset < 0 or info.offset + info.length > file_size or nbytes >= info.length:
            return None
        parts = tensor_archive_parts(dtype, sizes)
        if parts is None or info.length != len(parts[0]) + nbytes + len(parts[1]):
            return None
        return info, dtype, sizes, nbytes, parts

    def _read_into_targets(self, relative: str, path: str, plan: LoadPlan, planner: LoadPlanner) -> bool:
        """The file read once, in order, each item's data straight into its target, every byte checksummed as it
        goes. The bytes are in the targets before the checksum is known: a file that differs from the manifest is
        named in ``mismatches``, which fails the load, and the targets are the load's own buffers, discarded then
        (``own_targets``); the planner's ``commit_tensor`` follows only a match. False, and nothing committed,
        where an item is not its target's whole chunk as this package's writer writes it: the whole-file read
        then serves every item, writing over whatever part of the targets this read had filled."""
        lookup = getattr(planner, "lookup_tensor", None)  # torch's default planner's, megatron's planner's base
        if lookup is None:
            return False
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            archives = []
            for item in plan.items:
                archive = self._writer_archive(item, size)
                if archive is None:
                    return False
                info, dtype, sizes, _, parts = archive
                # judged on the destination itself, before ``resolve_tensor``: megatron's resolves an FP8 tensor to
                # a stand-in that its ``commit_tensor`` must follow at once
                target = lookup(item.dest_index)
                whole = list(item.lengths) == list(sizes) == list(target.shape) and not any(item.dest_offsets)
                if not (whole and type(target) is torch.Tensor and target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu"):
                    return False
                archives.append((info.offset, parts, item, target))
            reads = []
            for offset, parts, item, target in sorted(archives, key=lambda archive: archive[0]):
                resolved = planner.resolve_tensor(item).detach()
                if resolved.data_ptr() != target.data_ptr():
                    return False  # the planner gave a stand-in for the target: the whole-file read serves it
                reads.append((offset, parts, resolved, item))
            stream, checksum = _ChecksummedStream(handle), RunningChecksum()
            for offset, (head, tail), target, _ in reads:
                if offset < stream.position or stream.skip_to(offset, checksum) or stream.read(len(head), checksum) != head:
                    return False  # overlapping items, or bytes that are not the writer's archive
                stream.read_into(target, checksum)
                if stream.read(len(tail), checksum) != tail:
                    return False
            stream.skip_to(size, checksum)
            got = checksum.result(path) if stream.position == size and stream.read(1, checksum) == b"" else "short read"
        planner.reading = path
        if self._matches(relative, path, got):
            for _, _, target, item in reads:
                planner.commit_tensor(item, target)
        return True

    def _chunk_kinds(self) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
        """Each saved tensor chunk's dtype and shape by its fqn and offsets, from the metadata (built once)."""
        if self._kinds is None:
            self._kinds = {
                (fqn, tuple(chunk.offsets)): (entry.properties.dtype, tuple(chunk.sizes))
                for fqn, entry in self.read_metadata().state_dict_metadata.items()
                if isinstance(entry, TensorStorageMetadata)
                for chunk in entry.chunks
            }
        return self._kinds

    def read_metadata(self) -> Metadata:  # no ``rank``: torch then tries no per-rank file (megatron writes one)
        if self._metadata is None:
            self._metadata = read_dcp_metadata(os.path.join(self.path, METADATA_FILENAME))
            check_items_inside(str(self.path), self._metadata)
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id  # as torch's reader tags the load
        return self._metadata


class DataOnlyLoadPlanner(MCoreLoadPlanner):
    """megatron's load planner whose bytes items are checked with ``load_bytes_item`` before torch's own
    ``load_bytes`` (``weights_only=False``) sees the same in-memory bytes: only data ever reaches it."""

    def __init__(self, *args: Any, checkpoint_dir: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = checkpoint_dir
        self.reading: str | None = None  # the file the reader serves items from, when it says

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        source = self.reading or f"dist checkpoint {self.checkpoint_dir}"
        load_bytes_item(value.getvalue(), f"item {read_item.storage_index.fqn} of {source}")
        value.seek(0)
        super().load_bytes(read_item, value)


class _ChecksummedStream:
    """An unbuffered file read forward from its start, every byte it passes added to a running checksum."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._scratch = bytearray(CHUNK)
        self.position = 0

    def _fill(self, view: memoryview, checksum: RunningChecksum) -> int:
        """Read into ``view`` until full or at the end of the file; checksum what was read; how many bytes."""
        filled = 0
        while filled < len(view):
            got = self._handle.readinto(view[filled:])
            if not got:
                break
            filled += got
        checksum.update(view[:filled])
        self.position += filled
        return filled

    def read(self, count: int, checksum: RunningChecksum) -> bytes:
        buffer = bytearray(count)
        with memoryview(buffer) as view:
            return bytes(buffer[: self._fill(view, checksum)])

    def read_into(self, target: torch.Tensor, checksum: RunningChecksum) -> None:
        """Fill ``target`` (contiguous, on the host) with the next bytes of the file."""
        if target.numel():
            with memoryview(target.reshape(-1).view(torch.uint8).numpy()) as view:
                self._fill(view, checksum)

    def skip_to(self, offset: int, checksum: RunningChecksum) -> bool:
        """Read (checksumming) up to ``offset``; True if the file ended first."""
        with memoryview(self._scratch) as scratch:
            while self.position < offset:
                if not self._fill(scratch[: min(len(scratch), offset - self.position)], checksum):
                    return True
        return False


@contextlib.contextmanager
def _serving_from_memory(reader: FileSystemReader, path: str, data: bytes) -> Iterator[None]:
    """While inside: ``reader`` opens ``path`` as the in-memory ``data`` (already read and checksummed)."""
    real_fs = reader.fs

    class _InMemory:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_fs, name)

        def create_stream(self, wanted: str | os.PathLike, mode: str) -> Any:
            if os.fspath(wanted) == path and mode == "rb":
                return contextlib.nullcontext(io.BytesIO(data))
            return real_fs.create_stream(wanted, mode)

    reader.fs = _InMemory()
    try:
        yield
    finally:
        reader.fs = real_fs


@contextlib.contextmanager
def data_only_torch_dist_load(checkpoint_dir: str, checksums: dict[str, str] | None = None, own_targets: bool = False) -> Iterator[list[str]]:
    """For one megatron torch_dist load of ``checkpoint_dir``: its reader and planner are the data-only ones; with
    ``checksums`` (the manifest's, by file name in the directory) every file the load reads is checksummed from
    the bytes it loads (``own_targets``: the reader's). A world of one process loads without collectives (torch's ``no_dist``: the same plan and
    failures, without the plans' pickled round trip to itself). Yields the list of mismatches (one line per file),
    complete once the load returned."""
    from verl.utils.internals import megatron_core

    mismatches: list[str] = []

    def reader(checkpoint_dir: str | os.PathLike, cache_metadata: bool = False, async_strategy: str = "mcore") -> FileSystemReader:
        """megatron's ``_get_filesystem_reader`` replaced; megatron-core 0.18 also passes its ``async_strategy``,
        which a data-only read does not need (it reads in the rank either way)."""
        return DataOnlyFileSystemReader(checkpoint_dir, checksums, mismatches, own_targets)

    planner = functools.partial(DataOnlyLoadPlanner, checkpoint_dir=str(checkpoint_dir))
    one_rank = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    with megatron_core.torch_dist_load_reader_and_planner(reader, planner, one_rank), torch_internals.chunks_matched_by_place():
        yield mismatches

"""The data-only readers a dist-checkpoint load goes through: each refuses a crafted file by itself, before
anything of it runs (the checks before a load normally refuse it first: tests/test_checkpoint_lifecycle.py)."""

import contextlib
import io
import os
import pickle

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from tests.checkpoint_builders import CreatesFile
from verl.utils.checkpoint.data_only import (
    DataOnlyFileSystemReader,
    DataOnlyLoadPlanner,
    UntrustedContentError,
    load_bytes_item,
    read_dcp_metadata,
)


def test_the_reader_refuses_a_crafted_metadata_naming_file_and_class(tmp_path):
    marker = str(tmp_path / "ran")
    (tmp_path / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))
    with pytest.raises(UntrustedContentError, match=r"\.metadata names io\.open"):
        DataOnlyFileSystemReader(str(tmp_path)).read_metadata()
    assert not os.path.exists(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UntrustedContentError, match="holds a dict, not torch dist-checkpoint metadata"):
        read_dcp_metadata(str(tmp_path / ".metadata"))


def test_the_planner_refuses_a_crafted_bytes_item_before_torch_sees_it(tmp_path):
    marker = str(tmp_path / "ran")
    buffer = io.BytesIO()
    torch.save(CreatesFile(marker), buffer)
    planner = DataOnlyLoadPlanner(checkpoint_dir="ckpt")
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("rng_state"), [0], MetadataIndex("rng_state"), [0], [0])
    with pytest.raises(UntrustedContentError, match="item rng_state of dist checkpoint ckpt holds something other than"):
        planner.load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert not os.path.exists(marker)


def test_rng_states_are_data():
    """What an RNG state item holds (python's, numpy's, torch's, megatron's tracker states) loads as it was saved."""
    import random

    state = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.arange(3)}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = load_bytes_item(buffer.getvalue(), "test")
    assert loaded["random"] == state["random"] and torch.equal(loaded["torch"], state["torch"])
    assert loaded["np"][0] == "MT19937" and np.array_equal(loaded["np"][1], state["np"][1]) and loaded["np"][2:] == state["np"][2:]


def test_torchs_switch_to_unpickle_common_pt_is_refused(tmp_path, monkeypatch):
    from verl.utils.checkpoint.data_only import check_dist_checkpoint

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UntrustedContentError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch would unpickle .*common.pt"):
        check_dist_checkpoint(str(tmp_path))


def _saved_tensors(directory: str) -> dict[str, str]:
    """Two tensors saved as one dist checkpoint (no process group); the checksum of each of its shard files."""
    import torch.distributed.checkpoint as dcp

    from verl.utils.checkpoint.checksum import file_checksum

    dcp.save({"a": torch.arange(64.0), "b": torch.ones(8, 8)}, checkpoint_id=directory, no_dist=True)
    metadata_path = os.path.join(directory, ".metadata")
    with open(metadata_path, "rb") as handle:
        metadata = pickle.load(handle)  # torch's own file, just written
    metadata.storage_meta = None  # torch records its checkpoint_id as a pathlib.Path, which megatron's writer does not
    with open(metadata_path, "wb") as handle:
        pickle.dump(metadata, handle)
    return {name: file_checksum(os.path.join(directory, name)) for name in os.listdir(directory) if name.endswith(".distcp")}


def _load_checked(directory: str, checksums: dict[str, str]) -> tuple[dict, list[str]]:
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.zeros(64), "b": torch.zeros(8, 8)}
    reader = DataOnlyFileSystemReader(directory, checksums)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state, reader.mismatches


def _assert_a_flipped_byte_is_refused_and_nothing_served(directory, checksums: dict[str, str]) -> None:
    """Flip one byte in the middle of the checkpoint's one shard: the load names the file and none of its tensors
    reach the state being loaded (it keeps its zeros)."""
    ((victim, checksum),) = checksums.items()
    path = directory / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    state, mismatches = _load_checked(str(directory), checksums)
    assert mismatches == [f"{path}: its content checksum differs from the manifest's {checksum} (changed or corrupted since the save)"]
    assert not state["a"].any() and not state["b"].any()


def test_the_reader_checksums_what_it_loads_and_serves_nothing_of_a_file_that_differs(tmp_path):
    """Each shard is checksummed from the very bytes the load reads: a whole step loads as saved; after a byte
    flip, the file is named and none of its tensors reach the state being loaded (it keeps its zeros)."""
    checksums = _saved_tensors(str(tmp_path))
    state, mismatches = _load_checked(str(tmp_path), checksums)
    assert mismatches == [] and torch.equal(state["a"], torch.arange(64.0)) and torch.equal(state["b"], torch.ones(8, 8))
    _assert_a_flipped_byte_is_refused_and_nothing_served(tmp_path, checksums)


def test_torchs_reader_opens_each_file_through_its_fs_which_the_checksummed_read_replaces():
    """The checksummed read hands torch's ``read_data`` the bytes it checksummed by standing in for ``self.fs``
    (``create_stream``) and reads ``storage_data`` for each item's file: a torch that reads otherwise would load
    bytes nobody checksummed, so this fails first."""
    import inspect

    from torch.distributed.checkpoint import FileSystemReader

    source = inspect.getsource(FileSystemReader.read_data)
    assert "self.fs.create_stream(" in source and "self.storage_data[" in source and ".relative_path" in source


def _rewritten_as_this_packages_writer_writes(directory: str) -> dict[str, str]:
    """``_saved_tensors``' checkpoint with each tensor item rewritten as ``dist_writer.write_archive`` writes it
    (its archive without record CRCs), offsets and lengths in ``.metadata`` to match; the new checksums."""
    from verl.utils.checkpoint.checksum import file_checksum
    from verl.utils.checkpoint.dist_writer import write_archive

    _saved_tensors(directory)
    metadata_path = os.path.join(directory, ".metadata")
    with open(metadata_path, "rb") as handle:
        metadata = pickle.load(handle)
    (name,) = {info.relative_path for info in metadata.storage_data.values()}
    stream, templates = io.BytesIO(), {}
    for info in sorted(metadata.storage_data.values(), key=lambda info: info.offset):
        with open(os.path.join(directory, name), "rb") as handle:
            handle.seek(info.offset)
            tensor = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True)
        offset = stream.tell()
        write_archive(tensor, stream, templates)
        info.offset, info.length = offset, stream.tell() - offset
    with open(os.path.join(directory, name), "wb") as handle:
        handle.write(stream.getvalue())
    with open(metadata_path, "wb") as handle:
        pickle.dump(metadata, handle)
    return {name: file_checksum(os.path.join(directory, name))}


def test_items_this_packages_writer_wrote_load_with_nothing_unpickled_and_a_flip_is_still_refused(tmp_path, monkeypatch):
    """A tensor item whose archive is byte for byte the writer's for its dtype and shape is read in place:
    the load matches the save with ``torch.load`` unusable; a flipped byte is still named, nothing served."""
    checksums = _rewritten_as_this_packages_writer_writes(str(tmp_path))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    state, mismatches = _load_checked(str(tmp_path), checksums)
    assert mismatches == [] and torch.equal(state["a"], torch.arange(64.0)) and torch.equal(state["b"], torch.ones(8, 8))
    _assert_a_flipped_byte_is_refused_and_nothing_served(tmp_path, checksums)


def test_a_reader_whose_targets_are_its_own_reads_each_item_straight_into_its_target(tmp_path, monkeypatch):
    """``own_targets``: a file of the writer's tensor items is read once, straight into the targets (no whole-file
    read to copy from, nothing unpickled) and loads as saved; a flipped byte is still named (the targets, the
    caller's own buffers, are then discarded)."""
    import torch.distributed.checkpoint as dcp

    from verl.utils.checkpoint import data_only

    checksums = _rewritten_as_this_packages_writer_writes(str(tmp_path))

    def no_whole_file_read(*args, **kwargs):
        raise AssertionError("a whole-file read was checksummed")

    monkeypatch.setattr(torch, "load", no_whole_file_read)
    monkeypatch.setattr(data_only, "checksum_of", no_whole_file_read)
    for flip in (False, True):
        if flip:
            ((victim, checksum),) = checksums.items()
            data = bytearray((tmp_path / victim).read_bytes())
            data[data.index(torch.arange(64.0).numpy().tobytes()) + 9] ^= 0xFF  # inside a tensor's data
            (tmp_path / victim).write_bytes(bytes(data))
        state = {"a": torch.zeros(64), "b": torch.zeros(8, 8)}
        reader = DataOnlyFileSystemReader(str(tmp_path), checksums, own_targets=True)
        dcp.load(state, storage_reader=reader, no_dist=True)
        if not flip:
            assert reader.mismatches == [] and torch.equal(state["a"], torch.arange(64.0)) and torch.equal(state["b"], torch.ones(8, 8))
    path = tmp_path / victim
    assert reader.mismatches == [f"{path}: its content checksum differs from the manifest's {checksum} (changed or corrupted since the save)"]


@pytest.mark.parametrize(
    "damage",
    [lambda data: data + b"\0", lambda data: data[:-1], lambda data: data[:-300]],
    ids=["grown", "a_byte_short", "cut_into_the_data"],
)
def test_a_file_read_straight_into_the_targets_that_is_longer_or_shorter_than_saved_is_named(tmp_path, damage):
    import torch.distributed.checkpoint as dcp

    checksums = _rewritten_as_this_packages_writer_writes(str(tmp_path))
    ((victim, checksum),) = checksums.items()
    path = tmp_path / victim
    path.write_bytes(damage(path.read_bytes()))
    reader = DataOnlyFileSystemReader(str(tmp_path), checksums, own_targets=True)
    dcp.load({"a": torch.zeros(64), "b": torch.zeros(8, 8)}, storage_reader=reader, no_dist=True)
    assert reader.mismatches == [f"{path}: its content checksum differs from the manifest's {checksum} (changed or corrupted since the save)"]


@pytest.mark.parametrize("reshard", [False, True], ids=["same_chunks", "resharded"])
def test_a_load_plans_the_reads_torchs_sweep_plans(reshard):
    """Chunks requested as they were saved are found by their place: the same reads torch's sweep over every saved
    chunk plans (the experts' chunks differ along a dimension the sweep does not follow); a resharded request too."""
    from torch.distributed.checkpoint import planner_helpers
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from verl.utils.internals import torch as torch_internals

    saved = [ChunkStorageMetadata(torch.Size([expert, 0, row]), torch.Size([1, 64, 32])) for expert in range(8) for row in (0, 32)]
    metadata = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 64, 64]), saved)
    wanted = [ChunkStorageMetadata(torch.Size([e, 0, 0]), torch.Size([1, 64, 64])) for e in range(8)] if reshard else saved[::-1]
    swept = planner_helpers.create_read_items_for_chunk_list("w", metadata, wanted)
    with torch_internals.chunks_matched_by_place():
        planned = planner_helpers.create_read_items_for_chunk_list("w", metadata, wanted)
    assert planner_helpers.create_read_items_for_chunk_list.__name__ == "create_read_items_for_chunk_list"  # put back
    assert len(planned) == len(saved) and sorted(map(repr, planned)) == sorted(map(repr, swept))


@pytest.mark.parametrize("own_targets", [False, True], ids=["buffers", "own_targets"])
@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.int32], ids=["bf16", "int32"])
def test_an_item_loaded_into_a_tensor_of_another_dtype_is_converted_as_torchs_reader_converts_it(tmp_path, target_dtype, own_targets):
    """A float32 item read in place into a bf16 or int32 target is converted (torch's ``copy_``), never its raw
    bytes reinterpreted as the target's dtype."""
    import torch.distributed.checkpoint as dcp

    checksums = _rewritten_as_this_packages_writer_writes(str(tmp_path))
    state = {"a": torch.zeros(64, dtype=target_dtype), "b": torch.zeros(8, 8, dtype=target_dtype)}
    reader = DataOnlyFileSystemReader(str(tmp_path), checksums, own_targets=own_targets)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert reader.mismatches == []
    assert torch.equal(state["a"], torch.arange(64.0).to(target_dtype)) and torch.equal(state["b"], torch.ones(8, 8, dtype=target_dtype))


def test_a_metadata_chunk_size_larger_than_its_bytes_allocates_nothing_of_that_size(tmp_path, monkeypatch):
    """Chunk sizes come from ``.metadata``: one whose data could not fit in its item's bytes is never probed (the
    probe would allocate a tensor that size: 4 TiB here); the item goes to torch's read instead."""
    from verl.utils.checkpoint import data_only

    checksums = _rewritten_as_this_packages_writer_writes(str(tmp_path))
    metadata_path = tmp_path / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    metadata.state_dict_metadata["a"].chunks[0].sizes = torch.Size([2**40])
    metadata_path.write_bytes(pickle.dumps(metadata))
    probed = []
    monkeypatch.setattr(data_only, "tensor_archive_parts", lambda dtype, sizes: probed.append(sizes))
    with contextlib.suppress(Exception):  # whatever torch's read makes of the inconsistent item
        _load_checked(str(tmp_path), checksums)
    assert probed and torch.Size([2**40]) not in probed

"""The data-only readers a dist-checkpoint load goes through: each refuses a crafted file by itself, before
anything of it runs (the checks before a load normally refuse it first: tests/test_checkpoint_lifecycle.py)."""

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

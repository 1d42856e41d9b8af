"""Writes into a checkpoint directory never follow a link someone planted there (verl.utils.fs.atomic_open)."""

from __future__ import annotations

import os

import pytest

from verl.utils.fs import atomic_open, atomic_write_text


def _temp_name(path) -> str:
    """The temp file ``atomic_open`` writes first: predictable, which is why it must not follow a link."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp.{os.getpid()}")


def test_a_symlink_planted_at_the_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    tracker.parent.mkdir()
    os.symlink(victim, _temp_name(tracker))
    atomic_write_text(str(tracker), "7")
    assert tracker.read_text() == "7" and not tracker.is_symlink()
    assert victim.read_text() == "precious\n"
    assert not os.path.lexists(_temp_name(tracker))


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(str(path)) as handle:
        handle.write("half")
        raise RuntimeError("writer died")
    assert path.read_text() == "old"
    assert not os.path.lexists(_temp_name(path))

"""The step transaction, driven by a fake part writer on 2 gloo ranks: commit, failure cleanup, async finalize.

The part writer is the only stand-in (any object that fills the staging directory is one); the transaction,
its manifest, retention (upstream's ``BaseCheckpointManager`` rule), fsync, rename and tracker are real.
"""

import dataclasses
import json
import os
import threading

import pytest
import torch

from verl.utils.checkpoint import layout
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, read_tracker
from verl.utils.checkpoint.hf_verify import HFCheckpointIncompleteError
from verl.utils.checkpoint.integrity import CheckpointError, verify_manifest
from verl.utils.checkpoint.step_commit import StepCommit, StepSpec
from verl.utils.distributed import RankFailure, run_on_ranks

WORLD = 2


class PartWriter:
    """Writes one part per rank (rank 0 also upstream's contents file), as a checkpoint manager would."""

    def __init__(self, fail_after_part: bool = False) -> None:
        self.fail_after_part = fail_after_part

    def save_checkpoint(self, staging: str) -> None:
        rank = torch.distributed.get_rank()
        os.makedirs(staging, exist_ok=True)
        with open(os.path.join(staging, f"part{rank}.bin"), "wb") as handle:
            handle.write(bytes([rank]) * 1000)
        if rank == 0:
            with open(os.path.join(staging, layout.CONTENTS_FILENAME), "w") as handle:
                json.dump({"save_contents": ["model"], "contents": {"model": {"path": "part0.bin", "format": "raw"}}}, handle)
        torch.distributed.barrier()
        if self.fail_after_part:
            raise RuntimeError("the writer ran out of disk")


def _spec(retention=None, phases=None, **given) -> StepSpec:
    return StepSpec(
        parallel={"world_size": WORLD}, retention=retention, on_phase=(phases.append if phases is not None else lambda _: None), **given
    )


def _save(root: str, step: int, **given) -> StepCommit:
    transaction = StepCommit(layout.role_dir(root, step, "actor"), step, _spec(**given))
    with transaction as staging:
        PartWriter().save_checkpoint(staging)
    return transaction


def _commit_three_steps(root: str) -> dict:
    retention = BaseCheckpointManager(None, None)
    phases: list[str] = []
    seen = []
    for step in (1, 2, 3):
        record = _save(root, step, retention=retention, max_ckpt_to_keep=1, phases=phases, step_files={"data.pt": b"pos%d" % step}, track=True).committed
        seen.append([s for s in (1, 2, 3) if os.path.isdir(layout.role_dir(root, s, "actor"))])
    return {"record": record, "phases": phases[:5], "seen": seen, "kept": retention.previous_saved_paths}


def test_a_step_commits_its_parts_files_and_tracker_in_one_owner(tmp_path):
    root = str(tmp_path / "run")
    results = run_on_ranks(_commit_three_steps, WORLD, args=(root,))
    same = [dataclasses.replace(r["record"], phase_seconds={}) for r in results]
    assert same[0] == same[1]  # every rank returns the same record, with its own phase times
    record = results[0]["record"]
    path = layout.role_dir(root, 3, "actor")
    assert record.path == path and record.step == 3 and record.tracked and record.hf_tensors is None
    assert set(record.files) == {"part0.bin", "part1.bin", layout.CONTENTS_FILENAME, layout.COMMIT_MARK_FILENAME}
    assert record.contents == ("model",)
    assert results[0]["phases"] == ["staging", "hf_verify", "commit", "retention", "tracker"]
    assert set(record.phase_seconds) == {"staging", "hf_verify", "commit", "retention", "tracker"}
    verify_manifest(path)  # every listed file with its size and checksum
    assert read_tracker(root) == 3
    with open(os.path.join(layout.step_dir(root, 3), layout.DATA_STATE_FILENAME), "rb") as handle:
        assert handle.read() == b"pos3"
    # max_ckpt_to_keep=1: the tracked step survives its successor's commit and goes at the next one (its
    # data.pt stays, as upstream's retention removes only the role's directory)
    assert results[0]["seen"] == [[1], [1, 2], [2, 3]]
    assert results[0]["kept"] == [layout.role_dir(root, 2, "actor"), path]
    assert not os.path.exists(layout.staging_path(path))


def _fail_a_save(root: str, error: str) -> dict:
    _save(root, 1, track=True)
    transaction = StepCommit(layout.role_dir(root, 2, "actor"), 2, _spec(step_files={"data.pt": b"x"}, track=True))
    raised = None
    try:
        with transaction as staging:
            if error == "writer":
                PartWriter(fail_after_part=True).save_checkpoint(staging)
            else:  # the writer reports its failure as a checkpoint error
                PartWriter().save_checkpoint(staging)
                raise CheckpointError("the background write failed on rank 1")
    except (RuntimeError, CheckpointError) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    torch.distributed.barrier()
    return {"raised": raised, "tracker": read_tracker(root), "dirs": sorted(os.listdir(root))}


@pytest.mark.parametrize("error", ["writer", "checkpoint_error"])
def test_a_failed_save_is_discarded_and_keeps_the_previous_step(tmp_path, error):
    root = str(tmp_path / "run")
    result = run_on_ranks(_fail_a_save, WORLD, args=(root, error))[0]
    if error == "writer":
        assert result["raised"] == "RuntimeError: the writer ran out of disk"
    else:
        assert result["raised"].startswith("CheckpointError: the background write failed on rank 1. Nothing was committed")
    assert result["tracker"] == 1
    assert result["dirs"] == ["global_step_1", layout.TRACKER_FILENAME]  # no staging, no empty global_step_2
    verify_manifest(layout.role_dir(root, 1, "actor"))


def _save_in_background(root: str, fail: bool) -> dict:
    writer_done = threading.Event()
    release = threading.Event()
    transaction = StepCommit(layout.role_dir(root, 1, "actor"), 1, _spec(track=True))
    with transaction as staging:
        thread = threading.Thread(target=lambda: (release.wait(60), PartWriter().save_checkpoint(staging), writer_done.set()))
        thread.start()
        transaction.defer()
    blocked = not os.path.exists(staging + "/part0.bin")

    def wait(blocking: bool):
        if blocking:
            release.set()
            writer_done.wait(60)
        if not writer_done.is_set():
            return None
        if fail:
            raise CheckpointError("the background write failed")
        return staging

    early = transaction.finalize(wait, blocking=False)
    tracked_while_writing = read_tracker(root)
    try:
        committed = transaction.finalize(wait, blocking=True)
    except CheckpointError as exc:
        committed = str(exc)
    thread.join()
    return {"blocked": blocked, "early": early, "tracked_while_writing": tracked_while_writing, "committed": committed,
            "tracker": read_tracker(root), "staging_left": os.path.exists(staging)}  # fmt: skip


def test_an_async_save_commits_only_when_its_writer_finished(tmp_path):
    root = str(tmp_path / "run")
    result = run_on_ranks(_save_in_background, WORLD, args=(root, False))[0]
    assert result["blocked"] and result["early"] is None and result["tracked_while_writing"] is None
    assert result["committed"].path == layout.role_dir(root, 1, "actor") and "background_wait" in result["committed"].phase_seconds
    assert result["tracker"] == 1 and not result["staging_left"]


def test_an_async_save_whose_writer_failed_is_discarded(tmp_path):
    root = str(tmp_path / "run")
    result = run_on_ranks(_save_in_background, WORLD, args=(root, True))[0]
    assert result["committed"].startswith("the background write failed. Nothing was committed")
    assert result["tracker"] is None and not result["staging_left"]
    assert not os.path.exists(layout.step_dir(root, 1))


def _save_without_hf_weights(root: str, model_path: str) -> None:
    from transformers import AutoConfig

    _save(root, 1, hf_config=AutoConfig.from_pretrained(model_path), track=True)


def test_an_incomplete_hf_export_fails_the_commit_before_the_rename(tmp_path, tiny_dense_path):
    root = str(tmp_path / "run")
    with pytest.raises(RankFailure, match=HFCheckpointIncompleteError.__name__):
        run_on_ranks(_save_without_hf_weights, WORLD, args=(root, tiny_dense_path))
    assert not os.path.exists(layout.step_dir(root, 1)) and read_tracker(root) is None

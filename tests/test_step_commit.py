"""The step transaction, driven by a fake part writer on 2 gloo ranks: commit, failure cleanup, async finalize.

The part writer is the only stand-in (any object that fills the staging directory is one); the transaction,
its manifest, retention (upstream's ``BaseCheckpointManager`` rule), fsync, rename and tracker are real.
"""

import dataclasses
import json
import os
import shutil
import threading

import pytest
import torch

from verl.utils.checkpoint import layout
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, read_tracker
from verl.utils.checkpoint.hf_verify import HFCheckpointIncompleteError
from verl.utils.checkpoint.integrity import CheckpointError, verify_manifest
from verl.utils.checkpoint.step_commit import StepCommit, StepSpec, stale_steps
from verl.utils.distributed import RankFailure, run_on_ranks

WORLD = 2


class PartWriter:
    """Writes one part per rank (rank 0 also upstream's contents file), as a checkpoint manager would."""

    def __init__(self, fail_after_part: bool = False, fill: int | None = None) -> None:
        self.fail_after_part = fail_after_part
        self.fill = fill  # each part's byte (None: the rank's)

    def save_checkpoint(self, staging: str) -> None:
        rank = torch.distributed.get_rank()
        os.makedirs(staging, exist_ok=True)
        with open(os.path.join(staging, f"part{rank}.bin"), "wb") as handle:
            handle.write(bytes([rank if self.fill is None else self.fill]) * 1000)
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
    kept = [layout.role_dir(root, s, "actor") for s in (1, 2, 3) if os.path.isdir(layout.role_dir(root, s, "actor"))]
    return {"record": record, "phases": phases[:5], "seen": seen, "kept": kept}


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
    # the list is the disk's: the next commit drops step 2 (step 3 is tracked); one that re-saves step 2 drops
    # nothing (step 3 lies past it, for the run's later saves to replace)
    assert stale_steps(root, "actor", 4, 1) == [layout.role_dir(root, 2, "actor")]
    assert stale_steps(root, "actor", 2, 1) == [] == stale_steps(root, "actor", 4, None)
    assert not os.path.exists(layout.staging_path(path))


class CountingRetention(BaseCheckpointManager):
    """Upstream's retention, counting the removals this rank makes."""

    calls = 0

    def remove_previous_save_local_path(self, path: str | list[str]) -> None:
        self.calls += 1
        super().remove_previous_save_local_path(path)


def _commit_three_steps_keeping_one(root: str, track: bool) -> dict:
    retention = CountingRetention(None, None)
    for step in (1, 2, 3):
        _save(root, step, retention=retention, max_ckpt_to_keep=1, track=track)
    return {"calls": retention.calls, "kept": [s for s in (1, 2, 3) if os.path.isdir(layout.role_dir(root, s, "actor"))]}


@pytest.mark.parametrize("track", [True, False])
def test_rank_zero_alone_removes_the_older_steps(tmp_path, track):
    """Rank 0 renamed each step into place on the filesystem every rank shares; it alone removes the steps
    retention drops, and every rank sees them gone when the commit returns (tracked: the tracked step stays
    until the tracker moved on)."""
    results = run_on_ranks(_commit_three_steps_keeping_one, WORLD, args=(str(tmp_path / "run"), track))
    assert [r["calls"] for r in results] == [3] + [0] * (WORLD - 1)
    assert all(r["kept"] == ([2, 3] if track else [3]) for r in results), results


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


def _fail_on_rank_zero_in(root: str, phase: str) -> dict:
    """Step 2's commit on rank 0 meets a real write error (EFBIG from a file-size limit set as ``phase``
    starts): the manifest in ``commit``, ``data.pt`` in ``tracker``, after the rename."""
    import resource
    import signal

    _save(root, 1, track=True)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit_rank_zero(name: str) -> None:
        if name == phase and torch.distributed.get_rank() == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (128, limits[1]))  # room for the commit mark, not more

    spec = StepSpec(parallel={"world_size": WORLD}, step_files={"data.pt": b"x" * 4096}, track=True, on_phase=limit_rank_zero)
    raised = None
    try:
        with StepCommit(layout.role_dir(root, 2, "actor"), 2, spec) as staging:
            PartWriter().save_checkpoint(staging)
    except CheckpointError as exc:
        raised = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    torch.distributed.barrier()
    return {"raised": raised, "tracker": read_tracker(root), "dirs": sorted(os.listdir(root))}


@pytest.mark.parametrize("phase", ["commit", "tracker"])
def test_a_write_error_on_rank_zero_fails_every_rank_and_keeps_the_previous_step(tmp_path, phase):
    """Every rank raises rank 0's error at once (none waits for a verdict until the collective's timeout);
    a step already renamed into place but not tracked is removed again."""
    root = str(tmp_path / "run")
    results = run_on_ranks(_fail_on_rank_zero_in, WORLD, args=(root, phase), timeout_s=120)
    what = "commit step 2" if phase == "commit" else "track step 2"
    for result in results:
        assert result["raised"] is not None and result["raised"].startswith(f"rank 0 could not {what} (OSError: File too large (EFBIG) writing {root}/global_step_2"), result["raised"]
        assert result["raised"].endswith("Nothing was committed; the previous checkpoint and the tracker are unchanged.")
    assert results[0]["tracker"] == 1
    assert results[0]["dirs"] == ["global_step_1", layout.TRACKER_FILENAME]
    verify_manifest(layout.role_dir(root, 1, "actor"))


def _fail_a_seal_on_rank_one(root: str) -> dict:
    """Step 2: rank 1's sealer meets a real fsync error (a character device among its files)."""
    from verl.utils.checkpoint.durability import Sealer

    _save(root, 1, track=True)
    sealers: list = []

    def sealed() -> dict:
        return sealers[0].results()

    raised = None
    try:
        with StepCommit(layout.role_dir(root, 2, "actor"), 2, _spec(sealed=sealed, track=True)) as staging:
            PartWriter().save_checkpoint(staging)
            sealers.append(Sealer(staging))
            sealers[0].seal([f"part{torch.distributed.get_rank()}.bin", *([os.devnull] if torch.distributed.get_rank() == 1 else [])])
    except CheckpointError as exc:
        raised = str(exc)
    torch.distributed.barrier()
    return {"raised": raised, "tracker": read_tracker(root), "dirs": sorted(os.listdir(root))}


def test_a_rank_whose_fsync_failed_fails_the_commit_on_every_rank_before_the_rename(tmp_path):
    root = str(tmp_path / "run")
    results = run_on_ranks(_fail_a_seal_on_rank_one, WORLD, args=(root,), timeout_s=120)
    for result in results:
        assert result["raised"] == (
            "rank 1 could not make the files it wrote durable (OSError: [Errno 22] Invalid argument: '/dev/null'). "
            "Nothing was committed; the previous checkpoint and the tracker are unchanged."
        ), result["raised"]
    assert results[0]["tracker"] == 1
    assert results[0]["dirs"] == ["global_step_1", layout.TRACKER_FILENAME]


class FailingRetention(BaseCheckpointManager):
    """Upstream's retention whose removal fails (on rank 0, which removes; a step was already renamed into place)."""

    def remove_previous_save_local_path(self, path: str | list[str]) -> None:
        raise CheckpointError(f"retention could not remove the older steps {path}")


def _re_save_the_tracked_step_failing_in(root: str, phase: str) -> dict:
    """Step 1 is committed and tracked with its data.pt; a run resumed from an earlier point saves step 1 again
    and fails after the new copy was renamed into place: in ``retention``, or in ``tracker`` (rank 0 has
    replaced data.pt when the next step file meets EFBIG from a file-size limit set as the phase starts)."""
    import resource
    import signal

    _save(root, 1, step_files={"data.pt": b"old position"}, track=True)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit_rank_zero(name: str) -> None:
        if name == phase == "tracker" and torch.distributed.get_rank() == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (128, limits[1]))  # data.pt fits, big.bin does not

    spec = StepSpec(
        parallel={"world_size": WORLD}, retention=FailingRetention(None, None) if phase == "retention" else None,
        step_files={"data.pt": b"new position", "big.bin": b"x" * 4096}, track=True, on_phase=limit_rank_zero,
    )  # fmt: skip
    raised = None
    try:
        with StepCommit(layout.role_dir(root, 1, "actor"), 1, spec) as staging:
            PartWriter(fill=7).save_checkpoint(staging)
    except CheckpointError as exc:
        raised = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    torch.distributed.barrier()
    with open(os.path.join(layout.step_dir(root, 1), "data.pt"), "rb") as handle:
        data = handle.read()
    return {"raised": raised, "tracker": read_tracker(root), "data": data, "step_dir": sorted(os.listdir(layout.step_dir(root, 1)))}


@pytest.mark.parametrize("phase", ["retention", "tracker"])
def test_a_failed_re_save_of_the_tracked_step_puts_the_committed_copy_back(tmp_path, phase):
    """The tracker names step 1 throughout, so step 1 as it was committed must be there after the failure:
    its parts (not the re-save's), its data.pt, nothing else."""
    root = str(tmp_path / "run")
    results = run_on_ranks(_re_save_the_tracked_step_failing_in, WORLD, args=(root, phase), timeout_s=120)
    for result in results:
        assert result["raised"].endswith("Nothing was committed; the previous checkpoint and the tracker are unchanged."), result["raised"]
    assert results[0]["tracker"] == 1 and results[0]["data"] == b"old position"
    assert results[0]["step_dir"] == ["actor", "data.pt"]  # no superseded copy, staging or big.bin left
    actor = layout.role_dir(root, 1, "actor")
    verify_manifest(actor)
    with open(os.path.join(actor, "part0.bin"), "rb") as handle:
        assert handle.read() == bytes([0]) * 1000


def _commit_step_one(root: str, other_root: str) -> None:
    """Step 1 committed and tracked in ``root``; in ``other_root`` a committed copy whose part 0 differs."""
    _save(root, 1, step_files={"data.pt": b"old position"}, track=True)
    transaction = StepCommit(layout.role_dir(other_root, 1, "actor"), 1, _spec())
    with transaction as staging:
        PartWriter(fill=7).save_checkpoint(staging)


@pytest.mark.parametrize("crash", ["between_the_renames", "before_the_tracker", "after_the_commit"])
def test_a_crashed_re_save_of_the_tracked_step_is_settled_before_a_resume(tmp_path, crash):
    """What a SIGKILL leaves of a re-save of the tracked step 1, at three points (made here by the file
    operations the commit does up to there), then the driver's put_back_superseded:
    - between the renames: only the committed copy, aside; the resume check names it; it goes back;
    - after the rename and data.pt, before the tracker: the commit did not end, so the committed copy and its
      data.pt go back and the unfinished copy goes;
    - after the commit ended, while its older copies were removed: the new step stands, the leftover goes."""
    from verl.utils.checkpoint.integrity import find_resume_checkpoint
    from verl.utils.checkpoint.step_commit import put_back_superseded

    root = str(tmp_path / "run")
    run_on_ranks(_commit_step_one, WORLD, args=(root, str(tmp_path / "other")))
    actor, data = layout.role_dir(root, 1, "actor"), os.path.join(layout.step_dir(root, 1), "data.pt")
    new_copy = layout.staging_path(actor)  # the re-save's parts, marked and listed: its commit got that far
    shutil.copytree(layout.role_dir(str(tmp_path / "other"), 1, "actor"), new_copy)
    os.replace(actor, layout.superseded_path(actor))
    if crash != "between_the_renames":
        os.replace(new_copy, actor)
        os.replace(data, layout.superseded_path(data))
        with open(data, "wb") as handle:
            handle.write(b"new position")
    if crash == "after_the_commit":
        shutil.rmtree(layout.superseded_path(actor))
    if crash == "between_the_renames":
        with pytest.raises(CheckpointError, match=f"its committed copy is {layout.superseded_path(actor)} .*: rename it to {actor}$"):
            find_resume_checkpoint(root)
    notes = put_back_superseded(root)
    assert len(notes) == 1 and notes[0].startswith("removed" if crash == "after_the_commit" else "put the committed copy"), notes
    assert find_resume_checkpoint(root)[0] == actor  # checksums included
    with open(os.path.join(actor, "part0.bin"), "rb") as part, open(data, "rb") as position:
        assert (part.read(1), position.read()) == ((b"\x07", b"new position") if crash == "after_the_commit" else (b"\x00", b"old position"))
    assert not [name for name in os.listdir(layout.step_dir(root, 1)) if name.endswith(layout.SUPERSEDED_SUFFIX)]
    assert put_back_superseded(root) == []


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
        return WriteReport(staging, completed=True)

    early = transaction.finalize(wait, blocking=False)
    tracked_while_writing = read_tracker(root)
    try:
        committed = transaction.finalize(wait, blocking=True)
    except CheckpointError as exc:
        committed = str(exc)
    thread.join()
    return {"blocked": blocked, "early": early, "tracked_while_writing": tracked_while_writing, "committed": committed,
            "tracker": read_tracker(root), "staging_left": os.path.exists(staging)}  # fmt: skip


@dataclasses.dataclass
class WriteReport:
    """What a writer's ``completed_save`` returns, as far as the transaction reads it."""

    local_path: str
    completed: bool


def _finalize_with(root: str, answer: str) -> dict:
    transaction = StepCommit(layout.role_dir(root, 1, "actor"), 1, _spec(track=True))
    with transaction as staging:
        PartWriter().save_checkpoint(staging)
        transaction.defer()
    from verl.utils.checkpoint.megatron_checkpoint_manager import FinalizeState

    answers = {
        "writing": FinalizeState.WRITING,  # the old recipe's answer while the write still runs
        "true": True,
        "another_directory": WriteReport(staging + "-other", completed=True),
        "not_completed": WriteReport(staging, completed=False),
    }
    try:
        transaction.finalize(lambda blocking: answers[answer], blocking=False)
        refusal = None
    except TypeError as exc:
        refusal = str(exc)
    return {"refusal": refusal, "tracker": read_tracker(root), "staging_left": os.path.exists(staging)}


@pytest.mark.parametrize("answer", ["writing", "true", "another_directory", "not_completed"])
def test_finalize_commits_only_the_completed_report_of_its_own_staging_directory(tmp_path, answer):
    root = str(tmp_path / "run")
    for result in run_on_ranks(_finalize_with, WORLD, args=(root, answer)):
        assert result["refusal"] and "\n" not in result["refusal"] and "completed_save" in result["refusal"], result
        assert result["tracker"] is None and result["staging_left"]  # nothing committed, nothing discarded


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


def _save_with_the_hf_export_of(root: str, model_path: str) -> None:
    from transformers import AutoConfig

    class WithExport(PartWriter):
        def save_checkpoint(self, staging: str) -> None:
            if torch.distributed.get_rank() == 0:
                shutil.copytree(model_path, layout.hf_path(staging))
            super().save_checkpoint(staging)

    transaction = StepCommit(layout.role_dir(root, 1, "actor"), 1, _spec(hf_config=AutoConfig.from_pretrained(model_path), track=True))
    with transaction as staging:
        WithExport().save_checkpoint(staging)


def test_a_complete_hf_export_is_recorded_in_the_manifest_and_its_resume_check_derives_nothing(tmp_path, tiny_dense_path, monkeypatch):
    from transformers import AutoConfig

    from verl.utils.checkpoint import hf_verify
    from verl.utils.checkpoint.integrity import HF_EXPORT_KEY, read_manifest, verify_step_hf_export

    root = str(tmp_path / "run")
    run_on_ranks(_save_with_the_hf_export_of, WORLD, args=(root, tiny_dense_path))
    path = layout.role_dir(root, 1, "actor")
    config = AutoConfig.from_pretrained(tiny_dense_path)
    assert read_manifest(path)[HF_EXPORT_KEY] == hf_verify.verify_hf_checkpoint(tiny_dense_path, config).proof
    derivations = []
    monkeypatch.setattr(hf_verify, "expected_hf_tensors", lambda hf_config: derivations.append(hf_config))
    assert verify_step_hf_export(path, config) == len(hf_verify.read_saved_tensors(tiny_dense_path)[0])
    assert derivations == []


# --------------------------------------------------------------------------- one owner, enforced

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWNER = "verl/utils/checkpoint/step_commit.py"
# Renames that are not of a step: the atomic-file primitive, the dataset cache, the embedded model's
# directory, the merger's HF output, a fork's reserved outcome file renamed to its outcome (inside the staging).
OTHER_RENAMES = {"verl/utils/fs.py", "verl/utils/dataset/rl_dataset.py", "verl/trainer/main_ppo.py", "verl/model_merger/megatron_merge.py",
                 "verl/utils/checkpoint/snapshot_save.py"}
COMMIT_NAMES = {"TRACKER_FILENAME", "MANIFEST_FILENAME", "COMMIT_MARK_FILENAME", "get_checkpoint_tracker_filename", "tracker_path"}
WRITERS = {"atomic_write_text", "atomic_open", "write_text", "write_bytes"}


def _mentions(node, tainted: set[str]) -> bool:
    import ast

    return any(
        (isinstance(n, ast.Name) and (n.id in COMMIT_NAMES or n.id in tainted)) or (isinstance(n, ast.Attribute) and n.attr in COMMIT_NAMES)
        for n in ast.walk(node)
    )


def commit_writes(source: str) -> list[str]:
    """What a module does that only the step transaction may: rename with ``os.rename``/``os.replace``/
    ``shutil.move``, or write (or open for writing) a path built from the tracker, manifest or commit mark names
    (directly, or through a local name assigned from one)."""
    import ast

    found = []
    for function in [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        tainted = {t.id for n in ast.walk(function) if isinstance(n, ast.Assign) and _mentions(n.value, set()) for t in n.targets if isinstance(t, ast.Name)}
        for call in [n for n in ast.walk(function) if isinstance(n, ast.Call)]:
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            owner = getattr(call.func.value, "id", "") if isinstance(call.func, ast.Attribute) else ""
            if (owner, name) in {("os", "rename"), ("os", "replace"), ("shutil", "move")}:
                found.append(f"line {call.lineno}: {owner}.{name}")
            elif name in WRITERS and any(_mentions(a, tainted) for a in [*call.args, call.func]):
                found.append(f"line {call.lineno}: {name} of a commit file")
            elif name == "open" and call.args and _mentions(call.args[0], tainted):
                mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
                if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                    found.append(f"line {call.lineno}: open of a commit file for writing")
    return sorted(set(found))


def test_the_detector_sees_a_tracker_write_and_a_rename():
    source = (
        "import os\nfrom verl.utils.fs import atomic_write_text\n"
        "def track(root, step):\n    tracker = get_checkpoint_tracker_filename(root)\n    with open(tracker, 'w') as f:\n        f.write(str(step))\n"
        "def mark(staging):\n    atomic_write_text(os.path.join(staging, MANIFEST_FILENAME), '{}')\n"
        "def commit(staging, path):\n    os.replace(staging, path)\n"
    )
    assert commit_writes(source) == ["line 10: os.replace", "line 5: open of a commit file for writing", "line 8: atomic_write_text of a commit file"]
    assert commit_writes("def read(root):\n    with open(tracker_path(root)) as f:\n        return f.read()\n") == []


def test_only_the_step_transaction_renames_a_step_or_writes_the_tracker_manifest_or_mark():
    offenders = {}
    for folder, _, names in os.walk(os.path.join(REPO, "verl")):
        for name in names:
            if not name.endswith(".py"):
                continue
            relpath = os.path.relpath(os.path.join(folder, name), REPO)
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                found = commit_writes(handle.read())
            if relpath in OTHER_RENAMES:
                found = [f for f in found if not f.endswith(("os.rename", "os.replace", "shutil.move"))]
            if found and relpath != OWNER:
                offenders[relpath] = found
    assert offenders == {}
    with open(os.path.join(REPO, OWNER), encoding="utf-8") as handle:
        assert commit_writes(handle.read())  # the owner does all of it


def test_the_step_names_are_defined_once():
    """The tracker, manifest, mark, contents and data file names appear as a literal only in the layout module."""
    import ast

    names = {layout.TRACKER_FILENAME, layout.MANIFEST_FILENAME, layout.COMMIT_MARK_FILENAME, layout.CONTENTS_FILENAME,
             layout.DATA_STATE_FILENAME, layout.STAGING_SUFFIX, layout.HF_DIR}  # fmt: skip
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "verl")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            if os.path.relpath(path, REPO) == "verl/utils/checkpoint/layout.py":
                continue
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
            found += [f"{os.path.relpath(path, REPO)}:{n.lineno} {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    assert found == []


def test_the_transaction_imports_nothing_of_the_manager_nor_megatron():
    import ast

    with open(os.path.join(REPO, OWNER), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    forbidden = [m for m in imported if m.startswith("megatron") or "checkpoint_manager" in m or "megatron" in m.rsplit(".", 1)[-1]]
    assert imported and forbidden == []


def test_another_roles_older_copy_is_left_to_that_role(tmp_path):
    """``put_back_superseded`` for the actor removes a leftover step file, never a critic's older directory."""
    from verl.utils.checkpoint.step_commit import put_back_superseded

    step_dir = tmp_path / "global_step_1"
    (step_dir / "actor").mkdir(parents=True)
    (step_dir / "critic.superseded").mkdir()
    (step_dir / "data.pt.superseded").write_bytes(b"old position")
    assert put_back_superseded(str(tmp_path)) == [f"removed {step_dir / 'data.pt.superseded'}: the older copy of a step file that a committed save replaced"]
    assert sorted(os.listdir(step_dir)) == ["actor", "critic.superseded"]

"""A resume checks each thing once. The driver's pre-start check (``check_resume_step``, what
``python -m verl.trainer.main_ppo`` runs before Ray) hands its record to every rank's ``load_checkpoint``, and
the ranks do not check again what it proved; a load without the record checks everything itself. Both refuse
a damaged or crafted step before anything loads.

Reads are observed through Python's audit hook (the ``open`` event) in the driver and in each rank.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.checkpoint_builders import craft_metadata
from tests.main_leg import MBRIDGE, TRAINING_STEPS, actor_configs, override
from tests.test_checkpoint_lifecycle import _differing, _params_and_optimizer
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(ep=2, etp=1)  # 2 ranks: MoE with expert parallel, dense data parallel
WORLD = 2
LOAD_CONTENTS = ("model", "optimizer", "extra", "hf_model")
_RECORDING: list[tuple[str, collections.Counter]] = []  # (directory, its files' opens) while counting
_HOOKED: list[bool] = []


_UNREADABLE: list[str] = []  # files whose open fails in this process (a disk error on one rank)


def _on_audit_event(event: str, args: tuple) -> None:
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path in _UNREADABLE:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)
    for directory, opens in _RECORDING:
        if path.startswith(directory + os.sep):
            opens[os.path.relpath(path, directory)] += 1


def _hook_opens() -> None:
    """The audit hook that counts and fails opens: added once per process (it cannot be removed)."""
    if not _HOOKED:
        sys.addaudithook(_on_audit_event)
        _HOOKED.append(True)


@contextlib.contextmanager
def counting_opens(directory: str) -> Iterator[collections.Counter]:
    """How many times each file under ``directory`` is opened in this process inside the block (relative path
    -> count). An audit hook cannot be removed: it is added once per process and records only in here."""
    _hook_opens()
    opens: collections.Counter = collections.Counter()
    _RECORDING.append((os.path.abspath(directory), opens))
    try:
        yield opens
    finally:
        _RECORDING.pop()


def _actor(src: str, use_distributed_optimizer: bool = False):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return MegatronEngine(
        *actor_configs(
            src,
            override("checkpoint.load_contents", LOAD_CONTENTS),
            override("megatron.use_distributed_optimizer", use_distributed_optimizer),
            total_training_steps=TRAINING_STEPS,
        )
    )


def _save_step(src: str, root: str) -> None:
    actor = _actor(src)
    actor.train_step([torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))])
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1, track=True)


@pytest.fixture(scope="module")
def saved_root(tiny_moe_path, tmp_path_factory) -> str:
    """A run directory whose tracker names one committed step, with the data position a trainer writes."""
    root = str(tmp_path_factory.mktemp("resume_check"))
    run_on_ranks(_save_step, WORLD, LAYOUT, args=(tiny_moe_path, root))
    torch.save({"epoch": 0, "position": 2, "order": torch.arange(8)}, os.path.join(root, "global_step_1", "data.pt"))
    return root


def _copy_run(saved_root: str, tmp_path) -> str:
    root = os.path.join(str(tmp_path), "run")
    shutil.copytree(saved_root, root)
    return root


def _driver_check(root: str, *overrides: str, load_contents: tuple[str, ...] = LOAD_CONTENTS):
    """What main_ppo runs before Ray for ``trainer.resume_mode=auto`` on ``root``."""
    from hydra import compose, initialize_config_dir

    from verl.trainer.resume_step import check_resume_step
    from verl.trainer.run_config import build_run_config

    config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "verl", "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(
            config_name="ppo_megatron_trainer",
            overrides=[f"trainer.default_local_dir={root}", f"actor_rollout_ref.actor.checkpoint.load_contents=[{','.join(load_contents)}]", *overrides],
        )
    return check_resume_step(build_run_config(config))


def _load_counting(src: str, step: str, checked, checks: bool = True) -> dict[str, int]:
    """On each rank: build the actor, then load ``step`` (with the driver's record ``checked``, or None as a direct
    caller would), counting the opens of the step's files during the load alone. ``checks=False``: the manager's
    own load without any check, what the load itself opens."""
    actor = _actor(src)
    with counting_opens(step) as opens:
        if checks:
            actor.load_checkpoint(step, checked=checked)
        else:
            actor.checkpoint_manager.load_checkpoint(step)
    return dict(opens)


def _state(actor) -> dict:
    """This rank's parameters, optimizer state, RNG states and LR schedule: what a refused load leaves as it was.
    A distributed optimizer's state is left out: megatron's ``DistributedOptimizer.state_dict()`` fails before its
    first step (no Adam step to report)."""
    if actor.engine_config.use_distributed_optimizer:
        return {**actor.parameters_snapshot(), "lr_scheduler": actor.scheduler.state_dict()}
    return {**_params_and_optimizer(actor), "lr_scheduler": actor.scheduler.state_dict()}


def _refusal(actor, load: Callable[[], None]) -> str:
    """``load``'s refusal (its type and text) and whether the actor's whole state stayed as before; or "loaded"."""
    before = _state(actor)
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - the refusal's type and text are what is checked
        changed = _differing(before, _state(actor))  # a fresh optimizer that gained Adam state counts too
        return f"{type(exc).__name__}: {exc} | untouched={not changed}" + (f" {changed[:5]}" if changed else "")
    return "loaded"


def _load_refused(src: str, step: str, checked, use_distributed_optimizer: bool = False) -> str:
    actor = _actor(src, use_distributed_optimizer)
    return _refusal(actor, lambda: actor.load_checkpoint(step, checked=checked))


def _files(step: str, suffix: str = "") -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(folder, name), step) for folder, _, names in os.walk(step) for name in names if name.endswith(suffix)
    )


def _data_files(step: str) -> list[str]:
    """The step's bulk files: dist-checkpoint shards and HF weights."""
    return _files(step, ".distcp") + _files(step, ".safetensors")


def _beyond_the_load(opens: dict, load_alone: dict, files: list[str]) -> dict[str, int]:
    """How many more times than the load itself each of ``files`` was opened."""
    return {f: opens.get(f, 0) - load_alone.get(f, 0) for f in files}


def _a_full_checks_opens(files: list[str]) -> dict[str, int]:
    """A full check's opens of bulk files beyond the load: each shard holding bytes items (the RNG states, in
    ``extra``) parsed once as data, each HF weights file once for its header (the export's tensor shapes, a few KiB
    of it); no other shard."""
    return {f: 1 if f.startswith("extra") and f.endswith(".distcp") or f.endswith(".safetensors") else 0 for f in files}


def test_one_resume_reads_each_bulk_file_once_in_the_rank_that_loads_it(tiny_moe_path, saved_root, tmp_path):
    """Through the driver's record: the driver reads no shard or weights file for a checksum (only the shards that
    hold bytes items, to parse them as data, and the weights files' headers), and the ranks open the shards and weights exactly as often as the
    load itself does, which checksums what it reads: each bulk byte is read once for its load and its checksum."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    with counting_opens(step) as driver:
        found = _driver_check(root)
    assert (found.step, found.step_dir) == (1, os.path.dirname(step))
    ranks = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, found.checked))
    load_alone = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, None, False))

    dist_files = [f for f in _files(step) if f"{os.sep}dist_ckpt{os.sep}" in f]
    assert dist_files and {f: driver[f] for f in dist_files if driver[f] > 2} == {}, driver
    data_files = _data_files(step)
    assert {f: driver[f] for f in data_files} == _a_full_checks_opens(data_files), driver
    headers = not found.checked.model_checked  # the driver had no model config: rank 0 checks the HF export's headers
    for rank in range(WORLD):
        expected = {f: int(rank == 0 and headers and f.endswith(".safetensors")) for f in data_files}
        assert _beyond_the_load(ranks[rank], load_alone[rank], data_files) == expected, (rank, ranks[rank])
    assert any(ranks[0].get(f) for f in _files(step, ".distcp")), ranks[0]  # the load did read the shards
    # each .metadata parsed once per process: the pre-load check, megatron's readers and the planner share it
    # (rank 0 also reads each once for its checksum, with the other small files)
    metadata = _files(step, ".metadata")
    assert metadata and {f: ranks[1][f] for f in metadata} == dict.fromkeys(metadata, 1), ranks[1]


def _flip_a_byte(path: str) -> str:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        data = handle.read(64)
        handle.seek(-len(data), os.SEEK_CUR)
        handle.write(bytes(b ^ 0xFF for b in data))
    return path


def test_a_load_without_the_record_checks_everything_once_itself(tiny_moe_path, saved_root, tmp_path):
    """A direct caller (no driver): rank 0 reads no shard or weights file beyond the load but the shards holding
    bytes items (parsed as data) and the weights files' headers, no other rank reads anything beyond the load; a flipped byte in a shard is
    refused naming the file, with nothing loaded, on every rank."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    ranks = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, None))
    load_alone = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, None, False))
    data_files = _data_files(step)
    assert _beyond_the_load(ranks[0], load_alone[0], data_files) == _a_full_checks_opens(data_files), ranks[0]
    assert _beyond_the_load(ranks[1], load_alone[1], data_files) == dict.fromkeys(data_files, 0), ranks[1]

    victim = _flip_a_byte(os.path.join(step, "optimizer", "dist_ckpt", _files(os.path.join(step, "optimizer", "dist_ckpt"), ".distcp")[0]))
    for message in run_on_ranks(_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, step, None)):
        assert "nothing was loaded" in message and f"{victim}: its content checksum differs" in message, message
        assert message.endswith("untouched=True") and "\n" not in message, message


def _each_load_refused(src: str, steps: list[str], records: list) -> list[str]:
    """On each rank: one actor, each step loaded with its record; each refusal and whether the actor's state stayed."""
    actor = _actor(src)
    return [_refusal(actor, lambda step=step, checked=checked: actor.load_checkpoint(step, checked=checked)) for step, checked in zip(steps, records, strict=True)]


def _append_a_space(path: str) -> str:
    with open(path, "a") as handle:
        handle.write(" ")
    return f"{path} has "


def test_a_file_changed_after_the_drivers_check_is_refused_on_every_rank_before_anything_is_applied(tiny_moe_path, saved_root, tmp_path):
    """The driver checked the step; then a byte of one shard or weights file flips (the manifest unchanged, so the
    record still fits), or the small transformer_config.json changes: every rank refuses the load in one line
    naming the file, and the weights, optimizer state, RNG and LR schedule are as before, whichever part held the byte (model, optimizer, RNG).
    With a byte flipped in both the weights and a shard (checksummed side by side), the model's file is the one named."""
    steps, records, expected = [], [], []
    parts = ["model/huggingface", "optimizer/dist_ckpt", "extra/dist_ckpt", "transformer_config.json", "model/huggingface+optimizer/dist_ckpt"]
    for case, part in enumerate(parts):
        root = _copy_run(saved_root, tmp_path / str(case))
        step = os.path.join(root, "global_step_1", "actor")
        records.append(_driver_check(root).checked)
        if part.endswith(".json"):
            expected.append(_append_a_space(os.path.join(step, part)))
        else:
            folders = [os.path.join(step, p) for p in part.split("+")]
            flipped = [_flip_a_byte(os.path.join(folder, _data_files(folder)[0])) for folder in folders]
            expected.append(f"{flipped[0]}: its content checksum differs")
        steps.append(step)
    for refusals in run_on_ranks(_each_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, steps, records)):
        for named, message in zip(expected, refusals, strict=True):
            assert "nothing was loaded" in message and named in message, message
            assert message.endswith("untouched=True") and "\n" not in message, message


def _record_covers_before_and_after_a_load(src: str, step: str, checked) -> tuple[bool, bool]:
    from verl.utils.checkpoint.resume_check import load_target

    actor = _actor(src)
    target = load_target(actor.checkpoint_manager)
    before = checked.covers(step, target)
    actor.load_checkpoint(step, checked=checked)
    return before, checked.covers(step, target)


def test_a_record_vouches_for_one_load_only(tiny_moe_path, saved_root, tmp_path):
    """The driver's record covers the first load of its step on rank 0; once loaded with, it covers no other."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    checked = _driver_check(root).checked
    assert run_on_ranks(_record_covers_before_and_after_a_load, WORLD, LAYOUT, args=(tiny_moe_path, step, checked))[0] == (True, False)


def test_the_record_of_another_step_state_is_not_trusted(tiny_moe_path, saved_root, tmp_path):
    """A ``.metadata`` crafted after the driver's check, its manifest re-hashed to match: the record's fingerprint
    no longer fits, so the ranks check the step again and refuse it, and nothing of the pickle runs."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    checked = _driver_check(root).checked
    marker = str(tmp_path / "ran")
    path = craft_metadata(step, marker)
    for message in run_on_ranks(_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, step, checked)):
        assert "nothing was loaded" in message and f"{path} names io.open" in message, message
    assert not os.path.exists(marker)


def test_a_record_for_another_load_is_not_trusted(tiny_moe_path, saved_root, tmp_path):
    """A record checked for a load without the optimizer state does not vouch for one with it: rank 0 checks
    the step itself (it parses the bytes items of the extra shards once more than the load)."""
    import dataclasses

    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    checked = _driver_check(root).checked
    other = dataclasses.replace(checked, target=dataclasses.replace(checked.target, load_contents=("model", "extra")))
    ranks = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, other))
    load_alone = run_on_ranks(_load_counting, WORLD, LAYOUT, args=(tiny_moe_path, step, None, False))
    data_files = _data_files(step)
    assert _beyond_the_load(ranks[0], load_alone[0], data_files) == _a_full_checks_opens(data_files), ranks[0]


def test_a_step_that_does_not_fit_is_refused_in_one_wording_by_the_driver_and_the_ranks(tiny_moe_path, saved_root, tmp_path):
    """Optimizer state saved without the distributed optimizer, loaded into a run with it: the driver refuses it
    before Ray, and a direct load on the ranks refuses it before anything loads, with the same line."""
    from verl.trainer.run_config import ConfigError

    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    with pytest.raises(ConfigError) as refused:
        _driver_check(root, "actor_rollout_ref.actor.megatron.use_distributed_optimizer=True")
    (line,) = refused.value.problems
    assert line.startswith(f"{step} optimizer state was saved with use_distributed_optimizer=False, this run uses True; set "), line
    for message in run_on_ranks(_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, step, None, True)):
        assert "nothing was loaded" in message and line in message and message.endswith("untouched=True"), message


def _load_with_shards_unreadable_on_rank_1(src: str, step: str, checked, unreadable: list[str]) -> str:
    if torch.distributed.get_rank() == 1:
        _hook_opens()
        _UNREADABLE.extend(os.path.join(step, relative) for relative in unreadable)
    return _load_refused(src, step, checked)


def test_a_read_error_on_one_rank_fails_every_rank_together_with_nothing_applied(tiny_moe_path, saved_root, tmp_path):
    """The optimizer's shards cannot be read on rank 1 alone (an I/O error, not a refusal of ours): every rank fails
    in one line naming the error, none waits for another, and the weights, optimizer state, RNG and LR schedule are as before."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    shards = [os.path.join("optimizer", "dist_ckpt", name) for name in _files(os.path.join(step, "optimizer", "dist_ckpt"), ".distcp")]
    checked = _driver_check(root).checked
    for message in run_on_ranks(_load_with_shards_unreadable_on_rank_1, WORLD, LAYOUT, args=(tiny_moe_path, step, checked, shards), timeout_s=240):
        assert message.startswith(f"CheckpointError: cannot load {step}; nothing was loaded. "), message
        assert "OSError: [Errno 5]" in message and ".distcp" in message and "\n" not in message and message.endswith("untouched=True"), message


def _manager_load_refused(src: str, step: str) -> str:
    """The manager's own load, without the checks before it (a caller that skips them)."""
    actor = _actor(src)
    return _refusal(actor, lambda: actor.checkpoint_manager.load_checkpoint(step))


def test_a_step_of_ours_whose_manifest_is_gone_is_not_loaded_unchecksummed(tiny_moe_path, saved_root, tmp_path):
    """The manifest deleted after the step was checked: the load does not take it for an upstream step (nothing
    to compare with) but refuses it on every rank, naming the missing file, with nothing applied."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    os.remove(os.path.join(step, "manifest.json"))
    for message in run_on_ranks(_manager_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, step)):
        assert message.startswith(f"CheckpointError: cannot load {step}; nothing was loaded. "), message
        assert f"{os.path.join(step, 'manifest.json')} is missing" in message and message.endswith("untouched=True"), message


def test_a_bridge_record_naming_no_known_bridge_is_refused_in_one_line_and_upstreams_step_has_none():
    from verl.utils.checkpoint.integrity import BridgeRecord
    from verl.utils.checkpoint.resume_check import LoadTarget, load_fit_problems

    contents = {"save_contents": list(LOAD_CONTENTS), "contents": {"model": {"format": "huggingface"}}}
    target = LoadTarget(LOAD_CONTENTS, use_distributed_optimizer=False, param_dtype=None, bridge=BridgeRecord("mbridge", "local"))
    damaged = {"use_distributed_optimizer": False, "bridge": {"name": "foo\nbar", "layer_spec": "local"}}
    problems = load_fit_problems("/ckpt/global_step_3/actor", contents, damaged, target)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith("/ckpt/global_step_3/actor/manifest.json's bridge record {'name': 'foo\\nbar', 'layer_spec': 'local'} names no bridge")
    assert problems[0].endswith("the manifest is damaged; restore the step from a copy or resume an earlier step")
    assert load_fit_problems("/ckpt/global_step_3/actor", contents, None, target) == []  # upstream's step: no manifest


@pytest.mark.parametrize(
    ("saved", "now", "load_contents", "model_format", "refused"),
    [
        (("mbridge", "local"), ("Megatron-Bridge", "local"), LOAD_CONTENTS, "huggingface", False),  # the same modules
        (("mbridge", "transformer_engine"), ("Megatron-Bridge", "transformer_engine"), LOAD_CONTENTS, "huggingface", True),
        (("Megatron-Bridge", "transformer_engine"), ("mbridge", "local"), ("model", "extra"), "megatron_dist_checkpoint", True),
        (("mbridge", "transformer_engine"), ("Megatron-Bridge", "local"), ("model", "extra"), "huggingface", False),  # HF names only
        (("mbridge", "transformer_engine"), ("mbridge", "transformer_engine"), LOAD_CONTENTS, "huggingface", False),
        (None, ("Megatron-Bridge", "transformer_engine"), LOAD_CONTENTS, "huggingface", False),  # saved before the record
    ],
    ids=["local-across", "te-across", "te-dist-model-across", "te-hf-only-across", "same-bridge", "no-record"],
)
def test_a_step_of_the_other_bridge_loads_where_the_names_it_reads_agree(saved, now, load_contents, model_format, refused):
    """Where the two bridges build megatron-core's local spec their dist checkpoints share the module names
    (tests/py312/test_megatron_bridge_engine.py loads each through the other), and HF weights carry HF's names
    whichever wrote them; a dist checkpoint of the other bridge's TransformerEngine build is refused in one line
    that names the bridge it was written with and the setting that builds through it."""
    from verl.utils.checkpoint.integrity import BridgeRecord
    from verl.utils.checkpoint.resume_check import LoadTarget, load_fit_problems

    manifest = {"use_distributed_optimizer": False} | ({"bridge": dict(zip(("name", "layer_spec"), saved, strict=True))} if saved else {})
    contents = {"save_contents": list(LOAD_CONTENTS), "contents": {"model": {"format": model_format}}}
    target = LoadTarget(load_contents, use_distributed_optimizer=False, param_dtype=None, bridge=BridgeRecord(*now))
    problems = load_fit_problems("/ckpt/global_step_3/actor", contents, manifest, target)
    if not refused:
        assert problems == []
        return
    setting = "True" if saved[0] == "mbridge" else "False"
    assert problems == [
        f"/ckpt/global_step_3/actor was written through {saved[0]} ({saved[1]} layer spec), this run builds through {now[0]} "
        f"({now[1]} layer spec), whose dist-checkpoint names are not proven to match; set "
        f"actor_rollout_ref.actor.megatron.vanilla_mbridge={setting} (the bridge it was written with)"
    ]


def test_a_step_of_the_other_bridges_te_build_is_refused_by_the_driver_and_by_every_rank_without_its_record(
    tiny_moe_path, saved_root, tmp_path
):
    """The step, written here through mbridge's local spec, claims Megatron-Bridge's TransformerEngine build,
    whose dist-checkpoint names are not proven to be the local spec's: the driver refuses it (and takes it for an
    HF-only load), and a rank called directly (no driver, no record) checks the bridge itself: every rank refuses
    it in one line naming that bridge, nothing applied."""
    root = _copy_run(saved_root, tmp_path)
    step = os.path.join(root, "global_step_1", "actor")
    manifest_path = os.path.join(step, "manifest.json")
    with open(manifest_path) as file:
        manifest = json.load(file)
    assert manifest["bridge"] == {"name": "mbridge", "layer_spec": "local"}
    manifest["bridge"] = {"name": "Megatron-Bridge", "layer_spec": "transformer_engine"}
    with open(manifest_path, "w") as file:
        json.dump(manifest, file)
    from verl.trainer.run_config import ConfigError

    with pytest.raises(ConfigError, match="was written through Megatron-Bridge"):
        _driver_check(root, MBRIDGE)  # the bridge this run builds through, as the ranks below
    assert _driver_check(root, MBRIDGE, load_contents=("model",)).step == 1
    for message in run_on_ranks(_load_refused, WORLD, LAYOUT, args=(tiny_moe_path, step, None)):
        assert message.startswith(f"CheckpointError: cannot load {step}; nothing was loaded. "), message
        assert (
            f"{step} was written through Megatron-Bridge (transformer_engine layer spec), this run builds through mbridge "
            "(local layer spec)" in message
        ), message
        assert "vanilla_mbridge=False (the bridge it was written with)" in message and "\n" not in message, message
        assert message.endswith("untouched=True"), message

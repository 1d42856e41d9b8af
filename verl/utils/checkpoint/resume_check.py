"""What a resume checks of a step before any tensor loads, and where: each check once per resume.

``check_step`` is the whole check of one step that needs no bulk bytes: the manifest (every file listed, at its
size; the small files' CRC-32), the contents file, every dist checkpoint's metadata and bytes items being data
(``data_only.check_step``), the HF folders naming no custom code, the model identity, the HF export's tensors,
and whether the step fits this load (``load_fit_problems``: the contents asked for, the distributed-optimizer
flag and layout, the parameter dtype). The shards and weights (``checksum.is_bulk``) are checksummed on every
rank that loads them, before any of it is applied (``MegatronCheckpointManager.load_checkpoint``): a shard from
the very bytes the load reads, an HF weights file in a read before the bridge's own. ``check_step`` returns a
``CheckedStep``: the record of what it proved, of which step (a fingerprint of the files that vouch for every
other one).

Two callers. The driver (``python -m verl.trainer.main_ppo``) checks the step before Ray starts and hands the
record to every rank's ``load_checkpoint``; ``check_before_load`` on the ranks then checks, once, only what the
record does not cover: that the small files are still the bytes the driver checked (a ``.metadata`` or
``transformer_config.json`` replaced since is refused before anything loads), the parallel layout (which only
the ranks know), and the model identity and HF export against the model when the driver could not build the
model's config. A record vouches for one load (a second load with it checks everything). A load without the
record (``MegatronEngine.load_checkpoint`` called directly) checks everything, on rank 0. Either way every rank
fails together, in one line, before anything loads.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from typing import Any

import torch

from verl.utils.checkpoint import check_audit
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
from verl.utils.checkpoint.checksum import is_bulk
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.integrity import (
    BridgeRecord,
    check_model_identity,
    file_checksum,
    holds_hf_weights,
    read_ckpt_contents,
    read_manifest,
    verify_checkpoint,
    verify_manifest,
    verify_step_hf_export,
)
from verl.utils.checkpoint.layout import COMMIT_MARK_FILENAME, CONTENTS_FILENAME, MANIFEST_FILENAME
from verl.utils.checkpoint.precision import optimizer_dtype_problem
from verl.utils.checkpoint.step_commit import from_rank_zero
from verl.utils.internals.megatron_bridge import VANILLA_MBRIDGE_KEY

LOAD_CONTENTS_KEY = "actor_rollout_ref.actor.checkpoint.load_contents"
DIST_OPTIMIZER_KEY = "actor_rollout_ref.actor.megatron.use_distributed_optimizer"
# The files that vouch for every other file of a step: the same bytes here mean the step the check saw.
_VOUCHING_FILES = (MANIFEST_FILENAME, COMMIT_MARK_FILENAME, CONTENTS_FILENAME)


@dataclasses.dataclass(frozen=True)
class LoadTarget:
    """What a step is loaded into: what decides whether it fits, besides the model itself.

    ``param_dtype``: the parameters' torch dtype name (``float32``, ``bfloat16``); ``parallel``: the model-parallel
    sizes (tp, pp, ep, etp, cp), None where they are not known (before the ranks start); ``bridge``: the bridge
    the model is built through, None where not known (a manager called without an engine)."""

    load_contents: tuple[str, ...]
    use_distributed_optimizer: bool
    param_dtype: str | None
    parallel: dict[str, int] | None = None
    bridge: BridgeRecord | None = None


_SPENT_RECORDS: set[str] = set()  # the tokens of the records this process has loaded with: each vouches for one load


@dataclasses.dataclass(frozen=True)
class CheckedStep:
    """What one ``check_step`` proved, of which step: picklable, handed from the driver to the ranks, for one load."""

    path: str  # absolute: ``.../global_step_N/<role>``
    fingerprint: str  # CRC-32 of the manifest, commit mark and contents file, as the check read them
    target: LoadTarget  # the load it was checked for (its ``parallel`` None: the layout is left to the ranks)
    model_checked: bool  # identity and HF export compared with the model's config; False where none was at hand
    checks: tuple = ()  # ((kind, path), times): the checks the check made (``check_audit``), for the resume's metrics
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)  # this record, among all others

    def covers(self, path: str, target: LoadTarget) -> bool:
        """Whether this record vouches for loading ``path`` into ``target`` now: not yet loaded with, the same step,
        unchanged since, for the same contents, optimizer flag and dtype."""
        # the layout and the bridge are the ranks' to know: they check both themselves (``_check_what_is_left``)
        same_load = dataclasses.replace(self.target, parallel=None, bridge=None) == dataclasses.replace(target, parallel=None, bridge=None)
        return (
            self.token not in _SPENT_RECORDS
            and same_load
            and os.path.abspath(path) == self.path
            and step_fingerprint(path) == self.fingerprint
        )


def step_fingerprint(step_path: str) -> str:
    """CRC-32 of each file that vouches for the others (absent ones marked), in one string: the manifest lists
    every other file with its checksum, so equal fingerprints mean the step the check proved."""
    parts = []
    for name in _VOUCHING_FILES:
        path = os.path.join(step_path, name)
        parts.append(f"{name}={file_checksum(path) if os.path.isfile(path) else 'absent'}")
    return ";".join(parts)


def check_step(step_path: str, target: LoadTarget, transformer_config: Any = None, hf_config: Any = None) -> CheckedStep:
    """Every check of ``step_path`` for a load into ``target``, each once; the record of what it proved.

    Raises ``CheckpointError`` (``UntrustedContentError`` for a file that holds anything but data,
    ``FileNotFoundError`` for an absent step) naming the file and the cause; a step that does not fit the load
    raises ``StepDoesNotFitError`` with one line per problem."""
    with check_audit.recording() as checks:
        fingerprint = step_fingerprint(step_path) if os.path.isdir(step_path) else ""
        contents = verify_checkpoint(step_path, transformer_config, hf_config, bulk_checksums=False)
    problems = load_fit_problems(step_path, contents, read_manifest(step_path), target)
    if problems:
        raise StepDoesNotFitError(problems)
    return CheckedStep(
        os.path.abspath(step_path), fingerprint, target, model_checked=transformer_config is not None, checks=tuple(sorted(checks.items()))
    )


class StepDoesNotFitError(CheckpointError):
    """A whole step that this load cannot take (contents, optimizer layout or dtype); ``problems``: one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def load_fit_problems(step_path: str, contents: dict, manifest: dict | None, target: LoadTarget) -> list[str]:
    """One line per reason the step cannot load into ``target``, each naming the fix: contents that
    ``load_contents`` asks for and the step lacks; optimizer state saved with the other
    ``use_distributed_optimizer``, or distributed-optimizer state of another layout (``target.parallel`` known);
    optimizer state of another parameter dtype; dist checkpoints written through another bridge whose names are
    not proven to be this bridge's."""
    problems = []
    saved_contents = contents.get("save_contents", [])
    missing = [c for c in target.load_contents if c != "hf_model" and c not in saved_contents]
    if missing:
        problems.append(f"{step_path} holds {saved_contents} but {LOAD_CONTENTS_KEY} asks for {missing}; drop them from {LOAD_CONTENTS_KEY}")
    problems += _bridge_problems(step_path, contents, manifest, target)
    if "optimizer" not in target.load_contents:
        return problems
    if manifest is not None:
        problems += _optimizer_layout_problems(step_path, manifest, target)
    if target.param_dtype is not None:
        dtype = optimizer_dtype_problem(step_path, target.param_dtype)
        problems += [dtype] if dtype else []
    return problems


def _bridge_problems(step_path: str, contents: dict, manifest: dict | None, target: LoadTarget) -> list[str]:
    """A step written through the other bridge loads where the names it reads agree: its HF weights always, its
    dist checkpoints (the optimizer state; the model with use_dist_checkpointing=True) where both bridges build
    megatron-core's local layer spec, the same modules (tests/py312/test_megatron_bridge_engine.py). Elsewhere
    (TransformerEngine's spec, each bridge its own) the names are not proven equal: refused, naming the setting."""
    saved, now = BridgeRecord.of_step(manifest), target.bridge
    if saved is not None and not saved.is_known():
        return [
            f"{step_path}/manifest.json's bridge record {dataclasses.asdict(saved)!r} names no bridge this package builds with "
            f"({' or '.join(BridgeRecord.NAMES)}, {' or '.join(BridgeRecord.LAYER_SPECS)} layer spec): the manifest is "
            "damaged; restore the step from a copy or resume an earlier step"
        ]
    if saved is None or now is None or saved.name == now.name:
        return []
    model_format = contents.get("contents", {}).get("model", {}).get("format")
    reads_module_names = "optimizer" in target.load_contents or ("model" in target.load_contents and model_format != "huggingface")
    if not reads_module_names or saved.layer_spec == now.layer_spec == "local":
        return []
    return [
        f"{step_path} was written through {saved.name} ({saved.layer_spec} layer spec), this run builds through {now.name} "
        f"({now.layer_spec} layer spec), whose dist-checkpoint names are not proven to match; set "
        f"{VANILLA_MBRIDGE_KEY}={saved.name == 'mbridge'} (the bridge it was written with)"
    ]


def _optimizer_layout_problems(step_path: str, manifest: dict, target: LoadTarget) -> list[str]:
    saved_do, now_do = manifest.get("use_distributed_optimizer"), target.use_distributed_optimizer
    if saved_do is not None and saved_do != now_do:
        return [
            f"{step_path} optimizer state was saved with use_distributed_optimizer={saved_do}, this run uses {now_do}; "
            f"set {DIST_OPTIMIZER_KEY}={saved_do} or drop 'optimizer' from {LOAD_CONTENTS_KEY}"
        ]
    if not now_do or target.parallel is None:
        return []
    saved = {k: v for k, v in manifest.get("parallel", {}).items() if k != "world_size"}
    now = {k: v for k, v in target.parallel.items() if k != "world_size"}
    if saved == now:
        return []
    return [
        f"{step_path} holds distributed-optimizer state saved at {saved}; it loads only at the same TP/PP/EP/ETP/CP "
        f"(and virtual pipeline size), this run is {now}. Load the model alone (drop 'optimizer' from {LOAD_CONTENTS_KEY}), or save with "
        f"{DIST_OPTIMIZER_KEY}=False, whose optimizer state loads at any layout."
    ]


def load_target(manager: BaseCheckpointManager, bridge: BridgeRecord | None = None) -> LoadTarget:
    """The load ``manager`` is about to make: its contents, optimizer flag, parameter dtype, this rank's layout
    and ``bridge``, the bridge its model was built through."""
    from verl.utils.checkpoint.megatron_state_dicts import current_parallel_layout  # megatron: on the ranks only

    return LoadTarget(
        load_contents=tuple(manager.checkpoint_load_contents),
        use_distributed_optimizer=bool(getattr(manager, "use_distributed_optimizer", False)),
        param_dtype=str(manager.param_dtype).removeprefix("torch.") if getattr(manager, "param_dtype", None) is not None else None,
        parallel=current_parallel_layout(),
        bridge=bridge,
    )


def check_before_load(
    manager: BaseCheckpointManager, local_path: str, checked: CheckedStep | None = None, bridge: BridgeRecord | None = None
) -> None:
    """All ranks, before ``manager.load_checkpoint(local_path)``: rank 0 checks the step (``check_step``), or with
    ``checked``, the driver's record of this very step and load, only what that record leaves open; any problem
    fails every rank at once, in one line, before anything loads. ``bridge``: the bridge the model was built
    through (None: not compared with the step's)."""
    transformer_config, hf_config = getattr(manager, "transformer_config", None), getattr(manager, "hf_config", None)
    target = load_target(manager, bridge)

    def check() -> str | None:
        try:
            if checked is not None and checked.covers(local_path, target):
                _SPENT_RECORDS.add(checked.token)
                check_audit.note(check_audit.RECORD, os.path.abspath(local_path))
                _check_what_is_left(local_path, target, checked, transformer_config, hf_config)
            else:
                check_step(local_path, target, transformer_config, hf_config)
        except (CheckpointError, FileNotFoundError) as exc:
            return f"{type(exc).__name__}: {one_line(str(exc))}"
        return None

    problem = from_rank_zero(check, f"check {local_path}", local_path)
    if problem is not None:
        raise CheckpointError(f"cannot load {local_path}; nothing was loaded. {problem}")
    if not manager.should_load_optimizer and torch.distributed.get_rank() == 0:
        warnings.warn(
            f"loading {local_path} without its optimizer state (load_contents={manager.checkpoint_load_contents}): "
            "Adam's moments and step start from zero and the LR schedule from its start",
            stacklevel=2,
        )


def one_line(text: str) -> str:
    """A refusal of several lines (a list of problems) as one line: its items joined with '; '."""
    return "; ".join(part.strip().removeprefix("- ").strip() for part in text.strip().splitlines() if part.strip()).replace(":;", ":")


def _check_what_is_left(step_path: str, target: LoadTarget, checked: CheckedStep, transformer_config: Any, hf_config: Any) -> None:
    """The checks ``checked`` could not make: the small files still the bytes the driver checked (the bulk is
    checksummed as it loads), the model identity and HF export against the model's config when the driver had
    none, and what only the ranks know for sure: the distributed optimizer's layout and the bridge."""
    verify_manifest(step_path, required=False, bulk_checksums=False)
    if not checked.model_checked and transformer_config is not None:
        check_model_identity(step_path, transformer_config)
        if holds_hf_weights(read_ckpt_contents(step_path)):
            verify_step_hf_export(step_path, hf_config)
    manifest = read_manifest(step_path)
    problems = _bridge_problems(step_path, read_ckpt_contents(step_path), manifest, target)
    if manifest is not None and "optimizer" in target.load_contents:
        problems += _optimizer_layout_problems(step_path, manifest, target)
    if problems:
        raise StepDoesNotFitError(problems)


def resume_check_metrics(driver: dict, ranks: list[dict]) -> dict[str, int | bool]:
    """How one resume checked its step, from the driver's and every rank's ``check_audit`` notes ((kind, path) ->
    times): the bulk files (``checksum.is_bulk``) checksummed, by the driver and at most by one process, the HF
    export checks, and whether rank 0 took the driver's record. Logged as ``resume`` with the resume's first step."""

    def bulk(checks: dict) -> dict[str, int]:
        return {path: n for (kind, path), n in checks.items() if kind == check_audit.CHECKSUM and is_bulk(path)}

    per_process = [bulk(checks) for checks in (driver, *ranks)]
    everyone = [driver, *ranks]
    return {
        "bulk_files_checksummed": len(set().union(*per_process)),
        "bulk_checksums_by_driver": sum(per_process[0].values()),
        "bulk_checksums_per_file_and_process_max": max((n for p in per_process for n in p.values()), default=0),
        "hf_export_checks": sum(n for checks in everyone for (kind, _), n in checks.items() if kind == check_audit.HF_EXPORT),
        "driver_record_taken": any(kind == check_audit.RECORD for checks in ranks for (kind, _) in checks),
    }


"""MegatronCheckpointManager with upstream verl's constructor, flags, builders, layout and ``ckpt_contents.json``.

``save_checkpoint(path)`` writes a step's parts into ``path``, upstream's semantics (its retention included);
the phases of a save, which its writer runs in its own order (``save_writers``):

1. the async mode, chosen once (``AsyncMode``);
2. finite check: no parameter or Adam moment holds NaN/Inf (``verl.utils.checkpoint.finite``), checked before
   anything is written or removed; then, in sync mode, upstream's pre-save retention;
3. dist parts (``save_dist_checkpointing``): the optimizer + LR scheduler, the RNG state (extra), and the model
   only with ``use_dist_checkpointing=True``; upstream's default keeps the model as HF only;
4-6. the HF export, one unit (``forked_save.HFExport``, the same in a rank or a fork): rank 0 writes the HF
   config, tokenizer and generation config into ``model/huggingface``; a barrier (``wait_for_hf_config``): no rank
   starts the HF weights before the config is on disk (verl #6821); every rank takes part in the bridge's weight
   save. The sync writer runs it beside step 3 when it can (``save_writers``, note [2]); each rank seals the
   files it wrote (``durability``);
7. metadata: rank 0 writes ``transformer_config.json`` and, last, ``ckpt_contents.json``; upstream's retention.

A rank saves through the step transaction (``verl.utils.checkpoint.step_commit``), which hands this manager
its staging directory and then verifies, marks, renames, prunes and tracks the step. The writer, chosen once
when the manager is built from ``async_save`` and ``async_mode`` (``verl.utils.checkpoint.save_writers``),
runs steps 2-6 (``run(job)``) and says what is left; the manager never tests it. ``finalize_async_save`` completes an async
save. The builders and RNG methods are in ``megatron_state_dicts``, the load in ``megatron_checkpoint_load``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException as DistributedCheckpointException

from verl.utils import process_lifetime
from verl.utils.checkpoint import dist_writer, durability, finite, layout, os_errors, save_writers, snapshot_save
from verl.utils.checkpoint.async_modes import AsyncMode, choose_mode
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, config_get, not_implemented_unless_default
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.forked_save import ForkedSave, HFExport
from verl.utils.checkpoint.host_copy import HostCopy
from verl.utils.checkpoint.mbridge_config import save_weights_kwargs
from verl.utils.checkpoint.megatron_checkpoint_load import MegatronLoads
from verl.utils.checkpoint.megatron_metadata import MegatronMetadata, write_hf_config
from verl.utils.checkpoint.megatron_state_dicts import (
    DistParts,
    MegatronStateDicts,
    optimizer_layout,
    sharded_structure,
)
from verl.utils.device import get_device_name
from verl.utils.internals import megatron_core
from verl.utils.megatron.dist_checkpointing import load_dist_checkpointing, save_dist_checkpointing  # noqa: F401 (upstream's seams)
from verl.utils.rank_comm import GroupRankComm, PeerFailure, RankComm, forked_groups_possible

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

__all__ = ["AsyncMode", "FinalizeState", "MegatronCheckpointManager", "SaveReport", "SaveState"]


class FinalizeState(enum.Enum):
    """``finalize_async_save``'s answer. ``NOTHING_PENDING`` says nothing of how the latest save ended: another
    caller may have finalized it, or its write failed in their call; ``completed_save(path)`` tells. A plain
    enum (every member truthy either way): compare with ``is``, never test it as proof of a completed write."""

    WRITING = "writing"  # the background write still runs (``blocking=False`` only): call again
    DONE = "done"  # this call completed the pending save: every part is on disk
    NOTHING_PENDING = "nothing_pending"  # no save waited for a finalize


class SaveState(enum.Enum):
    """Where one save stands (``SaveReport.state``): the manager's one marker of a pending save, set only in its
    module. A plain enum: compare with ``is``."""

    RUNNING = "running"  # ``save_checkpoint`` is at work in the rank (or stopped there by a signal)
    WRITING = "writing"  # its background write goes on: pending until ``finalize_async_save`` completes it
    COMPLETED = "completed"  # every part on disk, the metadata written
    FAILED = "failed"  # it raised; ``failure`` says why


@dataclasses.dataclass
class SaveReport:
    """What one save did: returned by ``save_checkpoint`` and kept as ``last_save``. ``phase_seconds`` holds the
    rank's time per phase (``dist_checkpoints``, ``hf_config``, ``hf_weights``, ``fork``, ``background_wait``,
    ``metadata``, ``finite_check`` when the rank ran it; saved through ``MegatronEngine``, its
    ``last_committed.phase_seconds`` holds these and the step transaction's); ``blocked_seconds`` how long save_checkpoint
    held training; ``mode`` the manager's writer; ``checked_in_background`` whether the fork ran the NaN/Inf
    check, ``hf_weights_in_background`` whether it wrote the HF config and weights, ``planned_in_background``
    whether it planned the dist checkpoints (each as the writer's ``run`` reported it; all False when the save failed
    before the writer returned);
    ``hf_exported`` whether the rank's HF export ran, ``hf_comm`` set when it ran beside the dist write (its group)."""

    local_path: str
    global_step: int
    mode: AsyncMode
    max_ckpt_to_keep: int | None = None
    checked_in_background: bool = False
    sealer: durability.Sealer | None = None  # the files this rank wrote in the rank, hashed and fsynced since written
    hf_comm: RankComm | None = None  # the group the HF export runs over beside the dist write (None: the default group)
    hf_exported: bool = False  # the rank's HF export ran (beside the dist write, or after it)
    hf_weights_in_background: bool = False
    planned_in_background: bool = False
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    blocked_seconds: float | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    state: SaveState = SaveState.RUNNING
    failure: str | None = None  # why the save failed ("<class>: <cause>"), as the caller who met the failure was told

    @property
    def completed(self) -> bool:
        """Every part on disk (``state`` is ``COMPLETED``): what a commit needs."""
        return self.state is SaveState.COMPLETED



class MegatronCheckpointManager(MegatronLoads, MegatronStateDicts, MegatronMetadata, BaseCheckpointManager):
    """Saves and loads a Megatron model, its optimizer, LR scheduler and RNG state, with upstream verl's interface.

    ``use_dist_checkpointing`` picks the format of the ``model`` content: False (upstream's default) keeps it
    as HF weights through ``bridge`` (any object with mbridge's ``save_weights`` / ``load_weights``), True as
    Megatron shards under ``model/dist_ckpt``; ``hf_model`` adds the HF export to the latter. Optimizer, LR
    scheduler and RNG always go through dist checkpoints. ``checkpoint_config`` keys: ``save_contents``,
    ``load_contents``, ``async_save`` (see ``finalize_async_save``), ``async_mode`` (ours: ``background_write``,
    the default, or ``snapshot``; ``verl.utils.checkpoint.async_modes``), ``mbridge_config`` (keyword arguments of
    the bridge's ``save_weights``).
    """

    def __init__(
        self,
        config,
        checkpoint_config,
        model_config,
        transformer_config,
        role: str,
        model: list,
        arch: str,
        hf_config,
        param_dtype: torch.dtype,
        share_embeddings_and_output_weights: bool,
        processing_class,
        optimizer,
        optimizer_scheduler,
        use_distributed_optimizer: bool,
        use_checkpoint_opt_param_scheduler: bool = False,
        use_dist_checkpointing: bool = False,
        use_megatron_fsdp: bool = False,
        bridge=None,
        provider=None,
        peft_cls=None,
    ):
        not_implemented_unless_default(use_megatron_fsdp=use_megatron_fsdp, provider=provider, peft_cls=peft_cls)
        process_lifetime.install()  # a save's forks die with this process, also for a caller that skipped init_rank
        snapshot_save.guard_writers()  # megatron's writers: their Manager dies with this process, a killed one fails the save
        super().__init__(
            model,
            optimizer=optimizer,
            lr_scheduler=optimizer_scheduler,
            processing_class=processing_class,
            checkpoint_config=checkpoint_config,
        )
        self.arch = arch
        self.config = config
        self.transformer_config = transformer_config
        self.role = role
        self.is_value_model = role in ("reward", "critic")
        self.model_config = model_config
        self.hf_config = hf_config
        self.param_dtype = param_dtype
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.model_path = config_get(config_get(config, "model", None), "path", None)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.use_dist_checkpointing = use_dist_checkpointing
        self.use_megatron_fsdp = use_megatron_fsdp
        self.bridge = bridge
        self.provider = provider
        self.vanilla_bridge = provider is None
        self.peft_cls = peft_cls
        self._check_bridge_for_hf_contents()
        mbridge_config = config_get(checkpoint_config, "mbridge_config", None) or {}
        # the keyword arguments of every HF weight save (ValueError naming an entry the bridge does not take)
        strict = config_get(checkpoint_config, "strict", True)
        self.bridge_save_kwargs = save_weights_kwargs(bridge.save_weights, mbridge_config, strict=strict) if bridge is not None else {}
        # Made at the first async save (megatron_core.async_calls_queue). Not persistent: each save forks its
        # writer, whose copy-on-write image of this process is the snapshot of the tensors (on CPU megatron's
        # "copy to host" returns the live tensors themselves).
        self._async_queue = None
        self.last_save: SaveReport | None = None  # the latest save's report, its ``state`` the one pending marker
        self._save_strategies: dict[str, tuple[tuple, TorchDistSaveShardedStrategy]] = {}
        self._planned_optimizer_layout: tuple | None = None  # at the optimizer checkpoint's last planning here
        self._forked_saves = 0
        self._hf_comm: GroupRankComm | None = None  # the HF export's own group beside the dist write, made at its first save
        self._async_save = bool(config_get(checkpoint_config, "async_save", False))
        self._async_mode = str(config_get(checkpoint_config, "async_mode", AsyncMode.BACKGROUND_WRITE.value))
        self._choose_writer()

    def _choose_writer(self) -> None:
        """The writer of every save (``save_writers``), chosen here from the config and this rank's device: a mode
        this host cannot take (``snapshot`` with parameters on an accelerator) is refused in one line."""
        mode = choose_mode(self._async_save, self._async_mode, get_device_name())
        self._hf_in_fork = self.should_save_hf_model and getattr(self.bridge, "saves_in_parallel", False) and forked_groups_possible()
        self._writer = save_writers.make_writer(mode)

    @property
    def async_save(self) -> bool:
        """Upstream's ``checkpoint.async_save``; set, the writer is chosen again (between saves, never during one)."""
        return self._async_save

    @async_save.setter
    def async_save(self, value: bool) -> None:
        self._async_save = bool(value)
        self._choose_writer()

    @property
    def async_mode(self) -> str:
        """Ours, ``checkpoint.async_mode``: which async writer (``background_write`` or ``snapshot``); set, chosen again."""
        return self._async_mode

    @async_mode.setter
    def async_mode(self, value: str) -> None:
        self._async_mode = str(value)
        self._choose_writer()

    def _check_bridge_for_hf_contents(self) -> None:
        for contents, verb in ((self.checkpoint_save_contents, "save"), (self.checkpoint_load_contents, "load")):
            if "hf_model" in contents and self.bridge is None:
                raise ValueError(f"{verb}_contents lists 'hf_model' but bridge is None: pass bridge=... or drop 'hf_model'")
        if (self.should_save_hf_model or self.should_load_hf_model) and self.bridge is None:
            raise ValueError(
                "MegatronCheckpointManager: HF-format model weights require a bridge (use_dist_checkpointing=False keeps "
                "the 'model' content as HF weights): pass bridge=... or set use_dist_checkpointing=True"
            )

    # ------------------------------------------------------------------ which contents, in which format

    @property
    def should_save_hf_model(self) -> bool:
        """HF weights through the bridge: 'hf_model', or 'model' kept as HF (use_dist_checkpointing=False)."""
        contents = self.checkpoint_save_contents
        return "hf_model" in contents or ("model" in contents and not self.use_dist_checkpointing)

    @property
    def should_save_dist_ckpt_model(self) -> bool:
        return "model" in self.checkpoint_save_contents and self.use_dist_checkpointing

    @property
    def should_load_hf_model(self) -> bool:
        contents = self.checkpoint_load_contents
        return "hf_model" in contents or ("model" in contents and not self.use_dist_checkpointing)

    @property
    def should_load_dist_ckpt_model(self) -> bool:
        return "model" in self.checkpoint_load_contents and self.use_dist_checkpointing

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> SaveReport:
        """Write this step's parts into ``local_path`` (created if needed; the worker passes its staging directory).

        The body is the pipeline; the writer chosen when the manager was built runs the rank's part of it:
        all here (``sync``); a host copy of the device-resident state here, then checked, written and exported
        by a forked process (``background_write``); checked, written and exported by the fork (``snapshot``). Off ``sync`` this
        returns once the fork runs; ``finalize_async_save`` (which a later save or load calls first) writes the
        metadata. The step transaction then verifies and commits the staging directory. Returns the save's
        report (also ``last_save``).
        """
        if hdfs_path is not None:
            not_implemented_unless_default(hdfs_path=hdfs_path)
        if self.async_save_pending:  # one save in flight at a time
            self.finalize_async_save(blocking=True)
        self.previous_global_step = global_step
        os.makedirs(local_path, exist_ok=True)
        save = self.last_save = SaveReport(local_path, global_step, self._writer.mode, max_ckpt_to_keep)
        with self._failure_reported(save):
            # The writer runs this rank's part in its own order (``save_writers``); no NaN/Inf is ever saved:
            # checked before anything is written or removed, or by the fork on the very state it writes.
            outcome = self._writer.run(self._save_job(save))
            save.checked_in_background, save.hf_weights_in_background = outcome.checked_in_background, outcome.hf_weights_in_background
            save.planned_in_background, save.hf_exported = outcome.planned_in_background, outcome.hf_exported
            if outcome.background is not None:
                return self._continue_in_background(save, outcome.background)
        return self._finish_save(save)

    def save_mode(self) -> AsyncMode:
        """The mode every save of this manager takes (its writer's): ``sync`` without ``async_save``, else
        ``async_mode``'s (``verl.utils.checkpoint.async_modes``)."""
        return self._writer.mode

    @staticmethod
    def _refusal(save: SaveReport) -> str:
        return f"refusing to save step {save.global_step}: nothing was written"

    def _save_job(self, save: SaveReport) -> save_writers.SaveJob:
        """The save's phases, bound to it, for the writer to run (``save_writers.SaveJob``). This rank's sealer
        fsyncs the directories ``prepare`` makes too (``durability``)."""
        dist_dirs = [layout.dist_path(save.local_path, content) for content in self._dist_contents()]
        hf_dir = layout.hf_path(save.local_path) if self.should_save_hf_model else None
        made = [*dist_dirs, hf_dir] if hf_dir else dist_dirs
        save.sealer = durability.Sealer(save.local_path, made)
        return save_writers.SaveJob(
            self.rank,
            save.sealer,
            check=functools.partial(self._timed, "finite_check", finite.check_finite, self.model, self.optimizer, self._refusal(save), announce=True),
            prepare=functools.partial(self._prepare, save, made),
            plan_in_rank=functools.partial(self._timed, "dist_checkpoints", self._save_dist_checkpoints, save.local_path),
            plans_reusable=self._plans_are_reusable,
            dist_written=self._dist_files_written,
            fork=functools.partial(self._forked_save, save),
            export_hf=lambda comm: self._hf_export(save.local_path, in_rank=True).run(self.rank, comm, self.wait_for_hf_config),
            hf_group=functools.partial(self._hf_group, save),
            hf_dir=hf_dir,
            hf_parallel=getattr(self.bridge, "saves_in_parallel", False),
            hf_in_fork=self._hf_in_fork,
        )

    def _prepare(self, save: SaveReport, directories: list[str], make_room: bool) -> None:
        """With ``make_room``, upstream's pre-save retention (given a limit); then the save's directories."""
        if make_room and save.max_ckpt_to_keep:
            self.ensure_checkpoint_capacity(save.max_ckpt_to_keep)
        for directory in directories:
            os.makedirs(directory, exist_ok=True)

    def _hf_group(self, save: SaveReport) -> RankComm:
        """The HF export's gloo group beside the dist write, made collectively at its first save, so no
        collective of the two threads shares a group (``wait_for_hf_config`` barriers over it)."""
        if self._hf_comm is None:
            self._hf_comm = GroupRankComm()
        save.hf_comm = self._hf_comm
        return save.hf_comm

    def _dist_files_written(self) -> list[str]:
        """The files this rank's in-rank writers wrote in the sync save just made (``InRankSaveStrategy.last_files``)."""
        return [path for content in self._dist_contents() for path in self._save_strategies[content][1].last_files]

    def _plans_are_reusable(self) -> bool:
        """Whether a fork can plan this save alone: every plan reusable without a collective, same structure, and
        no state dict whose building is itself a collective: the distributed optimizer's ``fully_reshardable``
        format gathers every parameter's state over the data-parallel group (megatron's
        ``get_parameter_state_dp_zero``), whose sockets are the rank's; that format is planned in the rank."""
        if self.should_save_optimizer and self._build_sharded_state_dict_metadata().get("distrib_optim_sharding_type") == "fully_reshardable":
            return False
        if not all(megatron_core.save_plan_is_reusable(self._save_strategies.get(c, (None, None))[1]) for c in self._dist_contents()):
            return False
        return not self.should_save_optimizer or optimizer_layout(self.optimizer) == self._planned_optimizer_layout

    def _dist_parts(self) -> DistParts:
        """The sources of this save's dist checkpoints (references: no state dict built yet) and its RNG state."""
        return DistParts(
            self.model, self.optimizer, self.lr_scheduler, tuple(self._dist_contents()), self._build_sharded_state_dict_metadata(),
            self._build_extra_state_dict() if self.should_save_extra else None, self.on_save_phase,
        )  # fmt: skip

    def _forked_save(self, save: SaveReport, check: bool, export_hf: bool, to_host: bool) -> ForkedSave:
        """What an async writer's fork is given (it runs the NaN/Inf check with ``check``, the HF export with
        ``export_hf``, and reads the host copy taken here with ``to_host``); the RNG state is taken here (a fork
        reseeds ``random``)."""
        host = self._timed("host_copy", HostCopy.take, self.model, self.optimizer) if to_host else None
        self._forked_saves += 1
        hf = self._hf_export(save.local_path, in_rank=False) if export_hf else None
        group = f"{self.role}/step{save.global_step}/save{self._forked_saves}" if hf is not None else None
        parts = self._dist_parts()
        return ForkedSave(save.local_path, self.rank, self._refusal(save), parts, self._save_strategies, check, hf, group, host)

    def _hf_export(self, local_path: str, in_rank: bool) -> HFExport:
        """The step's HF export unit; ``in_rank``: its phases announced (``on_save_phase``) and timed here."""
        hf_path = layout.hf_path(local_path)
        config = functools.partial(write_hf_config, hf_path, self.processing_class, self.hf_config, self.model_path)
        export = HFExport(self.bridge, self.model, hf_path, self.bridge_save_kwargs, config)
        if in_rank:
            export.timed = functools.partial(self._timed, announce=True)
        return export

    def _continue_in_background(self, save: SaveReport, request: AsyncRequest) -> SaveReport:
        """Fork the writer's background part and give training back; ``finalize_async_save`` completes the save."""
        if self._async_queue is None:
            self._async_queue = megatron_core.async_calls_queue()
        self._timed("fork", snapshot_save.fork, self._async_queue, request)
        save.state = SaveState.WRITING
        save.blocked_seconds = time.monotonic() - save.started
        self._log(f"step {save.global_step}: returned after {save.blocked_seconds:.2f}s; {save.mode.value} runs in the background")
        return save

    def _finish_save(self, save: SaveReport) -> SaveReport:
        """Every part is on disk: rank 0 writes the metadata (``transformer_config.json``, ``ckpt_contents.json``
        last), then upstream's retention."""
        self._timed("metadata", self._write_metadata, save, announce=True)
        save.state = SaveState.COMPLETED
        self._log(f"wrote step {save.global_step} to {save.local_path} in {time.monotonic() - save.started:.1f}s ({save.mode.value})")
        self.register_checkpoint(save.local_path, save.max_ckpt_to_keep)
        if save.blocked_seconds is None:  # a sync save held training throughout
            save.blocked_seconds = time.monotonic() - save.started
        return save

    def _write_metadata(self, save: SaveReport) -> None:
        if self.rank != 0:
            return
        shutil.rmtree(os.path.join(save.local_path, snapshot_save.OUTCOME_DIRNAME), ignore_errors=True)
        if self.should_save_extra:
            self._save_transformer_config(save.local_path)
        self._write_checkpoint_manifest(save.local_path, save.global_step)

    @property
    def async_save_pending(self) -> bool:
        """Whether a save's background write is still waiting for ``finalize_async_save`` (its state ``WRITING``)."""
        return self.last_save is not None and self.last_save.state is SaveState.WRITING

    def finalize_async_save(self, blocking: bool = True) -> FinalizeState:
        """Complete the pending async save once its background write is durable; all ranks call this.

        Returns ``FinalizeState``: ``WRITING`` (with ``blocking=False``, the write still runs), ``DONE`` (this
        call completed it) or ``NOTHING_PENDING``. A failed write raises ``CheckpointError``, and what its
        writers left unread is dropped (``megatron_core.drain_write_results``), so the next save's metadata is
        made from its own writes. Whoever commits a save asks ``completed_save`` once this stops answering
        ``WRITING``: a second caller may have taken the ``DONE``, or the failure.
        """
        save = self.last_save
        if not self.async_save_pending:
            return FinalizeState.NOTHING_PENDING
        with self._failure_reported(save):  # a failure of the write or of the metadata after it: FAILED
            try:
                if not self._timed("background_wait", self._async_queue.maybe_finalize_async_calls, blocking):
                    return FinalizeState.WRITING
            except BaseException:
                megatron_core.drain_write_results()  # megatron's finalize of each write, which reads them, never ran
                raise
            self._finish_save(save)
        return FinalizeState.DONE

    def completed_save(self, local_path: str) -> SaveReport:
        """The report of this manager's save into ``local_path`` once every part of it is on disk; else
        ``CheckpointError`` in one line (still writing, its write failed, or a later save replaced it). What
        a caller committing ``local_path`` checks, rather than reading "nothing pending" as "completed"."""
        save = self.last_save
        if save is None or os.path.abspath(save.local_path) != os.path.abspath(local_path):
            raise CheckpointError(
                f"{local_path} is not the latest save of this manager, which cannot say whether it completed: "
                "call engine.finalize_checkpoint() before saving through the manager directly"
            )
        if save.state is SaveState.WRITING:
            raise CheckpointError(f"the save of step {save.global_step} into {local_path} is still writing: call finalize_async_save first")
        if not save.completed:
            raise CheckpointError(f"the save of step {save.global_step} into {local_path} did not complete: its write failed ({save.failure})")
        return save

    @contextlib.contextmanager
    def _failure_reported(self, save: SaveReport) -> Iterator[None]:
        """Turn any failure of ``save`` into one CheckpointError that names the step and the cause."""
        try:
            yield
        except (Exception, DistributedCheckpointException) as exc:  # the latter derives from BaseException
            found = os_errors.explain(exc, save.local_path)  # ENOSPC or another errno, named with the path
            cause = found.describe(save.local_path) if found else (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            if found and isinstance(exc, PeerFailure):  # which rank failed, and at what
                cause = f"{exc.failed}: {cause}"
            save.failure, save.state = f"{type(exc).__name__}: {cause}", SaveState.FAILED
            raise CheckpointError(f"saving step {save.global_step} to {save.local_path} failed ({type(exc).__name__}: {cause})") from exc

    @dist_writer.collection_paused()  # no full collection of the trainer's heap set off by this phase's objects
    def _save_dist_checkpoints(self, local_path: str, in_background: bool) -> list[AsyncRequest] | None:
        """Write (or, ``in_background``, plan) the dist checkpoints; return the writes still to run."""
        self.on_save_phase("dist_checkpoint")
        requests = []
        parts = self._dist_parts()
        for content, state, path in parts.build(local_path):
            # One strategy per content and structure, kept across saves: from the second save of the same
            # structure on, the plan is reused instead of gathering and checking every rank's plan again
            # (dist_writer), and the access-integrity check (each shard written exactly once) is needed
            # only on its first save. The reused plan lists the items to write, so a changed
            # structure (an optimizer that gained state) must start afresh.
            structure = sharded_structure(state)
            known = self._save_strategies.get(content)
            fresh = known is None or known[0] != structure
            strategy = dist_writer.InRankSaveStrategy(fsync=False) if fresh else known[1]  # in-rank; the sealer fsyncs
            if content == "optimizer":
                self._planned_optimizer_layout = optimizer_layout(self.optimizer)
            request = strategy.save_agreeing_on_rank_zero_files(
                save_dist_checkpointing,
                sharded_state_dict=state,
                ckpt_path=path,
                async_save=in_background,
                content_metadata=parts.metadata,
                sharded_strategy=strategy,
                validate_access_integrity=fresh,
            )
            self._save_strategies[content] = (structure, strategy)
            if request is not None:
                requests.append(request)
        # written in the rank, each content's save has ended on every rank together (the writes' agreement,
        # then megatron's finalize and the barrier its save ends with): no barrier of its own here
        self.on_save_phase("after_dist_checkpoint")
        return requests if in_background else None

    def _dist_contents(self) -> list[str]:
        """The dist checkpoints this manager saves."""
        wanted = {"model": self.should_save_dist_ckpt_model, "optimizer": self.should_save_optimizer, "extra": self.should_save_extra}
        return [content for content in layout.DIST_CKPT_DIRS if wanted[content]]

    def wait_for_hf_config(self, config_failure: BaseException | None = None) -> None:
        """Fix 2: no rank may start the bridge's HF weight save until rank 0's config is on disk. Public so
        that tests can show what a save without it gets wrong, and where a rank waits for rank 0. A barrier over
        the group the export runs over (its own one beside the dist write) that carries rank 0's outcome of the
        config write (``config_failure``): when it failed, every rank raises here (``RankComm.agree``)."""
        comm = self.last_save.hf_comm if self.last_save is not None and self.last_save.hf_comm is not None else RankComm()
        comm.agree(config_failure, "write the HF config")

    def _timed(self, phase: str, fn: Callable[..., Any], *args: Any, announce: bool = False) -> Any:
        """Run one phase of the current save, adding its time to the save's report; ``announce``: tell
        ``on_save_phase`` first."""
        if announce:
            self.on_save_phase(phase)
        start = time.monotonic()
        result = fn(*args)
        seconds = time.monotonic() - start
        if self.last_save is not None:
            self.last_save.phase_seconds[phase] = self.last_save.phase_seconds.get(phase, 0.0) + seconds
        self._log(f"  {phase}: {seconds:.2f}s")
        return result

    @staticmethod
    def _read_dist_checkpoint(**kwargs: Any) -> dict:
        """A dist checkpoint read through ``load_dist_checkpointing`` as this module holds it at call time: upstream's
        tests patch it here (the load methods live in ``megatron_checkpoint_load``, which does not import this module)."""
        return load_dist_checkpointing(**kwargs)

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)

"""How ``MegatronCheckpointManager`` loads a step (upstream's v2 layout): model, optimizer + LR schedule, RNG.

The checks of the step come before, on every rank together (``verl.utils.checkpoint.resume_check.check_before_load``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from verl.utils.checkpoint import layout
from verl.utils.checkpoint.checkpoint_manager import not_implemented_unless_default
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.integrity import (
    checksums_in,
    manifest_checksums,
    read_saved_layout,
    verify_bulk_checksums,
    verify_manifest,
)
from verl.utils.checkpoint.megatron_optimizer_state import (
    initialize_distributed_optimizer_state,
    optimizer_state_from_loaded,
    placeholder_optimizer_state,
    restore_adam_steps,
)
from verl.utils.checkpoint.megatron_state_dicts import RANK_RNG_STATE_KEY, current_parallel_layout
from verl.utils.internals import megatron_core
from verl.utils.megatron_utils import get_legacy_dist_checkpoint_path, get_legacy_hf_model_checkpoint_path
from verl.utils.rank_comm import RankComm, describe


class MegatronLoads:
    """The manager's load methods (a mixin over its model, optimizer, scheduler, bridge and builders; the manager
    gives ``_read_dist_checkpoint``, upstream's ``load_dist_checkpointing`` seam on its own module)."""

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        """Load the contents ``load_contents`` names from the step at ``local_path`` (upstream's v2 layout).

        The model comes from the HF folder through the bridge (use_dist_checkpointing=False) or from
        ``model/dist_ckpt``; the optimizer, LR scheduler and RNG from their dist checkpoints. Two phases: every
        part is read first, into buffers of its own, each file checksummed against the step's manifest from the
        very bytes read (``verl.utils.megatron.dist_checkpointing``); all ranks then agree that every read was
        whole (``RankComm.agree``), and only then is any of it applied to the model, optimizer, schedule and RNG.
        A damaged file, or any error of a read on one rank, fails every rank together, naming it, with nothing
        applied; every key the model holds must have been read before the agreement too. An error while
        applying fails every rank together as well, saying the state is partly applied (restart). Integrity checks of the step
        itself (manifest, data-only metadata, HF completeness, model identity) belong before this call:
        ``verl.utils.checkpoint.resume_check.check_before_load``.
        """
        not_implemented_unless_default(hdfs_path=hdfs_path, del_local_after_load=del_local_after_load)
        self.finalize_async_save(blocking=True)  # a pending save is of the state about to be replaced
        if not os.path.isdir(local_path):
            raise FileNotFoundError(f"checkpoint {local_path} does not exist (or is not a directory)")
        self._raise_for_old_layout(local_path)
        start = time.monotonic()
        try:
            applies, error = self._read_parts(local_path)
            RankComm().agree(error, f"read {local_path}")
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"cannot load {local_path}; nothing was loaded. {describe(exc)}") from exc
        apply_error: BaseException | None = None
        try:
            for apply in applies:
                apply()
        except (Exception, CheckpointException) as exc:
            apply_error = exc
        try:
            RankComm().agree(apply_error, f"apply {local_path}")
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"cannot load {local_path}: it was read whole, but applying it failed part way, so this run's model, "
                f"optimizer, schedule and RNG are partly from the step; restart the run. {describe(exc)}"
            ) from exc
        self._log(f"loaded {local_path} ({', '.join(self.checkpoint_load_contents)}) in {time.monotonic() - start:.1f}s")

    def _read_parts(self, local_path: str) -> tuple[list[Callable[[], None]], BaseException | None]:
        """Every part ``load_contents`` names, read (every rank takes every read: they are collectives) and
        checksummed, nothing applied: what applies each, and the error of a read on this rank to report (any
        error, torch's ``CheckpointException`` too, so that the agreement carries it rather than a peer waiting):
        the model's where it failed, else the first of the others."""
        error: BaseException | None = None
        try:
            metadata = self._load_content_metadata(local_path)
            checksums = _step_checksums(local_path)
        except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
            error = exc
        # every rank agrees here, the same once per load, before the reads (collectives) that need both
        RankComm().agree(error, f"read {local_path}")
        applies: list[Callable[[], None]] = []
        reads = []
        hf_weights = None
        if self.should_load_dist_ckpt_model:
            reads.append(lambda: self._read_model_from_dist_checkpoint(local_path, metadata, checksums))
        elif self.should_load_hf_model:
            hf_weights = os.path.relpath(layout.hf_path(local_path), local_path) if checksums is not None else None
            applies.append(lambda: self._load_model_as_hf_via_bridge(layout.hf_path(local_path)))
        if self.should_load_optimizer:
            reads.append(lambda: self._read_optimizer(local_path, metadata, checksums))
        if self.should_load_extra:
            reads.append(lambda: self._read_extra(local_path, checksums))
        # The bridge reads the HF weights straight into the model when applied, so their checksums come before any
        # apply: in a read of their own (the bridge's then finds them in the page cache), beside the other reads
        # (the pool starts its thread at the submit only).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-weights-checksums") as beside:
            hf_checked = beside.submit(verify_bulk_checksums, local_path, hf_weights) if hf_weights is not None else None
            for read in reads:
                try:
                    applies.append(read())
                except (Exception, CheckpointException) as exc:
                    error = error or exc
            try:
                if hf_checked is not None:
                    hf_checked.result()
            except (Exception, CheckpointException) as exc:
                error = exc  # the model's, the first part
        return applies, error

    @staticmethod
    def _has_checkpoint_files(path: str) -> bool:
        return os.path.isdir(path) and any(os.scandir(path))

    @classmethod
    def _raise_for_old_layout(cls, local_path: str) -> None:
        """A step of the layout before model/, optimizer/ and extra/ were split cannot load here: say how to migrate."""
        if any(os.path.isdir(os.path.join(local_path, sub)) for sub in ("model", "optimizer", "extra")):
            return
        for legacy in (get_legacy_dist_checkpoint_path(local_path), get_legacy_hf_model_checkpoint_path(local_path)):
            if cls._has_checkpoint_files(legacy):
                raise RuntimeError(
                    f"{local_path} has the deprecated Megatron checkpoint layout ({os.path.basename(legacy)}/ at its top "
                    "level); this loader reads model/, optimizer/ and extra/ subdirectories. Convert it with upstream "
                    "verl's scripts/migrate_megatron_checkpoint_layout.py, or load a checkpoint saved since."
                )

    def _load_content_metadata(self, local_path: str) -> dict:
        """The content metadata the step was saved with (what its optimizer state's layout depends on)."""
        for content in layout.DIST_CKPT_DIRS:
            path = layout.dist_path(local_path, content)
            if self._has_checkpoint_files(path):
                saved = dist_checkpointing.load_content_metadata(checkpoint_dir=path)
                if saved is not None:
                    return saved
                break
        return self._build_sharded_state_dict_metadata()

    def _read_model_from_dist_checkpoint(self, local_path: str, metadata: dict, checksums: dict | None) -> Callable[[], None]:
        path = layout.dist_path(local_path, "model")
        model_state = self._build_model_sharded_state_dict(metadata)
        checkpointed = {key: set(state) for key, state in model_state.items()}
        loaded = self._read_dist_checkpoint(
            sharded_state_dict=into_own_buffers(dict(model_state)), ckpt_dir=path, **_checked(checksums, local_path, path, own_targets=True)
        )
        for index in range(len(self.model)):
            key = "model" if len(self.model) == 1 else f"model{index}"
            if key not in loaded:
                raise CheckpointError(f"{path} holds no '{key}' state (saved with use_dist_checkpointing=False?)")
            held = unwrap_model(self.model[index]).state_dict().keys()
            _raise_unless_every_key_read(path, [k for k in held if k not in loaded[key]], checkpointed[key])

        def apply() -> None:
            for index, chunk in enumerate(self.model):
                key = "model" if len(self.model) == 1 else f"model{index}"
                if len(self.model) > 1:
                    mpu.set_virtual_pipeline_model_parallel_rank(index)
                _load_chunk_strictly(chunk, loaded[key], checkpointed[key], path)

        return apply

    def _load_model_as_hf_via_bridge(self, hf_model_path: str) -> None:
        self.bridge.load_weights(self.model, hf_model_path)

    def _read_optimizer(self, local_path: str, metadata: dict, checksums: dict | None) -> Callable[[], None]:
        path = layout.dist_path(local_path, "optimizer")
        built_bounds = [(group.get("max_lr"), group.get("min_lr")) for group in self.optimizer.param_groups]
        if self.use_distributed_optimizer:
            initialize_distributed_optimizer_state(self.optimizer)
        with placeholder_optimizer_state(self.optimizer):
            request = self._build_optimizer_state_dict(self._build_model_sharded_state_dict(metadata), metadata, is_loading=True)
        loaded = self._read_dist_checkpoint(
            sharded_state_dict=into_own_buffers(request), ckpt_dir=path, **_checked(checksums, local_path, path, own_targets=True)
        )
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path} holds no optimizer state")
        return lambda: self._apply_optimizer(path, request, loaded, built_bounds)

    def _apply_optimizer(self, path: str, request: dict, loaded: dict, built_bounds: list[tuple]) -> None:
        if self.use_distributed_optimizer:
            with torch.no_grad():  # the DP-reshardable loader copies into leaf main params in place
                self.optimizer.load_state_dict(loaded["optimizer"])
            restore_adam_steps(self.optimizer, loaded["optimizer"])
        else:
            self.optimizer.load_state_dict(optimizer_state_from_loaded(request["optimizer"], loaded["optimizer"]))
        if self.lr_scheduler is not None and "lr_scheduler" not in loaded:  # saved without a scheduler
            if self.rank == 0:
                warnings.warn(f"{path} holds no lr_scheduler state: the LR schedule starts again from its first step", stacklevel=2)
        elif self.lr_scheduler is not None:
            self._load_lr_scheduler(loaded["lr_scheduler"], built_bounds)

    def _load_lr_scheduler(self, state: dict, built_bounds: list[tuple]) -> None:
        """Restore the schedule's position on every load (upstream loads it only with
        ``use_checkpoint_opt_param_scheduler``, so a resume restarts warmup and decay: verl #7953).

        The flag keeps upstream's meaning, megatron's: True takes the schedule's settings (max/min LR, warmup,
        decay steps and style, weight-decay increment) from the checkpoint, False keeps this run's (the config's).
        megatron 0.16 reads max/min LR from each parameter group (``built_bounds``: as this run's optimizer was
        built; the optimizer's load may have replaced them with the saved groups'), so they follow the same choice:
        a group at this run's scheduler bounds gets the chosen ones, a group of its own (a decoupled LR) keeps
        this run's. megatron's ``load_state_dict`` adds the saved step count to the scheduler's own, so it is reset
        first: a load sets the position, also into a scheduler that already stepped."""
        scheduler = self.lr_scheduler
        if not hasattr(scheduler, "override_opt_param_scheduler"):  # not megatron's: its own load_state_dict
            scheduler.load_state_dict(state)
            return
        flags = (scheduler.use_checkpoint_opt_param_scheduler, scheduler.override_opt_param_scheduler)
        configured = (scheduler.max_lr, scheduler.min_lr)
        from_checkpoint = self.use_checkpoint_opt_param_scheduler
        scheduler.use_checkpoint_opt_param_scheduler, scheduler.override_opt_param_scheduler = from_checkpoint, not from_checkpoint
        scheduler.num_steps = 0
        try:
            scheduler.load_state_dict(state)
        finally:
            scheduler.use_checkpoint_opt_param_scheduler, scheduler.override_opt_param_scheduler = flags
        chosen = (scheduler.max_lr, scheduler.min_lr)
        for group, bounds in zip(self.optimizer.param_groups, built_bounds, strict=True):
            for key, built, run_value, value in zip(("max_lr", "min_lr"), bounds, configured, chosen, strict=True):
                if built is not None:
                    group[key] = value if built == run_value else built
        scheduler.step(increment=0)  # the groups' LR and weight decay at the restored position

    def _read_extra(self, local_path: str, checksums: dict | None) -> Callable[[], None]:
        """Each rank's own RNG streams when the step is ours and of this exact layout; upstream's per-(PP, TP)
        ones for an upstream step of this PP/TP; none (a warning) at another PP/TP, where they have no meaning."""
        saved, now = read_saved_layout(local_path), current_parallel_layout()
        if saved is not None and any(saved.get(k) != now[k] for k in ("pp", "tp")):
            if self.rank == 0:
                warnings.warn(f"{local_path} was saved at {saved}, this run is {now}: RNG states are not restored", stacklevel=2)
            return lambda: None
        path = layout.dist_path(local_path, "extra")
        per_rank = saved == now
        loaded = self._read_dist_checkpoint(
            sharded_state_dict=self._build_extra_state_dict(per_rank), ckpt_dir=path, **_checked(checksums, local_path, path)
        )
        if "rng_state" not in loaded:
            raise CheckpointError(f"{path} holds no rng_state")
        return lambda: self.load_rng_states([loaded[RANK_RNG_STATE_KEY]] if per_rank else loaded["rng_state"])


def _step_checksums(local_path: str) -> dict[str, str] | None:
    """The manifest's checksums of the step; None only for a step saved by upstream verl. A step of ours whose
    manifest is gone (since its check) is refused in one line, never loaded unchecksummed."""
    checksums = manifest_checksums(local_path)
    if checksums is None:
        verify_manifest(local_path, required=False, checksums=False)  # False for upstream's step, else the refusal
    return checksums


def _checked(checksums: dict | None, local_path: str, directory: str, own_targets: bool = False) -> dict:
    """The load's ``checksums`` argument for ``directory`` of the step, and ``own_targets`` for a state dict of
    ``into_own_buffers`` (none for a step without a manifest, so a patched ``load_dist_checkpointing`` of
    upstream's signature keeps working for upstream's steps)."""
    if checksums is None:
        return {}
    return {"checksums": checksums_in(checksums, os.path.relpath(directory, local_path))} | ({"own_targets": True} if own_targets else {})


def into_own_buffers(sharded_state_dict: dict) -> dict:
    """``sharded_state_dict`` with every tensor it would load into replaced by a new host buffer of the same
    shape and dtype: the read fills those, and the model's and optimizer's own tensors change only when the
    loaded state is applied (after every rank agreed that every file read was whole). A factory whose pieces
    the read leaves side by side in its buffer is merged as a view of it (``megatron_core.merge_without_copy``)."""

    def own(value: Any) -> Any:
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor):
            value.data = torch.empty_like(value.data, device="cpu")
        if isinstance(value, ShardedTensorFactory):
            value.merge_fn = megatron_core.merge_without_copy(value.merge_fn)
        return value

    dict_list_map_inplace(own, sharded_state_dict)
    return sharded_state_dict


def _beyond_uncheckpointed_extra_state(keys: list[str], checkpointed: set[str]) -> list[str]:
    """``keys`` but the ``_extra_state`` entries the model's sharded state dict (``checkpointed``) leaves out:
    megatron-core's TE attention keeps its FP8 metadata out of checkpoints by design."""
    return [k for k in keys if not (k.endswith("._extra_state") and k not in checkpointed)]


def _raise_unless_every_key_read(path: str, unread: list[str], checkpointed: set[str]) -> None:
    """Before any rank applies the read state: every key the model holds was read, but an ``_extra_state`` its
    sharded state dict leaves out. A key read beyond the model's is the strict apply's to judge (a grouped TE
    linear's per-GEMM ``_extra_state<i>`` are merged back by its own load hook there)."""
    unread = _beyond_uncheckpointed_extra_state(unread, checkpointed)
    if unread:
        raise CheckpointError(
            f"{path} left {len(unread)} key(s) of this model unread ({unread[:5]}{'...' if len(unread) > 5 else ''}): "
            "its sharded state dict does not request them, so Megatron shards cannot restore this model; save and load it "
            "with actor_rollout_ref.actor.megatron.use_dist_checkpointing=False (its weights as HF files)"
        )


def _load_chunk_strictly(chunk: torch.nn.Module, state: dict, checkpointed: set[str], path: str) -> None:
    """``load_state_dict`` strict in all but one case: an ``_extra_state`` the model's own sharded state dict
    leaves out (megatron-core's TE attention does, for its FP8 metadata) is not in the checkpoint by design,
    so its absence is no damage. Any other missing or unexpected key fails the load, named."""
    result = unwrap_model(chunk).load_state_dict(state, strict=False)  # megatron's DDP returns no result
    _raise_unless_fits(path, result.missing_keys, result.unexpected_keys, checkpointed)


def _raise_unless_fits(path: str, missing: list[str], unexpected: list[str], checkpointed: set[str]) -> None:
    """The model's keys ``missing`` from the loaded state and the state's ``unexpected`` ones fail the load, named,
    but an ``_extra_state`` the model does not checkpoint (``checkpointed``: the keys of its sharded state dict)."""
    missing = _beyond_uncheckpointed_extra_state(missing, checkpointed)
    unexpected = list(unexpected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )

"""MegatronCheckpointManager with upstream verl's constructor, flags, builders, layout and ``ckpt_contents.json``.

A save is one pipeline; ``save_checkpoint``'s body lists its phases in order:

1. staging: the worker hands in its staging directory (``verl.utils.checkpoint.commit.prepare_staging``);
   the async mode is chosen once (``AsyncMode``);
2. finite check: no parameter or Adam moment holds NaN/Inf (``verl.utils.checkpoint.finite``), checked before
   anything is written or removed; then, in sync mode, upstream's pre-save retention;
3. dist parts (``save_dist_checkpointing``): the optimizer + LR scheduler, the RNG state (extra), and the model
   only with ``use_dist_checkpointing=True``; upstream's default keeps the model as HF only;
4. rank 0 writes the HF config, tokenizer and generation config into ``model/huggingface``;
5. a barrier (``wait_for_hf_config``): no rank starts the HF weights before the config is on disk (verl #6821);
6. HF weights: every rank takes part in the bridge's save;
7. verify: the HF folder holds every tensor its config implies (the commit step, ``commit.commit_checkpoint``);
8. metadata: rank 0 writes ``transformer_config.json`` and, last, ``ckpt_contents.json``;
9. commit: manifest, fsync, one atomic rename (the commit step);
10. retention: upstream's ``max_ckpt_to_keep``, never removing the tracked step.

Steps 2-6 and 8 are this manager's (8 runs when the parts are on disk, before the commit step's 7 and 9: the
order on disk is the same, since the commit step renames the directory only after both). The async mode decides
only where steps 2-6 run: ``SYNC`` all in the rank; ``BACKGROUND_WRITE`` the dist parts planned in the rank,
written by a process forked from it while training goes on; ``SNAPSHOT`` (from the third save of one sharded
structure on, when megatron's save plan needs no collective, on the CPU runtime) the dist parts planned and
written by the fork. In both async modes on the CPU runtime (where a fork sees the tensors) the fork also runs
the finite check on its copy-on-write image, and steps 4-6 when the bridge saves in parallel (the barrier is
then the forks' own). ``finalize_async_save`` completes the save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException as DistributedCheckpointException

from verl.utils import process_lifetime
from verl.utils.checkpoint import finite, sealing, snapshot_save
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, config_get
from verl.utils.checkpoint.commit import current_parallel_layout
from verl.utils.checkpoint.integrity import CheckpointError, files_under, read_saved_layout
from verl.utils.checkpoint.mbridge_config import save_weights_kwargs
from verl.utils.checkpoint.megatron_optimizer_state import (
    initialize_distributed_optimizer_state,
    optimizer_state_from_loaded,
    restore_adam_steps,
)
from verl.utils.device import get_device_name, get_torch_device
from verl.utils.fs import atomic_write_text, local_mkdir_safe
from verl.utils.internals import megatron_core
from verl.utils.megatron.dist_checkpointing import load_dist_checkpointing, save_dist_checkpointing
from verl.utils.megatron_utils import (
    get_checkpoint_contents_manifest_path,
    get_extra_dist_checkpoint_path,
    get_hf_model_checkpoint_path,
    get_legacy_dist_checkpoint_path,
    get_legacy_hf_model_checkpoint_path,
    get_model_dist_checkpoint_path,
    get_optimizer_dist_checkpoint_path,
    get_transformer_config_checkpoint_path,
)
from verl.utils.rank_comm import ForkedRankComm, forked_groups_possible

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

CKPT_CONTENTS_SCHEMA_VERSION = 2  # upstream's ckpt_contents.json schema
RANK_RNG_STATE_KEY = "rank_rng_state"  # ours, beside upstream's rng_state in extra/dist_ckpt


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def _dist_dir(local_path: str, content: str) -> str:
    """``<step>/<content>/dist_ckpt`` without creating it (upstream's path helpers create directories: a load
    must leave the step as it found it)."""
    return os.path.join(local_path, content, "dist_ckpt")


_DIST_CHECKPOINT_PATHS = {  # content -> where its dist checkpoint goes
    "model": get_model_dist_checkpoint_path,
    "optimizer": get_optimizer_dist_checkpoint_path,
    "extra": get_extra_dist_checkpoint_path,
}


class AsyncMode(str, enum.Enum):
    """Where a save's dist checkpoints and HF export run; chosen per save (``MegatronCheckpointManager.save_mode``)."""

    SYNC = "sync"  # everything in the rank before save_checkpoint returns
    BACKGROUND_WRITE = "background_write"  # planned in the rank; a forked process writes the dist-checkpoint files
    SNAPSHOT = "snapshot"  # a forked process plans and writes them and does the HF export (a reusable plan, on host)


@dataclasses.dataclass
class SaveReport:
    """What one save did: returned by ``save_checkpoint`` and kept as ``last_save``. ``phase_seconds`` holds the
    rank's time per phase (``dist_checkpoints``, ``hf_config``, ``hf_weights``, ``fork``, ``background_wait``,
    ``metadata``, ``finite_check`` when the rank ran it; the commit step adds ``hf_verify`` and ``commit``,
    ``MegatronActor`` its ``staging``, which precedes this call); ``blocked_seconds`` how long save_checkpoint
    held training; ``checked_in_background`` whether the fork ran the NaN/Inf check (an async save on the CPU
    runtime, where the fork sees the tensors), ``hf_weights_in_background`` whether it wrote the HF config and
    weights (that, and a bridge that saves in parallel)."""

    local_path: str
    global_step: int
    mode: AsyncMode
    max_ckpt_to_keep: int | None = None
    checked_in_background: bool = False
    sealer: sealing.Sealer | None = None  # a sync save's dist-checkpoint files, being hashed and fsynced since written
    hf_weights_in_background: bool = False
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    blocked_seconds: float | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    completed: bool = False


def _not_implemented_unless_default(**given: Any) -> None:
    """Upstream options this overlay does not implement: refuse anything but their default, by name."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(
                f"MegatronCheckpointManager: {name}={value!r} is not supported by this overlay (PEFT, Megatron-FSDP, "
                f"Megatron-Bridge providers and HDFS copies are upstream-only); leave {name} at its default"
            )


def _optimizer_layout(optimizer) -> tuple:
    """What the optimizer's sharded structure depends on, cheap to read: each state entry's keys and shapes."""
    layout = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", chained)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                state = inner.state.get(param, {})
                layout.append(tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in sorted(state.items())))
    return tuple(layout)


def _sharded_structure(state: dict) -> tuple:
    """What megatron's save plan is made of: each sharded item's kind, key, place, shape and dtype."""
    items = []
    for value in nested_values(state):
        if not isinstance(value, ShardedBase):
            continue
        data = getattr(value, "data", None)
        shape = (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None
        place = tuple(str(getattr(value, name, None)) for name in ("global_shape", "global_offset", "replica_id", "flattened_range"))
        items.append((type(value).__name__, value.key, place, shape))
    return tuple(items)


def _without_view_copies(state: dict) -> dict:
    """``state`` with every contiguous host tensor that is a view into a larger storage given a storage
    of exactly its own bytes, aliasing the same memory.

    megatron's writer clones each such view before writing it (``torch.save`` of a view writes its
    whole storage): the per-expert slices of the grouped MLP weights, the gate / up halves of every
    SwiGLU ``linear_fc1`` and their Adam moments, ~0.3x of a rank's state held at once. The aliases
    write the same bytes without that copy. Factories are applied first, since their views are made then.
    """
    apply_factories(state)
    for value in nested_values(state):
        data = getattr(value, "data", None)
        if not isinstance(value, ShardedTensor) or not isinstance(data, torch.Tensor) or data.device.type != "cpu":
            continue
        nbytes = data.numel() * data.element_size()
        if not data.is_contiguous() or data.untyped_storage().nbytes() == nbytes:
            continue
        start = data.storage_offset() * data.element_size()
        own = data.untyped_storage()[start : start + nbytes]
        value.data = torch.empty(0, dtype=data.dtype).set_(own, 0, data.shape, data.stride())
    return state


def _planned_writes(requests: list[AsyncRequest]) -> Callable[[], None] | None:
    """The writes of ``requests``, one after another in the process that calls the result (None: nothing to write).

    Every torch_dist writer of a process reports through the same results queue, so the writes must
    finish in the order their finalize functions read the results: concurrent processes could swap
    them. Tensors are staged (``preload_fn``: device -> host on an accelerator) here, before the fork.
    """
    calls = [
        (request.async_fn, megatron_core.preloaded_args(request), dict(request.async_fn_kwargs))
        for request in requests
        if request.async_fn is not None
    ]

    def write_all() -> None:
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)

    return write_all if calls else None


def _in_one_fork(requests: list[AsyncRequest]) -> AsyncRequest:
    """One request that runs the writes of ``requests`` in a single forked process, which ends with its rank."""
    writes = _planned_writes(requests)

    def run() -> None:
        snapshot_save.fail_when_a_writer_dies(snapshot_save.report_to_stderr)
        writes()

    return megatron_core.async_request(run if writes else None, (), [fn for request in requests for fn in request.finalize_fns])


class MegatronCheckpointManager(BaseCheckpointManager):
    """Saves and loads a Megatron model, its optimizer, LR scheduler and RNG state, with upstream verl's interface.

    ``use_dist_checkpointing`` picks the format of the ``model`` content: False (upstream's default) keeps it
    as HF weights through ``bridge`` (any object with mbridge's ``save_weights`` / ``load_weights``), True as
    Megatron shards under ``model/dist_ckpt``; ``hf_model`` adds the HF export to the latter. Optimizer, LR
    scheduler and RNG always go through dist checkpoints. ``checkpoint_config`` keys: ``save_contents``,
    ``load_contents``, ``async_save`` (see ``finalize_async_save``), ``mbridge_config`` (keyword arguments of the
    bridge's ``save_weights``).
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
        _not_implemented_unless_default(use_megatron_fsdp=use_megatron_fsdp, provider=provider, peft_cls=peft_cls)
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
        self.async_save = bool(config_get(checkpoint_config, "async_save", False))
        self._check_bridge_for_hf_contents()
        mbridge_config = config_get(checkpoint_config, "mbridge_config", None) or {}
        # the keyword arguments of every HF weight save (ValueError naming an entry the bridge does not take)
        self.bridge_save_kwargs = save_weights_kwargs(bridge.save_weights, mbridge_config) if bridge is not None else {}
        # Made at the first async save (megatron_core.async_calls_queue). Not persistent: each save forks its
        # writer, whose copy-on-write image of this process is the snapshot of the tensors (on CPU megatron's
        # "copy to host" returns the live tensors themselves).
        self._async_queue = None
        self._pending: SaveReport | None = None
        self.last_save: SaveReport | None = None  # the latest save's report (public: tests and the benchmark read it)
        self._save_strategies: dict[str, tuple[tuple, TorchDistSaveShardedStrategy]] = {}
        self._planned_optimizer_layout: tuple | None = None  # at the optimizer checkpoint's last planning here
        self._forked_saves = 0

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

    # ------------------------------------------------------------------ state dict builders

    def _build_sharded_state_dict_metadata(self) -> dict:
        """The content metadata megatron's ``sharded_state_dict`` methods take, stored with each checkpoint."""
        metadata: dict[str, Any] = {}
        if self.use_distributed_optimizer:
            megatron = config_get(config_get(self.config, self.role, self.config), "megatron", None)
            if config_get(megatron, "dist_ckpt_optim_fully_reshardable", False):
                metadata["distrib_optim_sharding_type"] = "fully_reshardable"
                metadata["distrib_optim_fully_reshardable_mem_efficient"] = bool(
                    config_get(megatron, "distrib_optim_fully_reshardable_mem_efficient", False)
                )
            else:
                metadata["distrib_optim_sharding_type"] = "dp_reshardable"
        metadata["singleton_local_shards"] = False
        metadata["chained_optim_avoid_prefix"] = True
        return metadata

    def _build_model_sharded_state_dict(self, metadata: dict) -> dict:
        """Every model chunk's sharded state dict ("model", or "model0".. with virtual pipeline stages)."""
        state = {}
        model_metadata = {**metadata, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
        for index, chunk in enumerate(self.model):
            if len(self.model) > 1:
                mpu.set_virtual_pipeline_model_parallel_rank(index)
            module = chunk.module if hasattr(chunk, "module") else chunk
            state["model" if len(self.model) == 1 else f"model{index}"] = module.sharded_state_dict(metadata=model_metadata)
        return state

    def _build_optimizer_state_dict(self, model_sharded_state_dict: dict, metadata: dict, is_loading: bool = False) -> dict:
        """The optimizer's sharded state (mapped onto the model's shards, which it reads only) and the scheduler's."""
        state = {"optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def _build_extra_state_dict(self, per_rank: bool = True) -> dict:
        """Upstream's ``rng_state`` (one per PP/TP rank, from data-parallel rank 0) and, ours, every rank's own
        (``RANK_RNG_STATE_KEY``), so a resume at the same layout restores each rank's streams exactly.
        Upstream's loader reads only the first."""
        state = {"rng_state": self.get_rng_state()}
        if per_rank:
            own = self.get_rng_state(use_dist_ckpt=False)[0]
            state[RANK_RNG_STATE_KEY] = ShardedObject(RANK_RNG_STATE_KEY, own, (self.world_size,), (self.rank,), replica_id=0)
        return state

    def get_rng_state(self, use_dist_ckpt: bool = True, data_parallel_random_init: bool = False):
        """This rank's RNG states; as a ShardedObject over (PP, TP) with one replica per data-parallel group."""
        state = {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
        if get_device_name() != "cpu":
            state[f"{get_device_name()}_rng_state"] = get_torch_device().get_rng_state()
        states = [state]
        if data_parallel_random_init and mpu.get_data_parallel_world_size() > 1:
            states = [None] * mpu.get_data_parallel_world_size()
            torch.distributed.all_gather_object(states, state, group=mpu.get_data_parallel_group())
        if not use_dist_ckpt:
            return states
        return ShardedObject(
            "rng_state",
            states,
            (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
            (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
            replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),
        )

    def load_rng_states(self, rng_states: list, data_parallel_random_init: bool = False, use_dist_ckpt: bool = True) -> None:
        state = rng_states[mpu.get_data_parallel_rank()] if data_parallel_random_init else rng_states[0]
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        device_key = f"{get_device_name()}_rng_state"
        if get_device_name() != "cpu" and device_key in state:
            get_torch_device().set_rng_state(state[device_key])
        if not state["rng_tracker_states"]:
            raise CheckpointError("the checkpoint's RNG state holds no model-parallel RNG tracker states")
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> SaveReport:
        """Write this step's parts into ``local_path`` (created if needed; the worker passes its staging directory).

        The body is the pipeline. The async mode (``save_mode``) is chosen once, up front, and decides only where
        the dist parts and the HF weights run: here (``SYNC``); planned here, written by a forked process
        (``BACKGROUND_WRITE``); planned and written by the fork, HF export included where the bridge saves in
        parallel (``SNAPSHOT``). Off ``SYNC`` this returns once the fork runs; ``finalize_async_save`` (which a
        later save or load calls first) writes the metadata. Verifying the HF export and committing the staging
        directory follow in ``verl.utils.checkpoint.commit``. Returns the save's report (also ``last_save``).
        """
        _not_implemented_unless_default(hdfs_path=hdfs_path)
        self.finalize_async_save(blocking=True)  # one save in flight at a time
        save = self._start_save(local_path, global_step, max_ckpt_to_keep)
        with self._failure_reported(save):
            self._check_state_is_finite(save)
            if save.mode is AsyncMode.SYNC:
                self.ensure_checkpoint_capacity(max_ckpt_to_keep)
            background = self._save_dist_parts(save)
            self._seal_dist_parts(save)
            self._save_hf_config(save)
            self._save_hf_weights(save)
            if background is not None:
                return self._continue_in_background(save, background)
        return self._finish_save(save)

    def save_mode(self) -> AsyncMode:
        """The mode the next save takes: sync without ``async_save``; the snapshot once every dist checkpoint's
        plan is reusable without a collective (megatron validated it twice) and the tensors are in host memory."""
        if not self.async_save:
            return AsyncMode.SYNC
        return AsyncMode.SNAPSHOT if self._plans_are_reusable() else AsyncMode.BACKGROUND_WRITE

    def _start_save(self, local_path: str, global_step: int, max_ckpt_to_keep: int | None) -> SaveReport:
        """The step's directory and report, with the async mode and where the HF export goes decided once here."""
        self.previous_global_step = global_step
        mode = self.save_mode()
        checked_in_fork = mode is not AsyncMode.SYNC and snapshot_save.on_host(self.model)
        hf_in_fork = (
            checked_in_fork
            and self.should_save_hf_model
            and getattr(self.bridge, "saves_in_parallel", False)  # mbridge's own path needs the default group
            and forked_groups_possible()
        )
        save = SaveReport(
            local_mkdir_safe(local_path), global_step, mode, max_ckpt_to_keep,
            checked_in_background=checked_in_fork, hf_weights_in_background=hf_in_fork,
        )
        self.last_save = save
        return save

    def _check_state_is_finite(self, save: SaveReport) -> None:
        """No NaN/Inf is ever saved: checked here, before anything is written or removed, unless an async save's
        fork checks the very state it writes (``checked_in_background``, off the training path); a failure there
        fails the save when it is finalized, still before the commit."""
        if not save.checked_in_background:
            self.on_save_phase("finite_check")
            self._timed("finite_check", finite.check_finite, self.model, self.optimizer, self._refusal(save))

    @staticmethod
    def _refusal(save: SaveReport) -> str:
        return f"refusing to save step {save.global_step}: nothing was written"

    def _save_dist_parts(self, save: SaveReport) -> AsyncRequest | None:
        """The dist checkpoints (optimizer + scheduler, RNG, model shards if asked): written here (``SYNC``) or
        planned here (``BACKGROUND_WRITE``), or all left to the snapshot's fork. Returns what the fork is to run:
        with ``checked_in_background``, the rest of the pipeline that runs there (``_save_in_fork``) too."""
        if save.mode is AsyncMode.SNAPSHOT:
            return self._forked_request(save, functools.partial(self._plan_and_write_in_fork, save.local_path, self._build_extra_state_dict()))
        self.on_save_phase("dist_checkpoint")
        requests = self._timed("dist_checkpoints", self._save_dist_checkpoints, save.local_path, save.mode is AsyncMode.BACKGROUND_WRITE)
        self.on_save_phase("after_dist_checkpoint")
        if requests is None:
            return None
        if not save.checked_in_background:
            return _in_one_fork(requests)
        return self._forked_request(
            save, _planned_writes(requests) or (lambda: None), [fn for planned in requests for fn in planned.finalize_fns]
        )

    def _seal_dist_parts(self, save: SaveReport) -> None:
        """Sync mode: the dist checkpoints are complete on every rank; each rank starts hashing and fsyncing its
        share of their files while the HF export runs (``verl.utils.checkpoint.sealing``)."""
        if save.mode is not AsyncMode.SYNC:
            return
        directories = [_DIST_CHECKPOINT_PATHS[content](save.local_path) for content in self._dist_contents()]
        relpaths = files_under(save.local_path, directories)
        sizes = [os.path.getsize(os.path.join(save.local_path, r)) for r in relpaths]
        save.sealer = sealing.Sealer(save.local_path)
        save.sealer.seal(sealing.share_of(relpaths, sizes, self.rank, self.world_size))

    def _save_hf_config(self, save: SaveReport) -> None:
        """Rank 0: the HF config, tokenizer and generation config; then every rank waits for them (fix 2), so no
        rank starts the HF weights before the config is on disk. An async save's fork does both when it exports."""
        if not self.should_save_hf_model or save.hf_weights_in_background:
            return
        if self.rank == 0:
            self.on_save_phase("hf_config")
            self._timed("hf_config", self._save_hf_config_and_tokenizer, save.local_path)
        self.wait_for_hf_config()

    def _save_hf_weights(self, save: SaveReport) -> None:
        """Every rank: the bridge's HF weight save, unless an async save's fork does it."""
        if self.should_save_hf_model and not save.hf_weights_in_background:
            self.on_save_phase("hf_weights")
            self._timed("hf_weights", self._save_model_as_hf_via_bridge, get_hf_model_checkpoint_path(save.local_path))

    def _continue_in_background(self, save: SaveReport, request: AsyncRequest) -> SaveReport:
        """Fork the background part and give training back; ``finalize_async_save`` completes the save."""
        if self._async_queue is None:
            self._async_queue = megatron_core.async_calls_queue()
        self._timed("fork", snapshot_save.fork, self._async_queue, request)
        self._pending = save
        save.blocked_seconds = time.monotonic() - save.started
        self._log(f"step {save.global_step}: returned after {save.blocked_seconds:.2f}s; {save.mode.value} runs in the background")
        return save

    def _finish_save(self, save: SaveReport) -> SaveReport:
        """Every part is on disk: rank 0 writes the metadata (``transformer_config.json``, ``ckpt_contents.json``
        last), then upstream's retention."""
        self.on_save_phase("metadata")
        self._timed("metadata", self._write_metadata, save)
        save.completed = True
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
        """Whether a save's background write is still waiting for ``finalize_async_save``."""
        return self._pending is not None

    def finalize_async_save(self, blocking: bool = True) -> str | None:
        """Complete the pending async save once its background write is durable; all ranks call this.

        Returns the saved path; None when nothing was pending or, with ``blocking=False``, when the write is
        still running. A failed write raises ``CheckpointError``.
        """
        save = self._pending
        if save is None:
            return None
        with self._failure_reported(save):
            try:
                if not self._timed("background_wait", self._async_queue.maybe_finalize_async_calls, blocking):
                    return None
            finally:
                if not self._async_queue.get_num_unfinalized_calls():
                    self._pending = None
        self._finish_save(save)
        return save.local_path

    @contextlib.contextmanager
    def _failure_reported(self, save: SaveReport) -> Iterator[None]:
        """Turn any failure of ``save`` into one CheckpointError that names the step and the cause."""
        try:
            yield
        except (Exception, DistributedCheckpointException) as exc:  # the latter derives from BaseException
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise CheckpointError(f"saving step {save.global_step} to {save.local_path} failed ({type(exc).__name__}: {cause})") from exc

    def _save_dist_checkpoints(self, local_path: str, in_background: bool) -> list[AsyncRequest] | None:
        """Write (or, ``in_background``, plan) the dist checkpoints; return the writes still to run."""
        metadata = self._build_sharded_state_dict_metadata()
        requests = []
        for content, state, path in self._dist_checkpoint_parts(local_path, metadata):
            # One strategy per content and structure, kept across saves: from the third save of the same
            # structure on, megatron reuses the plan it validated twice instead of gathering and checking
            # every rank's plan again, and the access-integrity check (each shard written exactly once)
            # is needed only on its first save. The reused plan lists the items to write, so a changed
            # structure (an optimizer that gained state) must start afresh.
            structure = _sharded_structure(state)
            known = self._save_strategies.get(content)
            fresh = known is None or known[0] != structure
            strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True) if fresh else known[1]
            if content == "optimizer":
                self._planned_optimizer_layout = _optimizer_layout(self.optimizer)
            request = save_dist_checkpointing(
                sharded_state_dict=state,
                ckpt_path=path,
                async_save=in_background,
                content_metadata=metadata,
                sharded_strategy=strategy,
                validate_access_integrity=fresh,
            )
            self._save_strategies[content] = (structure, strategy)
            if request is not None:
                requests.append(request)
        if not in_background:
            torch.distributed.barrier()
            return None
        return requests

    def _dist_checkpoint_parts(
        self, local_path: str, metadata: dict, extra_state: dict | None = None
    ) -> Iterator[tuple[str, dict, str]]:
        """(content, sharded state dict, directory) of each dist checkpoint to save, built when reached:
        a save consumes the state dict it is given. ``extra_state``: taken before a fork (a forked process
        reseeds Python's ``random``)."""
        if self.should_save_dist_ckpt_model:
            yield "model", _without_view_copies(self._build_model_sharded_state_dict(metadata)), get_model_dist_checkpoint_path(local_path)
        self.on_save_phase("dist_checkpoint_optimizer")
        if self.should_save_optimizer:
            state = self._build_optimizer_state_dict(self._build_model_sharded_state_dict(metadata), metadata)
            yield "optimizer", _without_view_copies(state), get_optimizer_dist_checkpoint_path(local_path)
        if self.should_save_extra:
            yield "extra", extra_state or self._build_extra_state_dict(), get_extra_dist_checkpoint_path(local_path)

    def _dist_contents(self) -> list[str]:
        """The dist checkpoints this manager saves."""
        wanted = {"model": self.should_save_dist_ckpt_model, "optimizer": self.should_save_optimizer, "extra": self.should_save_extra}
        return [content for content in _DIST_CHECKPOINT_PATHS if wanted[content]]

    def _save_hf_config_and_tokenizer(self, local_path: str) -> None:
        """Rank 0 only: everything the HF folder needs besides the weights, written before them."""
        if self.rank != 0:
            return
        hf_path = get_hf_model_checkpoint_path(local_path)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_path)
        self.hf_config.save_pretrained(hf_path)
        generation_config = os.path.join(self.model_path or "", "generation_config.json")
        if self.model_path and os.path.isfile(generation_config):
            shutil.copyfile(generation_config, os.path.join(hf_path, "generation_config.json"))

    def wait_for_hf_config(self) -> None:
        """Fix 2: no rank may start the bridge's HF weight save until rank 0's config is on disk. Public so
        that tests can show what a save without it gets wrong, and where a rank waits for rank 0."""
        torch.distributed.barrier()

    def _save_model_as_hf_via_bridge(self, hf_ckpt_path: str) -> None:
        """Every rank: the bridge writes the HF weights (safetensors + index) into ``hf_ckpt_path``."""
        self.bridge.save_weights(self.model, hf_ckpt_path, **self.bridge_save_kwargs)
        torch.distributed.barrier()

    def _save_transformer_config(self, local_path: str) -> None:
        """Rank 0: the Megatron TransformerConfig as JSON (what the model-identity check reads at resume)."""
        if self.rank != 0:
            return
        config = self.transformer_config
        names = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else list(vars(config))
        fields = {name: _json_safe(getattr(config, name)) for name in names if not callable(getattr(config, name))}
        atomic_write_text(get_transformer_config_checkpoint_path(local_path), json.dumps(fields, indent=2))

    def _build_checkpoint_manifest(self, local_path: str, global_step: int) -> dict:
        """``ckpt_contents.json``: what each content is, where it lies (relative paths) and in which format."""
        hf = os.path.relpath(get_hf_model_checkpoint_path(local_path), local_path)
        dist = {name: os.path.relpath(where(local_path), local_path) for name, where in _DIST_CHECKPOINT_PATHS.items()}
        transformer_config = os.path.relpath(get_transformer_config_checkpoint_path(local_path), local_path)
        contents: dict[str, dict] = {}
        directories: dict[str, str] = {}
        if self.should_save_hf_model:
            if not self.should_save_dist_ckpt_model:
                contents["model"] = {"path": hf, "format": "huggingface", "backend": "mbridge"}
            if "hf_model" in self.checkpoint_save_contents:
                note = "HF export next to the Megatron model shards" if self.should_save_dist_ckpt_model else "the same files as 'model'"
                contents["hf_model"] = {"path": hf, "format": "huggingface", "note": note}
            directories[hf] = "HF weights, config, tokenizer and generation config, written through the bridge"
        if self.should_save_dist_ckpt_model:
            contents["model"] = {"path": dist["model"], "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"}
            directories[dist["model"]] = "Megatron dist-checkpoint shards of the model"
        if self.should_save_optimizer:
            contents["optimizer"] = {"path": dist["optimizer"], "format": "megatron_dist_checkpoint"}
            if self.lr_scheduler is not None:
                contents["lr_scheduler"] = {"path": dist["optimizer"], "format": "megatron_dist_checkpoint", "key": "lr_scheduler"}
            directories[dist["optimizer"]] = "Megatron dist-checkpoint shards of the optimizer state and the LR scheduler"
        if self.should_save_extra:
            contents["rng_state"] = {"path": dist["extra"], "format": "megatron_dist_checkpoint", "key": "rng_state"}
            contents["transformer_config"] = {"path": transformer_config, "format": "json"}
            directories[dist["extra"]] = "Megatron dist-checkpoint shards of the RNG state"
        if self.should_save_hf_model:
            contents["hf_config"] = {"path": hf, "format": "huggingface", "note": "config.json, tokenizer, generation_config.json"}
            if self.processing_class is not None:
                contents["tokenizer"] = {"path": hf, "format": "huggingface"}
        return {
            "schema_version": CKPT_CONTENTS_SCHEMA_VERSION,
            "framework": "megatron",
            "role": self.role,
            "arch": self.arch,
            "global_step": int(global_step),
            "world_size": self.world_size,
            "backend": {"has_bridge": self.bridge is not None, "use_dist_checkpointing": self.use_dist_checkpointing, "peft": False},
            "save_contents": list(self.checkpoint_save_contents),
            "contents": contents,
            "directories": directories,
            "saved_any_dist_ckpt": bool(self._dist_contents()),
        }

    def _write_checkpoint_manifest(self, local_path: str, global_step: int) -> None:
        """Rank 0, last: ``ckpt_contents.json``."""
        if self.rank != 0:
            return
        contents = self._build_checkpoint_manifest(local_path, global_step)
        atomic_write_text(get_checkpoint_contents_manifest_path(local_path), json.dumps(contents, indent=2, sort_keys=True))

    # ---------------------------------------------------- async save from a snapshot

    def _plans_are_reusable(self) -> bool:
        """Whether the fork can do the whole save: every plan reusable without a collective, same structure."""
        if not self.async_save or not snapshot_save.on_host(self.model):
            return False
        if not all(megatron_core.save_plan_is_reusable(self._save_strategies.get(c, (None, None))[1]) for c in self._dist_contents()):
            return False
        return not self.should_save_optimizer or _optimizer_layout(self.optimizer) == self._planned_optimizer_layout

    def _forked_request(
        self, save: SaveReport, write_dist: Callable[[], dict | None], finalize_planned: list[Callable] = ()
    ) -> AsyncRequest:
        """What an async save's fork runs when it holds the state (``checked_in_background``): the rest of the
        pipeline, ``_save_in_fork``, around ``write_dist`` (the writes planned in the rank, whose megatron
        finalize is ``finalize_planned``, or the snapshot's planning and writing, which returns its write
        results). When the save is finalized the forks' outcomes are agreed on first."""
        self._forked_saves += 1
        hf_group = f"{self.role}/step{save.global_step}/save{self._forked_saves}" if save.hf_weights_in_background else None
        job = functools.partial(self._save_in_fork, save, write_dist, hf_group)
        return megatron_core.async_request(
            snapshot_save.ForkedJob(save.local_path, self.rank, job, hf_group),
            (),
            [functools.partial(self._finish_forked_save, save.local_path), *finalize_planned],
        )

    def _save_in_fork(self, save: SaveReport, write_dist: Callable[[], dict | None], hf_group: str | None) -> dict:
        """The forked process, the save's pipeline on its copy-on-write image of the rank: the NaN/Inf check,
        this rank's dist checkpoints, then with ``hf_group`` the HF config (rank 0), the forks' barrier (fix 2)
        and the HF weights.

        The forks' group is formed first: a fork that fails later makes the others fail fast, not wait."""
        comm = ForkedRankComm(hf_group) if hf_group is not None else None
        finite.check_finite_here(self.model, self.optimizer, self._refusal(save), self.rank)
        outcome: dict[str, Any] = {"writes": write_dist() or {}}
        if comm is not None:
            self._save_hf_config_and_tokenizer(save.local_path)
            comm.barrier()
            self.bridge.save_weights(self.model, get_hf_model_checkpoint_path(save.local_path), comm=comm, **self.bridge_save_kwargs)
        return outcome

    def _plan_and_write_in_fork(self, local_path: str, extra_state: dict) -> dict:
        """The snapshot's dist part, in its fork: plan this rank's dist checkpoints with the reused plans and
        write them; the write results per content. The RNG state ``extra_state`` was taken in the rank (a forked
        process reseeds Python's ``random``)."""
        writes = {}
        metadata = self._build_sharded_state_dict_metadata()
        for content, state, path in self._dist_checkpoint_parts(local_path, metadata, extra_state):
            structure, strategy = self._save_strategies[content]
            if _sharded_structure(state) != structure:
                raise CheckpointError(f"the {content} checkpoint's sharded structure changed after its save plan was validated")
            writes[content] = snapshot_save.write_dist_checkpoint(strategy, state, path, metadata)
        return writes

    def _finish_forked_save(self, local_path: str) -> None:
        """Every rank: agree on the forks' outcomes, then rank 0 writes the metadata of each dist checkpoint the
        forks planned (the snapshot's; megatron's own finalize does it for the writes planned in the rank)."""
        outcome = snapshot_save.read_outcome(local_path, self.rank)
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, outcome)
        failed = [(rank, o["error"].strip().splitlines()[-1]) for rank, o in enumerate(everyone) if not o["ok"]]
        if failed:
            failed.sort(key=lambda f: "without a result" not in f[1])  # a fork that died first is the cause
            raise CheckpointError(f"the background save failed on {len(failed)} rank(s): " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        if self.rank == 0:
            for content in outcome["writes"]:
                path = _DIST_CHECKPOINT_PATHS[content](local_path)
                snapshot_save.finish_dist_checkpoint(self._save_strategies[content][1], path, [o["writes"][content] for o in everyone])

    # ------------------------------------------------------------------ load

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        """Load the contents ``load_contents`` names from the step at ``local_path`` (upstream's v2 layout).

        The model comes from the HF folder through the bridge (use_dist_checkpointing=False) or from
        ``model/dist_ckpt``; the optimizer, LR scheduler and RNG from their dist checkpoints. Integrity checks
        of our own (manifest, HF completeness, model identity) belong before this call:
        ``verl.utils.checkpoint.commit.check_before_load``.
        """
        _not_implemented_unless_default(hdfs_path=hdfs_path, del_local_after_load=del_local_after_load)
        self.finalize_async_save(blocking=True)  # a pending save is of the state about to be replaced
        if not os.path.isdir(local_path):
            raise FileNotFoundError(f"checkpoint {local_path} does not exist (or is not a directory)")
        self._raise_for_old_layout(local_path)
        start = time.monotonic()
        metadata = self._load_content_metadata(local_path)
        if self.should_load_dist_ckpt_model:
            self._load_model_from_dist_checkpoint(local_path, self._build_model_sharded_state_dict(metadata))
        elif self.should_load_hf_model:
            self._load_model_as_hf_via_bridge(os.path.join(local_path, "model", "huggingface"))
        if self.should_load_optimizer:  # mapped onto the model's shards as they are now, after its load
            self._load_optimizer(local_path, self._build_model_sharded_state_dict(metadata), metadata)
        if self.should_load_extra:
            self._load_extra(local_path)
        torch.distributed.barrier()
        self._log(f"loaded {local_path} ({', '.join(self.checkpoint_load_contents)}) in {time.monotonic() - start:.1f}s")

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
        for content in _DIST_CHECKPOINT_PATHS:
            path = _dist_dir(local_path, content)
            if self._has_checkpoint_files(path):
                saved = dist_checkpointing.load_content_metadata(checkpoint_dir=path)
                if saved is not None:
                    return saved
                break
        return self._build_sharded_state_dict_metadata()

    def _load_model_from_dist_checkpoint(self, local_path: str, model_state: dict) -> None:
        path = _dist_dir(local_path, "model")
        loaded = load_dist_checkpointing(sharded_state_dict=dict(model_state), ckpt_dir=path)
        for index, chunk in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{index}"
            if key not in loaded:
                raise CheckpointError(f"{path} holds no '{key}' state (saved with use_dist_checkpointing=False?)")
            if len(self.model) > 1:
                mpu.set_virtual_pipeline_model_parallel_rank(index)
            chunk.load_state_dict(loaded[key])

    def _load_model_as_hf_via_bridge(self, hf_model_path: str) -> None:
        self.bridge.load_weights(self.model, hf_model_path)

    def _load_optimizer(self, local_path: str, model_state: dict, metadata: dict) -> None:
        path = _dist_dir(local_path, "optimizer")
        built_bounds = [(group.get("max_lr"), group.get("min_lr")) for group in self.optimizer.param_groups]
        if self.use_distributed_optimizer:
            initialize_distributed_optimizer_state(self.optimizer)
        request = self._build_optimizer_state_dict(model_state, metadata, is_loading=True)
        loaded = load_dist_checkpointing(sharded_state_dict=request, ckpt_dir=path)
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path} holds no optimizer state")
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

    def _load_extra(self, local_path: str) -> None:
        """Each rank's own RNG streams when the step is ours and of this exact layout; upstream's per-(PP, TP)
        ones for an upstream step of this PP/TP; none (a warning) at another PP/TP, where they have no meaning."""
        saved, now = read_saved_layout(local_path), current_parallel_layout()
        if saved is not None and any(saved.get(k) != now[k] for k in ("pp", "tp")):
            if self.rank == 0:
                warnings.warn(f"{local_path} was saved at {saved}, this run is {now}: RNG states are not restored", stacklevel=2)
            return
        path = _dist_dir(local_path, "extra")
        per_rank = saved == now
        loaded = load_dist_checkpointing(sharded_state_dict=self._build_extra_state_dict(per_rank), ckpt_dir=path)
        if "rng_state" not in loaded:
            raise CheckpointError(f"{path} holds no rng_state")
        self.load_rng_states([loaded[RANK_RNG_STATE_KEY]] if per_rank else loaded["rng_state"])

    def _timed(self, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one phase of the current save, adding its time to the save's report."""
        start = time.monotonic()
        result = fn(*args)
        seconds = time.monotonic() - start
        if self.last_save is not None:
            self.last_save.phase_seconds[phase] = self.last_save.phase_seconds.get(phase, 0.0) + seconds
        self._log(f"  {phase}: {seconds:.2f}s")
        return result

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)

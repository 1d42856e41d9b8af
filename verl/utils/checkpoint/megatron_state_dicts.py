"""The sharded state dicts ``MegatronCheckpointManager`` saves and loads: model, optimizer + LR scheduler, RNG.

Upstream verl's builders and RNG methods, as a mixin of the manager over free builders (which a save's forked
process calls on its own references, never the manager), and the one transformation a save applies to them
before megatron writes (``without_view_copies``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor, apply_factories

from verl.utils.checkpoint.checkpoint_manager import config_get
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.layout import RANK_RNG_STATE_KEY, dist_path
from verl.utils.device import get_device_name, get_torch_device
from verl.utils.internals import megatron_core


def without_view_copies(state: dict) -> dict:
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


def optimizer_layout(optimizer) -> tuple:
    """What the optimizer's sharded structure depends on, cheap to read: each state entry's keys and shapes."""
    layout = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", chained)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                state = inner.state.get(param, {})
                layout.append(tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in sorted(state.items())))
    return tuple(layout)


def sharded_structure(state: dict) -> tuple:
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


def current_parallel_layout() -> dict[str, int]:
    """This process's world size and model-parallel sizes (a save's manifest records them; a load compares).

    ``vpp`` only with model chunks (interleaved pipeline): the distributed optimizer's state is laid out per
    chunk, so it is part of the layout, and a layout without chunks reads as before."""
    layout = {
        "world_size": torch.distributed.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
    }
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        layout["vpp"] = vpp
    return layout


def model_sharded_state_dict(model: list, metadata: dict) -> dict:
    """Every model chunk's sharded state dict ("model", or "model0".. with virtual pipeline stages)."""
    state = {}
    model_metadata = {**metadata, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    for index, chunk in enumerate(model):
        if len(model) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(index)
        module = chunk.module if hasattr(chunk, "module") else chunk
        state["model" if len(model) == 1 else f"model{index}"] = module.sharded_state_dict(metadata=model_metadata)
    return state


def optimizer_sharded_state_dict(optimizer, lr_scheduler, model_state: dict, metadata: dict, is_loading: bool = False) -> dict:
    """The optimizer's sharded state (mapped onto the model's shards, which it reads only) and the scheduler's."""
    megatron_core.map_only_tracked_params()
    state = {"optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    return state


@dataclasses.dataclass
class DistParts:
    """The dist checkpoints of one save (a save consumes the state dict it gets).

    ``contents``: of "model", "optimizer", "extra"; ``extra_state``: the RNG state, taken in the rank (a forked
    process reseeds Python's ``random``); ``on_phase``: the manager's public phase hook."""

    model: list
    optimizer: Any
    lr_scheduler: Any
    contents: tuple[str, ...]
    metadata: dict
    extra_state: dict | None
    on_phase: Callable[[str], None]

    def build(self, local_path: str) -> Iterator[tuple[str, dict, str]]:
        """(content, sharded state dict, directory) of each dist checkpoint, in the order they are written (the
        manager creates the directories before any is built). The model's sharded state dict is built once:
        the optimizer's is mapped onto it (by its tensors' identity) before the model's write replaces them,
        so the ``dist_checkpoint_optimizer`` phase starts after both were built."""
        model_state = model_sharded_state_dict(self.model, self.metadata) if {"model", "optimizer"} & set(self.contents) else None
        optimizer_state = None
        if "optimizer" in self.contents:
            optimizer_state = optimizer_sharded_state_dict(self.optimizer, self.lr_scheduler, model_state, self.metadata)
        if "model" in self.contents:
            yield "model", without_view_copies(model_state), dist_path(local_path, "model")
        model_state = None  # what the model's write built from it (factories' copies) is not held through the rest
        self.on_phase("dist_checkpoint_optimizer")
        if optimizer_state is not None:
            yield "optimizer", without_view_copies(optimizer_state), dist_path(local_path, "optimizer")
        if "extra" in self.contents:
            yield "extra", self.extra_state, dist_path(local_path, "extra")


class MegatronStateDicts:
    """The manager's state dict builders and RNG state methods (a mixin over its model, optimizer and config)."""

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
        return model_sharded_state_dict(self.model, metadata)

    def _build_optimizer_state_dict(self, model_sharded_state_dict: dict, metadata: dict, is_loading: bool = False) -> dict:
        return optimizer_sharded_state_dict(self.optimizer, self.lr_scheduler, model_sharded_state_dict, metadata, is_loading)

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

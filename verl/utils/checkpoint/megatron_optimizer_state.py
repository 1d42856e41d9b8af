"""Megatron optimizer state <-> dist checkpoint, in forms that survive a change of layout.

Non-distributed optimizer (use_distributed_optimizer=False): the state is saved as a flat list of
per-parameter ShardedTensors (exp_avg, exp_avg_sq keyed by their model tensor) plus one common Adam
step. Nothing in it depends on how megatron chains its optimizers (one for dense and one for
expert parameters at EP > 1, a single one at EP = 1), so it loads at any TP/PP/EP/ETP layout.

Distributed optimizer: megatron's own "dp_reshardable" form, which loads at the same TP/PP/EP/ETP
(any DP). megatron's "fully_reshardable" form cannot load into torch's Adam (no apex/TE: a
per-parameter "step" it does not save). Two megatron-core 0.16 defects of the no-apex path are
worked around here: a DistributedOptimizer that never stepped cannot be loaded into, and the
loaded Adam step is a stale tensor shared by every parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

_PER_PARAMETER = {"chained_optim_avoid_prefix": True}
_DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


class OptimizerStateError(RuntimeError):
    """The optimizer state on disk does not fit this optimizer."""


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sharded_leaves(tree: Any) -> list[ShardedBase]:
    if isinstance(tree, ShardedBase):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _sharded_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _sharded_leaves(value)]
    return []


def _replace_sharded_leaves(tree: Any, loaded: list) -> Any:
    """``tree`` with its ShardedTensors replaced, in order, by the loaded tensors (as load would)."""
    if isinstance(tree, ShardedBase):
        return loaded.pop(0)
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    if isinstance(tree, dict):
        return {key: _replace_sharded_leaves(value, loaded) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_replace_sharded_leaves(value, loaded) for value in tree]
    return tree


def _per_optimizer_states(state: dict) -> list[dict]:
    """The per-inner-optimizer state dicts of a (possibly chained) optimizer state dict."""
    return [state] if "state" in state else [state[index] for index in sorted(state)]


def optimizer_state_for_save(optimizer, model_sharded_state_dict: dict, distributed: bool) -> dict:
    """What to hand to ``dist_checkpointing.save`` for the optimizer."""
    if distributed:
        return {"optimizer": optimizer.sharded_state_dict(model_sharded_state_dict, metadata=_DP_RESHARDABLE)}
    state = optimizer.sharded_state_dict(model_sharded_state_dict, metadata=_PER_PARAMETER)
    steps = {float(step) for inner in _per_optimizer_states(state) if (step := inner["state"].get("common_step")) is not None}
    if len(steps) > 1:
        raise OptimizerStateError(f"chained optimizers disagree on the Adam step: {sorted(steps)}")
    return {"optimizer_tensors": _sharded_leaves(state), "optimizer_step": steps.pop() if steps else None}


def load_optimizer_state(optimizer, model_sharded_state_dict: Callable[[], dict], path: str, distributed: bool) -> dict:
    """Load the optimizer state at ``path`` into ``optimizer``; return the loaded common state."""
    if distributed:
        return _load_distributed(optimizer, model_sharded_state_dict, path)
    request = optimizer.sharded_state_dict(model_sharded_state_dict(), is_loading=True, metadata=_PER_PARAMETER)
    loaded = dist_checkpointing.load({"optimizer_tensors": _sharded_leaves(request)}, path)
    if "optimizer_tensors" not in loaded:
        raise OptimizerStateError(f"{path} holds no per-parameter optimizer state (saved with the distributed optimizer?)")
    state = _replace_sharded_leaves(request, list(loaded["optimizer_tensors"]))
    if loaded.get("optimizer_step") is not None:
        for inner in _per_optimizer_states(state):
            inner["state"]["common_step"] = torch.tensor(loaded["optimizer_step"], dtype=torch.float32)
    optimizer.load_state_dict(state)
    return loaded


def _load_distributed(optimizer, model_sharded_state_dict: Callable[[], dict], path: str) -> dict:
    _initialize_distributed_optimizer_state(optimizer)
    request = {"optimizer": optimizer.sharded_state_dict(model_sharded_state_dict(), is_loading=True, metadata=_DP_RESHARDABLE)}
    loaded = dist_checkpointing.load(request, path)
    with torch.no_grad():  # the DP-reshardable loader copies into leaf main params in place
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    return loaded


def _initialize_distributed_optimizer_state(optimizer) -> None:
    """Give a DistributedOptimizer that never stepped the Adam state its load path reads.

    A step with lr=0 and weight_decay=0 creates the state and leaves every parameter bit-identical;
    the checkpoint then overwrites the state.
    """
    for inner in _inner_optimizers(optimizer):
        if not isinstance(inner, DistributedOptimizer) or len(inner.optimizer.state) > 0:
            continue
        saved = [(group["lr"], group["weight_decay"]) for group in inner.optimizer.param_groups]
        for group in inner.optimizer.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        inner._init_optimizer_states_with_dummy_values()
        for group, (lr, weight_decay) in zip(inner.optimizer.param_groups, saved, strict=True):
            group["lr"], group["weight_decay"] = lr, weight_decay


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Set every parameter's Adam ``step`` from the param groups' saved step, one tensor each."""
    inners = _inner_optimizers(optimizer)
    states = [loaded[index] for index in range(len(inners))] if len(inners) > 1 else [loaded]
    for inner, state in zip(inners, states, strict=True):
        if not isinstance(inner, DistributedOptimizer):
            continue
        steps = {group["step"] for group in state["optimizer"]["param_groups"] if "step" in group}
        if len(steps) != 1:
            raise OptimizerStateError(f"distributed optimizer checkpoint holds inconsistent Adam steps {sorted(steps)}")
        step = float(steps.pop())
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)

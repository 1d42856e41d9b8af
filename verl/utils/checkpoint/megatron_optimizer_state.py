"""Megatron optimizer state from upstream's dist-checkpoint form, at any layout.

Saved as upstream verl saves it: ``{"optimizer": optimizer.sharded_state_dict(...)}`` with
``chained_optim_avoid_prefix``, so each parameter's Adam moments are ShardedTensors keyed by their model
tensor, whatever the TP/PP/EP/ETP layout. The non-sharded part (param groups, Adam step) follows how
megatron chains its optimizers (one for dense and one for expert parameters at EP > 1, one at EP = 1), so
the non-distributed optimizer's state is rebuilt here for *this* optimizer: loaded tensors at the
request's places, the saved Adam step, this optimizer's own param groups. That loads at any layout.

Distributed optimizer: megatron's "dp_reshardable" form, which loads at the same TP/PP/EP/ETP (any DP).
Two megatron-core 0.16 defects of the no-apex path are worked around here: a DistributedOptimizer that
never stepped cannot be loaded into, and the loaded Adam step is a stale tensor shared by every parameter.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.overrides import TorchFunctionMode

from verl.utils.internals import megatron_core


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


def _per_optimizer_states(state: dict) -> list[dict]:
    """The torch optimizers' state dicts (``state``, ``param_groups``) in a (possibly chained) optimizer state dict:
    megatron's fp32 optimizer's is torch's own, a mixed-precision one's (bf16 / fp16 parameters) lies under
    ``optimizer`` beside its fp32 master weights (``fp32_from_fp16_params``)."""
    if "state" in state:
        return [state]
    if "optimizer" in state:
        return [state["optimizer"]]
    return [inner for index in sorted(state) for inner in _per_optimizer_states(state[index])]


def _saved_adam_steps(tree: Any) -> set[float]:
    """Every ``common_step`` (the non-distributed optimizer's Adam step) in a loaded state tree."""
    if isinstance(tree, dict):
        own = {float(tree["common_step"])} if tree.get("common_step") is not None else set()
        return own.union(*(_saved_adam_steps(value) for value in tree.values()))
    if isinstance(tree, list):
        return set().union(*(_saved_adam_steps(value) for value in tree))
    return set()


def _at_request_places(request: Any, loaded: Any) -> Any:
    """``request`` with each sharded item replaced by what the load put at its place; the rest as requested."""
    if isinstance(request, ShardedBase):
        return loaded
    if isinstance(request, LocalNonpersistentObject):
        return request.unwrap()
    if isinstance(request, dict):
        return {key: _at_request_places(value, loaded[key] if _holds_sharded(value) else None) for key, value in request.items()}
    if isinstance(request, list):
        return [_at_request_places(value, loaded[index] if _holds_sharded(value) else None) for index, value in enumerate(request)]
    return request


def _holds_sharded(tree: Any) -> bool:
    return bool(_sharded_leaves(tree))


def optimizer_state_from_loaded(request: dict, loaded: dict) -> dict:
    """The non-distributed optimizer's state dict to load: ``request`` (this optimizer's ``sharded_state_dict``
    with ``is_loading=True``) filled with the loaded tensors and the saved Adam step."""
    state = _at_request_places(request, loaded)
    steps = _saved_adam_steps(loaded)
    if len(steps) > 1:
        raise OptimizerStateError(f"the saved optimizer state holds inconsistent Adam steps {sorted(steps)}")
    if steps:
        step = steps.pop()
        for inner in _per_optimizer_states(state):
            inner["state"]["common_step"] = torch.tensor(step, dtype=torch.float32)
    return state


def initialize_distributed_optimizer_state(optimizer) -> None:
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
        megatron_core.init_distributed_optimizer_state(inner)
        for group, (lr, weight_decay) in zip(inner.optimizer.param_groups, saved, strict=True):
            group["lr"], group["weight_decay"] = lr, weight_decay


class _UninitializedForZeros(TorchFunctionMode):
    """``torch.zeros_like`` allocates without writing (``empty_like``): a placeholder whose values nobody reads.
    The mode sees torch's own function, which a wrapper of ``torch.zeros_like`` (the CPU runtime's device
    mapping) calls: the comparison unwraps it."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros_like = inspect.unwrap(torch.zeros_like)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return (torch.empty_like if func is self.zeros_like else func)(*args, **(kwargs or {}))


@contextlib.contextmanager
def placeholder_optimizer_state(optimizer) -> Iterator[None]:
    """Within: megatron's ``init_state_fn`` (which ``sharded_state_dict(is_loading=True)`` calls to give a
    parameter without state the Adam moments a load request needs) allocates them without zeroing; on leaving,
    every state it created is removed, so the optimizer holds what it held before.

    A load request only needs the moments' shapes: the read fills buffers of its own (``into_own_buffers``) and
    applying replaces the whole state. Zeroing them cost a write of the full Adam state, and keeping them held a
    second copy of it through the load and left a refused load's optimizer with state it never had."""
    inners = [inner for inner in _inner_optimizers(optimizer) if getattr(inner, "init_state_fn", None) is not None]
    stateless = {
        id(inner): [p for group in inner.optimizer.param_groups for p in group["params"] if not inner.optimizer.state.get(p)]
        for inner in inners
    }
    originals = {id(inner): inner.init_state_fn for inner in inners}

    def uninitialized(original):
        def init_state_fn(*args: Any, **kwargs: Any) -> None:
            with _UninitializedForZeros():
                original(*args, **kwargs)

        return init_state_fn

    for inner in inners:
        inner.init_state_fn = uninitialized(originals[id(inner)])
    try:
        yield
    finally:
        for inner in inners:
            inner.init_state_fn = originals[id(inner)]
            for param in stateless[id(inner)]:
                inner.optimizer.state.pop(param, None)


def restore_adam_steps(optimizer, loaded: dict) -> None:
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

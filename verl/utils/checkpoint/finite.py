"""No checkpoint holds NaN or Inf: the check of a rank's model parameters and optimizer state.

A save runs it before anything is written (in the rank, or for an async save on the CPU runtime in the forked
process, on the copy-on-write image it writes, off the training path); a load runs it on what was loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from verl.utils.checkpoint.integrity import CheckpointError


def named_state_tensors(model: list | None, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters and the optimizer's state tensors (Adam moments), each with a name a user can read."""
    names = {}
    for index, chunk in enumerate(model or []):
        for name, param in chunk.named_parameters():
            names[id(param)] = f"{name}" if len(model) == 1 else f"chunk{index}.{name}"
            yield names[id(param)], param
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for number, (param, state) in enumerate(getattr(torch_optimizer, "state", {}).items()):
            owner = names.get(id(param), f"parameter #{number}")
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    yield f"optimizer {key} of {owner}", value


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. Exact, and ~50x faster on CPU than ``isfinite(t).all()`` alone: a NaN or
    Inf makes the sum NaN or Inf, so a finite sum proves the tensor finite; only a sum that is not (a real NaN/Inf,
    or finite values that overflowed the sum) takes the element-wise check."""
    data = tensor.detach()
    return bool(torch.isfinite(data.sum())) or bool(torch.isfinite(data).all())


def first_non_finite(model: list | None, optimizer) -> str | None:
    """The name of this rank's first model or optimizer tensor holding NaN or Inf, or None."""
    for name, tensor in named_state_tensors(model, optimizer):
        if tensor.untyped_storage().nbytes() and not is_finite(tensor):
            return name
    return None


def non_finite_error(what: str, rank: int, name: str, ranks_affected: int = 1) -> CheckpointError:
    return CheckpointError(f"{what}: rank {rank}'s {name} holds NaN or Inf ({ranks_affected} rank(s) affected)")


def check_finite(model: list | None, optimizer, what: str) -> None:
    """All ranks: fail together, naming the first NaN/Inf tensor of the first rank that has one."""
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, first_non_finite(model, optimizer))
    bad = [(rank, name) for rank, name in enumerate(found) if name is not None]
    if bad:
        raise non_finite_error(what, *bad[0], len(bad))


def check_finite_here(model: list | None, optimizer, what: str, rank: int) -> None:
    """This process alone (an async save's fork, which has no group of the parent's to agree in)."""
    name = first_non_finite(model, optimizer)
    if name is not None:
        raise non_finite_error(what, rank, name)

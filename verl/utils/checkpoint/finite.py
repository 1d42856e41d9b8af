"""No checkpoint holds NaN or Inf: the check of a rank's model parameters and optimizer state.

A save runs it before anything is written (in the rank, or for an async save on the CPU runtime in the forked
process, on the copy-on-write image it writes, off the training path); a load runs it on what was loaded.
The trainer checks what each step already has in hand (the rollout's and the actor's log-probabilities, the
loss sums, the grad norm: a few small tensors, no extra pass) and stops a diverged run at the first NaN/Inf,
before that step's weights can be saved (``check_step_is_finite``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.names import STEP_DIR_FORMAT
from verl.utils.rank_comm import RankComm


def named_state_tensors(model: list | None, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters and the optimizer's state tensors (Adam moments), each with a name a user can read."""
    names = {}
    for index, chunk in enumerate(model or []):
        for name, param in chunk.named_parameters():
            names[id(param)] = f"{name}" if len(model) == 1 else f"chunk{index}.{name}"
            yield names[id(param)], param
    for torch_optimizer in torch_optimizers(optimizer):
        for number, (param, state) in enumerate(getattr(torch_optimizer, "state", {}).items()):
            owner = names.get(id(param), f"parameter #{number}")
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    yield f"optimizer {key} of {owner}", value


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, distributed or not) optimizer: what holds the state."""
    if optimizer is None:
        return []
    return [getattr(inner, "optimizer", inner) for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. Exact, and ~50x faster on CPU than ``isfinite(t).all()`` alone: a NaN or
    Inf makes the sum NaN or Inf, so a finite sum proves the tensor finite; only a sum that is not (a real NaN/Inf,
    or finite values that overflowed the sum) takes the element-wise check."""
    data = tensor.detach()
    return bool(torch.isfinite(data.sum())) or bool(torch.isfinite(data).all())


def first_non_finite(model: list | None, optimizer) -> str | None:
    """The name of this rank's first model or optimizer tensor holding NaN or Inf, or None.

    Every tensor is screened as ``is_finite`` screens one (its sum), with one finiteness check over all the
    sums of a device and dtype instead of one per tensor (on an accelerator each would be a host sync); only
    a screen that fails (a real NaN/Inf, or finite sums that overflowed) checks tensor by tensor, in order,
    to name the first. Exact either way."""
    tensors = [(name, tensor) for name, tensor in named_state_tensors(model, optimizer) if tensor.untyped_storage().nbytes()]
    sums: dict[tuple, list[torch.Tensor]] = {}
    for _, tensor in tensors:
        sums.setdefault((tensor.device, tensor.dtype), []).append(tensor.detach().sum())
    if all(bool(torch.isfinite(torch.stack(group)).all()) for group in sums.values()):
        return None
    return next((name for name, tensor in tensors if not is_finite(tensor)), None)


def non_finite_error(what: str, rank: int, name: str, ranks_affected: int = 1) -> CheckpointError:
    return CheckpointError(f"{what}: rank {rank}'s {name} holds NaN or Inf ({ranks_affected} rank(s) affected)")


def check_finite(model: list | None, optimizer, what: str) -> None:
    """All ranks: fail together, naming the first NaN/Inf tensor of the first rank that has one (the names
    travel only then: a finite state costs one ``RankComm.any``)."""
    mine = first_non_finite(model, optimizer)
    comm = RankComm()
    (found_any,) = comm.any(mine is not None)
    if not found_any:
        return
    found = comm.all_gather_object(mine)
    bad = [(rank, name) for rank, name in enumerate(found) if name is not None]
    if bad:
        raise non_finite_error(what, *bad[0], len(bad))


def check_finite_here(model: list | None, optimizer, what: str, rank: int) -> None:
    """This process alone (an async save's fork, which has no group of the parent's to agree in)."""
    name = first_non_finite(model, optimizer)
    if name is not None:
        raise non_finite_error(what, rank, name)


class DivergedError(RuntimeError):
    """Training produced NaN or Inf (a loss, a grad norm, logits): the model diverged; the message says where
    first, at which step, and the committed checkpoint to resume from."""


def first_non_finite_quantity(quantities: dict[str, Any]) -> str | None:
    """The name of the first of ``quantities`` (tensors or numbers, in order) holding NaN or Inf, or None."""
    for name, value in quantities.items():
        tensor = torch.as_tensor(value)
        if tensor.is_floating_point() and tensor.numel() and not is_finite(tensor):
            return name
    return None


def check_step_is_finite(step: int, quantities: dict[str, Any], checkpoint_dir: str, role: str = "actor") -> None:
    """Raise DivergedError naming the first non-finite of ``quantities`` at ``step`` and the checkpoint to resume.

    Everything a step checks comes from the weights the update of step ``step - 1`` wrote (the rollout's and
    the actor's logits, the loss and the gradients of them), and ``global_step_<step - 1>`` holds those very
    weights (finite, so its save took them: ``lr=1e30`` makes them huge, not Inf). So the checkpoint to
    resume is the newest committed step before that one."""
    name = first_non_finite_quantity(quantities)
    if name is None:
        return
    raise DivergedError(
        f"the model diverged at step {step}: {name} holds NaN or Inf; nothing of step {step} is saved. "
        f"{_resume_advice(checkpoint_dir, role, step)}, with a lower actor_rollout_ref.actor.optim.lr (or a smaller "
        "actor_rollout_ref.actor.optim.clip_grad)"
    )


def _resume_advice(checkpoint_dir: str, role: str, step: int) -> str:
    """Which committed step to resume after a divergence found at ``step`` (see ``check_step_is_finite``)."""
    from verl.utils.checkpoint.checkpoint_manager import read_tracker
    from verl.utils.checkpoint.integrity import is_complete
    from verl.utils.checkpoint.layout import list_step_dirs

    tracked = read_tracker(checkpoint_dir)
    committed = [] if tracked is None else [s for s, path in list_step_dirs(checkpoint_dir) if s <= tracked and is_complete(os.path.join(path, role))]
    source = "the initial (or resumed) weights" if step <= 1 else f"the weights of step {step - 1}'s update"
    before = [s for s in committed if s < step - 1]
    advice = f"It came from {source}"
    if step - 1 in committed:
        advice += f", which {os.path.join(checkpoint_dir, STEP_DIR_FORMAT.format(step - 1))} holds (do not resume it)"
    if not before:
        return advice + "; no committed checkpoint before them is kept: start again"
    path = os.path.join(checkpoint_dir, STEP_DIR_FORMAT.format(before[-1]))
    return advice + f"; the previous checkpoint, {path} (step {before[-1]}), is the one to resume: trainer.resume_mode=resume_path trainer.resume_from_path={path}"

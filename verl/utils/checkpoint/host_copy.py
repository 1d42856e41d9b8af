"""The host copy a ``background_write`` save's fork reads, taken in the rank before it forks.

A process forked from the rank sees the rank's host memory as it was at the fork (copy-on-write), never an
accelerator's memory. So the rank copies each state tensor a save reads that is not in host memory (the model's
parameters and buffers, the optimizer's parameters and state) into host memory, and the fork, before anything
reads the state, points each such tensor at its copy (``HostCopy.install``). From then on the NaN/Inf check, the
dist-checkpoint planning and writes and the HF export read the state as it was when the save returned, off the
training path. A tensor already in host memory is not copied: the fork's image of it
is its snapshot, and training's later writes copy the page in the rank, never in the fork.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from verl.utils.checkpoint.finite import torch_optimizers


def state_tensors(model: list | None, optimizer) -> Iterator[torch.Tensor]:
    """Every tensor a save reads, once each: the model chunks' parameters and buffers, then each inner torch
    optimizer's parameters (a distributed optimizer's fp32 main copies) and its state (Adam moments, step)."""
    seen: set[int] = set()

    def fresh(tensors: Iterable) -> Iterator[torch.Tensor]:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor

    for chunk in model or []:
        yield from fresh(chunk.parameters())
        yield from fresh(torch.nn.Module.buffers(chunk))  # megatron's DDP names its grad buffers ``buffers``
    for torch_optimizer in torch_optimizers(optimizer):
        for group in getattr(torch_optimizer, "param_groups", []):
            yield from fresh(group["params"])
        for state in getattr(torch_optimizer, "state", {}).values():
            yield from fresh(state.values())


@dataclasses.dataclass
class HostCopy:
    """Each state tensor not in host memory with its host copy (``take``, in the rank); none on a host-memory run."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    kept: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @classmethod
    def take(cls, model: list | None, optimizer) -> HostCopy:
        """In the rank: copy what the fork could not see (the one part of the save that holds training besides the fork)."""
        pairs = []
        with torch.no_grad():
            for tensor in state_tensors(model, optimizer):
                if not tensor.is_cpu:
                    pairs.append((tensor, tensor.cpu()))
        return cls(pairs)

    def install(self) -> None:
        """In the fork, before anything reads the state: each copied tensor now holds its host copy. What it held
        before stays referenced (``kept``): freeing device memory would be a device call, which a fork must not make."""
        self.kept = [tensor.data for tensor, _ in self.pairs]
        for tensor, host in self.pairs:
            tensor.data = host

"""Tensor helpers with upstream verl's names, used by the rollout, the losses and the metrics."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """Log-softmax of ``logits [..., vocab]`` gathered at ``labels [...]``, in fp32 whatever the input dtype,
    so rollout and Megatron logprobs can be compared at 1e-4.

    ``inplace_backward`` is upstream's switch for flash-attn's fused cross-entropy; this package has no such
    kernel, so like upstream without flash-attn it computes the same values and the flag changes nothing."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` (a weighted mask weighs, as upstream); masked-out entries are dropped first, so
    a NaN there does not leak."""
    valid = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return valid.sum() if axis is None else valid.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 for an empty mask rather than NaN)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (count + 1e-8)

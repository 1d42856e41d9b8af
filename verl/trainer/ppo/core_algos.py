"""GRPO advantages, the PPO-clip policy loss and the KL estimators, with upstream verl's names and semantics.

``policy_loss_per_token`` and ``kl_penalty`` are reduction-free: the Megatron loss function applies its own
global-token normalisation to them; ``compute_policy_loss`` is upstream's reduced form on top of the first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from verl.utils.torch_functional import masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
# Upstream clamps log(ratio) so one wild token cannot overflow exp().
_LOG_RATIO_BOUND = 20.0
# upstream's kl_penalty names (aliases share an estimator); a trailing "+" takes k2's gradient (below).
# "full" (the exact KL over the whole vocabulary) is not implemented, upstream raises for it too.
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_LOW_VAR_KL_BOUND = 10.0


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | Sequence,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome advantages normalised within each group of responses to the same prompt.

    A row's score is the sum of its token rewards; rows sharing ``index[i]`` form a group; the score minus the
    group mean (divided by the group's unbiased std + ``epsilon`` when ``norm_adv_by_std_in_grpo``) is
    broadcast over the response tokens and masked. A group of one has mean 0 and std 1, as upstream.
    ``config`` (upstream's ``AlgoConfig``, which every registered estimator takes) is not read, as upstream.
    Returns ``(advantages, returns)``, which are equal for GRPO.
    """
    scores = token_level_rewards.sum(dim=-1)
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {scores.shape[0]} rows; pass one group id per row")
    groups: dict = defaultdict(list)
    for row, group_id in enumerate(index):
        groups[group_id].append(row)
    normalised = torch.empty_like(scores)
    for rows in groups.values():
        group_scores = scores[rows]
        if len(rows) == 1:
            mean, std = torch.zeros((), dtype=scores.dtype), torch.ones((), dtype=scores.dtype)
        else:
            mean, std = group_scores.mean(), group_scores.std()
        centred = group_scores - mean
        normalised[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    advantages = normalised.unsqueeze(-1) * response_mask
    return advantages, advantages


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce one micro-batch's ``[batch, response_len]`` loss to a scalar, upstream's aggregation exactly.

    The global-batch denominators (``batch_num_tokens``: valid tokens, ``global_batch_size``: sequences with at
    least one valid token) default to this micro-batch's own and must be given when ``dp_size > 1``; the result
    is scaled by ``dp_size`` so the data-parallel mean of the ranks' losses is the global aggregate.

    token-mean: token sum / ``batch_num_tokens``; token-sum: token sum; seq-mean-token-sum: sum over sequences
    of each one's token sum / ``global_batch_size``; seq-mean-token-sum-norm: that / ``loss_scale_factor``
    (default: ``response_len``); seq-mean-token-mean: sum over sequences of each one's token mean /
    ``global_batch_size``. Fully masked rows add nothing and are not counted; an all-masked micro-batch with
    the default denominators gives NaN (0 / 0), as upstream. Masked-out entries never leak, even NaN.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss(token-mean): pass the global batch_num_tokens when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        # DDP averages gradients over ranks: scaling each rank's sum by dp_size makes the mean the global sum.
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens + 1e-8)
        seq_mask = (tokens > 0).to(seq_losses.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss({loss_agg_mode}): pass the global_batch_size when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")


def policy_loss_per_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    clip_ratio_c: float,
) -> dict[str, torch.Tensor]:
    """Dual-clip PPO per token, no reduction and no mask (the caller normalises).

    Returns ``pg_losses`` (the loss per token), ``clipped_high`` (float, 1 where the clipped surrogate was the
    larger, i.e. the ratio bound was taken), ``clipped_lower`` (float, 1 where the dual clip at
    ``-advantage * clip_ratio_c`` applied, negative advantages only) and ``negative_approx_kl``
    (``log_prob - old_log_prob``, clamped to +-20 as in the ratio).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(negative_approx_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    return {
        "pg_losses": pg_losses,
        "clipped_high": (clipped > unclipped).float(),
        "clipped_lower": ((clip_loss > dual_bound) & negative).float(),
        "negative_approx_kl": negative_approx_kl,
    }


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream's vanilla PPO-clip loss: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, the fractions and
    the KL averaged over valid tokens. ``cliprange_low``/``cliprange_high`` default to ``cliprange``, which has
    no default (as upstream): a bound left unset is refused."""
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    if cliprange_low is None or cliprange_high is None:
        raise TypeError("compute_policy_loss needs a clip range: pass cliprange (or both cliprange_low and cliprange_high)")
    per_token = policy_loss_per_token(
        old_log_prob,
        log_prob,
        advantages,
        cliprange_low=cliprange_low,
        cliprange_high=cliprange_high,
        clip_ratio_c=clip_ratio_c,
    )
    pg_loss = agg_loss(per_token["pg_losses"], response_mask, loss_agg_mode)
    pg_clipfrac = masked_mean(per_token["clipped_high"], response_mask)
    ppo_kl = masked_mean(-per_token["negative_approx_kl"], response_mask)
    pg_clipfrac_lower = masked_mean(per_token["clipped_lower"], response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def kl_penalty_types() -> tuple[str, ...]:
    """Every ``kl_loss_type`` / ``kl_penalty`` value ``kl_penalty`` accepts: the estimators and their "+" forms."""
    return KL_PENALTY_TYPES + tuple(f"{name}+" for name in KL_PENALTY_TYPES)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities
    (J. Schulman, "Approximating KL divergence", 2020).

    kl / k1: ``logprob - ref_logprob`` (unbiased, high variance, can be negative); abs: its absolute value;
    mse / k2: half its square; low_var_kl / k3: ``r - log r - 1`` with ``r = ref_prob / prob`` (unbiased and
    never negative; the log-ratio clamped to +-20 and the result to +-10, as upstream).
    """
    diff = logprob - ref_logprob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(-diff, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
        estimate = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(estimate, min=-_LOW_VAR_KL_BOUND, max=_LOW_VAR_KL_BOUND)
    raise ValueError(f"kl_penalty={kl_penalty!r} is not implemented; use one of {', '.join(kl_penalty_types())}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """``kl_penalty_forward``; a name ending in "+" (e.g. ``k3+``) keeps that estimate's value but takes
    the gradient of k2, the estimator whose expected gradient is the KL's (upstream's straight-through form)."""
    if not kl_penalty.endswith("+"):
        return kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
    if kl_penalty in ("mse+", "k2+"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()

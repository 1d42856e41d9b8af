"""The log-prob parity check: the actor's recomputed log-probs against the rollout's own, on every step.

The rollout (transformers) and the actor (Megatron, built through the bridge) hold the same weights, so on the
first batch, before any update, they must give the same log-probs up to the rounding of their dtype. A larger
gap means the two are different models (the bridge maps an HF config field differently, e.g. a router that
normalises its top-k weights in one and not the other, or an activation it does not read) or see different
inputs (padding), and the run would train one model while sampling from another. Tolerances per dtype were
measured with ``benchmarks/measure_log_prob_parity.py`` (docs/trainer.md, "The log-prob parity gate").

After the first batch the same tolerance holds on every step (``every_step``): the two still hold the same weights,
synced after each update, so a gap that appears later means the sync put weights where they do not belong (a tensor
dropped or written twice, an MoE expert written into another expert's slot) and the rollout samples from a model
other than the one being trained.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

GATE_KEY = "actor_rollout_ref.rollout.log_prob_parity_check"


class LogProbParityError(RuntimeError):
    """The actor and the rollout disagree beyond the dtype's tolerance."""


def log_prob_gaps(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``|actor - rollout|`` at every response token (a flat tensor; padding after EOS left out)."""
    return (actor_log_probs.float() - rollout_log_probs.float()).abs()[response_mask.bool()]


def max_log_prob_diff(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Largest ``|actor - rollout|`` over the response tokens (0.0 when there are none)."""
    diff = log_prob_gaps(actor_log_probs, rollout_log_probs, response_mask)
    return diff.max().item() if diff.numel() else 0.0


def rollout_probs_metrics(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """Upstream's debug metrics of the two sides' token probabilities over the response tokens (its
    ``training/rollout_probs_diff_*`` names: ``|p_actor - p_rollout|`` and their Pearson correlation)."""
    keep = response_mask.bool()
    actor, rollout = actor_log_probs.float()[keep].exp(), rollout_log_probs.float()[keep].exp()
    if not actor.numel():
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0, "training/rollout_probs_diff_max": nan, "training/rollout_probs_diff_mean": nan,
                "training/rollout_probs_diff_std": nan, "training/rollout_actor_probs_pearson_corr": nan}  # fmt: skip
    diff = (actor - rollout).abs()
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": torch.corrcoef(torch.stack([actor, rollout]))[0, 1].item() if diff.numel() > 1 else float("nan"),
    }


def check_log_prob_parity(max_diff: float, dtype: str, tolerances: Mapping[str, float], step: int | None = None) -> float:
    """The tolerance that ``max_diff`` passed; raises ``LogProbParityError`` naming the gap, the tolerance,
    the dtype, the likely causes and the key that turns the check off. ``step``: a step after the first batch
    (None: the first batch, the gate)."""
    if dtype not in tolerances:
        raise LogProbParityError(
            f"log-prob parity gate: no tolerance for the actor's dtype {dtype}; set {GATE_KEY}.tolerance.{dtype}=<x> "
            f"(measure it with benchmarks/measure_log_prob_parity.py) or {GATE_KEY}.enable=False"
        )
    tolerance = float(tolerances[dtype])
    if not max_diff <= tolerance and step is not None:  # also catches NaN
        raise LogProbParityError(
            f"log-prob parity on step {step}: the actor's log-probs differ from the rollout's by up to {max_diff:.3e}, over the "
            f"{dtype} tolerance {tolerance:.1e} ({GATE_KEY}.tolerance.{dtype}). They agreed on the first batch, so the rollout no "
            "longer holds the weights being trained: the weight sync after an update dropped, duplicated or misplaced a tensor "
            "(e.g. an MoE expert written into another expert's slot). The steps saved before this one are intact. To check only "
            f"the first batch set {GATE_KEY}.every_step=False."
        )
    if not max_diff <= tolerance:
        raise LogProbParityError(
            f"log-prob parity gate: on the first batch the actor's log-probs differ from the rollout's by up to {max_diff:.3e}, "
            f"over the {dtype} tolerance {tolerance:.1e} ({GATE_KEY}.tolerance.{dtype}). The actor (Megatron, through the bridge) "
            "and the rollout (transformers) are not computing the same model: likely a bridge mapping mismatch for this "
            "model family (e.g. a router that renormalises its top-k weights in one and not the other, an activation or "
            "config field the bridge does not read; docs/models.md), or padding treated differently. Training would "
            f"update one model while sampling from another. To run anyway set {GATE_KEY}.enable=False."
        )
    return tolerance

"""The PPO actor on one Megatron rank: log-probabilities of responses and the clipped policy update.

Both run through megatron's pipeline schedule on this rank's data-parallel share of the batch. The
policy loss is a token mean over the whole mini-batch (every data-parallel rank's tokens), so the
update does not depend on how the batch was split into ranks and microbatches. With ``use_kl_loss`` the
loss adds ``kl_loss_coef`` times the token mean of the KL estimate to the reference policy (the batch's
``ref_log_prob``); with ``entropy_coeff`` it subtracts that times the token mean of the entropy (upstream's terms).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from verl.models.mcore.forward import (
    broadcast_from_last_stage,
    compute_log_probs,
    compute_log_probs_and_entropy,
    forward_backward,
    model_device,
    to_device,
    token_entropy,
    token_log_probs,
)
from verl.trainer.ppo.core_algos import kl_penalty, policy_loss_per_token
from verl.workers.config import McoreActorConfig, RolloutConfig

# Per-mini-batch sums the loss function collects; the trainer divides them by the token count.
# kl_loss / entropy_loss stay 0 unless use_kl_loss / entropy_coeff switch their term on.
_STAT_KEYS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy_loss", "tokens")


class MegatronPPOActor:
    """``config``: the actor's typed config (its PPO terms and epochs, upstream's names and the YAML's values);
    ``rollout``: the rollout's, whose ``response_length`` and ``temperature`` the log-probs are taken at. What
    depends on this rank's share of a batch (rows per micro batch, per optimizer step) each call is given."""

    def __init__(self, config: McoreActorConfig, rollout: RolloutConfig, model: list, optimizer, scheduler) -> None:
        self.config = config
        self.rollout = rollout
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler

    def compute_log_prob(self, input_ids: torch.Tensor, micro_batch_size: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, response_length]`` log-probabilities of each row's response under the current weights, in micro
        batches of ``micro_batch_size`` rows (``attention_mask``: 0 on the prompts' left padding)."""
        r = self.rollout
        return compute_log_probs(self.model, input_ids, r.response_length, r.temperature, micro_batch_size, attention_mask)

    def compute_log_prob_and_entropy(
        self, input_ids: torch.Tensor, micro_batch_size: int, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``compute_log_prob`` and the entropy at each response position (upstream's ``calculate_entropy``)."""
        r = self.rollout
        return compute_log_probs_and_entropy(self.model, input_ids, r.response_length, r.temperature, micro_batch_size, attention_mask)

    def update_policy(self, batch: dict[str, torch.Tensor], micro_batch_size: int, mini_batch_rows: int | None = None) -> dict[str, float]:
        """PPO-clip updates on ``batch`` (``input_ids``, ``response_mask``, ``old_log_probs``, ``advantages``,
        ``ref_log_prob`` with ``use_kl_loss``, and optionally ``attention_mask``, 0 on the prompts' left padding),
        one optimizer step per ``mini_batch_rows`` rows (None: all rows, one step) in micro batches of
        ``micro_batch_size`` rows.

        Returns the sums of the loss statistics over every mini-batch and data-parallel rank (divide by
        ``tokens``), and the last step's grad norm and learning rate.
        """
        rows = batch["input_ids"].shape[0]
        per_step = mini_batch_rows or rows
        if rows % per_step or per_step % micro_batch_size:
            raise ValueError(
                f"{rows} rows on this rank do not split into mini-batches of {per_step} rows made of whole microbatches of "
                f"{micro_batch_size}; adjust actor_rollout_ref.actor.ppo_mini_batch_size / ppo_micro_batch_size_per_gpu"
            )
        totals = torch.zeros(len(_STAT_KEYS), dtype=torch.float64)
        result: dict[str, float] = {}
        for _ in range(self.config.ppo_epochs):
            for start in range(0, rows, per_step):
                part = {key: value[start : start + per_step] for key, value in batch.items()}
                stats, step = self._optimizer_step(part, micro_batch_size)
                totals += stats
                result.update(step)
        result.update({key: float(value) for key, value in zip(_STAT_KEYS, totals.tolist(), strict=True)})
        return result

    def _optimizer_step(self, mini_batch: dict[str, torch.Tensor], micro_batch_size: int) -> tuple[torch.Tensor, dict]:
        c, response_length, temperature = self.config, self.rollout.response_length, self.rollout.temperature
        clip_low, clip_high = c.clip_ratios()
        # on the model's device: the token count's all-reduce and the loss terms meet the logits there
        mini_batch = to_device(mini_batch, model_device(self.model))
        tokens = mini_batch["response_mask"].sum().to(torch.float64)
        # Every data-parallel rank divides by the same global count; megatron divides each microbatch
        # loss by the number of microbatches and DDP averages over data parallel: undo both.
        torch.distributed.all_reduce(tokens, group=mpu.get_data_parallel_group())
        microbatches = [
            dict(zip(mini_batch.keys(), values, strict=True))
            for values in zip(*(value.split(micro_batch_size) for value in mini_batch.values()), strict=True)
        ]
        scale = len(microbatches) * mpu.get_data_parallel_world_size() / max(float(tokens), 1.0)

        def loss_fn(microbatch: dict, vocab_parallel_logits: torch.Tensor):
            log_probs = token_log_probs(vocab_parallel_logits, microbatch["input_ids"], temperature)[:, -response_length:]
            terms = policy_loss_per_token(
                microbatch["old_log_probs"], log_probs, microbatch["advantages"],
                clip_low, clip_high, c.clip_ratio_c,
            )  # fmt: skip
            mask = microbatch["response_mask"].to(log_probs.dtype)
            per_token = terms["pg_losses"]
            kl_sum = entropy_sum = torch.zeros((), dtype=mask.dtype, device=mask.device)
            if c.use_kl_loss:
                kld = kl_penalty(log_probs, microbatch["ref_log_prob"], c.kl_loss_type)
                per_token = per_token + c.kl_loss_coef * kld
                kl_sum = (kld * mask).sum()
            if c.entropy_coeff != 0:
                entropy = token_entropy(vocab_parallel_logits, temperature)[:, -response_length:]
                per_token = per_token - c.entropy_coeff * entropy
                entropy_sum = (entropy * mask).sum()
            loss = (per_token * mask).sum() * scale
            stats = torch.stack(
                [
                    (terms["pg_losses"] * mask).sum(),
                    (terms["clipped_high"].to(mask.dtype) * mask).sum(),
                    (terms["clipped_lower"].to(mask.dtype) * mask).sum(),
                    (-terms["negative_approx_kl"] * mask).sum(),
                    kl_sum,
                    entropy_sum,
                    mask.sum(),
                ]
            ).detach()
            return loss, {"stats": stats}

        # Parameters whose gradients live outside the DDP buffers keep .grad between steps unless cleared.
        self.optimizer.zero_grad()
        collected = forward_backward(self.model, microbatches, loss_fn)
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
        local = torch.stack([item["stats"] for item in collected]).sum(0).double() if collected else None
        local = broadcast_from_last_stage(local)
        torch.distributed.all_reduce(local, group=mpu.get_data_parallel_group())
        local = local.cpu()
        step = {
            "grad_norm": float(grad_norm or 0.0),
            "update_ok": bool(update_ok),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }
        return local, step

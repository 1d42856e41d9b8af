"""The GRPO trainer on the driver: rollout, reward, advantages, update, periodic saves, resume.

One step (``MegatronGRPOTrainer.fit``):

1. the next ``data.train_batch_size`` prompts of ``data.train_files`` (parquet in upstream's RLHFDataset format;
   the embedded task is written as such a file first: ``verl.trainer.data_plan``), left-padded to the run's one
   prompt length with an attention mask (0 on padding) that the rollout and Megatron both honour, each repeated
   ``rollout.n`` times;
2. ``generate_sequences`` on the ranks: the actor's current weights go to an HF model in memory
   (``verl.models.mcore.parallel_hf_save.gather_hf_weights``), which samples the responses; the sampling seed is a function of
   ``data.seed``, the step and the data-parallel rank, so a resumed run samples what an uninterrupted one would;
3. rule-based rewards on the driver, GRPO advantages (group-normalised per prompt);
4. ``compute_log_prob``: Megatron recomputes the responses' log-probabilities (the PPO "old" policy;
   their distance to the rollout's is logged as ``rollout/log_prob_diff_max``; on the run's first batch the
   parity gate stops the run when it exceeds the dtype's tolerance: ``verl.trainer.ppo.log_prob_parity``) and
   their entropy (``actor/entropy``); with ``actor.use_kl_loss``, ``compute_ref_log_prob``: the same under the
   reference policy, a second Megatron model on the same ranks holding the initial weights;
5. ``update_actor``: the PPO-clip loss (plus ``kl_loss_coef`` x the KL to the reference, minus
   ``entropy_coeff`` x the entropy) through Megatron's pipeline, optimizer step;
6. every ``trainer.save_freq`` steps, at the last, and (as upstream) once a capacity block's end is nearer than the
   longest step so far + 60 s + ``trainer.esi_redundant_time`` (``should_save_ckpt_esi``), the workers save ``global_step_N/actor``
   through their step transaction (``verl.utils.checkpoint.step_commit``), which the driver hands
   ``global_step_N/data.pt`` (the prompt sampler's position): it commits the step, then writes data.pt, and
   only then ``latest_checkpointed_iteration.txt``. A crash before that leaves the previous step tracked.
   With ``checkpoint.async_save`` training goes on while the ranks write the dist checkpoint; after every
   step the driver asks whether the write is durable and then commits and tracks the step (at the latest
   before the next save and at the end of the run).

With ``data.val_files`` the run validates before the first step (``trainer.val_before_train``), every
``trainer.test_freq`` steps and at the last one: every validation prompt sampled ``val_kwargs.n`` times with
``rollout.val_kwargs``, scored by the same reward, logged as upstream names it (``val-core/<data_source>/reward/mean@<n>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import torch

from verl.single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool, WorkerGroupError
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.log_prob_parity import (
    check_log_prob_parity,
    log_prob_gaps,
    max_log_prob_diff,
    rollout_probs_metrics,
)
from verl.trainer.run_config import CustomRewardFunctionConfig, build_run_config
from verl.trainer.run_control import output_dir, read_committed_step
from verl.trainer.shared_dir import check_shared_dir
from verl.utils.checkpoint import layout
from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename, should_save_ckpt_esi
from verl.utils.checkpoint.finite import check_step_is_finite
from verl.utils.checkpoint.layout import DATA_STATE_FILENAME, STEP_DIR_FORMAT
from verl.utils.checkpoint.resume_check import CheckedStep, resume_check_metrics
from verl.utils.dataset.arithmetic import PromptSampler
from verl.utils.dataset.rl_dataset import left_pad, left_pad_attention_mask
from verl.utils.reward_score import default_compute_score
from verl.utils.tracking import Tracking
from verl.workers.engine_workers import ActorRolloutRefWorker

METRICS_FILENAME = "metrics.jsonl"
REWARD_PLOT_FILENAME = "reward_curve.png"


def sampling_seed(data_seed: int, step: int, dp_rank: int) -> int:
    """The rollout's sampling seed: a function of the step, so resume needs no generator state."""
    return (data_seed * 1_000_003 + step) * 1009 + dp_rank


class MegatronGRPOTrainer:
    """The GRPO driver over one Megatron worker group. Not upstream's ``RayPPOTrainer`` (built from
    ``role_worker_mapping`` and a ``resource_pool_manager``): named apart so an upstream caller fails on the
    import instead of getting a different API under the same name."""

    def __init__(
        self,
        config: Any,
        model_path: str,
        device: str,
        resume: tuple[int, str] | None,
        data: Any = None,
        tokenizer: Any = None,
        resume_checked: CheckedStep | None = None,
    ) -> None:
        """``config``: the run's ``RunConfig`` (main_ppo builds it once while validating; a composed Hydra config is
        built into one here); ``data``: the run's prompts (``verl.trainer.data_plan.RunData``), loaded here when not
        given. ``resume_checked``: main_ppo's record of its check of the resumed step, handed to the ranks' load so
        that they do not repeat it (None: the ranks check the step themselves)."""
        from verl.trainer.data_plan import load_run_data, load_tokenizer

        self.config = config = build_run_config(config)
        self.model_path = model_path
        self.device = device
        self.resume = resume
        self.resume_checked = resume_checked
        self.resume_metrics: dict = {}  # how the resume checked its step (``resume_check_metrics``): its first step's ``resume``
        self.trainer_config, self.data_config = config.trainer, config.data
        self.default_local_dir = output_dir(config.trainer)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config, model_path)
        self.data = data if data is not None else load_run_data(config, self.tokenizer)
        self.total_training_steps = self.data.total_training_steps
        config.set_training_steps(self.total_training_steps)
        self.actor_configs = config.actor
        self.save_freq = self.trainer_config.save_freq
        self.global_steps = 0
        self.actor_rollout_wg: MegatronRayWorkerGroup | None = None
        self.loggers = list(self.trainer_config.logger)
        self.metrics_path = os.path.join(self.default_local_dir, METRICS_FILENAME)
        self.tracking: Tracking | None = None  # file / tensorboard / wandb, opened by fit()
        self.actor_dtype = "float32"  # what the ranks report once built
        self.bridges: dict | None = None  # {"actor": ..., "ref": ...}: the bridges the ranks built through
        self.parity_checked = False  # the log-prob parity gate runs on the first batch of this process, then every step
        self.saved: list[dict] = []
        self._pending: dict | None = None  # an async save not yet committed
        self.history: list[dict] = []
        self.sampler = PromptSampler(
            self.data.train.rows, self.data_config.train_batch_size, self.data_config.seed, shuffle=self.data_config.shuffle
        )
        self.n = config.rollout.n
        self.compute_score = load_reward_function(config.custom_reward_function)
        # upstream's attribute: a reference policy exists for the KL loss (use_kl_in_reward is refused here)
        self.use_reference_policy = config.actor.use_kl_loss

    # ------------------------------------------------------------------ workers

    def init_workers(self) -> None:
        trainer = self.trainer_config
        # The typed configs (model, actor, rollout, ref) travel to every rank; being Mappings, dict-style reads work.
        worker_config = {**self.config.actor_rollout_ref, "model": dataclasses.replace(self.config.model, path=self.model_path)}
        pool = RayResourcePool(
            [trainer.n_gpus_per_node] * trainer.nnodes, use_gpu=self.device == "cuda", name_prefix="actor_rollout"
        )
        start = time.monotonic()
        if self._ranks_use_checkpoint_dir():
            # Before any rank starts: a node that does not share the directory would split every checkpoint.
            try:
                pool.get_placement_groups(timeout_s=float(trainer.ray_wait_register_center_timeout))
                nodes = set(pool.bundle_node_ids())
                if nodes != {ray.get_runtime_context().get_node_id()}:  # ranks beyond this process's node
                    check_shared_dir(self.default_local_dir, sorted(nodes))
                    self._print(f"[trainer] {self.default_local_dir} is the same directory on all {len(nodes)} nodes of the run")
            except BaseException:
                pool.remove()
                raise
        self.actor_rollout_wg = MegatronRayWorkerGroup(
            pool,
            RayClassWithInitArgs(ActorRolloutRefWorker, config=worker_config, role="actor_rollout_ref" if self.use_reference_policy else "actor"),
            init_timeout_s=float(trainer.ray_wait_register_center_timeout),
        )
        wg = self.actor_rollout_wg
        self._print(
            f"[trainer] {wg.world_size} ranks up in {time.monotonic() - start:.1f}s "
            f"(TP {wg.tp_size} x PP {wg.pp_size} x CP {wg.cp_size} x DP {wg.dp_size}, device {self.device})"
        )
        start = time.monotonic()
        built = wg.init_model()
        self.actor_dtype = built[0]["dtype"]
        self.bridges = built[0]["bridge"]
        self._print(f"[trainer] model built on every rank in {time.monotonic() - start:.1f}s ({built[0]['num_params']:,} parameters on rank 0)")
        if built[0]["ref"]:
            offload = self.config.actor_rollout_ref["ref"]["megatron"].param_offload
            self._print(f"[trainer] reference policy built from {self.model_path} on the same ranks (never trained or saved; ref.megatron.param_offload={offload})")

    def _ranks_use_checkpoint_dir(self) -> bool:
        """Whether the ranks write into ``trainer.default_local_dir`` (saves) or load a step from under it."""
        resume_here = self.resume is not None and os.path.abspath(self.resume[1]).startswith(self.default_local_dir + os.sep)
        return self.save_freq > 0 or resume_here

    def pending_step(self) -> int | None:
        """The step of an async save not committed yet: a stop now discards it (the tracker keeps the previous one)."""
        return self._pending["step"] if self._pending else None

    def shutdown(self) -> None:
        if self.actor_rollout_wg is not None:
            self.actor_rollout_wg.shutdown()
            self.actor_rollout_wg = None
        if self.tracking is not None:
            self.tracking.finish()
            self.tracking = None

    # ------------------------------------------------------------------ loop

    def fit(self) -> None:
        from tqdm import tqdm

        self.global_steps = self._load_checkpoint()
        trainer = self.trainer_config
        self.tracking = self._open_tracking()
        if self.data.val is not None and (trainer.val_before_train or trainer.val_only):
            val_metrics = self._validate()
            self._log_metrics({"step": self.global_steps, **val_metrics}, history=False)
            self._print(_val_line(self.global_steps, val_metrics))
            if trainer.val_only:
                return
        if self.global_steps >= self.total_training_steps:  # main_ppo stops before starting ranks; kept for other callers
            self._print(f"[trainer] step {self.global_steps} >= trainer.total_training_steps={self.total_training_steps}: nothing to train")
            return
        bar = tqdm(
            total=self.total_training_steps, initial=self.global_steps, desc="GRPO", unit="step",
            # On a terminal; in logs (CI, ray job logs) the per-step lines below say the same.
            disable="console" not in self.loggers or not sys.stderr.isatty(), dynamic_ncols=True,
        )  # fmt: skip
        longest_step = 0.0  # upstream's max_steps_duration: how long one more step may take, for the ESI deadline
        try:
            for step in range(self.global_steps + 1, self.total_training_steps + 1):
                self.global_steps = step
                step_start = time.monotonic()
                metrics = self._train_step(step)
                metrics["bridge"] = self.bridges  # which bridge built each model (a record, as "checkpoint")
                if self.resume_metrics:
                    metrics["resume"], self.resume_metrics = self.resume_metrics, {}
                committed = self._finalize_pending(bar, blocking=False)
                if committed:
                    metrics["checkpoint_committed"] = committed
                test_freq = trainer.test_freq
                if self.data.val is not None and test_freq > 0 and (step >= self.total_training_steps or step % test_freq == 0):
                    start = time.monotonic()
                    val_metrics = self._validate()
                    metrics.update(val_metrics)
                    metrics["timing_s/testing"] = round(time.monotonic() - start, 3)
                    if "console" in self.loggers:
                        bar.write(_val_line(step, val_metrics))
                deadline_near = should_save_ckpt_esi(longest_step, redundant_time=float(trainer.esi_redundant_time))
                logged = False
                try:
                    if self.save_freq > 0 and (step >= self.total_training_steps or step % self.save_freq == 0 or deadline_near):
                        if deadline_near and "console" in self.loggers:
                            bar.write(f"[trainer] saving step {step} outside save_freq: the capacity block ends within the next step and a save")
                        start = time.monotonic()
                        metrics["checkpoint"] = self._save_checkpoint(bar)
                        metrics["timing_s/save_checkpoint"] = round(time.monotonic() - start, 3)
                    self._log_metrics(metrics)
                    logged = True
                except KeyboardInterrupt:
                    # A stop after the tracker moved to this step: a resume starts after it, so its metrics line is
                    # written now or never.
                    if not logged and read_committed_step(self.default_local_dir)[0] == step:
                        self._log_metrics(metrics)
                    raise
                bar.set_postfix(
                    reward=f"{metrics['critic/score/mean']:.3f}", pg_loss=f"{metrics['actor/pg_loss']:.4f}",
                    len=f"{metrics['response_length/mean']:.1f}", refresh=False,
                )  # fmt: skip
                bar.update(1)
                if "console" in self.loggers:
                    bar.write(_step_line(metrics, self.total_training_steps))
                longest_step = max(longest_step, time.monotonic() - step_start)
            self._finalize_pending(bar, blocking=True)  # the last save is committed before the run ends
        finally:
            bar.close()
        self._summary()

    def _train_step(self, step: int) -> dict:
        timing: dict[str, float] = {}
        start_step = time.monotonic()
        rows = self.sampler.next_batch()
        group_index = np.repeat(np.arange(len(rows)), self.n)
        input_ids = self._encode_prompts(rows).repeat_interleave(self.n, dim=0)
        prompt_mask = self._prompt_attention_mask(rows).repeat_interleave(self.n, dim=0)

        with _timed(timing, "gen"):
            rollout = self._generate(input_ids, step, timing, attention_mask=prompt_mask)
        timing["gen"] -= timing["update_weights"]  # upstream's split: gen is the sampling, update_weights the sync
        self._stop_if_diverged(step, {"the rollout's logits (their log-probs of the sampled tokens)": rollout["rollout_log_probs"]})
        with _timed(timing, "reward"):
            scores = self._score(rows, rollout["responses"], rollout["response_mask"])
            advantages = self._advantages(scores, rollout["response_mask"], group_index)
        sequences = torch.cat([input_ids, rollout["responses"]], dim=1)
        # Every generated token is attended to (transformers extends the mask with ones while generating).
        attention_mask = torch.cat([prompt_mask, torch.ones_like(rollout["responses"])], dim=1)
        old_log_probs, policy_terms, policy_metrics = self._policy_log_probs(sequences, attention_mask, rollout["response_mask"], timing)
        self._stop_if_diverged(step, {"the actor's logits (its log-probs of the rollout)": old_log_probs})
        self._check_parity(step, old_log_probs, rollout)
        batch = {"input_ids": sequences, "attention_mask": attention_mask, "response_mask": rollout["response_mask"],
                 "old_log_probs": old_log_probs, "advantages": advantages, **policy_terms}  # fmt: skip
        with _timed(timing, "update_actor"):
            updates = self.actor_rollout_wg.update_actor(self._split(batch))
        self._stop_if_diverged(step, {"the policy loss": [u["pg_loss"] for u in updates], "the grad norm": [u["grad_norm"] for u in updates]})
        timing["step"] = time.monotonic() - start_step
        return {"step": step, **self._step_metrics(scores, advantages, rollout, old_log_probs, updates), **policy_metrics,
                **rollout["sync_metrics"],
                **self._kl_entropy_metrics(updates), "data/epoch": self.sampler.epoch,
                **{f"timing_s/{key}": round(value, 3) for key, value in timing.items()}}  # fmt: skip

    def _stop_if_diverged(self, step: int, quantities: dict) -> None:
        """A NaN/Inf in what the step has in hand stops the run here, naming it and the committed step to resume."""
        check_step_is_finite(step, quantities, self.default_local_dir)

    def _policy_log_probs(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, timing: dict
    ) -> tuple[torch.Tensor, dict, dict]:
        """The old policy's log-probs and entropy, and with a reference policy its log-probs (``ref_log_prob``,
        upstream's batch key): ``(old_log_probs, extra batch entries, metrics)``."""
        inputs = {"input_ids": sequences, "attention_mask": attention_mask}
        with _timed(timing, "old_log_prob"):
            outputs = self.actor_rollout_wg.compute_log_prob(self._split(inputs))
        old_log_probs = torch.cat([out["old_log_probs"] for out in outputs])
        entropys = torch.cat([out["entropys"] for out in outputs])
        mask = response_mask.to(entropys.dtype)
        # upstream's actor/entropy: the token mean (loss_agg_mode token-mean) of the old pass's entropy
        metrics = {"actor/entropy": ((entropys * mask).sum() / mask.sum().clamp(min=1)).item()}
        if not self.use_reference_policy:
            return old_log_probs, {}, metrics
        with _timed(timing, "ref"):
            outputs = self.actor_rollout_wg.compute_ref_log_prob(self._split(inputs))
        metrics["ref/param_offloaded"] = all(out["param_offloaded_before"] and out["param_offloaded_after"] for out in outputs)
        return old_log_probs, {"ref_log_prob": torch.cat([out["ref_log_prob"] for out in outputs])}, metrics

    def _kl_entropy_metrics(self, updates: list[dict]) -> dict:
        """The update's KL and entropy terms as upstream names them (each a token mean over the step's tokens)."""
        actor, update = self.config.actor, updates[0]  # already summed over data-parallel ranks
        tokens = max(update["tokens"], 1.0)
        metrics = {}
        if actor.use_kl_loss:
            metrics["actor/kl_loss"] = update["kl_loss"] / tokens
            metrics["actor/kl_coef"] = float(actor.kl_loss_coef)
        if float(actor.entropy_coeff) != 0:
            metrics["actor/entropy_loss"] = update["entropy_loss"] / tokens
        return metrics

    def _split(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """One dict per data-parallel rank, the rows split evenly in order."""
        parts = zip(*(value.chunk(self.actor_rollout_wg.dp_size) for value in batch.values()), strict=True)
        return [dict(zip(batch, values, strict=True)) for values in parts]

    def _generate(
        self, input_ids: torch.Tensor, step: int, timing: dict, sampling: dict | None = None, seed_offset: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        seed = self.data_config.seed + seed_offset
        prompts = {"input_ids": input_ids} if attention_mask is None else {"input_ids": input_ids, "attention_mask": attention_mask}
        shards = [
            {**part, "seed": sampling_seed(seed, step, dp), **({"sampling": sampling} if sampling else {})}
            for dp, part in enumerate(self._split(prompts))
        ]
        generated = self.actor_rollout_wg.generate_sequences(shards)
        timing["update_weights"] = max(g["timing"]["update_weights"] for g in generated)
        out = {key: torch.cat([g[key] for g in generated]) for key in ("responses", "response_mask", "rollout_log_probs")}
        return {**out, "sync_metrics": _sync_metrics([g["sync"] for g in generated])}

    def _validate(self) -> dict:
        """Every validation prompt, ``val_kwargs.n`` responses each, scored by the training reward.

        Metrics as upstream names them: ``val-core/<data_source>/reward/mean@<n>`` (per prompt the mean over its
        n responses, then the mean over prompts) and, for n > 1, ``val-aux/<data_source>/reward/std@<n>``.
        Batches of ``data.val_batch_size`` prompts (null: all), padded to a multiple of the data-parallel size
        by repeating the last sequence (its extra responses are not scored).
        """
        val_kwargs = self.config.rollout.val_kwargs
        n = val_kwargs.n
        sampling = {"do_sample": val_kwargs.do_sample, "temperature": val_kwargs.temperature, "top_p": val_kwargs.top_p}
        rows_all = self.data.val.rows
        per_batch = self.data_config.val_batch_size or len(rows_all)
        dp = self.actor_rollout_wg.dp_size
        scores: dict[str, list[list[float]]] = {}
        samples: list[tuple[str, str, float]] = []
        for start in range(0, len(rows_all), per_batch):
            rows = rows_all[start : start + per_batch]
            input_ids = self._encode_prompts(rows).repeat_interleave(n, dim=0)
            prompt_mask = self._prompt_attention_mask(rows).repeat_interleave(n, dim=0)
            extra = (-input_ids.shape[0]) % dp
            if extra:
                input_ids = torch.cat([input_ids, input_ids[-1:].expand(extra, -1)])
                prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(extra, -1)])
            out = self._generate(input_ids, self.global_steps, {}, sampling=sampling, seed_offset=7919, attention_mask=prompt_mask)
            for i, row in enumerate(rows):
                group = []
                for j in range(n):
                    ids, mask = out["responses"][i * n + j].tolist(), out["response_mask"][i * n + j].tolist()
                    text = response_text(self.tokenizer, [t for t, m in zip(ids, mask, strict=True) if m])
                    group.append(self._score_one(row, text))
                    if len(samples) < self.trainer_config.log_val_generations:
                        samples.append((self.tokenizer.decode(row["input_ids"]), text, group[-1]))
                scores.setdefault(row["data_source"], []).append(group)
        for prompt, text, score in samples:
            self._print(f"[trainer] val sample: {prompt!r} -> {text!r} score {score}")
        metrics = {}
        for source, groups in sorted(scores.items()):
            metrics[f"val-core/{source}/reward/mean@{n}"] = float(np.mean([np.mean(g) for g in groups]))
            if n > 1:
                metrics[f"val-aux/{source}/reward/std@{n}"] = float(np.mean([np.std(g) for g in groups]))
        return metrics

    def _advantages(self, scores: torch.Tensor, response_mask: torch.Tensor, group_index: np.ndarray) -> torch.Tensor:
        """The score on each response's last token, then GRPO's group normalisation."""
        token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
        last = (response_mask.sum(dim=1) - 1).clamp(min=0)
        token_rewards[torch.arange(len(scores)), last] = scores
        norm = self.config.algorithm.norm_adv_by_std_in_grpo
        advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask, group_index, norm_adv_by_std_in_grpo=norm)
        return advantages

    @staticmethod
    def _step_metrics(scores, advantages, rollout: dict, old_log_probs: torch.Tensor, updates: list[dict]) -> dict:
        mask = rollout["response_mask"].bool()
        diff = log_prob_gaps(old_log_probs, rollout["rollout_log_probs"], mask)
        update = updates[0]  # the statistics are already summed over data-parallel ranks
        tokens = max(update["tokens"], 1.0)
        lengths = rollout["response_mask"].sum(dim=1).float()
        return {
            "critic/score/mean": scores.mean().item(),
            "critic/score/max": scores.max().item(),
            "critic/score/min": scores.min().item(),
            "critic/accuracy": (scores >= 1.0).float().mean().item(),
            "critic/advantages/max": advantages[mask].max().item(),
            "critic/advantages/min": advantages[mask].min().item(),
            "response_length/mean": lengths.mean().item(),
            "response_length/clip_ratio": (lengths == mask.shape[1]).float().mean().item(),
            "actor/pg_loss": update["pg_loss"] / tokens,
            "actor/pg_clipfrac": update["pg_clipfrac"] / tokens,
            "actor/pg_clipfrac_lower": update["pg_clipfrac_lower"] / tokens,
            "actor/ppo_kl": update["ppo_kl"] / tokens,
            "actor/grad_norm": update["grad_norm"],
            "actor/lr": update["lr"],
            "actor/update_ok": all(u["update_ok"] for u in updates),
            "rollout/log_prob_diff_max": diff.max().item() if diff.numel() else 0.0,
            "rollout/log_prob_diff_mean": diff.mean().item() if diff.numel() else 0.0,
            **rollout_probs_metrics(old_log_probs, rollout["rollout_log_probs"], rollout["response_mask"]),
        }

    def _encode_prompts(self, rows: list[dict]) -> torch.Tensor:
        """The rows' tokenized prompts, left-padded to the run's one prompt length."""
        return left_pad(rows, self.data.prompt_length, self.tokenizer.pad_token_id)

    def _prompt_attention_mask(self, rows: list[dict]) -> torch.Tensor:
        """1 on each prompt's tokens, 0 on its left padding: the rollout and Megatron both keep the padding out
        of attention and positions (as upstream), so a prompt's log-probs do not depend on how much it was padded."""
        return left_pad_attention_mask(rows, self.data.prompt_length)

    def _check_parity(self, step: int, old_log_probs: torch.Tensor, rollout: dict) -> None:
        """The parity gate (``rollout.log_prob_parity_check``) on the first batch this process trains; with
        ``every_step`` the same tolerance on every later step."""
        gate = self.config.rollout.log_prob_parity_check
        first, self.parity_checked = not self.parity_checked, True
        if not gate.enable or not (first or gate.every_step):
            return
        max_diff = max_log_prob_diff(old_log_probs, rollout["rollout_log_probs"], rollout["response_mask"])
        tolerance = check_log_prob_parity(max_diff, self.actor_dtype, gate.tolerance, step=None if first else step)
        if first:
            self._print(f"[trainer] log-prob parity on the first batch: actor vs rollout max |diff| {max_diff:.1e} <= {tolerance:.0e} ({self.actor_dtype})")

    def _score_one(self, row: dict, text: str) -> float:
        return float(self.compute_score(row["data_source"], text, row["ground_truth"], row["extra_info"]))

    def _score(self, rows: list[dict], responses: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        scores = []
        for i, (ids, mask) in enumerate(zip(responses.tolist(), response_mask.tolist(), strict=True)):
            text = response_text(self.tokenizer, [t for t, m in zip(ids, mask, strict=True) if m])
            scores.append(self._score_one(rows[i // self.n], text))
        return torch.tensor(scores, dtype=torch.float32)

    # ------------------------------------------------------------------ checkpoints

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.default_local_dir, STEP_DIR_FORMAT.format(step))

    def _load_checkpoint(self) -> int:
        if self.resume is None:
            self._print(f"[trainer] starting from scratch (trainer.resume_mode={self.trainer_config.resume_mode})")
            return 0
        step, path = self.resume
        start = time.monotonic()
        loads = self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"), checked=self.resume_checked)
        driver_checks = dict(self.resume_checked.checks) if self.resume_checked is not None else {}
        self.resume_metrics = resume_check_metrics(driver_checks, [load["checks"] for load in loads])
        self.sampler.load_state_dict(torch.load(os.path.join(path, DATA_STATE_FILENAME), weights_only=True))
        self._print(
            f"[trainer] resumed from {path} (step {step}) in {time.monotonic() - start:.1f}s; "
            f"data: epoch {self.sampler.epoch}, position {self.sampler.position}"
        )
        return step

    def _save_checkpoint(self, bar) -> dict:
        """Save this step. With ``checkpoint.async_save`` the ranks return once the dist-ckpt write runs in
        the background; the step is committed (and tracked) later by ``_finalize_pending``."""
        self._finalize_pending(bar, blocking=True)  # one save in flight at a time
        step = self.global_steps
        actor_path = os.path.join(self._step_dir(step), "actor")
        start = time.monotonic()
        keep = self.trainer_config.max_actor_ckpt_to_keep
        # the data position and the tracker go through the ranks' step transaction, after the commit
        with self._discarded_if_the_group_fails(step):
            results = self.actor_rollout_wg.save_checkpoint(
                actor_path, global_step=step, max_ckpt_to_keep=keep, step_files={DATA_STATE_FILENAME: _as_bytes(self.sampler.state_dict())}, track=True
            )
        save = {"step": step, "path": actor_path, "results": results, "blocked_s": time.monotonic() - start}
        if not results[0].get("pending"):
            return self._record_committed(save, [r["committed"] for r in results], bar)
        self._pending = save
        if "console" in self.loggers:
            bar.write(
                f"[trainer] step {step}: async save started, training blocked {save['blocked_s']:.1f}s; the tracker moves "
                "once the background write is durable"
            )
        return {"path": actor_path, "pending": True, "blocked_s": round(save["blocked_s"], 3)}

    def _finalize_pending(self, bar, blocking: bool) -> dict | None:
        """Commit a pending async save once every rank's background write is durable; its record, or None."""
        if self._pending is None:
            return None
        start = time.monotonic()
        with self._discarded_if_the_group_fails(self._pending["step"]):
            finalized = self.actor_rollout_wg.finalize_checkpoint(blocking=blocking)
        if finalized[0]["path"] is None:
            return None  # still writing
        save, self._pending = self._pending, None
        save["waited_s"] = time.monotonic() - start
        return self._record_committed(save, [f["committed"] for f in finalized], bar)

    @contextlib.contextmanager
    def _discarded_if_the_group_fails(self, step: int) -> Iterator[None]:
        """A save the worker group failed in: the group stopped every rank after a short grace, and a rank killed
        before its own cleanup left the step's staging directory behind (on a full disk, keeping it full). The
        driver, which owns the run and holds its directory's writer lock, removes that directory and a
        ``global_step_N`` left empty, then re-raises. Nothing committed is touched: a step renamed into place (the
        tracker not yet moved, skipped on resume), the older copy a re-save moved aside (put back by the next
        run). Only the group's failure: a stopped run (SIGTERM) leaves its staging directory, as documented."""
        try:
            yield
        except WorkerGroupError:
            self._pending = None  # discarded: a stop now has no uncommitted step to name
            step_dir = layout.step_dir(self.default_local_dir, step)
            shutil.rmtree(layout.staging_path(layout.role_dir(self.default_local_dir, step, "actor")), ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty: a committed role or data position stays
                os.rmdir(step_dir)
            raise

    def _record_committed(self, save: dict, per_rank: list[dict], bar) -> dict:
        """The ranks' step transaction committed the step, wrote its data position and moved the tracker:
        record what it reports (it verified the HF export and built the manifest from these very files), and each
        phase's seconds on its slowest rank (``phase_s``: where a save's time goes)."""
        step, actor_path, results = save["step"], save["path"], save["results"]
        committed = per_rank[0]
        verified = {"files": len(committed["files"]), "contents": list(committed["contents"] or [])}
        if committed["hf_tensors"] is not None:
            verified["hf"] = f"all {committed['hf_tensors']} tensors present with the expected shapes"
        record = {
            "path": actor_path,
            "save_time_s": round(save["blocked_s"], 3),
            "module_device": results[0]["module_device"],
            "param_offloaded_before": results[0]["param_offloaded_before"],
            "param_offloaded_after": all(r["param_offloaded_after"] for r in results),
            **verified,
            "phase_s": slowest_rank_phases([c["phase_seconds"] for c in per_rank]),
        }
        if "waited_s" in save:
            record["async_finalize_wait_s"] = round(save["waited_s"], 3)
        self.saved.append(record)
        offload = ""
        if record["param_offloaded_before"]:
            after = "offloaded again" if record["param_offloaded_after"] else "NOT offloaded again"
            offload = f"\n[trainer]   param_offload: the weights were offloaded; brought back for the save, then {after}"
        how = "committed async save of" if "waited_s" in save else "saved"
        if "console" in self.loggers:
            bar.write(
                f"[trainer] {how} step {step} (training blocked {save['blocked_s']:.1f}s) -> {actor_path}\n"
                f"[trainer]   committed: {verified['files']} files in the manifest; contents {verified['contents']}"
                + (f"; HF export: {verified['hf']}" if verified.get("hf") else "")
                + offload
                + f"\n[trainer]   tracker {get_checkpoint_tracker_filename(self.default_local_dir)} -> {step}"
            )
        return record

    # ------------------------------------------------------------------ output

    def _print(self, message: str) -> None:
        if "console" in self.loggers:
            print(message, flush=True)

    def _open_tracking(self) -> Tracking:
        trainer = self.trainer_config
        return Tracking(
            trainer.project_name, trainer.experiment_name, self.loggers,
            config=dataclasses.asdict(self.config), metrics_path=self.metrics_path,
        )  # fmt: skip

    def _log_metrics(self, metrics: dict, history: bool = True) -> None:
        if history:
            self.history.append(metrics)
        if self.tracking is not None:
            self.tracking.log(metrics, step=int(metrics["step"]))

    def _summary(self) -> None:
        lines = [f"[trainer] done: {self.total_training_steps} steps; checkpoints under {self.default_local_dir}"]
        if self.history:
            first, last = _window_mean(self.history[:10]), _window_mean(self.history[-10:])
            lines.append(
                f"[trainer]   mean reward: first {min(10, len(self.history))} steps {first:.3f} -> last {min(10, len(self.history))} steps {last:.3f}"
            )
        if self.saved:
            latest = self.saved[-1]
            lines.append(f"[trainer]   latest: {latest['path']} (tracker latest_checkpointed_iteration.txt -> {self.global_steps})")
        if "file" in self.loggers and os.path.exists(self.metrics_path):
            from verl.utils.metric.plot import plot_metric_curve

            png = plot_metric_curve(
                self.metrics_path, os.path.join(self.default_local_dir, REWARD_PLOT_FILENAME),
                key="critic/score/mean", title=f"GRPO mean reward ({self.trainer_config.experiment_name})",
            )  # fmt: skip
            lines.append(f"[trainer]   metrics: {self.metrics_path}\n[trainer]   reward curve: {png}")
        print("\n".join(lines), flush=True)


def load_reward_function(custom: CustomRewardFunctionConfig):
    """``custom_reward_function.path`` / ``name`` (upstream's keys) when set, else ``default_compute_score``;
    either is called as ``fn(data_source, solution_str, ground_truth, extra_info)``."""
    if not custom.path:
        return default_compute_score
    import importlib.util

    path = os.path.abspath(os.path.expanduser(str(custom.path)))
    spec = importlib.util.spec_from_file_location("custom_reward_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = str(custom.name or "compute_score")
    if not hasattr(module, name):
        raise AttributeError(f"custom_reward_function.path={path} has no function {name!r} (custom_reward_function.name)")
    return getattr(module, name)


def slowest_rank_phases(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's seconds on the rank that spent longest in it, in the order the phases ran."""
    order = dict.fromkeys(phase for rank in per_rank for phase in rank)
    return {phase: round(max(rank.get(phase, 0.0) for rank in per_rank), 3) for phase in order}


def _val_line(step: int, metrics: dict) -> str:
    return f"[trainer] validation at step {step}: " + "  ".join(f"{key} {value:.3f}" for key, value in metrics.items())


def response_text(tokenizer, ids: list[int]) -> str:
    """The response as the model wrote it, one character per token: ``decode`` of the char-level tokenizer
    puts spaces between characters and drops ids outside its vocabulary, which would turn "7x7" into a
    correct "7". Unknown ids become U+FFFD; special tokens (EOS) are dropped."""
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return "".join("\ufffd" if token is None else token for i, token in zip(ids, tokens, strict=True) if i not in special)


@contextlib.contextmanager
def _timed(timing: dict[str, float], key: str):
    start = time.monotonic()
    try:
        yield
    finally:
        timing[key] = time.monotonic() - start


def _sync_metrics(syncs: list[dict]) -> dict[str, float]:
    """The weight sync of a step from each rollout replica's report: ``checkpoint_engine/payload_mbytes``
    (upstream's name: MiB of the tensors one replica received; every replica receives the whole model) and,
    with vllm, ``checkpoint_engine/vllm_slots_written`` (the fewest parameter slots an engine's reload wrote)."""
    metrics = {"checkpoint_engine/payload_mbytes": max(sync["payload_bytes"] for sync in syncs) / (1 << 20)}
    if all("engine_slots" in sync for sync in syncs):
        metrics["checkpoint_engine/vllm_slots_written"] = float(min(sync["engine_slots"] for sync in syncs))
    return metrics


def _window_mean(history: list[dict]) -> float:
    return sum(m["critic/score/mean"] for m in history) / len(history)


def _step_line(metrics: dict, total: int) -> str:
    return (
        f"[trainer] step {metrics['step']}/{total}  reward {metrics['critic/score/mean']:.3f}  "
        f"acc {metrics['critic/accuracy']:.3f}  resp_len {metrics['response_length/mean']:.1f}  "
        f"pg_loss {metrics['actor/pg_loss']:+.4f}  grad_norm {metrics['actor/grad_norm']:.3f}  "
        + (f"kl_loss {metrics['actor/kl_loss']:.2e}  " if "actor/kl_loss" in metrics else "")
        + f"entropy {metrics['actor/entropy']:.3f}  "
        f"logp_diff {metrics['rollout/log_prob_diff_max']:.1e}  "
        f"time {metrics['timing_s/step']:.1f}s (gen {metrics['timing_s/gen']:.1f}, sync {metrics['timing_s/update_weights']:.1f}, "
        f"logp {metrics['timing_s/old_log_prob']:.1f}, "
        f"update {metrics['timing_s/update_actor']:.1f})"
    )


def _as_bytes(state: dict) -> bytes:
    """``torch.save`` of ``state`` (the prompt sampler's position), as the bytes of ``data.pt``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()

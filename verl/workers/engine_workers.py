"""The Ray actor worker (upstream's ``verl/workers/engine_workers.py``): one rank's engine, PPO actor and rollout.

A ``MegatronRayWorkerGroup`` starts one ``ActorRolloutRefWorker`` per rank (upstream verl's name; roles
``actor`` and, with a KL loss, ``actor_rollout_ref``: the reference policy on the same ranks). The constructor
joins torch.distributed and megatron parallel state; ``init_model`` builds a ``MegatronEngine`` (HF model ->
bridge -> DDP model, optimizer, scheduler, ``MegatronCheckpointManager``), the PPO actor, the HF rollout and,
for ``actor_rollout_ref``, a ``MegatronReference`` from the same HF weights; ``generate_sequences``,
``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``, ``save_checkpoint`` and ``load_checkpoint``
are the calls the trainer makes on every rank.

With ``param_offload`` (and ``grad_offload`` / ``optimizer_offload``) the weights live in host copies
between calls; every call that needs them brings them back first and offloads them again after. The
reference follows ``ref.megatron.param_offload`` the same way around ``compute_ref_log_prob``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.megatron.worker import MegatronWorker
from verl.utils.checkpoint import check_audit
from verl.utils.logging_utils import silence_library_notices
from verl.utils.megatron.parallel import ParallelSizes
from verl.workers.config import megatron_worker_config

if TYPE_CHECKING:  # a type only: megatron-core is imported after silence_library_notices below
    from verl.utils.checkpoint.resume_check import CheckedStep

silence_library_notices()  # before megatron-core / mbridge are imported on this rank


class ActorRolloutRefWorker(MegatronWorker):
    """``config`` is the plain-dict ``actor_rollout_ref`` section, with ``model.path`` already resolved; its
    ``actor``, ``rollout`` and ``ref.megatron`` nodes are the typed configs the trainer built
    (``verl.workers.config.megatron_worker_config``), or plain nodes that are built here. Every setting is read
    from them, never with a default of its own."""

    ROLES = ("actor", "actor_rollout_ref")

    def __init__(self, config: dict, role: str = "actor") -> None:
        super().__init__()
        if role not in self.ROLES:
            raise ValueError(f"role={role!r}: this worker implements the roles {list(self.ROLES)}")
        self.config = config = megatron_worker_config(config)
        self.actor_config = config["actor"]  # McoreActorConfig
        self.rollout_config = config["rollout"]  # RolloutConfig
        self.role = role
        self._is_ref = role == "actor_rollout_ref"
        self._ref_is_offload_param = self._is_ref and config["ref"]["megatron"].param_offload
        megatron = self.actor_config.megatron
        self.sizes = ParallelSizes.from_megatron(megatron)
        self._is_offload_param = megatron.param_offload
        self._is_offload_grad = megatron.grad_offload
        self._is_offload_optimizer = megatron.optimizer_offload
        self.init_megatron(self.sizes, seed=megatron.seed, timeout_s=config["nccl_timeout"])
        self.actor = None
        self.ref = None
        self.ppo_actor = None
        self.rollout = None
        self._rollout_ranks: list[int] = []

    # ------------------------------------------------------------------ build

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:

        from verl.models.mcore.bridge import bridge_name
        from verl.utils.host_memory import freeze_long_lived_objects
        from verl.utils.megatron_utils import offload_megatron_model_to_cpu, offload_megatron_optimizer
        from verl.workers.actor.megatron_actor import MegatronPPOActor
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine, MegatronReference

        actor = self.actor_config
        start = time.monotonic()
        self.actor = MegatronEngine(self.config["model"], actor.megatron, actor.optim, actor.checkpoint)
        self.ppo_actor = MegatronPPOActor(actor, self.rollout_config, self.actor.model, self.actor.optimizer, self.actor.scheduler)
        self._build_rollout()
        if self._is_offload_param:
            offload_megatron_model_to_cpu(self.actor.model, offload_grad=self._is_offload_grad)
        if self._is_offload_optimizer:
            offload_megatron_optimizer(self.actor.optimizer)
        if self._is_ref:
            # the actor's dtype and bridge: the reference runs on the actor's ranks, from the same HF weights
            self.ref = MegatronReference(self.actor.model_config.path, dtype=self.actor.param_dtype, vanilla_mbridge=actor.megatron.vanilla_mbridge)
            if self._ref_is_offload_param:
                offload_megatron_model_to_cpu(self.ref.model)
        freeze_long_lived_objects()
        return {
            "rank": self.rank,
            "seconds": time.monotonic() - start,
            "num_params": sum(p.numel() for chunk in self.actor.model for p in chunk.parameters()),
            "ref": self.ref is not None,
            # the bridges the models were built through, as the run's metrics report them
            "bridge": {"actor": bridge_name(self.actor.bridge), "ref": bridge_name(self.ref.bridge) if self.ref is not None else None},
            "dtype": actor.megatron.dtype,
            "frozen_objects": gc.get_freeze_count(),
        }

    @contextlib.contextmanager
    def _resident(self, optimizer: bool):
        """Model (and optimizer) weights on the device for the duration; offloaded again afterwards."""
        from verl.utils.megatron_utils import (
            load_megatron_model_to_gpu,
            load_megatron_optimizer,
            offload_megatron_model_to_cpu,
            offload_megatron_optimizer,
        )

        if self._is_offload_param:
            load_megatron_model_to_gpu(self.actor.model, load_grad=True)
        if optimizer and self._is_offload_optimizer:
            load_megatron_optimizer(self.actor.optimizer)
        try:
            yield
        finally:
            if self._is_offload_param:
                offload_megatron_model_to_cpu(self.actor.model, offload_grad=self._is_offload_grad)
            if optimizer and self._is_offload_optimizer:
                offload_megatron_optimizer(self.actor.optimizer)

    # ------------------------------------------------------------------ train

    def _build_rollout(self) -> None:
        """The rollout (``rollout.name``: hf, transformers' generate; vllm, an in-process vLLM engine) on the output
        rank of each data-parallel group; every rank learns which those are."""
        import torch

        from verl.utils.device import get_device_name
        from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings

        flags: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(flags, self._is_output_rank())
        self._rollout_ranks = [rank for rank, flag in enumerate(flags) if flag]
        rollout, tokenizer = self.rollout_config, self.actor.tokenizer
        if rollout.name == "vllm":
            from verl.workers.rollout.vllm_rollout import join_engine_groups

            try:
                import vllm  # noqa: F401  (the driver's host had it; on a cluster this one may not)
            except ImportError as exc:
                raise RuntimeError(
                    f"actor_rollout_ref.rollout.name=vllm: `import vllm` fails on {socket.gethostname()} ({exc}); "
                    "install vLLM on every node of the cluster, or set actor_rollout_ref.rollout.name=hf"
                ) from None
            join_engine_groups()  # every rank: vLLM's groups span the world
        if not self._is_output_rank():
            return
        settings = RolloutSettings(
            response_length=rollout.response_length, temperature=rollout.temperature, top_p=rollout.top_p, do_sample=rollout.do_sample
        )
        ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        # the actor's dtype: the parity gate compares like with like
        if rollout.name == "vllm":
            from verl.workers.rollout.vllm_rollout import InMemoryVLLMRollout

            self.rollout = InMemoryVLLMRollout(
                self.actor.model_config.path, self.actor.hf_config, settings, rollout, **ids, dtype=self.actor.param_dtype,
                seed=self.actor_config.megatron.seed,
            )
            return
        self.rollout = InMemoryHFRollout(self.actor.hf_config, settings, **ids, device=get_device_name(), dtype=self.actor.param_dtype)

    def _mini_batch_rows(self) -> int:
        """Rows of one optimizer step on this rank: upstream's normalisation, ppo_mini_batch_size prompts x n
        responses split over data parallel."""
        from megatron.core import parallel_state as mpu

        return self.actor_config.ppo_mini_batch_size * self.rollout_config.n // mpu.get_data_parallel_world_size()

    # ------------------------------------------------------------------ rollout and train

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def generate_sequences(self, prompts: dict) -> dict | None:
        """Responses for ``prompts["input_ids"]`` (``[rows, prompt_len]``, left padding marked 0 in the optional
        ``prompts["attention_mask"]``), sampled with ``prompts["seed"]``.

        Every rank takes part in gathering the current weights, whole and in HF names, onto the output
        rank of each data-parallel group (in memory), which loads them into its rollout model and
        generates for its group. The output ranks add ``timing`` (seconds of the weight sync,
        ``update_weights``, and of ``generate``) and ``sync`` (``payload_bytes``: the bytes of the tensors
        loaded into the rollout; with vllm ``engine_slots``: the engine's parameter slots they wrote).
        """
        self._check_built()
        sampling = prompts.get("sampling") if prompts else None
        start = time.monotonic()
        sync: dict[str, int] = {}
        with self._resident(optimizer=False):
            weights = self.actor.bridge.gather_hf_weights(self.actor.model, receivers=self._rollout_ranks)
            # Inside: a gathered tensor may be this rank's own parameter storage, which param_offload frees.
            if self.rollout is not None:
                sync["payload_bytes"] = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
                slots = self.rollout.load_weights(weights.items())
                if self.rollout_config.name == "vllm":
                    sync["engine_slots"] = int(slots)
            del weights
        sync_seconds = time.monotonic() - start
        if self.rollout is None:
            return None
        start = time.monotonic()
        with self._sampling(sampling):
            output = self.rollout.generate_sequences(prompts["input_ids"], seed=int(prompts["seed"]), attention_mask=prompts.get("attention_mask"))
        output["timing"] = {"update_weights": sync_seconds, "generate": time.monotonic() - start}
        output["sync"] = sync
        return output

    @contextlib.contextmanager
    def _sampling(self, sampling: dict | None):
        """The rollout samples with ``sampling`` (do_sample / temperature / top_p: the validation's
        ``val_kwargs``) for the duration, then with the training settings again."""
        import dataclasses

        if not sampling or self.rollout is None:
            yield
            return
        kept = self.rollout.settings
        do_sample = bool(sampling["do_sample"])
        # Greedy decoding reads no temperature; the rollout's log-probs still divide by one, so keep it finite.
        temperature = float(sampling["temperature"]) if do_sample else 1.0
        self.rollout.settings = dataclasses.replace(kept, do_sample=do_sample, temperature=temperature, top_p=float(sampling["top_p"]))
        try:
            yield
        finally:
            self.rollout.settings = kept

    def _micro_batch_size(self, rows: int, seq_len: int, dynamic: bool, max_token_len: int, fixed: int) -> int:
        """Rows per micro batch: with dynamic batch size (upstream's ``use_dynamic_bsz``) the most that fit
        ``max_token_len`` tokens and divide ``rows`` (every sequence here has one length, so a token budget
        is a row count; megatron's pipeline needs equal micro batches; the interleaved schedule, a number of them
        that is a multiple of the pipeline size, where the rows allow it); otherwise ``fixed``."""
        if not dynamic:
            return fixed
        from verl.models.mcore.forward import interleaved_microbatch_multiple

        fit = max(1, min(rows, int(max_token_len) // max(seq_len, 1)))
        sizes = [size for size in range(fit, 0, -1) if rows % size == 0]
        multiple = interleaved_microbatch_multiple()
        return next((size for size in sizes if (rows // size) % multiple == 0), sizes[0])

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def compute_log_prob(self, batch: dict) -> dict:
        """Log-probabilities of the responses in ``batch["input_ids"]`` (prompt + response; ``attention_mask``, when
        given, marks the prompt's left padding) under the current weights, and the entropy at each response
        position from the same forward (``entropys``, upstream's key).

        Micro batches follow ``rollout.log_prob_*`` (upstream's keys for this pass): dynamic by token budget,
        or ``log_prob_micro_batch_size_per_gpu``, else ``actor.ppo_micro_batch_size_per_gpu``.
        """
        self._check_built()
        size = self._log_prob_micro_batch_size(self.rollout_config, batch["input_ids"])
        with self._resident(optimizer=False):
            log_probs, entropys = self.ppo_actor.compute_log_prob_and_entropy(batch["input_ids"], size, batch.get("attention_mask"))
        return {"old_log_probs": log_probs, "entropys": entropys}

    def _log_prob_micro_batch_size(self, node: Mapping, input_ids) -> int:
        """Rows per micro batch of a forward-only pass from ``node``'s ``log_prob_*`` keys (the rollout's or the ref's)."""
        rows, seq_len = input_ids.shape
        fixed = node["log_prob_micro_batch_size_per_gpu"] or self.actor_config.ppo_micro_batch_size_per_gpu
        return self._micro_batch_size(
            rows, seq_len, bool(node["log_prob_use_dynamic_bsz"]), int(node["log_prob_max_token_len_per_gpu"] or 0), int(fixed)
        )

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def compute_ref_log_prob(self, batch: dict) -> dict:
        """Log-probabilities of the responses in ``batch["input_ids"]`` under the reference policy (``ref_log_prob``).

        Micro batches follow ``ref.log_prob_*``. With ``ref.megatron.param_offload`` the reference weights are
        brought back for this pass and offloaded again after it; ``param_offloaded_before`` / ``_after`` say
        whether they were offloaded on every rank before and after the call.
        """
        import torch

        from verl.utils.megatron_utils import (
            is_megatron_module_offloaded,
            load_megatron_model_to_gpu,
            offload_megatron_model_to_cpu,
        )

        self._check_built()
        if self.ref is None:
            raise RuntimeError(f"compute_ref_log_prob needs role='actor_rollout_ref' (this worker's role is {self.role!r})")
        size = self._log_prob_micro_batch_size(self.config["ref"], batch["input_ids"])
        rollout = self.rollout_config
        flags = [is_megatron_module_offloaded(self.ref.model)]
        if self._ref_is_offload_param:
            load_megatron_model_to_gpu(self.ref.model, load_grad=False)
        try:
            log_probs = self.ref.compute_log_prob(
                batch["input_ids"], rollout.response_length, rollout.temperature, size, batch.get("attention_mask")
            )
        finally:
            if self._ref_is_offload_param:
                offload_megatron_model_to_cpu(self.ref.model, offload_grad=False)
        flags.append(is_megatron_module_offloaded(self.ref.model))
        every_rank = torch.tensor(flags, dtype=torch.int32)
        torch.distributed.all_reduce(every_rank, op=torch.distributed.ReduceOp.MIN)
        return {"ref_log_prob": log_probs, "param_offloaded_before": bool(every_rank[0]), "param_offloaded_after": bool(every_rank[1])}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def update_actor(self, batch: dict) -> dict:
        """PPO-clip update on this data-parallel rank's rows (``input_ids``, ``response_mask``, ``old_log_probs``, ``advantages``).

        With ``actor.use_dynamic_bsz`` the micro batches hold up to ``ppo_max_token_len_per_gpu`` tokens; the loss
        is a token mean over the whole mini-batch either way, so only memory and speed change.
        """
        self._check_built()
        actor, mini_batch_rows = self.actor_config, self._mini_batch_rows()
        size = self._micro_batch_size(
            mini_batch_rows or batch["input_ids"].shape[0], batch["input_ids"].shape[1],
            actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu or 0, actor.ppo_micro_batch_size_per_gpu,
        )  # fmt: skip
        start = time.monotonic()
        with self._resident(optimizer=True):
            metrics = self.ppo_actor.update_policy(batch, size, mini_batch_rows)
        metrics["update_seconds"] = time.monotonic() - start
        return metrics

    # ------------------------------------------------------------------ checkpoints

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        *,
        step_files: dict[str, bytes] | None = None,
        track: bool = False,
    ) -> dict:
        """Save this rank's part of ``local_path`` (``<default_local_dir>/global_step_N/actor``).

        The upstream order: find where the model is (``get_megatron_module_device``, safe for DDP buffers
        whose ``param_data`` is None, i.e. use_distributed_optimizer=False), bring offloaded weights back,
        save through the checkpoint manager, and offload again when param_offload is on.
        With ``checkpoint.async_save`` the result's ``pending`` is True: the step is committed only by
        ``finalize_checkpoint``. ``step_files`` / ``track``: the driver's files of the step and the tracker, which
        the step transaction writes after the commit; ``committed`` is its record (None while pending).
        """
        from verl.utils.megatron_utils import (
            get_megatron_module_device,
            is_megatron_module_offloaded,
            load_megatron_model_to_gpu,
            load_megatron_optimizer,
            offload_megatron_model_to_cpu,
            offload_megatron_optimizer,
        )

        self._check_built()
        model = self.actor.model
        module_device = get_megatron_module_device(model)
        offloaded_before = is_megatron_module_offloaded(model)
        if offloaded_before:
            load_megatron_model_to_gpu(model, load_grad=False)
        reload_optimizer = self._is_offload_optimizer and self.actor.checkpoint_manager.should_save_optimizer
        if reload_optimizer:
            load_megatron_optimizer(self.actor.optimizer)
        start = time.monotonic()
        try:
            pending = self.actor.save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, step_files=step_files, track=track)
        finally:
            if self._is_offload_param:
                offload_megatron_model_to_cpu(model, offload_grad=self._is_offload_grad)
            if reload_optimizer:
                offload_megatron_optimizer(self.actor.optimizer)
        return {
            "rank": self.rank,
            "module_device": module_device,
            "param_offloaded_before": offloaded_before,
            "param_offloaded_after": is_megatron_module_offloaded(model),
            "seconds": time.monotonic() - start,
            "pending": pending,
            "committed": None if pending else dataclasses.asdict(self.actor.last_committed),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finalize_checkpoint(self, blocking: bool = True) -> dict:
        """Commit the pending async save once its background write is durable (every rank takes part).

        ``path`` is the committed step, or None when nothing was pending (or, with ``blocking=False``,
        the write is still running: ``pending`` stays True). The weights need not be resident.
        """
        self._check_built()
        start = time.monotonic()
        path = self.actor.finalize_checkpoint(blocking=blocking)
        return {
            "rank": self.rank,
            "path": path,
            "committed": dataclasses.asdict(self.actor.last_committed) if path is not None else None,
            "pending": self.actor.save_pending,
            "seconds": time.monotonic() - start,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False, *, checked: CheckedStep | None = None
    ) -> dict:
        """Load a step on every rank (upstream's arguments); ``checked``: the driver's record of its check of the step,
        so that the ranks repeat none of it (``MegatronEngine.load_checkpoint``). Returns this rank's seconds and
        the checks it made of the step's files (``check_audit``)."""
        self._check_built()
        start = time.monotonic()
        self.actor.finalize_checkpoint(blocking=True)  # a pending save commits first: its checks are not the load's
        with self._resident(optimizer=self.actor.checkpoint_manager.should_load_optimizer), check_audit.recording() as checks:
            self.actor.load_checkpoint(local_path, hdfs_path, del_local_after_load, checked=checked)
        return {"rank": self.rank, "seconds": time.monotonic() - start, "checks": dict(checks)}

    def _check_built(self) -> None:
        if self.actor is None:
            raise RuntimeError("init_model() must run before this call")


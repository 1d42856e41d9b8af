"""The Megatron engine of one rank (upstream's ``verl/workers/engine/megatron/transformer_impl.py``):
HF model -> bridge -> DDP model, optimizer, scheduler and checkpoint manager, built in ``MegatronEngine``'s
constructor; its ``save_checkpoint`` runs the step transaction around the manager's save, its
``load_checkpoint`` checks the step before the manager loads it. ``MegatronReference``: the reference policy,
the same HF model -> bridge -> a frozen model that is never trained or saved.

The Ray worker (``verl.workers.engine_workers``) builds the engine from upstream's typed configs
(``verl.workers.config``); tests, benchmarks and scripts from the same YAML through
``verl.workers.config.megatron_actor_configs_from_yaml``. Parallel state
must already be initialised on the rank (``ParallelSizes.initialize_megatron``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from verl.models.mcore import load_hf_config
from verl.models.mcore.bridge import checkpoint_bridge, make_model_bridge
from verl.models.mcore.forward import compute_log_probs, forward_logits, train_step
from verl.models.mcore.model import build_megatron_model
from verl.utils.checkpoint import finite
from verl.utils.checkpoint.checkpoint_manager import config_get
from verl.utils.checkpoint.megatron_checkpoint_manager import FinalizeState, MegatronCheckpointManager, SaveReport
from verl.utils.checkpoint.megatron_state_dicts import current_parallel_layout
from verl.utils.checkpoint.resume_check import CheckedStep, check_before_load
from verl.utils.checkpoint.step_commit import CommittedStep, StepCommit, StepSpec
from verl.utils.custom_code import load_tokenizer
from verl.utils.host_memory import release_free_heap
from verl.utils.megatron.optimizer import (
    get_megatron_optimizer,
    get_megatron_optimizer_param_scheduler,
    init_megatron_optim_config,
)
from verl.workers.config import HFModelConfig, McoreCheckpointConfig, McoreEngineConfig, McoreOptimizerConfig
from verl.workers.engine.base import BaseEngine


class MegatronEngine(BaseEngine):
    """One rank's actor, built whole by the constructor (upstream builds it in ``initialize``, which this
    engine has not: nothing is half-built here). ``verl.workers.megatron_rank.MegatronActor`` is this class."""

    def __init__(
        self,
        model_config: HFModelConfig,
        engine_config: McoreEngineConfig,
        optimizer_config: McoreOptimizerConfig,
        checkpoint_config: McoreCheckpointConfig,
        *,
        wrap_bridge=None,
        manager_cls: type = MegatronCheckpointManager,
        refuse_unsupported: bool = True,
    ):
        """Upstream's four configs (``verl.workers.config``): the HF model (its ``path``), the Megatron engine
        (``dtype``, ``use_distributed_optimizer``, ``use_dist_checkpointing``, ``vanilla_mbridge``), the optimizer and
        the checkpoint; outside the trainer ``megatron_actor_configs_from_yaml`` builds them from its YAML.
        ``wrap_bridge(bridge)`` gives the object the manager saves HF weights through (tests observe the real
        bridge with it); ``manager_cls`` replaces the checkpoint manager class; ``refuse_unsupported=False``
        builds a model ``verl.models.support`` refuses (the tests that show what the refusal prevents)."""
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        model_path = model_config.path
        self.param_dtype = getattr(torch, engine_config.dtype)
        self.hf_config = load_hf_config(model_path)
        self.tokenizer = load_tokenizer(model_path, f"actor_rollout_ref.model.path={model_path}")
        self.bridge = make_model_bridge(model_path, self.hf_config, self.param_dtype, engine_config.vanilla_mbridge, refuse_unsupported)
        self.model = build_megatron_model(self.bridge, use_distributed_optimizer=engine_config.use_distributed_optimizer)
        self.bridge.load_weights(self.model, model_path)
        release_free_heap()  # the load's temporary tensors, ~the model's size, would stay resident
        self.optimizer, self.scheduler = self._build_optimizer()
        self.checkpoint_manager = manager_cls(
            config={"model": {"path": model_path}},
            checkpoint_config=checkpoint_config,
            model_config=self.hf_config,
            transformer_config=self.bridge.config,
            role="actor",
            model=self.model,
            arch=self.hf_config.architectures[0] if getattr(self.hf_config, "architectures", None) else None,
            hf_config=self.hf_config,
            param_dtype=self.param_dtype,
            share_embeddings_and_output_weights=bool(getattr(self.hf_config, "tie_word_embeddings", False)),
            processing_class=self.tokenizer,
            optimizer=self.optimizer,
            optimizer_scheduler=self.scheduler,
            use_distributed_optimizer=engine_config.use_distributed_optimizer,
            # where a load takes the LR schedule's settings from (its position is always restored)
            use_checkpoint_opt_param_scheduler=optimizer_config.use_checkpoint_opt_param_scheduler,
            use_dist_checkpointing=engine_config.use_dist_checkpointing,
            bridge=wrap_bridge(self.bridge) if wrap_bridge is not None else self.bridge,
        )
        self._save_spec = self._step_spec()  # the step transaction's spec, but for what each save adds
        self._pending: StepCommit | None = None  # the async save's transaction, until finalize_checkpoint commits it
        self.last_committed: CommittedStep | None = None  # the record of the latest committed save

    def _build_optimizer(self) -> tuple:
        """Through upstream's three helpers from the typed optim config."""
        use_distributed_optimizer = self.engine_config.use_distributed_optimizer
        megatron_config = init_megatron_optim_config(
            self.optimizer_config,
            use_distributed_optimizer=use_distributed_optimizer,
            fp16=self.param_dtype is torch.float16,
            bf16=self.param_dtype is torch.bfloat16,
        )
        optimizer = get_megatron_optimizer(self.model, megatron_config)
        return optimizer, get_megatron_optimizer_param_scheduler(optimizer, self.optimizer_config)

    def train_step(self, microbatches: list[torch.Tensor]) -> dict:
        return train_step(self.model, self.optimizer, self.scheduler, microbatches)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return forward_logits(self.model, tokens)

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        *,
        step_files: dict[str, bytes] | None = None,
        track: bool = False,
        **kwargs: Any,
    ) -> bool:
        """Save the step (upstream's arguments): the manager writes its parts into the step transaction's staging
        directory, the transaction commits them as ``local_path`` (``verl.utils.checkpoint.step_commit``).
        ``step_files`` (name -> bytes, beside ``local_path``'s directory) and, with ``track``, the tracker follow
        the commit. With async_save the write goes on in the background and this returns True (upstream's
        returns None): ``finalize_checkpoint`` commits. A failed save raises and leaves every committed step
        as it was. The record: ``last_committed``."""
        if hdfs_path is not None or kwargs:
            raise _unsupported("save_checkpoint", hdfs_path, kwargs, ", step_files and track")
        if self._pending is not None:  # one save in flight at a time
            self.finalize_checkpoint(blocking=True)
        manager = self.checkpoint_manager
        spec = dataclasses.replace(self._save_spec, max_ckpt_to_keep=max_ckpt_to_keep, step_files=step_files or {}, track=track)
        transaction = StepCommit(local_path, global_step, spec)
        with transaction as staging:
            if not manager.save_checkpoint(staging, global_step=global_step).completed:  # goes on in the background
                transaction.defer()
        if transaction.deferred:
            self._pending = transaction
            return True
        self._committed(transaction.committed)
        return False

    @property
    def save_pending(self) -> bool:
        """Whether a save's step transaction waits for ``finalize_checkpoint``: the rank's one marker of a
        pending save (the manager's own ``async_save_pending`` serves a direct call of the manager)."""
        return self._pending is not None

    def finalize_checkpoint(self, blocking: bool = True) -> str | None:
        """Commit a pending async save once its background write is durable; the committed path, or None when
        nothing was pending (or, with ``blocking=False``, the write is still running). The step is committed
        only when the manager reports that very staging directory's save completed: a direct call of the
        manager's finalize may have completed it, or failed it (then this raises and nothing is tracked)."""
        transaction = self._pending
        if transaction is None:
            return None
        manager = self.checkpoint_manager

        def written(blocking: bool) -> SaveReport | None:  # docs/checkpoint.md's recipe
            if manager.finalize_async_save(blocking) is FinalizeState.WRITING:
                return None
            return manager.completed_save(transaction.staging)

        try:
            committed = transaction.finalize(written, blocking)
        except BaseException:
            self._pending = None
            raise
        if committed is None:
            return None
        self._pending = None
        return self._committed(committed).path

    def _step_spec(self) -> StepSpec:
        """What the step transaction is told of every save of this engine, made explicit once it is built: the
        manager's role, contents, verification and hooks, and the parallel layout, all fixed from here on
        (each save adds its retention limit, step files and tracking)."""
        manager = self.checkpoint_manager

        def sealed() -> dict[str, str]:
            sealer = manager.last_save.sealer if manager.last_save is not None else None
            return sealer.results() if sealer is not None else {}

        return StepSpec(
            role=manager.role,
            hf_config=manager.hf_config if manager.should_save_hf_model else None,
            strict_hf_verify=bool(config_get(manager.checkpoint_config, "strict_hf_verify", True)),
            parallel=current_parallel_layout(),
            use_distributed_optimizer=manager.use_distributed_optimizer,
            bridge=checkpoint_bridge(self.engine_config.vanilla_mbridge),
            sealed=sealed,
            retention=manager,
            on_phase=manager.on_save_phase,
        )

    def _committed(self, committed: CommittedStep) -> CommittedStep:
        """Keep the record, carrying the whole save's phases: the manager's report (the writer's phases) and the
        transaction's. Each stays written by its owner: nothing here writes into the manager's report."""
        report = self.checkpoint_manager.last_save
        writer_phases = dict(report.phase_seconds) if report is not None else {}
        self.last_committed = dataclasses.replace(committed, phase_seconds={**writer_phases, **committed.phase_seconds})
        return self.last_committed

    def load_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        del_local_after_load: bool = True,
        *,
        checked: CheckedStep | None = None,
        **kwargs: Any,
    ) -> None:
        """Check the step (every rank fails together, before anything loads), then load it (upstream's arguments;
        upstream's ``del_local_after_load`` removes only a remote checkpoint's local copy: here there is none, so
        the step is kept either way). ``checked``: the driver's record of its check of this step before the ranks
        started (``verl.utils.checkpoint.resume_check``); the ranks then check only what it leaves open. Without
        it, every check runs here.

        The manager loads the weights before the optimizer state, so a bf16 run's fp32 master weights come from
        the checkpoint, never from the bf16 weights. Weights loaded without the optimizer state are copied into
        the master weights (megatron's ``reload_model_params``): otherwise the next step would write the masters,
        still this run's initial weights, back over them."""
        if hdfs_path is not None or kwargs:
            raise _unsupported("load_checkpoint", hdfs_path, kwargs)
        self.finalize_checkpoint(blocking=True)
        manager = self.checkpoint_manager
        check_before_load(manager, local_path, checked, checkpoint_bridge(self.engine_config.vanilla_mbridge))
        manager.load_checkpoint(local_path)
        if (manager.should_load_hf_model or manager.should_load_dist_ckpt_model) and not manager.should_load_optimizer:
            self.optimizer.reload_model_params()
        finite.check_finite(self.model, self.optimizer, f"{local_path} loaded a corrupt state; do not train on it")

    def export_hf(self, path: str) -> None:
        """Write the current weights as an HF folder through the bridge (all ranks take part)."""
        self.bridge.save_weights(self.model, path)

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of this rank's parameters by name (to compare runs bit for bit)."""
        return {
            f"{index}.{name}": param.detach().clone()
            for index, chunk in enumerate(self.model)
            for name, param in chunk.named_parameters()
        }


def _unsupported(method: str, hdfs_path: str | None, extra: dict[str, Any], ours: str = "") -> Exception:
    """The refusal of upstream's remote copy, or of keywords this engine does not know (upstream's engine
    ignores them; a misspelt ``step_files`` would lose the step's data), raised before any work."""
    if hdfs_path is not None:
        return NotImplementedError(f"MegatronEngine.{method}: hdfs_path={hdfs_path!r} is not supported; copy the local checkpoint yourself")
    return TypeError(f"MegatronEngine.{method}: unknown keyword(s) {sorted(extra)}; it takes upstream's arguments{ours} only")


class MegatronReference:
    """The reference policy of the KL term: a second Megatron model on the actor's ranks and layout, built
    from the same HF weights the actor started from (``model_path``), frozen, never trained and never saved
    (upstream checkpoints no reference). A resumed run rebuilds it from ``model_path``, so it is always the
    initial model. As upstream's, it is not DDP-wrapped: it only runs forward, and holds no grad buffers."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, vanilla_mbridge: bool = False) -> None:
        self.hf_config = load_hf_config(model_path)
        self.bridge = make_model_bridge(model_path, self.hf_config, dtype, vanilla_mbridge)
        self.model = build_megatron_model(self.bridge, wrap_with_ddp=False)
        self.bridge.load_weights(self.model, model_path)
        release_free_heap()
        for chunk in self.model:
            chunk.requires_grad_(False)

    def compute_log_prob(
        self, input_ids: torch.Tensor, response_length: int, temperature: float, micro_batch_size: int,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[rows, response_length]`` log-probabilities of each row's response under the reference weights
        (``attention_mask``: 0 on the prompts' left padding)."""
        return compute_log_probs(self.model, input_ids, response_length, temperature, micro_batch_size, attention_mask)

    def params_digest(self) -> str:
        """SHA-256 of this rank's reference parameters (names and bytes, in order): equal digests, equal weights.
        The weights must be resident (not offloaded)."""
        import hashlib

        digest = hashlib.sha256()
        for index, chunk in enumerate(self.model):
            for name, param in chunk.named_parameters():
                digest.update(f"{index}.{name}".encode())
                # a copy: exporting the parameter's own storage to numpy would make it non-resizable (no offload)
                digest.update(param.detach().to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

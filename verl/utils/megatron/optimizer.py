"""Megatron optimizer and LR scheduler from the typed optim config, with upstream verl's three helpers.

``init_megatron_optim_config`` (typed config -> megatron's ``OptimizerConfig``), ``get_megatron_optimizer``
and ``get_megatron_optimizer_param_scheduler`` have upstream's names, signatures and defaults, so code
written against upstream builds its optimizer here unchanged. ``get_megatron_optimizer_and_scheduler`` is
this package's older one-call form, kept for its callers and built on the same three, so there is one path.

Differences from upstream, each because upstream's behaviour would drop a setting without a word:
``betas`` reach Megatron's Adam (upstream leaves Megatron's (0.9, 0.999)); Muon is refused rather than
attempted (no emerging-optimizers build here); a schedule without decay steps fails naming the keys to
set instead of on an assertion inside Megatron.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

# Only the names upstream's module imports at load time, so code (and upstream's tests) that stands in for
# these two megatron modules imports this one the same way.
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer as _megatron_get_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

logger = logging.getLogger(__name__)

__all__ = [
    "MuonUnavailableError",
    "init_megatron_optim_config",
    "get_megatron_optimizer",
    "get_megatron_optimizer_param_scheduler",
    "get_megatron_last_lr",
    "get_megatron_optimizer_and_scheduler",
]

_STATE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A key of the typed config, a DictConfig or a plain dict (upstream's callers pass any of them)."""
    if isinstance(config, Mapping) or hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


class MuonUnavailableError(NotImplementedError, ValueError):
    """``optimizer: muon`` without a Muon build: upstream raises ValueError, this package always refuses Muon."""


def init_megatron_optim_config(
    optim_config: dict,
    use_distributed_optimizer: bool = True,
    fp16: bool = False,
    bf16: bool = True,
) -> OptimizerConfig:
    """Megatron's ``OptimizerConfig`` for ``optim_config`` (a ``McoreOptimizerConfig`` or the same keys).

    ``fp16`` / ``bf16`` describe the model's parameters (neither: fp32); they pick Megatron's mixed-precision
    optimizer. ``override_optimizer_config`` entries are applied last, as upstream does.
    """
    algorithm = str(_get(optim_config, "optimizer", "adam")).lower()
    if algorithm not in ("adam", "sgd"):
        raise MuonUnavailableError(
            f"optim.optimizer={algorithm!r}: only Megatron's 'adam' and 'sgd' are built here (upstream's Muon "
            "path needs a megatron-core build with emerging_optimizers support); set optim.optimizer=adam"
        )
    args: dict[str, Any] = {
        "optimizer": algorithm,
        "lr": float(_get(optim_config, "lr")),
        "min_lr": float(_get(optim_config, "min_lr", 0.0)),
        "clip_grad": float(_get(optim_config, "clip_grad", 1.0)),
        "weight_decay": float(_get(optim_config, "weight_decay", 0.01)),
        "use_distributed_optimizer": use_distributed_optimizer,
    }
    if "adam_beta1" in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        # every megatron-core has them; a stand-in OptimizerConfig may not
        beta1, beta2 = tuple(_get(optim_config, "betas", (0.9, 0.999)))
        args.update(adam_beta1=float(beta1), adam_beta2=float(beta2))
    if fp16:
        # Megatron's fp16 path: dynamic loss scaling from 2**15, as upstream configures it.
        args.update(
            bf16=False,
            fp16=True,
            params_dtype=torch.float16,
            initial_loss_scale=32768,
            min_loss_scale=1,
            use_precision_aware_optimizer=True,
            store_param_remainders=False,
        )
    elif bf16:
        args.update(bf16=True, params_dtype=torch.bfloat16)
        if _get(optim_config, "use_precision_aware_optimizer", False):
            args.update(
                use_precision_aware_optimizer=True,
                main_grads_dtype=_STATE_DTYPES[str(_get(optim_config, "main_grads_dtype", "fp32"))],
                exp_avg_dtype=_STATE_DTYPES[str(_get(optim_config, "exp_avg_dtype", "fp32"))],
                exp_avg_sq_dtype=_STATE_DTYPES[str(_get(optim_config, "exp_avg_sq_dtype", "fp32"))],
            )
    else:
        # fp32: the precision-aware optimizer only helps below fp32, and Megatron refuses its dtypes without it.
        args.update(bf16=False, fp16=False, params_dtype=torch.float32)
    args.update(_get(optim_config, "override_optimizer_config", None) or {})
    logger.debug("megatron optimizer config: %s", args)
    return OptimizerConfig(**args)


def get_megatron_optimizer(model: list, config: OptimizerConfig) -> MegatronOptimizer:
    """Megatron's optimizer over the model chunks (a ``ChainedOptimizer`` when there are expert params)."""
    return _megatron_get_optimizer(config=config, model_chunks=model)


def get_megatron_optimizer_param_scheduler(optimizer: MegatronOptimizer, config: Any) -> OptimizerParamScheduler:
    """Megatron's LR / weight-decay scheduler for ``config`` (a ``McoreOptimizerConfig`` or the same keys).

    The decay runs over ``lr_decay_steps`` (None: ``total_training_steps``); warmup is ``lr_warmup_steps``,
    or, when that is None or <= 0, ``lr_warmup_steps_ratio`` of the decay steps.
    """
    total = _get(config, "total_training_steps", -1)
    decay_steps = _get(config, "lr_decay_steps", None)
    if decay_steps is None:
        decay_steps = total
    if decay_steps is None or decay_steps <= 0:
        raise ValueError(
            f"the LR schedule needs a positive number of steps: optim.lr_decay_steps={_get(config, 'lr_decay_steps')}, "
            f"optim.total_training_steps={total}; set one of them (the trainer fills total_training_steps in)"
        )
    warmup_steps = _get(config, "lr_warmup_steps", None)
    ratio = _get(config, "lr_warmup_steps_ratio", None)
    if ratio is not None and (warmup_steps is None or warmup_steps <= 0):
        warmup_steps = int(ratio * decay_steps)
    warmup_steps = max(int(warmup_steps or 0), 0)
    if warmup_steps >= decay_steps:
        raise ValueError(f"optim: {warmup_steps} warmup steps must be fewer than the {decay_steps} decay steps")
    use_checkpoint = bool(_get(config, "use_checkpoint_opt_param_scheduler", False))
    weight_decay = float(_get(config, "weight_decay", 0.01))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=float(_get(config, "lr_warmup_init", 0.0)),
        max_lr=float(_get(config, "lr")),
        min_lr=float(_get(config, "min_lr", 0.0)),
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=int(decay_steps),
        lr_decay_style=_get(config, "lr_decay_style", "linear"),
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=total,
        wd_incr_style=_get(config, "weight_decay_incr_style", "constant"),
        use_checkpoint_opt_param_scheduler=use_checkpoint,
        override_opt_param_scheduler=not use_checkpoint,
        wsd_decay_steps=_get(config, "lr_wsd_decay_steps", None),
        lr_wsd_decay_style=_get(config, "lr_wsd_decay_style", "exponential"),
    )


def get_megatron_last_lr(optimizer: MegatronOptimizer) -> float:
    """The learning rate the optimizer's first parameter group used last."""
    return optimizer.param_groups[0]["lr"]


def get_megatron_optimizer_and_scheduler(
    model: list,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    use_distributed_optimizer: bool = False,
    total_steps: int = 1000,
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Adam plus a constant-after-warmup schedule that resumes from the checkpoint's scheduler state,
    through the three helpers above; the model's parameter dtype picks the mixed-precision path."""
    # The keys of McoreOptimizerConfig (verl.workers.config sits above this layer, so a plain dict).
    config = {
        "optimizer": "adam",
        "lr": lr,
        "weight_decay": weight_decay,
        "clip_grad": clip_grad,
        "min_lr": min_lr,
        "lr_warmup_init": 0.0,
        "lr_warmup_steps": warmup_steps,
        "total_training_steps": max(total_steps, 1),
        "lr_decay_style": "constant",
        "use_checkpoint_opt_param_scheduler": True,
    }
    dtype = next(model[0].parameters()).dtype
    megatron_config = init_megatron_optim_config(
        config,
        use_distributed_optimizer=use_distributed_optimizer,
        fp16=dtype is torch.float16,
        bf16=dtype is torch.bfloat16,
    )
    optimizer = get_megatron_optimizer(model, megatron_config)
    return optimizer, get_megatron_optimizer_param_scheduler(optimizer, config)

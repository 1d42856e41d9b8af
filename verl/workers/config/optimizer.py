"""Optimizer configs with upstream verl's names, fields and defaults: ``OptimizerConfig``, the
Megatron one, ``McoreOptimizerConfig``, and upstream's FSDP one, ``FSDPOptimizerConfig`` (a config type
only: no FSDP optimizer is built here).

Each checks its values when it is built, so a bad ``optim.*`` override fails at start-up with the
field named instead of as an assertion deep inside Megatron's scheduler after the ranks are up.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any, ClassVar

from verl.base_config import BaseConfig

__all__ = ["OptimizerConfig", "McoreOptimizerConfig", "FSDPOptimizerConfig"]

# Megatron's OptimizerParamScheduler accepts exactly these.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
# Megatron's optimizers; "muon" is upstream's route to Megatron's emerging optimizers (not built here).
OPTIMIZERS = ("adam", "sgd", "muon")
_STATE_DTYPES = ("fp32", "float32", "32", "bf16", "bfloat16")
# The LR schedules of upstream's FSDP workers.
FSDP_LR_SCHEDULER_TYPES = ("constant", "cosine")


def _number(owner: str, name: str, value: Any, minimum: float | None = None) -> float:
    """``value`` as a float (a numeric string from a YAML file included), >= ``minimum`` when given."""
    if isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}") from None
    if math.isnan(number) or (minimum is not None and number < minimum):
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value!r}")
    return number


def _integer(owner: str, name: str, value: Any, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{owner}.{name} must be an integer{' or null' if optional else ''}, got {value!r}")
    return int(value)


def _choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of {list(choices)}")


def _boolean(owner: str, name: str, value: Any) -> None:
    # bool("false") is True: a string that reached here would silently mean the opposite.
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be true or false, got {value!r}")


@dataclasses.dataclass
class OptimizerConfig(BaseConfig):
    """What every optimizer shares.

    Args:
        lr: peak learning rate; 0 is allowed (a run that must not move the weights, e.g. a sanity check).
        lr_warmup_steps_ratio: warmup as a fraction of the decay steps, used when lr_warmup_steps <= 0 or None.
        total_training_steps: filled in by the trainer (hence mutable); -1 until then.
        weight_decay: decoupled weight decay.
        lr_warmup_steps: warmup steps; None or <= 0 defers to lr_warmup_steps_ratio.
        betas: Adam's (beta1, beta2).
        clip_grad: gradient-norm clip; 0 disables clipping.
        grad_clip: deprecated spelling of clip_grad (upstream's); when set it wins, with a warning.
    """

    _mutable_fields: ClassVar[set[str]] = {"clip_grad", "total_training_steps", "lr_warmup_steps"}

    lr: float = 1e-3
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1
    weight_decay: float = 0.01
    lr_warmup_steps: int | None = -1
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = 1.0
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.lr, str) and self.lr == "???":
            raise ValueError(f"{owner}.lr must be set")
        self._normalize("lr", _number(owner, "lr", self.lr, minimum=0.0))
        self._normalize("weight_decay", _number(owner, "weight_decay", self.weight_decay, minimum=0.0))
        self._normalize("clip_grad", _number(owner, "clip_grad", self.clip_grad, minimum=0.0))
        ratio = _number(owner, "lr_warmup_steps_ratio", self.lr_warmup_steps_ratio, minimum=0.0)
        if ratio > 1.0:
            raise ValueError(f"{owner}.lr_warmup_steps_ratio must be in [0, 1], got {ratio}")
        self._normalize("lr_warmup_steps_ratio", ratio)
        _integer(owner, "total_training_steps", self.total_training_steps)
        _integer(owner, "lr_warmup_steps", self.lr_warmup_steps, optional=True)
        betas = tuple(self.betas) if not isinstance(self.betas, (str, bytes)) else ()
        if len(betas) != 2:
            raise ValueError(f"{owner}.betas must be two numbers (beta1, beta2), got {self.betas!r}")
        betas = tuple(_number(owner, "betas", beta, minimum=0.0) for beta in betas)
        if any(beta >= 1.0 for beta in betas):
            raise ValueError(f"{owner}.betas must each be in [0, 1), got {list(betas)}")
        self._normalize("betas", betas)
        if self.grad_clip is not None:
            warnings.warn("grad_clip is deprecated; use clip_grad", DeprecationWarning, stacklevel=3)
            self.clip_grad = _number(owner, "grad_clip", self.grad_clip, minimum=0.0)


@dataclasses.dataclass
class McoreOptimizerConfig(OptimizerConfig):
    """Megatron-core's optimizer and LR scheduler settings (upstream's ``optim`` keys of a Megatron actor).

    Args:
        optimizer: "adam" or "sgd" (Megatron's); "muon" is upstream's and is refused when the optimizer is built.
        lr_warmup_init: learning rate at the first warmup step.
        lr_decay_steps: steps the decay runs over; None: total_training_steps.
        lr_decay_style: one of LR_DECAY_STYLES (Megatron's spelling).
        min_lr: floor of the decay; must not exceed lr.
        weight_decay_incr_style: one of WEIGHT_DECAY_INCR_STYLES.
        lr_wsd_decay_style / lr_wsd_decay_steps: the anneal of the "WSD" decay style.
        use_checkpoint_opt_param_scheduler: on load, take the scheduler's settings from the checkpoint
            (False: from this config, overriding the checkpoint's). The schedule's position (its step count)
            is restored either way.
        use_precision_aware_optimizer, main_grads_dtype, exp_avg_dtype, exp_avg_sq_dtype: Megatron's
            precision-aware optimizer (bf16 only; needs TransformerEngine).
        use_layer_wise_distributed_optimizer, use_layer_wise_param_layout, muon_*: upstream's Muon
            settings, accepted so upstream configs load; Muon itself is not built here.
        override_optimizer_config: extra keyword arguments for megatron's ``OptimizerConfig``, applied last.
    """

    optimizer: str = "adam"
    lr_warmup_init: float = 0.0
    lr_decay_steps: int | None = None
    lr_decay_style: str = "linear"
    min_lr: float = 0.0
    weight_decay_incr_style: str = "constant"
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_steps: int | None = None
    use_checkpoint_opt_param_scheduler: bool = False
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    use_layer_wise_distributed_optimizer: bool = False
    use_layer_wise_param_layout: bool | None = None
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_fp32_matmul_prec: str = "medium"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    muon_match_adamw_update_rms: bool = False
    override_optimizer_config: dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _choice(owner, "optimizer", str(self.optimizer).lower(), OPTIMIZERS)
        _choice(owner, "lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        _choice(owner, "weight_decay_incr_style", self.weight_decay_incr_style, WEIGHT_DECAY_INCR_STYLES)
        _choice(owner, "lr_wsd_decay_style", self.lr_wsd_decay_style, LR_WSD_DECAY_STYLES)
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            _choice(owner, name, str(getattr(self, name)), _STATE_DTYPES)
        self._normalize("min_lr", _number(owner, "min_lr", self.min_lr, minimum=0.0))
        self._normalize("lr_warmup_init", _number(owner, "lr_warmup_init", self.lr_warmup_init, minimum=0.0))
        # Megatron's scheduler asserts these when it is built, far from the key that caused them.
        if self.min_lr > self.lr:
            raise ValueError(f"{owner}.min_lr={self.min_lr} exceeds lr={self.lr}")
        if self.lr_warmup_init > self.lr:
            raise ValueError(f"{owner}.lr_warmup_init={self.lr_warmup_init} exceeds lr={self.lr}")
        for name in ("lr_decay_steps", "lr_wsd_decay_steps"):
            steps = _integer(owner, name, getattr(self, name), optional=True)
            if steps is not None and steps <= 0:
                raise ValueError(f"{owner}.{name} must be a positive integer or null, got {steps}")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_steps is None:
            raise ValueError(f"{owner}.lr_decay_style='WSD' needs lr_wsd_decay_steps")
        if self.override_optimizer_config is not None and not isinstance(self.override_optimizer_config, dict):
            raise ValueError(f"{owner}.override_optimizer_config must be a mapping, got {self.override_optimizer_config!r}")
        for name in ("use_checkpoint_opt_param_scheduler", "use_precision_aware_optimizer"):
            _boolean(owner, name, getattr(self, name))


@dataclasses.dataclass
class FSDPOptimizerConfig(OptimizerConfig):
    """Upstream's FSDP optimizer and LR schedule settings (the ``optim`` node of an FSDP actor or critic).

    Args:
        optimizer / optimizer_impl: the optimizer class and the module it comes from ("AdamW", "torch.optim").
        lr_scheduler_type: one of FSDP_LR_SCHEDULER_TYPES (settable afterwards, as upstream's).
        warmup_style: upstream's deprecated spelling of lr_scheduler_type; when set it wins, with a warning.
        min_lr_ratio: the cosine schedule's floor as a fraction of lr (None: 0).
        num_cycles: cosine waves over the decay (0.5: one half-wave down to the floor).
        override_optimizer_config: extra keyword arguments for the optimizer.
        zero_indexed_step: the schedule counts steps from 0 (False: from 1).
    """

    _mutable_fields: ClassVar[set[str]] = OptimizerConfig._mutable_fields | {"lr_scheduler_type"}

    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    min_lr_ratio: float | None = None
    warmup_style: str | None = None
    lr_scheduler_type: str = "constant"
    num_cycles: float = 0.5
    override_optimizer_config: dict | None = None
    zero_indexed_step: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.warmup_style is not None:
            _choice(owner, "warmup_style", self.warmup_style, FSDP_LR_SCHEDULER_TYPES)
            warnings.warn("warmup_style is deprecated; use lr_scheduler_type", DeprecationWarning, stacklevel=3)
            self.lr_scheduler_type = self.warmup_style
        _choice(owner, "lr_scheduler_type", self.lr_scheduler_type, FSDP_LR_SCHEDULER_TYPES)
        if self.min_lr_ratio is not None:
            ratio = _number(owner, "min_lr_ratio", self.min_lr_ratio, minimum=0.0)
            if ratio > 1.0:
                raise ValueError(f"{owner}.min_lr_ratio must be in [0, 1], got {ratio}")
            self._normalize("min_lr_ratio", ratio)
        self._normalize("num_cycles", _number(owner, "num_cycles", self.num_cycles, minimum=0.0))
        _boolean(owner, "zero_indexed_step", self.zero_indexed_step)
        if self.override_optimizer_config is not None and not isinstance(self.override_optimizer_config, dict):
            raise ValueError(f"{owner}.override_optimizer_config must be a mapping, got {self.override_optimizer_config!r}")

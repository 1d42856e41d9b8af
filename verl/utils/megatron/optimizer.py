"""Megatron optimizer and LR scheduler from plain settings (upstream verl's optim keys)."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def get_megatron_optimizer_and_scheduler(
    model: list,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    use_distributed_optimizer: bool = False,
    total_steps: int = 1000,
    warmup_steps: int = 0,
    min_lr: float = 0.0,
):
    """Adam (megatron's ChainedOptimizer over dense and expert params) plus a constant-after-warmup scheduler."""
    dtype = next(model[0].parameters()).dtype
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        use_distributed_optimizer=use_distributed_optimizer,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
    )
    optimizer = get_megatron_optimizer(config, model)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_steps else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, 1),
        lr_decay_style="constant",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
    return optimizer, scheduler

"""Megatron model chunks from a bridge (either of ``verl.models.mcore.bridge``'s), wrapped in Megatron DDP."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.utils import get_model_config

from verl.utils.internals import mbridge as mbridge_internals


def build_megatron_model(bridge: Any, use_distributed_optimizer: bool = False, wrap_with_ddp: bool = True) -> list:
    """Model chunks (one per virtual pipeline stage) in the bridge's dtype, DDP-wrapped for training.

    ``use_distributed_optimizer=False`` gives DDP buffers with ``param_data is None`` (no flat
    parameter buffer): the configuration MoE runs such as PP4 EP2 TP2 ETP2 use.
    """
    half = bridge.dtype in (torch.bfloat16, torch.float16)
    mbridge_internals.let_get_model_compare_model_types()
    model = bridge.get_model(
        wrap_with_ddp=wrap_with_ddp,
        bf16=bridge.dtype is torch.bfloat16,
        fp16=bridge.dtype is torch.float16,
        use_cpu_initialization=True,
        ddp_config={
            "use_distributed_optimizer": use_distributed_optimizer,
            "grad_reduce_in_fp32": True,
            "overlap_grad_reduce": False,
            "overlap_param_gather": False,
        },
        data_parallel_random_init=not half,
    )
    if wrap_with_ddp:
        _install_grad_sync(model)
    return model


def _install_grad_sync(model: list) -> None:
    """What megatron's training loop wires up and the pipeline schedule calls after backward.

    Without ``finalize_model_grads`` no gradient is all-reduced across data parallel ranks, and the
    replicated norm weights (sequence parallel, qk-norm) drift apart across tensor parallel ranks.
    """
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync

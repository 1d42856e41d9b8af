"""verl.utils.megatron.optimizer: upstream's three helpers build a real Megatron optimizer and scheduler from
the typed config on a CPU rank, and the older one-call helper is the same path."""

import math

import pytest
import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler, init_megatron_optim_config
from verl.utils.megatron.parallel import ParallelSizes
from verl.workers.config import McoreOptimizerConfig


def _model() -> list:
    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.models.tiny import tiny_hf_config

    torch.manual_seed(0)
    return build_megatron_model(make_bridge(tiny_hf_config("moe"), dtype=torch.float32), use_distributed_optimizer=False)


def _batches() -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(1))
    return [data[:2], data[2:]]


def _weights(model: list) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in model for p in chunk.parameters()]


def _helpers_on_a_rank() -> dict:
    from verl.models.mcore.forward import train_step
    from verl.utils.megatron.optimizer import (
        get_megatron_last_lr,
        get_megatron_optimizer,
        get_megatron_optimizer_and_scheduler,
    )

    report: dict = {}
    config = McoreOptimizerConfig(
        lr=1e-3, min_lr=1e-4, clip_grad=0.5, weight_decay=0.1, betas=(0.8, 0.95),
        lr_warmup_steps=2, lr_decay_style="cosine", total_training_steps=10,
    )
    model = _model()
    optimizer = get_megatron_optimizer(model, init_megatron_optim_config(config, use_distributed_optimizer=False, bf16=False))
    scheduler = get_megatron_optimizer_param_scheduler(optimizer, config)
    report["optimizer"] = type(optimizer).__name__
    report["betas"] = sorted({g["betas"] for opt in optimizer.chained_optimizers for g in opt.optimizer.param_groups})
    lrs = [get_megatron_last_lr(optimizer)]
    for _ in range(3):
        result = train_step(model, optimizer, scheduler, _batches())
        lrs.append(get_megatron_last_lr(optimizer))
    report["lrs"], report["step_ok"] = lrs, result["update_ok"] and math.isfinite(result["loss"])

    # lr=0 is a legitimate sanity run: a full step (grads, clipping, Adam) that leaves the weights alone.
    still = _model()
    frozen = McoreOptimizerConfig(lr=0.0, weight_decay=0.0, total_training_steps=5)
    optimizer = get_megatron_optimizer(still, init_megatron_optim_config(frozen, use_distributed_optimizer=False, bf16=False))
    before = _weights(still)
    result = train_step(still, optimizer, get_megatron_optimizer_param_scheduler(optimizer, frozen), _batches())
    report["lr0_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _weights(still), strict=True))
    report["lr0_grad_norm"] = result["grad_norm"]

    # The one-call helper (its callers' defaults) trains exactly as the three helpers with the same settings.
    one_call, three = _model(), _model()
    opt_a, sched_a = get_megatron_optimizer_and_scheduler(one_call, lr=2e-3, clip_grad=1.0)
    same = {"lr": 2e-3, "weight_decay": 0.0, "lr_decay_style": "constant", "total_training_steps": 1000}
    opt_b = get_megatron_optimizer(three, init_megatron_optim_config(same, use_distributed_optimizer=False, bf16=False))
    sched_b = get_megatron_optimizer_param_scheduler(opt_b, same)
    for _ in range(2):
        train_step(one_call, opt_a, sched_a, _batches())
        train_step(three, opt_b, sched_b, _batches())
    report["one_call_equals_helpers"] = all(
        torch.equal(a, b) for a, b in zip(_weights(one_call), _weights(three), strict=True)
    )
    report["one_call_scheduler"] = (sched_a.use_checkpoint_opt_param_scheduler, sched_a.lr_decay_style, sched_a.max_lr)
    return report


def test_upstream_helpers_build_and_train_on_a_cpu_rank():
    report = run_on_ranks(_helpers_on_a_rank, 1, ParallelSizes())[0]
    assert report["optimizer"] == "ChainedOptimizer"  # dense + expert parameters
    assert report["betas"] == [(0.8, 0.95)]  # the config's betas reach Megatron's Adam
    lrs = report["lrs"]
    # warmup from lr_warmup_init=0 over 2 steps, then cosine from 1e-3 towards min_lr 1e-4 over 10 steps
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(5e-4) and lrs[2] == pytest.approx(1e-3)
    assert 1e-4 < lrs[3] < 1e-3
    assert report["step_ok"]
    assert report["lr0_unchanged"] and report["lr0_grad_norm"] > 0
    assert report["one_call_equals_helpers"]
    assert report["one_call_scheduler"] == (True, "constant", 2e-3)


def test_init_megatron_optim_config_maps_upstreams_keys():
    config = McoreOptimizerConfig(lr=0.0, clip_grad=0.0, override_optimizer_config={"adam_eps": 1e-6})
    fp32 = init_megatron_optim_config(config, use_distributed_optimizer=False, bf16=False)
    assert (fp32.lr, fp32.clip_grad, fp32.params_dtype, fp32.bf16, fp32.fp16) == (0.0, 0.0, torch.float32, False, False)
    assert fp32.adam_eps == 1e-6 and fp32.use_distributed_optimizer is False
    bf16 = init_megatron_optim_config({"lr": 1e-3, "min_lr": 0.0, "clip_grad": 1.0, "weight_decay": 0.01})  # upstream's defaults
    assert (bf16.bf16, bf16.params_dtype, bf16.use_distributed_optimizer) == (True, torch.bfloat16, True)
    with pytest.raises(NotImplementedError, match="optimizer='muon'"):
        init_megatron_optim_config(McoreOptimizerConfig(optimizer="muon"))


def test_scheduler_without_steps_names_the_keys_to_set():
    with pytest.raises(ValueError, match=r"optim.lr_decay_steps=None, optim.total_training_steps=-1"):
        get_megatron_optimizer_param_scheduler(None, McoreOptimizerConfig())
    with pytest.raises(ValueError, match="5 warmup steps must be fewer than the 5 decay steps"):
        get_megatron_optimizer_param_scheduler(None, McoreOptimizerConfig(lr_warmup_steps=5, total_training_steps=5))

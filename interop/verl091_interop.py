#!/usr/bin/env python
"""Checkpoints across verl 0.9.1 (the PyPI wheel) and this package, both directions.

Both packages are named ``verl``, so they never share a process: this file runs under two interpreters.

* this repository's venv (``.venv``), where ``import verl`` is this package;
* a venv of its own holding verl 0.9.1 installed with ``--no-deps`` (docs/upstream-interop.md says how),
  passed as ``--verl091-python``.

Commands (run them with this repository's venv python; the 0.9.1 steps are started as subprocesses):

``fixture --out DIR``
    Writes the interop fixture: a tiny Qwen3-MoE made by this package (``verl.models.tiny``), trained for
    two steps and saved by verl 0.9.1's own code (mbridge bridge, 0.9.1's ``make_megatron_module``, its
    ``McoreOptimizerConfig`` -> ``init_megatron_optim_config`` -> ``get_megatron_optimizer`` ->
    ``get_megatron_optimizer_param_scheduler``, its ``MegatronCheckpointManager``), at 1 rank and at
    4 ranks (PP2 EP2), then loaded back by 0.9.1's manager into a fresh model; ``expected.json`` next to
    each checkpoint records what that load gives (and the state as it was saved).

``ours --out DIR``
    This package saves a checkpoint the same way (same model, steps and upstream keywords), records the
    saved state in ``expected.json``, then verl 0.9.1's manager loads it and every value is compared.

``verl091-load --ckpt CKPT --expected JSON``
    Only the 0.9.1 side of ``ours``: load any checkpoint this package saved and compare it with a
    record in this file's ``expected.json`` format.

Internal: ``_make-model`` and ``_run`` are the per-interpreter steps the commands above start.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VERL091_PYTHON = os.environ.get("VERL091_PYTHON", os.path.expanduser("~/.cache/verl091-venv/bin/python"))
RECORD_FORMAT = "verl091-interop/1"

# The fixture model: small enough that two checkpoints and their records stay well under 5 MB.
TINY_MODEL = {"kind": "moe", "num_layers": 2, "num_experts": 4, "seed": 7}
# Layouts: name -> (world size, pipeline parallel, expert parallel); TP = ETP = 1.
LAYOUTS = {"tp1_pp1_ep1": (1, 1, 1), "pp2_ep2": (4, 2, 2)}
TRAIN_STEPS = 2
MICRO_BATCH, SEQ_LEN = 2, 16
SEED = 1234
# Optimizer and scheduler settings, as upstream's ``actor.optim`` keys (McoreOptimizerConfig fields).
OPTIM = {
    "lr": 1e-2,
    "min_lr": 1e-4,
    "clip_grad": 1.0,
    "weight_decay": 0.01,
    "lr_warmup_steps": 1,
    "lr_warmup_init": 1e-3,
    "total_training_steps": 10,
    "lr_decay_style": "cosine",
    "use_checkpoint_opt_param_scheduler": True,
}
SAVE_CONTENTS = ["model", "optimizer", "extra", "hf_model"]
LOAD_CONTENTS = ["model", "optimizer", "extra"]


# --------------------------------------------------------------------------------------------------
# verl 0.9.1 on a CPU-only host
# --------------------------------------------------------------------------------------------------


def install_cpu_shim() -> None:
    """Give megatron-core, mbridge and verl 0.9.1 CPU answers to their CUDA-only calls.

    This package does the same in ``verl/utils/megatron/cpu_runtime.py`` (see docs/cpu.md for why each
    answer is needed); 0.9.1 cannot import it, so the 0.9.1 side installs this smaller equivalent. It
    covers training at TP1 (no uneven tensor-parallel collectives); at TP2 / ETP2 it covers building, loading
    and saving (what ``benchmarks/bench_vs_verl091.py`` does), not the MoE forward.
    """
    import contextlib
    import functools

    import torch

    if torch.cuda.is_available():
        return
    cpu = torch.device("cpu")

    def names_cuda(device) -> bool:
        if isinstance(device, torch.device):
            return device.type == "cuda"
        if isinstance(device, str):
            return device.startswith("cuda")
        return isinstance(device, int) and not isinstance(device, bool)

    cuda = torch.cuda
    cuda.current_device = lambda: cpu
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    cuda.empty_cache = lambda: None
    cuda.synchronize = lambda device=None: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0

    class NoStream:
        """A stream/event stand-in: CPU work is already in order."""

        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            answers = {"query": True, "elapsed_time": 0.0}
            return lambda *args, **kwargs: answers.get(name, NoStream())

    cuda.Stream = cuda.Event = NoStream
    cuda.current_stream = cuda.default_stream = lambda device=None: NoStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.nvtx.range_push = cuda.nvtx.range_pop = lambda *args, **kwargs: None

    def on_cpu(factory):
        @functools.wraps(factory)
        def wrapped(*args, **kwargs):
            if names_cuda(kwargs.get("device")):
                kwargs["device"] = cpu
            return factory(*args, **kwargs)

        return wrapped

    for name in (
        "tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "rand",
        "randn",
        "arange",
        "zeros_like",
        "empty_like",
        "ones_like",
    ):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kwargs: self
    plain_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and names_cuda(args[0]):
            args = (cpu, *args[1:])
        if names_cuda(kwargs.get("device")):
            kwargs["device"] = cpu
        return plain_to(self, *args, **kwargs)

    torch.Tensor.to = to

    # The "CUDA" generator is the CPU one.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None

    # megatron's optimizers check for torch.cuda.*Tensor type names.
    plain_type = torch.Tensor.type
    cuda_names = {
        torch.float32: "torch.cuda.FloatTensor",
        torch.bfloat16: "torch.cuda.BFloat16Tensor",
        torch.float16: "torch.cuda.HalfTensor",
    }

    def tensor_type(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in cuda_names:
            return cuda_names[self.dtype]
        return plain_type(self, *args, **kwargs)

    torch.Tensor.type = tensor_type
    torch._dynamo.config.disable = True  # megatron's jit_fuser would compile C++ for microsecond kernels

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)

    def split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = split_sizes_to_host
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16 leaves it undefined without TransformerEngine


def local_spec_bridge(bridge):
    """Turn an mbridge bridge into one that builds megatron-core's local layer spec (no TransformerEngine).

    mbridge knows only the TransformerEngine spec's parameter names; the few local-spec names that
    differ are translated (this package does the same in ``verl/models/mcore/local_spec.py``). Any TP / ETP:
    every rank reads its parameters' HF tensors and keeps its own tensor-parallel slice (mbridge's split).
    """
    import re

    from mbridge.core.util import unwrap_model
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    expert_name = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
    base = type(bridge)

    class LocalSpec(base):
        def _get_transformer_layer_spec(self, vp_stage=None):
            self.has_vp_stage = True
            return get_gpt_decoder_block_spec(
                self.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
            )

        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep=True):
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)
            offset = 0
            if consider_ep and self.mpu.ep_size > 1:
                offset = self.mpu.ep_rank * (self.config.num_moe_experts // self.mpu.ep_size)
            return {local: te_name(name, offset) for local, name in names.items()}

        def load_weights(self, models, weights_path, memory_efficient=False):
            self.safetensor_io = self._get_safetensor_io(weights_path)
            for model in models:
                state = unwrap_model(model).state_dict()
                for local, name in self._weight_name_mapping_mcore_local_to_global(model).items():
                    if "_extra_state" in local:
                        continue
                    hf_names = self._weight_name_mapping_mcore_to_hf(name)
                    tensors = self.safetensor_io.load_some_hf_weight(hf_names)
                    value = self._weight_to_mcore_format(name, [tensors[n] for n in hf_names])
                    # experts are split over the expert-TP group, everything else over the TP group
                    if ".mlp.experts.linear_fc" in name:
                        size, index = self.mpu.etp_size, self.mpu.etp_rank
                    else:
                        size, index = self.mpu.tp_size, self.mpu.tp_rank
                    value = list(self._weight_split_across_tp(name, value, state[local], size))[index]
                    state[local].copy_(value.to(state[local].dtype))

    def te_name(name: str, offset: int) -> str:
        if name.endswith(".input_layernorm.weight"):
            return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
        found = expert_name.search(name)
        if found:
            return f"{name[: found.start()]}.mlp.experts.{found.group(2)}.weight{int(found.group(1)) + offset}"
        return name

    LocalSpec.__name__ = f"CpuLocalSpec{base.__name__}"
    bridge.__class__ = LocalSpec
    return bridge


# --------------------------------------------------------------------------------------------------
# One rank: build, train, save, load, record (the same code for both packages where the API is shared)
# --------------------------------------------------------------------------------------------------


def setup_rank(side: str, rank: int, world: int, port: int, pp: int, ep: int, tp: int = 1, etp: int = 1) -> None:
    import torch

    if side == "verl091":
        install_cpu_shim()
    else:
        from verl.utils.megatron import cpu_runtime

        cpu_runtime.enable()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    random.seed(SEED + rank)
    import numpy as np

    np.random.seed(SEED + rank)


def load_hf(model_path: str):
    """The HF config and tokenizer of ``model_path`` in this interpreter. A model written by transformers 5 (this
    repository's venv) meets transformers 4 in the 0.9.1 venv, which knows neither its tokenizer class
    (``TokenizersBackend``: the fast tokenizer reads the same tokenizer.json) nor Qwen3-MoE's ``num_local_experts``
    (it reads ``num_experts``, 128 by default); under transformers 5 both load as written."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    hf_config = AutoConfig.from_pretrained(model_path)
    if hasattr(hf_config, "num_local_experts") and getattr(hf_config, "num_experts", None) != hf_config.num_local_experts:
        hf_config.num_experts = hf_config.num_local_experts
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except ValueError as exc:
        if "TokenizersBackend" not in str(exc):
            raise
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    return hf_config, tokenizer


def build_bridge(side: str, hf_config):
    import torch

    if side == "verl091":
        from verl.models.mcore.mbridge import AutoBridge  # 0.9.1's import applies its mbridge patches

        bridge = local_spec_bridge(AutoBridge.from_config(hf_config, dtype=torch.float32))
        # 0.9.1 passes override_transformer_config through set_extra_args; these are what the local spec needs.
        # megatron's torch norm (local spec) refuses sequence parallelism, which mbridge turns on at TP > 1; the
        # saved state does not depend on it (at TP > 1 the shim builds, loads and saves; with EP > 1 it is refused).
        bridge.set_extra_args(
            moe_grouped_gemm=False, use_cpu_initialization=True, persist_layer_norm=False, sequence_parallel=False
        )
        bridge.config.fp16 = bridge.config.bf16 = False
        return bridge
    from verl.models.mcore import make_bridge

    return make_bridge(hf_config, dtype=torch.float32)


def build_model(side: str, bridge, hf_config) -> list:
    if side == "verl091":
        from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

        wrap = McoreModuleWrapperConfig(is_value_model=False, wrap_with_ddp=True, use_distributed_optimizer=False)
        model, _ = make_megatron_module(wrap_config=wrap, tf_config=bridge.config, hf_config=hf_config, bridge=bridge)
        return model
    from verl.models.mcore.model import build_megatron_model

    return build_megatron_model(bridge, use_distributed_optimizer=False)


def build_optimizer(side: str, model: list):
    """Upstream's path: McoreOptimizerConfig -> init_megatron_optim_config -> get_megatron_optimizer -> scheduler."""
    from verl.utils.megatron.optimizer import (
        get_megatron_optimizer,
        get_megatron_optimizer_param_scheduler,
        init_megatron_optim_config,
    )
    from verl.workers.config.optimizer import McoreOptimizerConfig

    optim_config = McoreOptimizerConfig(**OPTIM)
    megatron_config = init_megatron_optim_config(optim_config, use_distributed_optimizer=False, fp16=False, bf16=False)
    optimizer = get_megatron_optimizer(model=model, config=megatron_config)
    if side == "verl091":
        from verl.utils.megatron_utils import register_megatron_training_hooks

        register_megatron_training_hooks(model, optimizer)
    scheduler = get_megatron_optimizer_param_scheduler(optimizer=optimizer, config=optim_config)
    return optim_config, optimizer, scheduler


def build_manager(model, bridge, hf_config, tokenizer, optimizer, scheduler, optim_config, model_path: str):
    import torch
    from omegaconf import OmegaConf

    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.workers.config.checkpoint import McoreCheckpointConfig

    config = OmegaConf.create(
        {
            "model": {"path": model_path},
            "megatron": {
                "dist_ckpt_optim_fully_reshardable": False,
                "distrib_optim_fully_reshardable_mem_efficient": False,
            },
        }
    )
    return MegatronCheckpointManager(
        config=config,
        checkpoint_config=McoreCheckpointConfig(
            save_contents=list(SAVE_CONTENTS), load_contents=list(LOAD_CONTENTS), async_save=False
        ),
        model_config=hf_config,
        transformer_config=bridge.config,
        role="actor",
        model=model,
        arch=hf_config.architectures[0],
        hf_config=hf_config,
        param_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
        processing_class=tokenizer,
        optimizer=optimizer,
        optimizer_scheduler=scheduler,
        use_distributed_optimizer=False,
        use_checkpoint_opt_param_scheduler=optim_config.use_checkpoint_opt_param_scheduler,
        use_dist_checkpointing=False,
        bridge=bridge,
    )


def train(model: list, optimizer, scheduler, vocab_size: int) -> list[float]:
    """TRAIN_STEPS steps of next-token loss on seeded random tokens through megatron's pipeline schedule."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        positions = torch.arange(SEQ_LEN).unsqueeze(0).expand_as(tokens)
        mask = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1).view(1, 1, SEQ_LEN, SEQ_LEN)
        output = chunk(tokens, positions, mask, labels=torch.roll(tokens, -1, dims=1))

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses = []
    for step in range(TRAIN_STEPS):
        generator = torch.Generator().manual_seed(1000 * step + mpu.get_data_parallel_rank())
        tokens = torch.randint(4, vocab_size, (MICRO_BATCH, SEQ_LEN), generator=generator)
        for chunk in model:
            chunk.train()
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=model,
            num_microbatches=1,
            seq_length=SEQ_LEN,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        ok, _, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        scheduler.step(increment=1)
        losses.append(float(out[0]["loss"]) if out else float("nan"))
    return losses


def _digest(tensor) -> dict:
    import torch

    t = tensor.detach().to(torch.float32).contiguous().cpu()
    return {
        "shape": list(t.shape),
        "dtype": str(tensor.dtype).replace("torch.", ""),
        "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest(),
        "sum": float(t.double().sum()),
        "abs_sum": float(t.double().abs().sum()),
        "head": [float(x) for x in t.flatten()[:4]],
    }


def _rng_record() -> dict:
    """Digests of the RNG states and the next value each gives (the states are restored afterwards)."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    record = {
        "python_sha256": hashlib.sha256(repr(py_state).encode()).hexdigest(),
        "numpy_sha256": hashlib.sha256(np_state[1].tobytes() + repr((np_state[0], *np_state[2:])).encode()).hexdigest(),
        "torch_sha256": hashlib.sha256(torch_state.numpy().tobytes()).hexdigest(),
        "tracker_sha256": {
            name: hashlib.sha256(state.numpy().tobytes()).hexdigest()
            for name, state in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items())
        },
        "python_next": random.random(),
        "numpy_next": float(np.random.random()),
        "torch_next": float(torch.rand(1)[0]),
    }
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    return record


def record_state(model: list, bridge, optimizer, scheduler) -> dict:
    """This rank's view: parameters and Adam moments under their global (TE-spec) Megatron names."""
    from mbridge.core.util import unwrap_model

    params, exp_avg, exp_avg_sq, steps = {}, {}, {}, set()
    owner = {}
    for chunk in model:
        names = bridge._weight_name_mapping_mcore_local_to_global(chunk)
        for local, param in unwrap_model(chunk).named_parameters():
            name = names[local]
            params[name] = _digest(param)
            owner[id(param)] = name
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    groups = []
    for sub in subs:
        torch_opt = sub.optimizer
        for group in torch_opt.param_groups:
            groups.append({"lr": group["lr"], "weight_decay": group["weight_decay"], "params": len(group["params"])})
            for param in group["params"]:
                state = torch_opt.state.get(param, {})
                name = owner.get(id(param))
                if name is None or "exp_avg" not in state:
                    continue
                exp_avg[name] = _digest(state["exp_avg"])
                exp_avg_sq[name] = _digest(state["exp_avg_sq"])
                steps.add(int(state["step"]))
    return {
        "params": params,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "optimizer_steps": sorted(steps),
        "param_groups": groups,
        "lr_scheduler": scheduler.state_dict(),
        "rng": _rng_record(),
    }


def merge_ranks(per_rank: list[dict]) -> dict:
    """One record for the whole job: tensors by global name (replicas must agree), RNG per rank."""
    merged = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "rng": {}, "param_groups": {}, "lr_scheduler": None}
    steps = set()
    for rank, rec in enumerate(per_rank):
        for key in ("params", "exp_avg", "exp_avg_sq"):
            for name, value in rec[key].items():
                seen = merged[key].setdefault(name, value)
                if seen["sha256"] != value["sha256"]:
                    raise RuntimeError(f"{key} {name} differs between replicas (rank {rank})")
        steps.update(rec["optimizer_steps"])
        merged["rng"][str(rank)] = rec["rng"]
        merged["param_groups"][str(rank)] = rec["param_groups"]
        if merged["lr_scheduler"] is None:
            merged["lr_scheduler"] = rec["lr_scheduler"]
        elif merged["lr_scheduler"] != rec["lr_scheduler"]:
            raise RuntimeError(f"lr scheduler state differs on rank {rank}")
    if len(steps) != 1:
        raise RuntimeError(f"Adam step counts differ across parameters: {sorted(steps)}")
    merged["optimizer_step"] = steps.pop()
    for key in ("params", "exp_avg", "exp_avg_sq"):
        merged[key] = dict(sorted(merged[key].items()))
    return merged


def compare(expected: dict, got: dict, rng_source: dict[str, str] | None = None) -> dict:
    """Per category: how many entries match; ``rng_source`` maps each rank to the rank whose saved RNG it should get."""
    report = {}
    for key in ("params", "exp_avg", "exp_avg_sq"):
        want, have = expected[key], got[key]
        bad = sorted(n for n in want if n not in have or have[n]["sha256"] != want[n]["sha256"])
        extra = sorted(set(have) - set(want))
        report[key] = {
            "expected": len(want),
            "matching": len(want) - len(bad),
            "mismatched": bad[:10],
            "unexpected": extra[:10],
        }
    report["optimizer_step"] = {"expected": expected["optimizer_step"], "got": got["optimizer_step"]}
    report["lr_scheduler"] = {
        "match": expected["lr_scheduler"] == got["lr_scheduler"],
        "expected": expected["lr_scheduler"],
        "got": got["lr_scheduler"],
    }
    rng = {}
    for rank, rec in got["rng"].items():
        source = (rng_source or {}).get(rank, rank)
        want = expected["rng"][source]
        rng[rank] = {
            field: rec[field] == want[field]
            for field in ("python_sha256", "numpy_sha256", "torch_sha256", "tracker_sha256")
        }
    report["rng"] = rng
    groups = {rank: have == expected["param_groups"].get(rank) for rank, have in got["param_groups"].items()}
    report["param_groups"] = groups
    report["ok"] = (
        all(
            report[k]["matching"] == report[k]["expected"] and not report[k]["unexpected"]
            for k in ("params", "exp_avg", "exp_avg_sq")
        )
        and report["optimizer_step"]["expected"] == report["optimizer_step"]["got"]
        and report["lr_scheduler"]["match"]
        and all(all(v.values()) for v in rng.values())
        and all(groups.values())
    )
    return report


def rng_sources(world: int, pp: int) -> dict[str, str]:
    """Megatron saves RNG once per (PP, TP) coordinate, from data-parallel rank 0; every DP replica loads that one.

    With TP = 1 and megatron's default rank order, the ranks of one pipeline stage are consecutive.
    """
    per_stage = world // pp
    return {str(rank): str((rank // per_stage) * per_stage) for rank in range(world)}


def rank_main(rank: int, world: int, port: int, job: dict, results) -> None:
    try:
        results.put((rank, run_job(rank, world, port, job)))
    except BaseException as exc:  # report, then fail the rank
        import traceback

        results.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
        raise


def run_job(rank: int, world: int, port: int, job: dict) -> dict:
    """``job['action']``: 'save' (build, train, save, record; then for 0.9.1 load again and record) or 'load'."""
    side, pp, ep = job["side"], job["pp"], job["ep"]
    setup_rank(side, rank, world, port, pp, ep)
    import torch

    model_path = job["model_path"]
    hf_config, tokenizer = load_hf(model_path)
    bridge = build_bridge(side, hf_config)
    out = {"verl_file": __import__("verl").__file__}

    if job["action"] == "save":
        model = build_model(side, bridge, hf_config)
        bridge.load_weights(model, model_path)
        optim_config, optimizer, scheduler = build_optimizer(side, model)
        out["losses"] = train(model, optimizer, scheduler, hf_config.vocab_size)
        manager = build_manager(model, bridge, hf_config, tokenizer, optimizer, scheduler, optim_config, model_path)
        out["saved"] = record_state(model, bridge, optimizer, scheduler)
        manager.save_checkpoint(local_path=job["ckpt"], global_step=TRAIN_STEPS)
        torch.distributed.barrier()
        if rank == 0:
            # upstream's public helper: this code runs against 0.9.1's package as well as this one
            from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

            tracker = get_checkpoint_tracker_filename(os.path.dirname(os.path.dirname(job["ckpt"])))
            with open(tracker, "w") as f:
                f.write(str(TRAIN_STEPS))
        if side != "verl091":
            return out
        model_path = os.path.join(job["ckpt"], "model", "huggingface")

    # Load into a fresh model, optimizer and scheduler, with the RNGs moved elsewhere first.
    random.seed(99 + rank)
    import numpy as np

    np.random.seed(99 + rank)
    torch.manual_seed(99 + rank)
    # A new bridge, as a resumed process has: the training hooks put the optimizer into the old one's config.
    bridge = build_bridge(side, hf_config)
    model = build_model(side, bridge, hf_config)
    optim_config, optimizer, scheduler = build_optimizer(side, model)
    manager = build_manager(model, bridge, hf_config, tokenizer, optimizer, scheduler, optim_config, model_path)
    manager.load_checkpoint(job["ckpt"])
    out["loaded"] = record_state(model, bridge, optimizer, scheduler)
    torch.distributed.barrier()
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(job: dict, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, world, port, job, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    collected = {}
    try:
        while len(collected) < world:
            rank, value = results.get(timeout=900)
            if "error" in value:
                raise RuntimeError(f"rank {rank} failed:\n{value['error']}")
            collected[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=60 if len(collected) == world else 1)
            if proc.is_alive():
                proc.kill()
    return [collected[rank] for rank in range(world)]


# --------------------------------------------------------------------------------------------------
# Per-interpreter entry points
# --------------------------------------------------------------------------------------------------


def check_side(side: str) -> None:
    from importlib.metadata import version

    import verl

    inside_repo = os.path.abspath(verl.__file__).startswith(REPO + os.sep)
    if side == "verl091" and (inside_repo or version("verl") != "0.9.1"):
        sys.exit(
            f"expected verl 0.9.1 from its own venv, got {verl.__file__} ({version('verl')}); see docs/upstream-interop.md"
        )
    if side == "ours" and not inside_repo:
        sys.exit(f"expected this repository's verl, got {verl.__file__}")


def meta(side: str, layout: str, model_path: str) -> dict:
    from importlib.metadata import version

    from transformers import AutoConfig

    world, pp, ep = LAYOUTS[layout]
    cfg = AutoConfig.from_pretrained(model_path).to_dict()
    keep = (
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "tie_word_embeddings",
        "torch_dtype",
        "dtype",
    )
    return {
        "format": RECORD_FORMAT,
        "written_by": f"verl {version('verl')}" if side == "verl091" else "this package (verl overlay)",
        "script": "interop/verl091_interop.py",
        "layout": {"name": layout, "world_size": world, "tp": 1, "pp": pp, "ep": ep, "etp": 1, "dp": world // pp},
        "global_step": TRAIN_STEPS,
        "train": {"steps": TRAIN_STEPS, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "seed": SEED},
        "optim": OPTIM,
        "save_contents": SAVE_CONTENTS,
        "use_distributed_optimizer": False,
        "use_dist_checkpointing": False,
        "model_config": {k: cfg[k] for k in keep if k in cfg},
        "versions": {p: version(p) for p in ("verl", "torch", "megatron-core", "mbridge", "transformers")},
    }


def cmd_make_model(args) -> None:
    from verl.models.tiny import make_tiny_hf_model

    make_tiny_hf_model(
        args.out,
        kind=TINY_MODEL["kind"],
        seed=TINY_MODEL["seed"],
        num_layers=TINY_MODEL["num_layers"],
        num_experts=TINY_MODEL["num_experts"],
    )
    print(args.out)


def cmd_run(args) -> None:
    """Inside one interpreter: run a save and/or load job on the layout's ranks; write a JSON result."""
    check_side(args.side)
    world, pp, ep = LAYOUTS[args.layout]
    job = {
        "side": args.side,
        "action": args.action,
        "pp": pp,
        "ep": ep,
        "model_path": args.model,
        "ckpt": os.path.abspath(args.ckpt),
    }
    results = spawn_ranks(job, world)
    out = {"meta": meta(args.side, args.layout, args.model), "verl_file": results[0]["verl_file"]}
    if "losses" in results[0]:
        out["losses"] = [r["losses"] for r in results]
    for phase in ("saved", "loaded"):
        if phase in results[0]:
            out[phase] = merge_ranks([r[phase] for r in results])
    if args.expected:
        with open(args.expected) as f:
            expected = json.load(f)
        out["comparison"] = compare(expected["saved"], out["loaded"], rng_sources(world, pp))
    elif "saved" in out and "loaded" in out:
        out["comparison"] = compare(out["saved"], out["loaded"], rng_sources(world, pp))
    with open(args.result, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


def side_process_kwargs() -> dict:
    """``subprocess`` keywords for a script run by the other interpreter: outside the repository and without
    ``PYTHONPATH``, so the 0.9.1 interpreter cannot pick up this package's verl/ by cwd or path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("PYTHONWARNINGS", "ignore")
    return {"cwd": tempfile.gettempdir(), "env": env}


def _sub(python: str, *argv: str) -> None:
    subprocess.run([python, os.path.abspath(__file__), *argv], check=True, **side_process_kwargs())


def _summary(comparison: dict) -> str:
    parts = [
        f"{k} {comparison[k]['matching']}/{comparison[k]['expected']}" for k in ("params", "exp_avg", "exp_avg_sq")
    ]
    parts.append(f"step {comparison['optimizer_step']['got']} (want {comparison['optimizer_step']['expected']})")
    parts.append(f"scheduler {'ok' if comparison['lr_scheduler']['match'] else 'DIFFERS'}")
    parts.append(f"param groups (lr, wd) {'ok' if all(comparison['param_groups'].values()) else 'DIFFER'}")
    rng_ok = all(all(v.values()) for v in comparison["rng"].values())
    parts.append(f"rng {'ok' if rng_ok else 'DIFFERS: ' + json.dumps(comparison['rng'])}")
    return ("OK   " if comparison["ok"] else "FAIL ") + ", ".join(parts)


def cmd_fixture(args) -> None:
    out = os.path.abspath(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny_qwen3_moe")
        cmd_make_model(argparse.Namespace(out=model))
        for layout in args.layouts:
            root = os.path.join(out, layout)
            shutil.rmtree(root, ignore_errors=True)
            ckpt = os.path.join(root, f"global_step_{TRAIN_STEPS}", "actor")
            result = os.path.join(tmp, f"{layout}.json")
            _sub(
                args.verl091_python,
                "_run",
                "--side",
                "verl091",
                "--action",
                "save",
                "--layout",
                layout,
                "--model",
                model,
                "--ckpt",
                ckpt,
                "--result",
                result,
            )
            with open(result) as f:
                data = json.load(f)
            expected = {key: data[key] for key in ("meta", "saved", "loaded", "losses")}
            expected["self_check"] = {"loaded_equals_saved": data["comparison"]["ok"], "detail": data["comparison"]}
            with open(os.path.join(root, "expected.json"), "w") as f:
                json.dump(expected, f, indent=1, sort_keys=True)
            print(f"{layout}: 0.9.1 saved {ckpt}; 0.9.1's own load vs its save: {_summary(data['comparison'])}")
            if not data["comparison"]["ok"]:
                sys.exit(1)
    print(f"fixture: {out} ({tree_bytes(out) / 1e6:.2f} MB)")


def cmd_ours(args) -> None:
    """This package saves; verl 0.9.1 loads and compares."""
    check_side("ours")
    out = os.path.abspath(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny_qwen3_moe")
        cmd_make_model(argparse.Namespace(out=model))
        failed = False
        for layout in args.layouts:
            root = os.path.join(out, layout)
            shutil.rmtree(root, ignore_errors=True)
            ckpt = os.path.join(root, f"global_step_{TRAIN_STEPS}", "actor")
            expected = os.path.join(root, "expected.json")
            cmd_run(
                argparse.Namespace(
                    side="ours", action="save", layout=layout, model=model, ckpt=ckpt, result=expected, expected=None
                )
            )
            result = os.path.join(root, "verl091_load.json")
            comparison = _verl091_loads(args.verl091_python, layout, ckpt, expected, result)
            print(f"{layout}: ours saved {ckpt}; verl 0.9.1 loaded it: {_summary(comparison)}")
            failed |= not comparison["ok"]
    sys.exit(1 if failed else 0)


def _verl091_loads(python: str, layout: str, ckpt: str, expected: str, result: str) -> dict:
    """verl 0.9.1, in its own interpreter, loads ``ckpt`` and compares with ``expected``; its comparison."""
    model = os.path.join(ckpt, "model", "huggingface")
    _sub(python, "_run", "--side", "verl091", "--action", "load", "--layout", layout, "--model", model,
         "--ckpt", ckpt, "--expected", expected, "--result", result)  # fmt: skip
    with open(result) as f:
        return json.load(f)["comparison"]


def cmd_verl091_load(args) -> None:
    with open(args.expected) as f:
        layout = json.load(f)["meta"]["layout"]["name"]
    result = args.result or os.path.join(tempfile.gettempdir(), "verl091_load.json")
    comparison = _verl091_loads(args.verl091_python, layout, os.path.abspath(args.ckpt), os.path.abspath(args.expected), result)
    print(f"verl 0.9.1 loaded {args.ckpt}: {_summary(comparison)} (full report: {result})")
    sys.exit(0 if comparison["ok"] else 1)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("fixture", "ours"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
        p.add_argument("--verl091-python", default=DEFAULT_VERL091_PYTHON)
    p = sub.add_parser("verl091-load")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--expected", required=True)
    p.add_argument("--result")
    p.add_argument("--verl091-python", default=DEFAULT_VERL091_PYTHON)
    p = sub.add_parser("_make-model")
    p.add_argument("--out", required=True)
    p = sub.add_parser("_run")
    p.add_argument("--side", choices=["verl091", "ours"], required=True)
    p.add_argument("--action", choices=["save", "load"], required=True)
    p.add_argument("--layout", choices=list(LAYOUTS), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--expected")
    args = parser.parse_args()
    {
        "fixture": cmd_fixture,
        "ours": cmd_ours,
        "verl091-load": cmd_verl091_load,
        "_make-model": cmd_make_model,
        "_run": cmd_run,
    }[args.command](args)


if __name__ == "__main__":
    main()

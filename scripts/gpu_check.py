"""The CUDA path on one rank, without Ray: fix 1, a save in the worker's order, its HF export, loads (docs/gpu.md).

Everything else in the project runs on CPU ranks over gloo. This joins a one-rank process group (NCCL on
``--device cuda``, gloo on ``--device cpu``), builds the embedded tiny Qwen3-MoE through the bridge into
Megatron DDP with megatron's optimizer (the project's ``MegatronEngine``), and runs one row per check:

- ``environment``: the device, the backend and the versions imported (megatron-core, transformers, zlib-ng and
  Megatron-Bridge from where; it fails where Megatron-Bridge is asked for and does not import);
- ``offload DO=False`` / ``offload DO=True``: ``get_megatron_module_device`` resident / offloaded / reloaded,
  offload and reload of the model and the optimizer, every byte back, the next step trains; on CUDA the
  allocated and peak memory (``torch.cuda.max_memory_allocated``) of each phase, and what the offload freed;
- ``save while offloaded``: the worker's order (query the device of the offloaded model, reload it, save through
  ``MegatronCheckpointManager`` + the commit step, offload again), with fix 2's order seen through the manager's
  public ``on_save_phase`` hook: the HF config and tokenizer are on disk when the HF weight save starts;
- ``hf export``: the project's ``verify_hf_checkpoint`` on the export, and transformers' logits on the device
  equal Megatron's;
- ``dist-ckpt load``: a fresh model and optimizer load ``model/dist_ckpt`` + the optimizer bit for bit;
- ``async save``: an ``async_save`` with the distributed optimizer returns before the write, training goes on,
  the finalize commits it, and a fresh model loads the state as of the save, bit for bit;
- ``megatron-bridge save`` / ``megatron-bridge hf export`` (with ``--megatron-bridge``, or where it is installed): its model
  built on the device, one training step, a save through the checkpoint manager with its own HF weight save
  in fix 2's order, and that export verified and loaded by transformers with Megatron's logits.

    python scripts/gpu_check.py --device cuda --out DIR     # DIR/result.json and result.md; exit 1 on a failure
    python scripts/gpu_check.py --summarize DIR             # one table of DIR/*/result.json (scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

MIB = 2**20
FREED_SHARE = 0.9  # an offload on CUDA must free at least this share of the bytes it moves (and a reload take them back)
LOGITS_TOLERANCE = 1e-4
TRAINING_STEPS = 1000  # the run length the engines are built for: the YAML's LR schedule is constant
# Actor overrides: the model checkpointed by megatron's dist checkpointing, HF weights saved beside it; a load
# that leaves the HF weights out.
DIST_CHECKPOINT = ("megatron.use_dist_checkpointing=True", "checkpoint.save_contents=[model,optimizer,extra,hf_model]")
LOAD_NO_HF = "checkpoint.load_contents=[model,optimizer,extra]"


@dataclasses.dataclass
class Row:
    check: str
    ok: bool
    numbers: dict
    error: str | None = None


class Memory:
    """Per phase: on CUDA the allocated bytes after it and its peak (``max_memory_allocated``, reset at its start);
    on the CPU the process's resident set after it."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        self.numbers: dict[str, float] = {}

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        yield
        if self.cuda:
            self.torch.cuda.synchronize()
            self.numbers[f"{name}_peak_mib"] = self.torch.cuda.max_memory_allocated() / MIB
            self.numbers[f"{name}_alloc_mib"] = self.torch.cuda.memory_allocated() / MIB
        else:
            import psutil

            self.numbers[f"{name}_rss_mib"] = psutil.Process().memory_info().rss / MIB


def _batches(ctx: Context, seed: int) -> list:
    """Two microbatches on the host, as the trainer hands them: the Megatron forward moves them to the model."""
    import torch

    return list(torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed)).split(2))


def _bits(tensor):
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().clone()


def _state_bits(actor) -> dict:
    """Bytes of every parameter and of every optimizer-state tensor, in parameter order (stable across models)."""
    import torch

    bits = {name: _bits(value) for name, value in actor.parameters_snapshot().items()}
    for o, opt in enumerate(actor.optimizer.chained_optimizers):
        for g, group in enumerate(opt.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                for key, value in sorted(opt.optimizer.state.get(param, {}).items()):
                    if torch.is_tensor(value):
                        bits[f"optimizer{o}.group{g}.{i}.{key}"] = _bits(value)
    return bits


def _parameter_bits(model) -> dict:
    return {f"{i}.{n}": _bits(p) for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}


def _grad_bits(actor) -> dict:
    return {f"{i}.{n}": _bits(p.main_grad) for i, chunk in enumerate(actor.model) for n, p in chunk.named_parameters()}


def _differing(before: dict, after: dict) -> list[str]:
    if before.keys() != after.keys():
        return sorted(set(before) ^ set(after))
    import torch

    return [name for name in before if not torch.equal(before[name], after[name])]


def _actor(ctx: Context, *overrides: str, manager_cls: type | None = None):
    """The engine from ppo_megatron_trainer.yaml and ``overrides`` (under ``actor_rollout_ref.actor``), built
    through mbridge over a run of ``TRAINING_STEPS`` steps."""
    from verl.workers.config import megatron_actor_configs_from_yaml
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = megatron_actor_configs_from_yaml(ctx.model_path, ("megatron.vanilla_mbridge=True", *overrides), total_training_steps=TRAINING_STEPS)
    return MegatronEngine(*configs, **({"manager_cls": manager_cls} if manager_cls is not None else {}))


@dataclasses.dataclass
class Context:
    device: str
    work: Path
    torch_compile: str = ""
    model_path: str = ""
    megatron_bridge: bool = False  # its rows run, and the environment row fails where it does not import
    saved: dict = dataclasses.field(default_factory=dict)  # what the save row left for the rows after it


# --------------------------------------------------------------------------------------------- the checks


def _version_or_none(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_in(package) -> str:
    """The sys.path entry a top-level package was imported from."""
    return str(Path(package.__file__).parents[len(package.__name__.split("."))])


def check_environment(ctx: Context) -> tuple[bool, dict]:
    import megatron.core
    import torch
    import transformers

    from verl.utils.checkpoint import integrity
    from verl.utils.device import get_device_name

    numbers = {
        "device": get_device_name(),
        "backend": torch.distributed.get_backend(),
        "python": ".".join(map(str, sys.version_info[:3])),
        **{name: importlib.metadata.version(name) for name in ("torch", "megatron-core", "mbridge", "transformers")},
        "megatron-bridge": _version_or_none("megatron-bridge"),
        "megatron_core_from": _installed_in(megatron.core),
        "transformers_from": _installed_in(transformers),
        "crc32": integrity.crc32.__module__,  # zlib_ng.zlib_ng where installed (users' path), else zlib
        "zlib_ng_from": _installed_in(sys.modules["zlib_ng"]) if "zlib_ng" in sys.modules else None,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "torch_compile": ctx.torch_compile,
    }
    bridge_ok = True
    if ctx.megatron_bridge:  # as verl imports it (a host without TransformerEngine too)
        from verl.utils.internals.megatron_bridge import import_megatron_bridge

        try:
            numbers["megatron_bridge_from"] = _installed_in(import_megatron_bridge())
        except Exception as exc:  # noqa: BLE001 - whatever stops the import fails this row, named
            numbers["megatron_bridge_from"], bridge_ok = f"not importable: {type(exc).__name__}: {exc}", False
    if ctx.device == "cuda":
        numbers["gpu"] = torch.cuda.get_device_name()
    expected_backend = "nccl" if ctx.device == "cuda" else "gloo"
    return numbers["device"] == ctx.device and numbers["backend"] == expected_backend and bridge_ok, numbers


def check_offload(ctx: Context, use_distributed_optimizer: bool) -> tuple[bool, dict]:
    """Fix 1: where the model is, offload and reload of model + optimizer, nothing lost, training goes on."""
    from verl.utils import megatron_utils as mu

    memory = Memory(ctx.device)
    with memory.phase("build"):
        actor = _actor(ctx, f"megatron.use_distributed_optimizer={use_distributed_optimizer}", "checkpoint.save_contents=[model,optimizer,extra]")
    with memory.phase("train"):
        actor.train_step(_batches(ctx, 0))
    model, optimizer = actor.model, actor.optimizer
    before, grads = _state_bits(actor), _grad_bits(actor)
    storages = mu.describe_megatron_storages(model, optimizer)
    moved = sum(s.nbytes for s in storages if s.resident)
    states = {"resident": (mu.get_megatron_module_device(model), mu.is_megatron_module_offloaded(model))}
    allocated = {"resident": memory.allocated()}
    with memory.phase("offload"):
        mu.offload_megatron_model_to_cpu(model)
        mu.offload_megatron_optimizer(optimizer)
    states["offloaded"] = (mu.get_megatron_module_device(model), mu.is_megatron_module_offloaded(model))
    allocated["offloaded"] = memory.allocated()
    none_resident = not any(s.resident for s in mu.describe_megatron_storages(model, optimizer))
    with memory.phase("reload"):
        mu.load_megatron_model_to_gpu(model)
        mu.load_megatron_optimizer(optimizer)
    states["reloaded"] = (mu.get_megatron_module_device(model), mu.is_megatron_module_offloaded(model))
    allocated["reloaded"] = memory.allocated()
    all_resident = all(s.resident for s in mu.describe_megatron_storages(model, optimizer))
    differing = _differing(before, _state_bits(actor)) + _differing(grads, _grad_bits(actor))
    with memory.phase("train2"):
        loss = actor.train_step(_batches(ctx, 1))["loss"]
    numbers = {
        "device": "/".join(f"{state[0]}{'(offloaded)' if state[1] else ''}" for state in states.values()),
        "storages": len(storages),
        "moved_mib": moved / MIB,
        "bytes_differing": len(differing),
        "next_loss": loss,
        **memory.numbers,
    }
    ok = (
        states["resident"] == (ctx.device, False)
        and states["offloaded"] == ("cpu", True)
        and states["reloaded"] == (ctx.device, False)
        and none_resident
        and all_resident
        and not differing
        and math.isfinite(loss)
    )
    if memory.cuda:
        freed, retaken = allocated["resident"] - allocated["offloaded"], allocated["reloaded"] - allocated["offloaded"]
        numbers.update(freed_mib=freed / MIB, retaken_mib=retaken / MIB)
        numbers.update(_pinned_host_mib())
        ok = ok and freed >= FREED_SHARE * moved and retaken >= FREED_SHARE * moved
    return ok, numbers


def _pinned_host_mib() -> dict:
    """The pinned host memory torch's host allocator holds (the offload's host copies), where torch reports it."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        found = stats() if stats is not None else {}
    except RuntimeError:  # a torch without the host allocator's statistics
        return {}
    return {f"pinned_{key.split('.')[0]}_mib": found[key] / MIB for key in ("allocated_bytes.current", "reserved_bytes.current") if key in found}


def _phase_observer(seen: list[tuple[str, bool]]) -> type:
    """A checkpoint manager that notes, at each phase's start, whether the HF config and tokenizer are already in
    the save's folder (fix 2: both before ``hf_weights``), through the manager's public ``on_save_phase`` hook."""
    from verl.utils.checkpoint import layout
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    class PhaseObserver(MegatronCheckpointManager):
        def on_save_phase(self, phase: str) -> None:
            # the step transaction's first phase ("staging") comes before the manager's save report exists
            staging = self.last_save.local_path if self.last_save is not None else None
            hf = Path(layout.hf_path(staging)) if staging else None  # upstream's get_*_path would create it
            seen.append((phase, hf is not None and (hf / "config.json").exists() and (hf / "tokenizer_config.json").exists()))
            super().on_save_phase(phase)

    return PhaseObserver


def _fix2_seen(seen: list[tuple[str, bool]]) -> tuple[list[str], bool, bool]:
    """The phases in order, whether the HF config and tokenizer were on disk when ``hf_weights`` started, and
    whether the whole is fix 2's order (``hf_config`` before ``hf_weights``, both files there by then)."""
    phases = [phase for phase, _ in seen]
    on_disk = dict(seen).get("hf_weights", False)
    ordered = "hf_config" in phases and "hf_weights" in phases and phases.index("hf_config") < phases.index("hf_weights")
    return phases, on_disk, ordered and on_disk


def _hf_export_matches(hf: str, tokens, megatron_logits, device: str) -> tuple[bool, dict]:
    """``verify_hf_checkpoint`` finds every tensor the export's config implies, and transformers on the device
    computes Megatron's logits from it."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl.utils.checkpoint.hf_verify import verify_hf_checkpoint

    report = verify_hf_checkpoint(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = model(tokens.to(device)).logits.float().cpu()
    gap = (logits - megatron_logits).abs().max().item()
    numbers = {"verified": report.describe().split(": ", 1)[-1], "tensors": report.expected, "logits_gap": gap}
    return report.ok and gap <= LOGITS_TOLERANCE, numbers


def check_save_while_offloaded(ctx: Context) -> tuple[bool, dict]:
    """The worker's save: the offloaded model's device query, reload, save + commit, offload again; fix 2's order."""
    import torch

    from verl.utils import megatron_utils as mu

    seen: list[tuple[str, bool]] = []
    memory = Memory(ctx.device)
    actor = _actor(ctx, *DIST_CHECKPOINT, manager_cls=_phase_observer(seen))
    actor.train_step(_batches(ctx, 0))
    tokens = torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(3))
    ctx.saved.update(bits=_state_bits(actor), logits=actor.logits(tokens.to(ctx.device)).cpu(), tokens=tokens)
    mu.offload_megatron_model_to_cpu(actor.model)
    mu.offload_megatron_optimizer(actor.optimizer)
    queried = mu.get_megatron_module_device(actor.model)  # fix 1: safe on an offloaded model, and "cpu" there
    mu.load_megatron_model_to_gpu(actor.model, load_grad=False)
    mu.load_megatron_optimizer(actor.optimizer)
    path = str(ctx.work / "checkpoints" / "global_step_1" / "actor")
    with memory.phase("save"):
        pending = actor.save_checkpoint(path, global_step=1)
    mu.offload_megatron_model_to_cpu(actor.model)
    mu.offload_megatron_optimizer(actor.optimizer)
    offloaded_after = mu.is_megatron_module_offloaded(actor.model)
    ctx.saved["path"] = path
    phases, config_before_weights, fix2 = _fix2_seen(seen)
    numbers = {
        "queried_while_offloaded": queried,
        "phases": ">".join(phases),
        "config_on_disk_at_hf_weights": config_before_weights,
        "offloaded_after": offloaded_after,
        **({f"{k}_s": v for k, v in actor.last_committed.phase_seconds.items()} if actor.last_committed is not None else {}),
        **memory.numbers,
    }
    committed = (Path(path) / "manifest.json").exists() and not Path(path + ".incomplete").exists()
    ok = queried == "cpu" and not pending and fix2 and offloaded_after and committed
    return ok, numbers


def check_hf_export(ctx: Context) -> tuple[bool, dict]:
    """The export holds every tensor its config implies, and transformers on the device computes Megatron's logits."""
    from verl.utils.megatron_utils import get_hf_model_checkpoint_path

    return _hf_export_matches(get_hf_model_checkpoint_path(ctx.saved["path"]), ctx.saved["tokens"], ctx.saved["logits"], ctx.device)


def check_dist_checkpoint_load(ctx: Context) -> tuple[bool, dict]:
    """A fresh model and optimizer load model/dist_ckpt and optimizer/dist_ckpt: every byte as saved."""
    fresh = _actor(ctx, *DIST_CHECKPOINT, LOAD_NO_HF)
    differed = len(_differing(ctx.saved["bits"], _state_bits(fresh)))
    start = time.monotonic()
    fresh.load_checkpoint(ctx.saved["path"])
    seconds = time.monotonic() - start
    differing = _differing(ctx.saved["bits"], _state_bits(fresh))
    numbers = {"tensors": len(ctx.saved["bits"]), "differing_before_load": differed, "differing_after_load": len(differing),
               "load_s": seconds}  # fmt: skip
    return differed > 0 and not differing, numbers


def check_async_save(ctx: Context) -> tuple[bool, dict]:
    """async_save with the distributed optimizer: returns pending, a training step runs during the write, the
    finalize commits, and a fresh model loads the state of the moment of the save."""
    actor = _actor(ctx, "megatron.use_distributed_optimizer=True", "checkpoint.async_save=True", *DIST_CHECKPOINT)
    actor.train_step(_batches(ctx, 0))
    expected = _state_bits(actor)
    path = str(ctx.work / "checkpoints" / "global_step_2" / "actor")
    pending = actor.save_checkpoint(path, global_step=2)
    report = actor.checkpoint_manager.last_save
    actor.train_step(_batches(ctx, 1))  # changes every parameter while the write runs
    start = time.monotonic()
    committed = actor.finalize_checkpoint(blocking=True)
    finalize_s = time.monotonic() - start
    fresh = _actor(ctx, "megatron.use_distributed_optimizer=True", LOAD_NO_HF, *DIST_CHECKPOINT)
    fresh.load_checkpoint(path)
    differing = _differing(expected, _state_bits(fresh))
    numbers = {"mode": report.mode.value, "pending": pending, "blocked_s": report.blocked_seconds, "finalize_s": finalize_s,
               "differing_after_load": len(differing), "tensors": len(expected)}  # fmt: skip
    return pending and committed == path and not differing, numbers


def check_ppo_update(ctx: Context) -> tuple[bool, dict]:
    """The PPO actor's log-probs and clipped update from host tensors, as the trainer hands a rank its batch:
    results come back on the host, finite, and the update moves the weights."""
    import torch

    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl.workers.config import McoreActorConfig, RolloutConfig

    actor = _actor(ctx)
    ppo = MegatronPPOActor(McoreActorConfig(), RolloutConfig(response_length=4), actor.model, actor.optimizer, actor.scheduler)
    input_ids = torch.randint(4, 90, (4, 12), generator=torch.Generator().manual_seed(7))
    old_log_probs = ppo.compute_log_prob(input_ids, 2)
    before = _state_bits(actor)
    stats = ppo.update_policy({
        "input_ids": input_ids, "old_log_probs": old_log_probs, "response_mask": torch.ones(4, 4),
        "advantages": torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 4).contiguous(),
    }, 2)  # fmt: skip
    moved = len(_differing(before, _state_bits(actor)))
    numbers = {"log_probs_device": old_log_probs.device.type, "grad_norm": stats["grad_norm"], "params_moved": moved}
    ok = old_log_probs.device.type == "cpu" and bool(torch.isfinite(old_log_probs).all()) and moved > 0
    return ok and stats["update_ok"] and stats["grad_norm"] == stats["grad_norm"], numbers


def check_megatron_bridge_save(ctx: Context) -> tuple[bool, dict]:
    """Megatron-Bridge, upstream's default bridge: the model built through ``megatron_bridge_provider`` into
    Megatron DDP with megatron's optimizer, one training step, then the model (dist checkpoint) and its HF export
    saved through ``MegatronCheckpointManager`` with Megatron-Bridge's own HF save (``MegatronBridgeWeights``),
    which reads the folder's config: fix 2's order (rank 0's config and tokenizer, then the weights)."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from transformers import AutoConfig

    from verl.models.mcore.forward import forward_logits, train_step
    from verl.models.mcore.megatron_bridge import MegatronBridgeWeights, megatron_bridge_provider
    from verl.utils.custom_code import load_tokenizer
    from verl.utils.megatron.optimizer import get_megatron_optimizer_and_scheduler

    memory = Memory(ctx.device)
    with memory.phase("build"):
        auto_bridge, provider = megatron_bridge_provider(ctx.model_path, dtype=torch.float32)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
        model = provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True)
        optimizer, scheduler = get_megatron_optimizer_and_scheduler(model, lr=3e-3, clip_grad=1.0, use_distributed_optimizer=False)
    device = {p.device.type for chunk in model for p in chunk.parameters()}
    before = _parameter_bits(model)
    with memory.phase("train"):
        loss = train_step(model, optimizer, scheduler, _batches(ctx, 0))["loss"]
    after = _parameter_bits(model)
    tokens = torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(5))
    ctx.saved.update(bridge_tokens=tokens, bridge_logits=forward_logits(model, tokens.to(ctx.device)).cpu())
    seen: list[tuple[str, bool]] = []
    hf_config = AutoConfig.from_pretrained(ctx.model_path)
    manager = _phase_observer(seen)(
        config={"model": {"path": ctx.model_path}}, checkpoint_config={"save_contents": ["model", "hf_model"], "load_contents": ["model"]},
        model_config=hf_config, transformer_config=provider, role="actor", model=model, arch=hf_config.architectures[0],
        hf_config=hf_config, param_dtype=torch.float32, share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        processing_class=load_tokenizer(ctx.model_path, ctx.model_path), optimizer=None, optimizer_scheduler=None,
        use_distributed_optimizer=False, bridge=MegatronBridgeWeights(auto_bridge),
    )  # fmt: skip
    path = str(ctx.work / "megatron_bridge" / "global_step_1" / "actor")
    with memory.phase("save"):
        report = manager.save_checkpoint(path, global_step=1)
    ctx.saved["bridge_path"] = path
    phases, config_before_weights, fix2 = _fix2_seen(seen)
    moved = len(_differing(before, after))
    numbers = {"params_device": "/".join(sorted(device)), "loss": loss, "params_moved": moved, "phases": ">".join(phases),
               "config_on_disk_at_hf_weights": config_before_weights, **memory.numbers}  # fmt: skip
    ok = device == {ctx.device} and math.isfinite(loss) and moved > 0 and report.completed
    return ok and fix2, numbers


def check_megatron_bridge_export(ctx: Context) -> tuple[bool, dict]:
    """Megatron-Bridge's HF export of the trained model: complete for its config, and transformers' logits equal
    Megatron's."""
    from verl.utils.checkpoint import layout

    hf = layout.hf_path(ctx.saved["bridge_path"])
    return _hf_export_matches(hf, ctx.saved["bridge_tokens"], ctx.saved["bridge_logits"], ctx.device)


MEGATRON_BRIDGE_CHECKS: list[tuple[str, Callable[[Context], tuple[bool, dict]]]] = [
    ("megatron-bridge save", check_megatron_bridge_save),
    ("megatron-bridge hf export", check_megatron_bridge_export),
]


CHECKS: list[tuple[str, Callable[[Context], tuple[bool, dict]]]] = [
    ("environment", check_environment),
    ("offload DO=False", lambda ctx: check_offload(ctx, False)),
    ("offload DO=True", lambda ctx: check_offload(ctx, True)),
    ("save while offloaded", check_save_while_offloaded),
    ("hf export", check_hf_export),
    ("dist-ckpt load", check_dist_checkpoint_load),
    ("async save DO=True", check_async_save),
    ("ppo update, host batch", check_ppo_update),
]


# --------------------------------------------------------------------------------------------- driver


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def table(rows: list[dict], by_version: bool = False) -> str:
    """The markdown table: one line per check (``by_version``: first the row's megatron-core version)."""
    head = (["megatron-core"] if by_version else []) + ["check", "result", "numbers"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        numbers = ", ".join(f"{k}={_format(v)}" for k, v in row["numbers"].items())
        if row.get("error"):
            numbers = (numbers + "; " if numbers else "") + "error: " + row["error"]
        cells = ([row["megatron_core"]] if by_version else []) + [row["check"], "pass" if row["ok"] else "FAIL", numbers]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def missing_compile_toolchain() -> str | None:
    """What torch.compile's CUDA backend lacks here, if anything: triton builds its launcher with a C compiler
    against Python's headers (megatron's fused bias-dropout-add and SwiGLU are torch.compile'd)."""
    import sysconfig

    if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
        return "no C compiler"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python.h"
    return None


def run_checks(device: str, work: Path, torch_compile: str, megatron_bridge: bool) -> list[Row]:
    """Every row; Megatron-Bridge's where ``megatron_bridge`` is asked for (scripts/gpu_check.sh asks where the
    bundle carries it: missing there, its rows fail) or where it is installed."""
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.distributed import find_free_port, init_rank
    from verl.utils.megatron.parallel import ParallelSizes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    init_rank(0, 1, ParallelSizes(), seed=1234, timeout_s=300.0)
    with_bridge = megatron_bridge or importlib.util.find_spec("megatron.bridge") is not None
    ctx = Context(device=device, work=work, torch_compile=torch_compile, megatron_bridge=with_bridge,
                  model_path=make_tiny_hf_model(str(work / "tiny_moe"), kind="moe"))  # fmt: skip
    rows = []
    for name, check in CHECKS + (MEGATRON_BRIDGE_CHECKS if with_bridge else []):
        start = time.monotonic()
        try:
            ok, numbers = check(ctx)
            row = Row(name, bool(ok), numbers)
        except Exception as exc:  # noqa: BLE001 - a failed check is a row; the rest still run
            last = traceback.extract_tb(exc.__traceback__)[-1]
            row = Row(name, False, {}, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                                       f"({Path(last.filename).name}:{last.lineno})")  # fmt: skip
            traceback.print_exc()
        row.numbers["seconds"] = time.monotonic() - start
        rows.append(row)
        print(f"[gpu_check] {name}: {'pass' if row.ok else 'FAIL'}", flush=True)
    return rows


def summarize(root: Path) -> int:
    """One table of every ``root/*/result.json`` (one per megatron-core version), written as summary.md/json."""
    results = [json.loads(p.read_text()) for p in sorted(root.glob("*/result.json"))]
    if not results:
        print(f"gpu_check: no */result.json under {root}; run scripts/gpu_check.sh", file=sys.stderr)
        return 2
    rows = [dict(row, megatron_core=result["megatron_core"]) for result in results for row in result["rows"]]
    text = table(rows, by_version=True)
    (root / "summary.md").write_text(text + "\n")
    (root / "summary.json").write_text(json.dumps({"results": results}, indent=2) + "\n")
    print(text)
    return 0 if rows and all(row["ok"] for row in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), help="cuda: NCCL on GPU 0; cpu: gloo, CUDA hidden")
    parser.add_argument("--out", type=Path, help="folder for result.json and result.md")
    parser.add_argument("--work", type=Path, help="folder for the model and checkpoints (default: a temp folder, removed)")
    parser.add_argument("--no-table", action="store_true", help="do not print the table (gpu_check.sh prints one of all runs)")
    parser.add_argument("--megatron-bridge", action="store_true",
                        help="run Megatron-Bridge's rows, failing where it does not import (gpu_check.sh: where the bundle carries it)")
    parser.add_argument("--summarize", type=Path, metavar="DIR", help="print one table of DIR/*/result.json and exit")
    args = parser.parse_args()
    if args.summarize is not None:
        return summarize(args.summarize)
    if args.device is None or args.out is None:
        parser.error("--device and --out are required (or --summarize DIR)")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: this run must not see a GPU
        torch_compile = "off (the CPU runtime disables it)"
    elif (missing := missing_compile_toolchain()) is not None:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # megatron's fused kernels then run eagerly instead of failing to build
        torch_compile = f"off ({missing})"
    else:
        torch_compile = "on"
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device; run on a GPU host or pass --device cpu", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="verl_gpu_check."))
    try:
        rows = run_checks(args.device, work, torch_compile, args.megatron_bridge)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {"device": args.device, "megatron_core": importlib.metadata.version("megatron-core"),
              "rows": [dataclasses.asdict(row) for row in rows]}  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = table(result["rows"])
    (args.out / "result.md").write_text(text + "\n")
    if not args.no_table:
        print(text)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmarks share: the benchmark's Qwen3-MoE, the bytes of a rank's state and of a folder, the machine.

Only the standard library at the top: megatron's dist-checkpoint writer starts a helper process with "spawn",
which imports the benchmark (and so this module) again; torch and megatron are imported where they are used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

MiB = 1 << 20
# Fixed shape; only the expert FFN width scales with --params.
HIDDEN, LAYERS, EXPERTS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 512, 8, 32, 8, 4, 64, 256


def model_overrides(params: float, experts: int = EXPERTS) -> dict:
    """HF config overrides for a Qwen3-MoE of about ``params`` parameters with ``experts`` experts per layer."""
    attention = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2 + 2 * HEAD_DIM
    per_layer_fixed = attention + 2 * HIDDEN + experts * HIDDEN
    fixed = LAYERS * per_layer_fixed + 2 * VOCAB * HIDDEN + HIDDEN
    per_unit = LAYERS * experts * 3 * HIDDEN  # parameters per unit of moe_intermediate_size
    intermediate = max(16, int(round((params - fixed) / per_unit / 16)) * 16)
    return dict(
        num_layers=LAYERS,
        num_experts=experts,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=4 * HIDDEN,
        moe_intermediate_size=intermediate,
        num_experts_per_tok=4,
    )


def make_model(path: str, params: float, experts: int = EXPERTS) -> tuple[str, int]:
    """Write the benchmark's Qwen3-MoE (fp32 HF folder, ~16 source shards) to ``path``; (path, parameter count)."""
    from verl.models.tiny import make_tiny_hf_model, tiny_hf_config

    overrides = model_overrides(params, experts)
    config = tiny_hf_config("moe", **overrides)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shard_mb = max(1, count * 4 // MiB // 16)  # ~16 source shards: 2 files per rank at 8 ranks
    make_tiny_hf_model(path, kind="moe", max_shard_size=f"{shard_mb}MB", **overrides)
    return path, count


# The benchmarks build through mbridge (Megatron-Bridge needs Python 3.12), over a run this long: the YAML's LR
# schedule is constant, so the length changes no step's LR.
MBRIDGE = "megatron.vanilla_mbridge=True"
TRAINING_STEPS = 1000


def engine(model_path: str, *overrides: str) -> Any:
    """A ``MegatronEngine`` of ``model_path`` from ppo_megatron_trainer.yaml and ``overrides`` (Hydra overrides
    under ``actor_rollout_ref.actor``): a benchmark times what a run gets, with no defaults of its own."""
    from verl.workers.config import megatron_actor_configs_from_yaml
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return MegatronEngine(*megatron_actor_configs_from_yaml(model_path, (MBRIDGE, *overrides), total_training_steps=TRAINING_STEPS))


def optim_overrides(optim: Mapping[str, Any]) -> list[str]:
    """``actor.optim`` values (``interop.OPTIM``, the settings verl 0.9.1 is timed with) as Hydra overrides;
    ``++``: the YAML leaves some of the keys out."""
    return [f"++optim.{key}={value}" for key, value in optim.items()]


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def state_bytes(actor) -> dict:
    """This rank's params, grads (DDP main_grad) and optimizer state tensors, each storage once."""
    import torch

    seen: set[int] = set()

    def add(tensor) -> int:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return 0
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return tensor.untyped_storage().nbytes()

    params = grads = optim = 0
    for chunk in actor.model:
        for param in chunk.parameters():
            params += add(param)
            grads += add(getattr(param, "main_grad", None))
            grads += add(param.grad)
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(sub, "optimizer", sub)
        for values in inner.state.values():
            for value in values.values():
                optim += add(value)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def prime_optimizer(model: list, optimizer, scheduler, seed: int) -> None:
    """One optimizer step on seeded gradients, so Adam holds its moments and step as after training."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for chunk in model:
        chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 1e-3)
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    scheduler.step(increment=1)


def machine() -> dict:
    import platform

    import psutil
    import torch

    disk = shutil.disk_usage(os.getcwd())
    return {
        "cpus": os.cpu_count(),
        "cpu_model": next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
            platform.processor(),
        ),
        "memory_GiB": psutil.virtual_memory().total / (1 << 30),
        "memory_available_GiB": psutil.virtual_memory().available / (1 << 30),
        "disk_GiB": disk.total / (1 << 30),
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


class PeriodicSampler:
    """Calls ``sample()`` every ``period_s`` on a thread while the ``with`` block runs."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def __enter__(self) -> PeriodicSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class LoadSampler(PeriodicSampler):
    """The 1-minute load average, sampled every few seconds on a thread while a run goes on."""

    def __init__(self, period_s: float = 5.0) -> None:
        super().__init__(period_s)
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])


class RankPeakRSS(PeriodicSampler):
    """Each rank's peak RSS over a run, in bytes: every ``period_s`` the descendants of ``pid`` that carry a rank
    (``RANK`` in the environment they started with: the worker group's Ray actors) are read, and a rank's peak is
    the largest high-water mark (``VmHWM``, which only grows) read from its process; growth after the last read is
    missed. ``driver``: the same of ``pid`` itself."""

    def __init__(self, pid: int, period_s: float = 2.0) -> None:
        super().__init__(period_s)
        self.pid = pid
        self.ranks: dict[int, int] = {}
        self.driver = 0
        self._rank_of: dict[int, int | None] = {}

    @staticmethod
    def _hwm(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)

    def _rank(self, pid: int) -> int | None:
        if pid not in self._rank_of:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            ray_rank = env.get(b"WG_BACKEND") == b"ray" and env.get(b"RANK", b"").isdigit()
            self._rank_of[pid] = int(env[b"RANK"]) if ray_rank else None
        return self._rank_of[pid]

    def sample(self) -> None:
        import psutil

        try:
            self.driver = max(self.driver, self._hwm(self.pid))
            children = psutil.Process(self.pid).children(recursive=True)
        except (OSError, psutil.Error):
            return
        for child in children:
            try:
                # only once titled ``ray::<class>``: a worker read between the raylet's fork and its exec shows the
                # raylet's environment (no RANK) and would be cached as no rank; a rank's own children inherit RANK
                title = child.cmdline()[:1]
                if not title or not title[0].startswith("ray::"):
                    continue
                rank = self._rank(child.pid)
                if rank is not None:
                    self.ranks[rank] = max(self.ranks.get(rank, 0), self._hwm(child.pid))
            except (OSError, psutil.Error):  # gone, or not ours to read
                continue


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_main_job(
    run_dir: str, overrides: list[str], label: str, rank_rss: dict | None = None
) -> tuple[list[dict], float, list[float]]:
    """One ``python -m verl.trainer.main_ppo`` through mbridge (requirements.txt's stack has no Megatron-Bridge) with
    ``overrides``, in a fresh ``run_dir`` (its checkpoints, metrics and ``run.log``): its metrics records, wall
    seconds and the load average sampled while it ran. ``rank_rss``, when given, is filled with the peak RSS in
    bytes of each rank (``RankPeakRSS``; rank -> bytes) and of the driver (key ``"driver"``). A run that fails ends
    the benchmark, naming its log."""
    from verl.trainer.ppo.ray_trainer import METRICS_FILENAME
    from verl.utils.internals.megatron_bridge import VANILLA_MBRIDGE_KEY

    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"{VANILLA_MBRIDGE_KEY}=True", f"trainer.default_local_dir={run_dir}", *overrides]
    print(f"[{label}] {' '.join(command[1:])}", flush=True)
    with open(os.path.join(run_dir, "run.log"), "w") as log, LoadSampler() as load:
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if rank_rss is None:
            returncode = proc.wait()
        else:
            with RankPeakRSS(proc.pid) as peaks:
                returncode = proc.wait()
            rank_rss.update({**dict(sorted(peaks.ranks.items())), "driver": peaks.driver})
        wall_s = time.monotonic() - start
    if returncode != 0:
        raise SystemExit(f"[{label}] exited {returncode}; see {run_dir}/run.log")
    return read_metrics(os.path.join(run_dir, METRICS_FILENAME)), wall_s, load.samples

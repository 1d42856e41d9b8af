"""A sync save's HF export: one unit in the rank (config -> barrier -> weights), run beside the dist-checkpoint
write over a group of its own when the bridge saves in parallel, its files sealed in the background.

Observed through public hooks only: the phase hook (``on_save_phase``), fix 2's ``wait_for_hf_config``, the
bridge's ``save_weights`` (wrapped), the save's report (``last_save``) and the committed files.
"""

from __future__ import annotations

import glob
import os
import threading
import time

import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(ep=2, etp=1)  # 2 ranks: experts split, dense data parallel
WORLD = 2
NAMES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class ParallelObservingBridge:
    """The real bridge (which saves in parallel over any group), plus what a rank finds on disk when its HF
    weight save starts and in which thread it runs."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.seen_at_start: dict | None = None
        self.in_main_thread: bool | None = None

    @property
    def saves_in_parallel(self) -> bool:
        return self.bridge.saves_in_parallel

    def save_weights(self, models, weights_path, memory_efficient=False, comm=None):
        self.seen_at_start = {name: os.path.exists(os.path.join(weights_path, name)) for name in NAMES}
        self.in_main_thread = threading.current_thread() is threading.main_thread()
        return self.bridge.save_weights(models, weights_path, memory_efficient=memory_efficient, comm=comm)


class SerialBridge:
    """The real bridge without ``saves_in_parallel``: the manager exports after the dist write, on the default group."""

    def __init__(self, bridge):
        self.bridge = bridge

    def save_weights(self, models, weights_path, memory_efficient=False):
        return self.bridge.save_weights(models, weights_path, memory_efficient=memory_efficient)


class SlowConfigManager(MegatronCheckpointManager):
    """Rank 0 takes its time writing the HF config (verl #6821's race, made certain); the phases are noted."""

    def on_save_phase(self, phase):
        if phase == "hf_config":
            time.sleep(3.0)
        super().on_save_phase(phase)


class SlowConfigNoBarrierManager(SlowConfigManager):
    def wait_for_hf_config(self, config_failure=None):
        pass


def _actor(src: str, wrap_bridge, manager_cls=MegatronCheckpointManager):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(src, "checkpoint.save_contents=[model,optimizer,extra,hf_model]", total_training_steps=TRAINING_STEPS)
    return MegatronEngine(*configs, wrap_bridge=wrap_bridge, manager_cls=manager_cls)


def _save_and_observe(src: str, root: str, manager_cls: type) -> dict:
    observed = {}

    def wrap(bridge):
        observed["bridge"] = ParallelObservingBridge(bridge)
        return observed["bridge"]

    actor = _actor(src, wrap, manager_cls)
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)
    bridge = observed["bridge"]
    return {"seen": bridge.seen_at_start, "in_main_thread": bridge.in_main_thread}


def test_beside_the_dist_write_every_rank_still_finds_the_config_before_its_weights(tiny_moe_path, tmp_path):
    results = run_on_ranks(_save_and_observe, WORLD, LAYOUT, args=(tiny_moe_path, str(tmp_path), SlowConfigManager))
    assert all(not r["in_main_thread"] for r in results), "the HF export should have run beside the dist write"
    assert all(all(r["seen"].values()) for r in results), results


def test_beside_the_dist_write_without_the_barrier_the_check_fails(tiny_moe_path, tmp_path):
    results = run_on_ranks(_save_and_observe, WORLD, LAYOUT, args=(tiny_moe_path, str(tmp_path), SlowConfigNoBarrierManager))
    assert not all(all(r["seen"].values()) for r in results), "the no-barrier variant should have raced rank 0"
    assert all(results[0]["seen"].values())  # rank 0 itself always writes first


def _hf_files(folder: str) -> dict[str, bytes]:
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(folder, "*")))}


def _beside_and_serial(src: str, root: str) -> dict:
    report = {}
    for name, wrap in (("beside", ParallelObservingBridge), ("serial", SerialBridge)):
        actor = _actor(src, wrap)
        actor.train_step([torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))] * 2)
        path = os.path.join(root, name, "global_step_1", "actor")
        actor.save_checkpoint(path, global_step=1)
        save = actor.checkpoint_manager.last_save
        hf = os.path.join("model", "huggingface")
        report[name] = {
            "hf": _hf_files(os.path.join(path, hf)) if torch.distributed.get_rank() == 0 else None,
            "committed_hf": sorted(os.path.relpath(p, path) for p in glob.glob(os.path.join(path, hf, "*"))),
            "sealed_hf": sorted(r for r in save.sealer.results() if r.startswith(hf)),
            "in_main_thread": getattr(actor.checkpoint_manager.bridge, "in_main_thread", True),
        }
    return report


def test_the_export_beside_the_dist_write_writes_the_same_files_and_seals_them(tiny_moe_path, tmp_path):
    reports = run_on_ranks(_beside_and_serial, WORLD, LAYOUT, args=(tiny_moe_path, str(tmp_path)))
    beside, serial = reports[0]["beside"], reports[0]["serial"]
    assert all(not r["beside"]["in_main_thread"] for r in reports)
    assert beside["hf"] == serial["hf"] and len(beside["hf"]) >= 4  # byte for byte: config, tokenizer, index, weights
    for name in ("beside", "serial"):
        # every HF file was hashed and fsynced by one rank's sealer, so the commit hashes none of them
        sealed = [r for report in reports for r in report[name]["sealed_hf"]]
        assert sorted(sealed) == reports[0][name]["committed_hf"], name

"""A reused dist-checkpoint save plan writes the current values, in the bytes a fresh plan writes.

From the second save of one sharded structure the in-rank writer reuses its plan, and resolves the tensors
megatron's conversion would hand it (checked on the fresh plan, item by item) straight from the state dict,
without building torch ``ShardedTensor``s. These tests train between saves (parameters and Adam moments change
every step), load each reused save back bit-exactly, compare a reused save's files byte for byte with a fresh
plan's of the same values, and show a release that resolves differently loses only the shortcut.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from verl.utils.checkpoint import dist_writer, finite
from verl.utils.distributed import run_on_ranks
from verl.utils.internals import megatron_core
from verl.utils.megatron.parallel import ParallelSizes

CONTENTS = ("model", "optimizer", "extra")
METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}  # non-distributed optimizer


def _actor(src: str):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    contents = (override("checkpoint.save_contents", CONTENTS), override("checkpoint.load_contents", CONTENTS))
    return MegatronEngine(*actor_configs(src, *contents, total_training_steps=TRAINING_STEPS))


def _batches(seed: int) -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def _state(actor) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment of the actor, cloned."""
    return {name: tensor.detach().clone() for name, tensor in finite.named_state_tensors(actor.model, actor.optimizer)}


def _record_direct(direct: list) -> None:
    """After each sync dist-checkpoint save, how many items its plan resolved directly (the public counter)."""
    real = dist_writer.InRankSaveStrategy.save

    def save(self, sharded_state_dict, checkpoint_dir):
        real(self, sharded_state_dict, checkpoint_dir)
        direct.append(self.last_direct)

    dist_writer.InRankSaveStrategy.save = save


def _train_save_three_times_then_load_each(src: str, root: str) -> dict:
    actor = _actor(src)
    direct: list = []
    _record_direct(direct)
    saved, per_save = {}, []
    for step in (1, 2, 3):
        actor.train_step(_batches(step))
        saved[step] = _state(actor)
        before = len(direct)
        actor.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step)
        per_save.append(direct[before:])  # one count per dist checkpoint (optimizer, RNG)
    assert all(not torch.equal(saved[2][name], saved[3][name]) for name in saved[3] if "exp_avg_sq" in name)
    fresh = _actor(src)
    differing = {}
    for step in (2, 3):
        fresh.load_checkpoint(os.path.join(root, f"global_step_{step}", "actor"))
        loaded = _state(fresh)
        differing[step] = [name for name in saved[step] if not torch.equal(saved[step][name], loaded[name])]
    return {"direct": per_save, "differing": differing}


@pytest.mark.parametrize(("world", "sizes"), [(1, ParallelSizes()), (2, ParallelSizes(ep=2, etp=1))], ids=["1rank", "EP2"])
def test_each_reused_plan_writes_the_current_values_and_loads_back_bit_exactly(tiny_moe_path, tmp_path, world, sizes):
    results = run_on_ranks(_train_save_three_times_then_load_each, world, sizes, args=(tiny_moe_path, str(tmp_path)))
    for rank, result in enumerate(results):
        first, second, third = result["direct"]  # the first save plans afresh, the later ones resolve directly
        assert len(first) >= 2 and not any(first), f"rank {rank}: a fresh plan resolved directly: {result}"
        assert max(second) > 0 and second == third, f"rank {rank}: {result}"
        assert result["differing"] == {2: [], 3: []}, f"rank {rank}: a reused plan wrote stale values"


def _fresh_and_reused_saves(src: str, root: str, convert_with_copies: bool) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from verl.utils.checkpoint.megatron_state_dicts import (
        model_sharded_state_dict,
        optimizer_sharded_state_dict,
        without_view_copies,
    )

    if convert_with_copies:  # a release whose conversion hands the planner copies: the direct tensors disagree
        module, name = megatron_core.TO_PYT_STATE_DICT.path.split(":")
        module = __import__(module, fromlist=[name])
        real = getattr(module, name)

        def copying(state_dict, is_loading=False, *args, **kwargs):
            converted = real(state_dict, is_loading, *args, **kwargs)
            for value in converted.values():
                if hasattr(value, "_sh_ten"):
                    value._sh_ten.data = value._sh_ten.data.clone()
                for shard in getattr(value, "local_shards", lambda: [])():
                    shard.tensor = shard.tensor.clone()
            return converted

        setattr(module, name, copying)
    actor = _actor(src)
    actor.train_step(_batches(0))

    def state() -> dict:
        model_state = model_sharded_state_dict(actor.model, METADATA)
        return without_view_copies(optimizer_sharded_state_dict(actor.optimizer, actor.scheduler, model_state, METADATA))

    kept, other = dist_writer.InRankSaveStrategy(), dist_writer.InRankSaveStrategy()
    report = {"direct": []}
    for name, strategy in (("first", kept), ("reused", kept), ("fresh", other)):
        path = os.path.join(root, f"rank{torch.distributed.get_rank()}", name)
        os.makedirs(path)
        dist_checkpointing.save(state(), path, sharded_strategy=strategy)
        report["direct"].append(strategy.last_direct)
    base = os.path.join(root, f"rank{torch.distributed.get_rank()}")
    files = sorted(f for f in os.listdir(os.path.join(base, "fresh")) if f.endswith(".distcp"))
    report["files"] = files
    report["identical"] = [filecmp.cmp(os.path.join(base, "reused", f), os.path.join(base, "fresh", f), shallow=False) for f in files]
    report["tensor_items"] = sum(isinstance(value, ShardedTensor) for value in nested_values(state()))
    return report


def test_a_reused_plan_writes_the_bytes_a_fresh_plan_writes(tiny_moe_path, tmp_path):
    report = run_on_ranks(_fresh_and_reused_saves, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path), False))[0]
    assert report["direct"][0] == 0 and report["direct"][2] == 0  # fresh plans: megatron's conversion throughout
    assert report["direct"][1] == report["tensor_items"]  # every tensor of this model resolves directly
    assert report["files"] and all(report["identical"])


def test_a_conversion_that_resolves_other_tensors_only_loses_the_shortcut(tiny_moe_path, tmp_path):
    report = run_on_ranks(_fresh_and_reused_saves, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path), True))[0]
    assert report["direct"] == [0, 0, 0]
    assert report["files"] and all(report["identical"])

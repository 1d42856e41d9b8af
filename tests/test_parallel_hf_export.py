"""The parallel HF export (every rank writes its own files) against mbridge's own save_weights, bit for bit."""

import glob
import json
import multiprocessing
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def _export_both_ways(src: str, root: str) -> None:
    from mbridge.core.safetensor_io import SafeTensorIO
    from transformers import AutoConfig

    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model

    bridge = make_bridge(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model = build_megatron_model(bridge, wrap_with_ddp=False)
    bridge.load_weights(model, src)
    # With the source's shard plan (what the checkpoint manager sees after loading from HF).
    bridge.save_weights(model, os.path.join(root, "fast"))
    bridge.save_weights_gathered(model, os.path.join(root, "mbridge"))
    torch.distributed.barrier()
    # From processes forked off every rank, over their own gloo group (the background save's way),
    # while the parents go on using the default group.
    forked = multiprocessing.get_context("fork").Process(target=_export_from_fork, args=(bridge, model, os.path.join(root, "forked")))
    forked.start()
    for _ in range(20):
        torch.distributed.all_reduce(torch.ones(1024))
    forked.join(120)
    assert forked.exitcode == 0, f"the forked export exited with {forked.exitcode}"
    torch.distributed.barrier()
    # Without a source plan: mbridge writes one file, the parallel export about one per rank.
    bridge.safetensor_io = SafeTensorIO(os.path.join(root, "no_such_dir"))
    bridge.save_weights(model, os.path.join(root, "fast_noindex"))
    bridge.save_weights_gathered(model, os.path.join(root, "mbridge_noindex"))
    torch.distributed.barrier()


def _export_from_fork(bridge, model, path: str) -> None:
    from verl.utils.rank_comm import ForkedRankComm

    bridge.save_weights(model, path, comm=ForkedRankComm("test_export"))


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for file in sorted(os.listdir(path)):
        with open(os.path.join(path, file), "rb") as handle:
            out[file] = handle.read()
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        part = load_file(file)
        assert not set(part) & set(state), f"{file} repeats tensors"
        state.update(part)
    return state


@pytest.mark.parametrize(
    "sizes,world", [(ParallelSizes(1, 1, 1, 1), 1), (ParallelSizes(tp=2, pp=2, ep=2, etp=2), 8)], ids=["1rank", "tp2pp2ep2etp2"]
)
def test_parallel_export_is_bit_identical_to_mbridge(tiny_moe_path, tmp_path, sizes, world):
    from transformers import AutoModelForCausalLM

    run_on_ranks(_export_both_ways, world, sizes, args=(tiny_moe_path, str(tmp_path)))

    # Same source plan: the very same files, byte for byte (safetensors, index, config).
    fast, reference = _files(str(tmp_path / "fast")), _files(str(tmp_path / "mbridge"))
    assert sorted(fast) == sorted(reference)
    assert len([f for f in fast if f.endswith(".safetensors")]) > 1
    for name in reference:
        assert fast[name] == reference[name], name
    assert _files(str(tmp_path / "forked")) == fast, "the export from forked processes differs"

    # No source plan: same tensors, bit for bit; a proper index covering each exactly once.
    fast_dir = str(tmp_path / "fast_noindex")
    exported, source = _tensors(fast_dir), _tensors(str(tmp_path / "mbridge_noindex"))
    assert set(exported) == set(source) and len(source) == 135
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    with open(os.path.join(fast_dir, "model.safetensors.index.json")) as handle:
        weight_map = json.load(handle)["weight_map"]
    assert set(weight_map) == set(exported)
    for name, file in weight_map.items():
        assert name in load_file(os.path.join(fast_dir, file)), name
    assert len(set(weight_map.values())) == world

    # transformers loads it, and gets the source weights (compared as it saves them: transformers 5 holds the
    # experts fused in memory and writes them one tensor per expert, as the files above are).
    model = AutoModelForCausalLM.from_pretrained(fast_dir, dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "reloaded"))
    original, reloaded = _tensors(tiny_moe_path), _tensors(str(tmp_path / "reloaded"))
    assert set(reloaded) == set(original)
    for name, tensor in reloaded.items():
        assert torch.equal(tensor, original[name]), name


def _gather_vs_export(src: str) -> dict:
    """Two syncs against mbridge's export, the weights changed in place between them (as an optimizer step
    changes them); the second sync's object gathers counted."""
    from verl.models.mcore.parallel_hf_save import gather_hf_weights
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    actor = MegatronEngine(*actor_configs(src, "checkpoint.save_contents=[model]", total_training_steps=TRAINING_STEPS))
    receivers = [0, torch.distributed.get_world_size() - 3]
    receiving = torch.distributed.get_rank() in receivers

    def compared(gathered: dict) -> dict:
        exported = dict(actor.bridge.export_weights(actor.model))  # mbridge's: every tensor on every rank
        if not receiving:
            return {"gathered": len(gathered)}
        mismatched = [name for name in exported if name not in gathered or not torch.equal(gathered[name], exported[name])]
        return {"names": sorted(gathered) == sorted(exported), "mismatched": mismatched, "count": len(gathered)}

    first = compared(gather_hf_weights(actor.bridge, actor.model, receivers=receivers))
    with torch.no_grad():
        for model in actor.model:
            for param in model.parameters():
                param.mul_(-2.0).add_(0.5)
    gathers, all_gather_object = [], torch.distributed.all_gather_object
    torch.distributed.all_gather_object = lambda *args, **kwargs: gathers.append(1) or all_gather_object(*args, **kwargs)
    try:
        after_update = gather_hf_weights(actor.bridge, actor.model, receivers=receivers)
    finally:
        torch.distributed.all_gather_object = all_gather_object
    return {"receiver": receiving, "first": first, "after_update": compared(after_update), "object_gathers": len(gathers)}


def test_in_memory_gather_equals_mbridge_export_weights(tiny_moe_path):
    """The rollout's weight sync: whole HF tensors on the receiving ranks only, bit-identical to mbridge's export;
    a later sync (after the weights changed) only confirms what each rank holds, gathering no object, and sends
    the weights as they are now."""
    results = run_on_ranks(_gather_vs_export, 8, ParallelSizes(tp=2, pp=2, ep=2, etp=2), args=(tiny_moe_path,))
    receivers = [r for r in results if r["receiver"]]
    assert len(receivers) == 2
    for report in receivers:
        for sync in (report["first"], report["after_update"]):
            assert sync["names"] and sync["mismatched"] == [] and sync["count"] == 135
    assert all(r[sync]["gathered"] == 0 for r in results if not r["receiver"] for sync in ("first", "after_update"))
    assert all(r["object_gathers"] == 0 for r in results), results

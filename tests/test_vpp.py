"""Interleaved pipelines (VPP2 at PP2, 4 ranks, MoE, use_distributed_optimizer=False): every model chunk is
trained, saved (dist checkpoint and verified HF export), resumed bit-exactly, and resharded to no VPP and back.

One module-scoped run saves the VPP2 step the tests share; each layout's ranks are started once.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

VPP2 = ParallelSizes(pp=2, vpp=2)
NO_VPP = ParallelSizes(pp=2)
CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _batches(seed: int) -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def _actor(src: str):
    from verl.workers.engine.megatron.transformer_impl import ActorSettings, MegatronEngine

    return MegatronEngine(ActorSettings(model_path=src, use_dist_checkpointing=True, save_contents=CONTENTS))


def _hf_state(path: str) -> dict:
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


def _train_save_continue_then_resume(src: str, root: str) -> dict:
    """VPP2: two steps, save step 2, two more; a fresh actor loads step 2 and takes the same two steps."""
    first = _actor(src)
    for step in range(2):
        first.train_step(_batches(step))
    first.save_checkpoint(os.path.join(root, "global_step_2", "actor"), global_step=2)
    continued = [first.train_step(_batches(10 + step))["loss"] for step in range(2)]
    expected = first.parameters_snapshot()

    resumed_actor = _actor(src)
    resumed_actor.load_checkpoint(os.path.join(root, "global_step_2", "actor"))
    resumed = [resumed_actor.train_step(_batches(10 + step))["loss"] for step in range(2)]
    actual = resumed_actor.parameters_snapshot()
    return {
        "chunks": len(first.model),
        "continued": continued,
        "resumed": resumed,
        "differing": [name for name in expected if not torch.equal(expected[name], actual[name])],
    }


def _load_export_save_and_train(src: str, ckpt: str, export: str, save_as: str | None) -> list[float]:
    """Load ``ckpt`` (model and optimizer) at this run's layout, export its weights, optionally save them as
    ``save_as`` (step 3), then train two steps: the second step's loss follows the first's update, which the
    loaded Adam moments shape."""
    actor = _actor(src)
    actor.load_checkpoint(ckpt)
    actor.export_hf(export)
    if save_as is not None:
        actor.save_checkpoint(save_as, global_step=3)
    return [actor.train_step(_batches(20 + step))["loss"] for step in range(2)]


@pytest.fixture(scope="module")
def vpp2_run(tiny_moe_path, tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("vpp2"))
    return root, run_on_ranks(_train_save_continue_then_resume, 4, VPP2, args=(tiny_moe_path, root))


def test_vpp2_trains_and_resumes_bit_exactly(vpp2_run):
    _, results = vpp2_run
    for result in results:
        assert result["chunks"] == 2  # two model chunks on every rank: the interleaved schedule ran them
        assert result["continued"] == result["resumed"]
        assert result["differing"] == []


def test_vpp2_step_holds_every_chunk(vpp2_run, tiny_moe_path):
    root, _ = vpp2_run
    step = os.path.join(root, "global_step_2", "actor")
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    assert manifest["parallel"] == {"world_size": 4, "tp": 1, "pp": 2, "ep": 1, "etp": 1, "cp": 1, "vpp": 2}
    transformer_config = json.loads(open(os.path.join(step, "transformer_config.json")).read())
    assert transformer_config["virtual_pipeline_model_parallel_size"] == 2
    # megatron's dist checkpoint stacks the layers on one global axis: each chunk wrote its own layers' rows
    num_layers = json.loads(open(os.path.join(tiny_moe_path, "config.json")).read())["num_hidden_layers"]
    for part in ("model", "optimizer"):
        metadata = FileSystemReader(os.path.join(step, part, "dist_ckpt")).read_metadata().state_dict_metadata
        key = next(k for k in metadata if k.endswith("decoder.layers.self_attention.linear_proj.weight"))
        rows = sorted({chunk.offsets[0] for chunk in metadata[key].chunks})
        assert metadata[key].size[0] == num_layers and rows == list(range(num_layers)), (part, key, rows)
    # the HF export (verified before the commit) names every layer of every chunk
    exported, source = _hf_state(os.path.join(step, "model", "huggingface")), _hf_state(tiny_moe_path)
    assert set(exported) == set(source)
    assert any(not torch.equal(exported[k], source[k]) for k in source)  # the trained weights, not the initial ones


def test_vpp2_reshards_to_no_vpp_and_back(vpp2_run, tiny_moe_path, tmp_path):
    root, _ = vpp2_run
    step2 = os.path.join(root, "global_step_2", "actor")
    saved = _hf_state(os.path.join(step2, "model", "huggingface"))

    step3 = str(tmp_path / "global_step_3" / "actor")
    no_vpp_losses = run_on_ranks(
        _load_export_save_and_train, 4, NO_VPP, args=(tiny_moe_path, step2, str(tmp_path / "no_vpp"), step3)
    )[0]
    loaded = _hf_state(str(tmp_path / "no_vpp"))
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert "vpp" not in json.loads(open(os.path.join(step3, "manifest.json")).read())["parallel"]

    vpp_losses = run_on_ranks(
        _load_export_save_and_train, 4, VPP2, args=(tiny_moe_path, step3, str(tmp_path / "back"), None)
    )[0]
    back = _hf_state(str(tmp_path / "back"))
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    # the optimizer state came along both ways: the same update at either layout, so the same next loss
    assert all(abs(a - b) < 1e-5 for a, b in zip(vpp_losses, no_vpp_losses, strict=True)), (vpp_losses, no_vpp_losses)

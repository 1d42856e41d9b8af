"""Interleaved pipelines (VPP2 at PP2, 4 ranks, MoE, use_distributed_optimizer=False): every model chunk is
trained, saved (dist checkpoint and verified HF export), resumed bit-exactly, and resharded to no VPP and back.

One module-scoped run saves the VPP2 step the first four tests share; each layout's ranks are started once.
The distributed optimizer (per-chunk state) is checked on its own: exact resume, another VPP refused.
tests/checks/check_vpp.py runs the same checks at PP4 EP2 TP2 ETP2 VPP2 (16 ranks).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.vpp_check import (
    hf_state,
    load,
    logits_gap,
    missing_layer_rows,
    num_hidden_layers,
    reshard_round_trip,
    train_save_continue_then_resume,
)
from verl.utils.distributed import RankFailure, run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

VPP2 = ParallelSizes(pp=2, vpp=2)
NO_VPP = ParallelSizes(pp=2)


@pytest.fixture(scope="module")
def vpp2_run(tiny_moe_path, tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("vpp2"))
    return root, run_on_ranks(train_save_continue_then_resume, 4, VPP2, args=(tiny_moe_path, root))


def test_vpp2_trains_and_resumes_bit_exactly(vpp2_run):
    _, results = vpp2_run
    for result in results:
        assert result["chunks"] == 2  # two model chunks on every rank: the interleaved schedule ran them
        assert result["continued"] == result["resumed"]
        assert result["differing"] == []


def test_vpp2_step_holds_every_chunk(vpp2_run, tiny_moe_path):
    root, results = vpp2_run
    step = os.path.join(root, "global_step_2", "actor")
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    assert manifest["parallel"] == {"world_size": 4, "tp": 1, "pp": 2, "ep": 1, "etp": 1, "cp": 1, "vpp": 2}
    transformer_config = json.loads(open(os.path.join(step, "transformer_config.json")).read())
    assert transformer_config["virtual_pipeline_model_parallel_size"] == 2
    # megatron's dist checkpoint stacks the layers on one global axis: each chunk wrote its own layers' rows
    assert missing_layer_rows(step, num_hidden_layers(tiny_moe_path)) == {}
    # the HF export (verified before the commit) names every layer of every chunk, and is the trained model
    hf = os.path.join(step, "model", "huggingface")
    exported, source = hf_state(hf), hf_state(tiny_moe_path)
    assert set(exported) == set(source)
    assert any(not torch.equal(exported[k], source[k]) for k in source)
    assert logits_gap(hf, results[0]["logits"]) <= 1e-5


def test_vpp2_step_merges_at_one_rank_to_its_own_export(vpp2_run, tmp_path):
    """``python -m verl.model_merger merge`` reads the chunks' dist checkpoint at one rank: the HF folder it writes
    is the step's own export, tensor for tensor."""
    root, _ = vpp2_run
    step = os.path.join(root, "global_step_2", "actor")
    target = str(tmp_path / "merged")
    merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "megatron", "--local_dir", step, "--target_dir", target]
    result = subprocess.run(merge, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[merge] loading the model shards" in result.stdout
    merged, exported = hf_state(target), hf_state(os.path.join(step, "model", "huggingface"))
    assert set(merged) == set(exported) and all(torch.equal(merged[k], exported[k]) for k in exported)


def test_vpp2_reshards_to_no_vpp_and_back(vpp2_run, tiny_moe_path, tmp_path):
    root, _ = vpp2_run
    result = reshard_round_trip(tiny_moe_path, os.path.join(root, "global_step_2", "actor"), str(tmp_path), VPP2, NO_VPP, 4)
    assert result["no_vpp_exact"] and result["back_exact"]
    assert "vpp" not in json.loads(open(os.path.join(result["step3"], "manifest.json")).read())["parallel"]
    # the optimizer state came along both ways: the same update at either layout, so the same next loss
    pairs = zip(result["back_losses"], result["no_vpp_losses"], strict=True)
    assert all(abs(a - b) < 1e-5 for a, b in pairs), result


def test_distributed_optimizer_resumes_at_vpp2_and_refuses_another_vpp(tiny_moe_path, tmp_path):
    """use_distributed_optimizer=True lays its state out per model chunk: it resumes exactly at the VPP it was
    saved at, and a load without VPP is refused before anything loads, naming both layouts and the fix."""
    for result in run_on_ranks(train_save_continue_then_resume, 4, VPP2, args=(tiny_moe_path, str(tmp_path), True)):
        assert result["continued"] == result["resumed"] and result["differing"] == []
    step = str(tmp_path / "global_step_2" / "actor")
    with pytest.raises(RankFailure, match=r"saved at \{.*'vpp': 2\}; it loads only at the same .*this run is \{'tp': 1, 'pp': 2, 'ep': 1, 'etp': 1, 'cp': 1\}"):
        run_on_ranks(load, 4, NO_VPP, args=(tiny_moe_path, step, True))

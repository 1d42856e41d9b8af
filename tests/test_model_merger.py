"""``python -m verl.model_merger merge``: a step of either model format -> a verified HF folder, bit-exact.

One run on 2 ranks (MoE, EP2) trains a step from the tiny MoE, then saves it twice from that state: with
``use_dist_checkpointing=True`` (the model only as Megatron shards) and, from a second actor trained the
same way, with upstream's default (the model as HF); and writes the actor's own HF export as the reference.
"""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint_builders import train_and_save
from verl.model_merger.__main__ import main
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(ep=2, etp=1)
WORLD = 2


@pytest.fixture(scope="module")
def run_root(tiny_moe_path, tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("merge_run"))
    run_on_ranks(train_and_save, WORLD, LAYOUT, args=(tiny_moe_path, root))
    return root


def _step(root: str, use_dist_checkpointing: bool) -> str:
    return os.path.join(root, f"dc_{use_dist_checkpointing}", "global_step_1", "actor")


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in glob.glob(os.path.join(folder, "*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_bit_equal(merged: dict, reference: dict) -> None:
    assert sorted(merged) == sorted(reference)
    different = [n for n in reference if merged[n].dtype != reference[n].dtype or not torch.equal(merged[n], reference[n])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"


def _cli_merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "megatron", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_transformers_loads_it_whole(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info  # lists on 4.x, sets on 5.x


def test_a_dist_checkpoint_step_merges_to_the_hf_export_of_the_same_weights(run_root, tiny_moe_path, tmp_path):
    step = _step(run_root, True)
    assert not glob.glob(os.path.join(step, "model", "huggingface", "*"))  # no HF config or weights in the step
    target = str(tmp_path / "merged")
    result = _cli_merge("--local_dir", step, "--target_dir", target, "--hf_model_path", tiny_moe_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[merge] loading the model shards" in result.stdout and f"[merge] OK: {target}" in result.stdout
    assert not os.path.exists(target + ".merging")

    merged, reference = _tensors(target), _tensors(os.path.join(run_root, "export"))
    _assert_bit_equal(merged, reference)
    source = _tensors(tiny_moe_path)
    # the trained weights, not the start: every tensor but an expert's (an expert no token was routed to in the
    # one training step keeps its start values) changed
    assert all(not torch.equal(merged[n], source[n]) for n in source if ".experts." not in n)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(target, name), "rb") as got, open(os.path.join(tiny_moe_path, name), "rb") as want:
            assert got.read() == want.read(), name
    _assert_transformers_loads_it_whole(target)


def test_an_hf_step_is_copied_and_verified(run_root, tmp_path):
    step = _step(run_root, False)
    target = str(tmp_path / "merged")
    os.makedirs(target)  # an empty target, as upstream's merger creates it, is fine
    result = _cli_merge("--local_dir", step, "--target_dir", target)
    assert result.returncode == 0, result.stderr[-3000:]
    source = os.path.join(step, "model", "huggingface")
    assert sorted(os.listdir(target)) == sorted(os.listdir(source))
    for name in os.listdir(source):
        with open(os.path.join(target, name), "rb") as got, open(os.path.join(source, name), "rb") as want:
            assert got.read() == want.read(), name
    # The second actor trained the same batch from the same start: its save equals the first actor's export.
    _assert_bit_equal(_tensors(target), _tensors(os.path.join(run_root, "export")))
    _assert_transformers_loads_it_whole(target)


def _refusal(capsys, *args: str) -> tuple[int, str]:
    code = main(["merge", "--backend", "megatron", *args])
    err = capsys.readouterr().err.strip()
    assert err.startswith("merge failed: ") and "\n" not in err, err
    return code, err


def test_refusals_name_the_problem_and_write_nothing(run_root, tiny_moe_path, tmp_path, capsys):
    step = _step(run_root, True)
    target = str(tmp_path / "merged")

    damaged = str(tmp_path / "damaged" / "actor")
    shutil.copytree(step, damaged)
    shard = sorted(glob.glob(os.path.join(damaged, "model", "dist_ckpt", "*.distcp")))[0]
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    code, err = _refusal(capsys, "--local_dir", damaged, "--target_dir", target, "--hf_model_path", tiny_moe_path)
    assert code == 1 and shard in err and "truncated" in err

    code, err = _refusal(capsys, "--local_dir", step, "--target_dir", target)
    assert code == 2 and "--hf_model_path" in err

    os.makedirs(target)
    open(os.path.join(target, "keep.txt"), "w").close()
    code, err = _refusal(capsys, "--local_dir", step, "--target_dir", target, "--hf_model_path", tiny_moe_path)
    assert code == 2 and "not empty" in err
    assert os.listdir(target) == ["keep.txt"]

    code, err = _refusal(capsys, "--local_dir", str(tmp_path / "absent"), "--target_dir", str(tmp_path / "t2"))
    assert code == 2 and "does not exist" in err

    code, err = main(["merge", "--backend", "fsdp", "--local_dir", step]), capsys.readouterr().err
    assert code == 2 and "not supported here" in err
    assert not os.path.exists(target + ".merging") and not os.path.exists(str(tmp_path / "t2"))

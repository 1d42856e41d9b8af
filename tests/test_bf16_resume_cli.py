"""bf16 end to end through the CLI, ``actor_rollout_ref.actor.megatron.dtype=bfloat16``: bf16 parameters,
rollout and parity gate, fp32 master weights saved in ``optimizer/dist_ckpt`` and loaded back from it.

A bf16 step saved at TP2 on 2 ranks resumes at 1 rank with the same master weights; a float32 run refuses it
before Ray starts. A bf16 run with a cosine schedule resumed from a step the uninterrupted run saved equals the
uninterrupted run in every metric of every later step, in the final HF export and in the final fp32 master weights,
bit for bit: tests/test_resume_schedules_cli.py's ``cosine-bf16-1rank`` case."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.cli_runs import MEGATRON, TRACKER, run_trainer
from tests.test_bf16_checkpoint import master_weights

OPTIM = "actor_rollout_ref.actor.optim."
BF16 = f"{MEGATRON}dtype=bfloat16"


def _layout(ranks: int, tp: int) -> list[str]:
    return [
        f"trainer.n_gpus_per_node={ranks}", f"{MEGATRON}tensor_model_parallel_size={tp}",
        f"{MEGATRON}pipeline_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=1",
        f"{MEGATRON}use_distributed_optimizer=False",
    ]  # fmt: skip


def _step(ckpt: Path, step: int) -> Path:
    return ckpt / f"global_step_{step}" / "actor"


def _hf_weights(step_path: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted((step_path / "model" / "huggingface").glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def _unequal(expected: dict, actual: dict) -> list[str]:
    assert sorted(actual) == sorted(expected)
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


def test_a_bf16_step_saved_at_tp2_resumes_at_one_rank_with_the_same_master_weights(tmp_path, env, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    common = [f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={ckpt}", "trainer.save_freq=2"]
    code, out = run_trainer([*common, *_layout(2, 2), BF16, "trainer.total_training_steps=2"], tmp_path, env)
    assert code == 0, out[-6000:]
    saved = master_weights(str(_step(ckpt, 2)))

    # lr 0 for the resumed step: Adam leaves every master weight as loaded, so step 3 saves exactly what was loaded;
    # the step named by trainer.resume_mode=resume_path, as a user resumes a chosen step
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}/global_step_2"]
    code, out = run_trainer([*common, *_layout(1, 1), BF16, *resume, "trainer.total_training_steps=3", f"{OPTIM}lr=0"], tmp_path, env)
    assert code == 0, out[-6000:]
    assert f"resumed from {ckpt}/global_step_2 (step 2)" in out
    assert _unequal(saved, master_weights(str(_step(ckpt, 3)))) == []
    assert _unequal(_hf_weights(_step(ckpt, 2)), _hf_weights(_step(ckpt, 3))) == []
    assert (ckpt / TRACKER).read_text() == "3"

    code, out = run_trainer([*common, *_layout(1, 1), "trainer.total_training_steps=4"], tmp_path, env)  # float32, the default
    assert code == 2, out[-6000:]
    assert f"{ckpt}/global_step_3/actor optimizer state was saved with {MEGATRON}dtype=bfloat16" in out
    assert "this run uses float32" in out

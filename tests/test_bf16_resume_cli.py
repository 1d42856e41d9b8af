"""bf16 end to end through the CLI, ``actor_rollout_ref.actor.megatron.dtype=bfloat16``: bf16 parameters,
rollout and parity gate, fp32 master weights saved in ``optimizer/dist_ckpt`` and loaded back from it.

A bf16 run with a cosine schedule stopped by SIGTERM after a save and resumed with the same command equals the
uninterrupted run in every metric of every step (``actor/lr`` included), in the final HF export and in the final
fp32 master weights, bit for bit. A bf16 step saved at TP2 on 2 ranks resumes at 1 rank with the same master
weights; a float32 run refuses it before Ray starts."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.cli_runs import MEGATRON, TRACKER, comparable_by_step, read_metrics, run_trainer, stop_after_a_save
from tests.test_bf16_checkpoint import as_bf16, master_weights

STEPS = 4
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


def test_a_bf16_run_stopped_by_sigterm_and_resumed_equals_the_uninterrupted_one(tmp_path, env, tiny_moe_path):
    def command(ckpt: Path) -> list[str]:
        return [
            f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={ckpt}", *_layout(1, 1), BF16,
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2", "trainer.logger=[console,file]",
            f"{OPTIM}lr_decay_style=cosine", f"{OPTIM}lr_warmup_steps=2", f"{OPTIM}min_lr=1e-4",
        ]  # fmt: skip

    whole_dir, stopped_dir = tmp_path / "uninterrupted", tmp_path / "stopped"
    code, out = run_trainer(command(whole_dir), tmp_path, env)
    assert code == 0, out[-6000:]
    whole = comparable_by_step(read_metrics(whole_dir))
    lrs = [whole[step]["actor/lr"] for step in range(1, STEPS + 1)]
    assert len(set(lrs)) == STEPS, lrs  # the schedule moves at every step
    # the rollout and the actor both run in bf16: their first-batch gap is bf16's, within the bf16 tolerance
    assert 1e-4 < whole[1]["rollout/log_prob_diff_max"] <= 1e-1, whole[1]["rollout/log_prob_diff_max"]

    tracked = stop_after_a_save(command(stopped_dir), tmp_path, env, stopped_dir, step=2, last=STEPS)
    assert tracked == 2
    before = len(read_metrics(stopped_dir))
    code, out = run_trainer(command(stopped_dir), tmp_path, env)  # the same command, resume_mode=auto
    assert code == 0, out[-6000:]
    assert f"resumed from {stopped_dir}/global_step_2 (step 2)" in out
    first, resumed = comparable_by_step(read_metrics(stopped_dir)[:before]), comparable_by_step(read_metrics(stopped_dir)[before:])
    assert sorted(resumed) == [3, 4]
    combined = {1: first[1], 2: first[2], **resumed}
    assert [combined[step]["actor/lr"] for step in range(1, STEPS + 1)] == lrs
    for step in range(1, STEPS + 1):
        assert combined[step] == whole[step], f"step {step} differs"

    expected, actual = _hf_weights(_step(whole_dir, STEPS)), _hf_weights(_step(stopped_dir, STEPS))
    assert _unequal(expected, actual) == []
    assert {value.dtype for value in actual.values()} == {torch.bfloat16}  # the HF export holds the bf16 parameters
    masters = master_weights(str(_step(stopped_dir, STEPS)))
    assert _unequal(master_weights(str(_step(whole_dir, STEPS))), masters) == []
    rounded = as_bf16(masters)  # fp32 masters, not bf16 numbers: they were never rebuilt from the parameters
    assert sum(int((masters[k] != rounded[k]).sum()) for k in masters) > sum(v.numel() for v in masters.values()) // 2


def test_a_bf16_step_saved_at_tp2_resumes_at_one_rank_with_the_same_master_weights(tmp_path, env, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    common = [f"actor_rollout_ref.model.path={tiny_moe_path}", f"trainer.default_local_dir={ckpt}", "trainer.save_freq=2"]
    code, out = run_trainer([*common, *_layout(2, 2), BF16, "trainer.total_training_steps=2"], tmp_path, env)
    assert code == 0, out[-6000:]
    saved = master_weights(str(_step(ckpt, 2)))

    # lr 0 for the resumed step: Adam leaves every master weight as loaded, so step 3 saves exactly what was loaded
    code, out = run_trainer([*common, *_layout(1, 1), BF16, "trainer.total_training_steps=3", f"{OPTIM}lr=0"], tmp_path, env)
    assert code == 0, out[-6000:]
    assert f"resumed from {ckpt}/global_step_2 (step 2)" in out
    assert _unequal(saved, master_weights(str(_step(ckpt, 3)))) == []
    assert _unequal(_hf_weights(_step(ckpt, 2)), _hf_weights(_step(ckpt, 3))) == []
    assert (ckpt / TRACKER).read_text() == "3"

    code, out = run_trainer([*common, *_layout(1, 1), "trainer.total_training_steps=4"], tmp_path, env)  # float32, the default
    assert code == 2, out[-6000:]
    assert f"{ckpt}/global_step_3/actor optimizer state was saved with {MEGATRON}dtype=bfloat16" in out
    assert "this run uses float32" in out

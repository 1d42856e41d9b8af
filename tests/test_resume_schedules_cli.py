"""Resume is exact under a non-constant LR schedule, through the CLI: a run resumed from a step the uninterrupted
run saved (``trainer.resume_mode=resume_path``, into a directory of its own) logs the uninterrupted run's metrics at
every later step (``actor/lr``, and every other metric: rollout samples, rewards, losses, validation) and ends with
its weights, bit for bit. How a run is stopped and resumed with its own command is proven exact elsewhere, on the
same state: SIGTERM mid-generation then ``resume_mode=auto`` (tests/test_vllm_resume_cli.py), SIGTERM after a save
through Megatron-Bridge (tests/py312/test_megatron_bridge_cli.py), SIGKILL of the whole run (tests/test_trainer_cli.py).

The embedded task has 9 prompts for a batch of 8, so every step is a new epoch: the sampler's reshuffle is
crossed at every step, including the one after the resume. Validation every 2 steps crosses its cadence.

The 1-rank case runs in bf16 (``actor_rollout_ref.actor.megatron.dtype=bfloat16``): bf16 parameters, rollout and
parity gate, and its fp32 master weights, saved in ``optimizer/dist_ckpt`` and loaded back from it, end equal to
the uninterrupted run's too; tests/test_bf16_resume_cli.py holds the rest of bf16 through the CLI (a TP2 save
resumed at 1 rank; a float32 run refusing a bf16 step). The 2-rank case runs in float32, the default, at PP2 with
upstream's interleaved pipeline (VPP2) and the KL loss: the reference and log-prob passes run as model chunks too,
every chunk is saved and the HF export is complete (tests/test_vpp.py: the same at rank level). Its uninterrupted
run also carries two behaviours that need a float32 run and change none of its metrics: the log-prob parity gate
turned off below a correct run's gap, and upstream's ESI rule (a capacity block ending soon saves outside
save_freq); sharing the launch saves a run of their own."""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli_runs import (
    MEGATRON,
    PARITY_GATE,
    REPO,
    TRACKER,
    comparable_by_step,
    read_metrics,
    run_trainer,
)
from tests.main_leg import MBRIDGE
from tests.test_bf16_checkpoint import as_bf16, master_weights

STEPS = 5
OPTIM = "actor_rollout_ref.actor.optim."
SCHEDULES = {
    # warmup over 2 steps, then cosine to min_lr over the run's length (lr_decay_steps unset)
    "cosine_warmup": [f"{OPTIM}lr_decay_style=cosine", f"{OPTIM}lr_warmup_steps=2", f"{OPTIM}min_lr=1e-4"],
    # warmup from a ratio of the decay length, then lr * sqrt(warmup / step), with weight decay
    "inverse_sqrt": [
        f"{OPTIM}lr_decay_style=inverse-square-root", f"{OPTIM}lr_warmup_steps_ratio=0.2",
        f"{OPTIM}min_lr=1e-4", f"{OPTIM}weight_decay=0.01",
    ],
}  # fmt: skip
ONE_RANK = ["trainer.n_gpus_per_node=1", f"{MEGATRON}pipeline_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=1"]
LAYOUTS = {
    "1_rank_bf16": [*ONE_RANK, f"{MEGATRON}dtype=bfloat16"],
    # upstream's interleaved pipeline key; the KL loss makes the reference and log-prob passes run as model chunks too
    "2_ranks_pp2_vpp2": [
        "trainer.n_gpus_per_node=2", f"{MEGATRON}pipeline_model_parallel_size=2", f"{MEGATRON}virtual_pipeline_model_parallel_size=2",
        f"{MEGATRON}expert_model_parallel_size=1", "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.05",
    ],
}  # fmt: skip
# The float32 case's runs also have the log-prob parity gate off at a tolerance of 1e-12, below a correct run's gap:
# they train and log that gap (the gate on, the same model and tolerance stop the run: test_trainer_cli.py's
# test_parity_gate_stops_a_model_the_bridge_maps_differently). Its uninterrupted run is also upstream's ESI rule
# (CAPACITY_BLOCK_END below, that run only): a block end nearer than the longest step + 60 s +
# trainer.esi_redundant_time saves every step from the second on (the first has no step duration yet).
LAYOUT_EXTRAS = {
    "2_ranks_pp2_vpp2": [f"{PARITY_GATE}.tolerance.float32=1e-12", f"{PARITY_GATE}.enable=False", "trainer.esi_redundant_time=100000"],
}
CAPACITY_BLOCK_END = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"  # MLP's variable, one of those upstream reads


def _command(model_path: str, ckpt: Path, val_parquet: str, schedule: str, layout: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_path}", f"trainer.default_local_dir={ckpt}", *LAYOUTS[layout],
        f"{MEGATRON}tensor_model_parallel_size=1", f"{MEGATRON}use_distributed_optimizer=False",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2",
        f"data.val_files={val_parquet}", "trainer.val_before_train=False", "trainer.test_freq=2",
        "trainer.logger=[console,file]", *SCHEDULES[schedule], *LAYOUT_EXTRAS.get(layout, []),
    ]  # fmt: skip


def _final_step(ckpt: Path) -> Path:
    return ckpt / f"global_step_{STEPS}" / "actor"


def _final_weights(ckpt: Path) -> dict:
    hf = _final_step(ckpt) / "model" / "huggingface"
    weights = {}
    for file in sorted(hf.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


@pytest.mark.parametrize(
    ("schedule", "layout"),
    [("cosine_warmup", "1_rank_bf16"), ("inverse_sqrt", "2_ranks_pp2_vpp2")],
    ids=["cosine-bf16-1rank", "invsqrt-vpp2-2ranks"],
)
def test_a_run_resumed_from_a_saved_step_equals_the_uninterrupted_one(tmp_path, env, tiny_moe_path, val_parquet, schedule, layout):
    bf16, vpp = layout.endswith("_bf16"), "vpp2" in layout
    whole_dir, resumed_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    block_end = {CAPACITY_BLOCK_END: str(time.time() + 50000)} if vpp else {}  # ESI: the uninterrupted run only
    code, out = run_trainer(_command(tiny_moe_path, whole_dir, val_parquet, schedule, layout), tmp_path, {**env, **block_end})
    assert code == 0, out[-6000:]
    whole_records = {m["step"]: m for m in read_metrics(whole_dir)}
    whole = comparable_by_step(read_metrics(whole_dir))
    lrs = [whole[step]["actor/lr"] for step in range(1, STEPS + 1)]
    assert len(set(lrs)) == STEPS, lrs  # the schedule moves at every step
    assert "val-core/arithmetic/reward/mean@1" in whole[2] and "val-core/arithmetic/reward/mean@1" not in whole[3]
    if bf16:  # the rollout and the actor both run in bf16: their first-batch gap is bf16's, within the bf16 tolerance
        assert 1e-4 < whole[1]["rollout/log_prob_diff_max"] <= 1e-1, whole[1]["rollout/log_prob_diff_max"]
    if vpp:
        assert "TP1 PP2 VPP2 EP1 ETP1 CP1" in out
        # the parity gate off: a correct run's gap, above the tolerance set, logged and trained through
        assert 1e-12 < whole[1]["rollout/log_prob_diff_max"] <= 1e-4, whole[1]["rollout/log_prob_diff_max"]
        # ESI: step 3 saved outside save_freq=2, step 1 not (no step duration yet); the tracker on the last
        assert [step for step, m in whole_records.items() if "checkpoint" in m] == [2, 3, 4, 5]
        assert "[trainer] saving step 3 outside save_freq: the capacity block ends within the next step and a save" in out
        assert (whole_dir / TRACKER).read_text() == str(STEPS)
        assert whole_records[2]["checkpoint"]["hf"] == "all 135 tensors present with the expected shapes"
        assert {"actor/kl_loss", "actor/grad_norm", "actor/entropy"} <= set(whole[2])
        # the actor moved away from the reference: from step 3 on, the warmup's first step having had lr 0
        assert all(whole[step]["actor/kl_loss"] > 0 for step in range(3, STEPS + 1))

    tracked = 2  # the first save_freq step: steps 3 to 5 are trained again from it
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={whole_dir}/global_step_{tracked}"]
    code, out = run_trainer([*_command(tiny_moe_path, resumed_dir, val_parquet, schedule, layout), *resume], tmp_path, env)
    assert code == 0, out[-6000:]
    assert f"resumed from {whole_dir}/global_step_{tracked} (step {tracked})" in out
    assert "warning: resuming" not in out  # the same length: nothing to warn about
    resumed = comparable_by_step(read_metrics(resumed_dir))
    assert sorted(resumed) == list(range(tracked + 1, STEPS + 1))
    assert [resumed[step]["actor/lr"] for step in range(tracked + 1, STEPS + 1)] == lrs[tracked:]
    for step in range(tracked + 1, STEPS + 1):
        assert resumed[step] == whole[step], f"step {step} differs"
    expected, actual = _final_weights(whole_dir), _final_weights(resumed_dir)
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if not expected[name].equal(actual[name])] == []
    if bf16:
        assert {value.dtype for value in actual.values()} == {torch.bfloat16}  # the HF export holds the bf16 parameters
        masters = master_weights(str(_final_step(resumed_dir)))
        expected_masters = master_weights(str(_final_step(whole_dir)))
        assert sorted(masters) == sorted(expected_masters)
        assert [key for key in masters if not torch.equal(masters[key], expected_masters[key])] == []
        rounded = as_bf16(masters)  # fp32 masters, not bf16 numbers: they were never rebuilt from the parameters
        assert sum(int((masters[k] != rounded[k]).sum()) for k in masters) > sum(v.numel() for v in masters.values()) // 2
    manifest = json.loads((_final_step(resumed_dir) / "manifest.json").read_text())
    assert manifest["parallel"]["world_size"] == int(LAYOUTS[layout][0].rsplit("=", 1)[1])
    if vpp:
        assert manifest["parallel"] == {"world_size": 2, "tp": 1, "pp": 2, "ep": 1, "etp": 1, "cp": 1, "vpp": 2}


def test_a_negative_esi_slack_is_refused_naming_the_key(tiny_moe_path):
    from hydra import compose, initialize_config_dir

    from verl.trainer.validation import check_config

    with initialize_config_dir(config_dir=str(REPO / "verl" / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, "trainer.esi_redundant_time=-5"])
    assert "trainer.esi_redundant_time=-5 must be >= 0 (seconds); set trainer.esi_redundant_time=0" in check_config(config, tiny_moe_path)

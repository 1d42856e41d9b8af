"""``python -m verl.trainer.main_ppo`` from the command line, as a user runs it (real Hydra, Ray, Megatron).

- 8 ranks at TP2 PP2 EP2 ETP2, use_distributed_optimizer=False, GRPO on the parquet file written by
  scripts/make_task_parquet.py, validated on it, with the KL loss to an offloaded reference model and the
  entropy bonus: step checkpoints; the run is killed mid-way and a restart with resume_mode=auto continues
  from the last saved step with the metrics of the uninterrupted run;
- the same layout on a Mixtral (the model family's run through the CLI) and a hand-made gsm8k-format parquet
  file with mixed-length prompts, validation metrics, saves whose HF export is verified complete and tensorboard
  event files that hold what metrics.jsonl holds;
- the log-prob parity gate stops a run whose model the bridge maps differently from transformers;
- param_offload with use_distributed_optimizer=False saves (fix 1, through the worker), each save's record with
  its manifest's file count and where its time went per phase;
- bad configurations exit with status 2 and their message before Ray or any rank starts.

The seed layout, PP4 EP2 TP2 ETP2 on 16 ranks, is not launched here (16 ranks cost the 2-core leg more than any
other test): the steps the workers run at it, a trained and saved step with its verified HF export and the
manifest's layout, are tests/test_megatron_checkpoint_manager.py::test_pp4_ep2_tp2_etp2_saves_everything_and_transformers_loads_it;
the layout's pre-start check is tests/test_validation.py::test_valid_layouts_pass.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_runs import (
    MEGATRON,
    PARITY_GATE,
    REPO,
    TRACKER,
    kill_session,
    read_metrics,
    run_trainer,
    start_trainer,
    two_ranks_ep2,
)


def test_kill_and_resume_auto_continues_from_last_save(tmp_path, env):
    """Default layout (8 ranks, TP2 PP2 EP2 ETP2), embedded default model, DO=False, GRPO on the parquet file
    scripts/make_task_parquet.py writes (the default run's data), validated on it every 4 steps, with use_kl_loss
    (the reference offloaded between its passes) and entropy_coeff: a run killed after step 5 (saved at 3)
    resumes at step 3 and its steps 4 and 5, validation and the KL to the reference included, equal the killed
    run's: the resumed run's reference is the initial model again (rebuilt from the HF model, never saved)."""
    script = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_task_parquet.py"), "--out-dir", str(tmp_path / "data")],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    parquet = script.stdout.strip().splitlines()[-1]
    ckpt = tmp_path / "ckpt"
    common = [
        f"trainer.default_local_dir={ckpt}", f"{MEGATRON}use_distributed_optimizer=False", "trainer.save_freq=3",
        f"data.train_files={parquet}", f"data.val_files={parquet}", "trainer.val_before_train=False", "trainer.test_freq=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.05",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.ref.megatron.param_offload=True",
    ]  # fmt: skip
    log = tmp_path / "first.log"
    first = start_trainer([*common, "trainer.total_training_steps=8"], tmp_path, env, log)
    try:
        deadline = time.monotonic() + 480
        while not any(m["step"] == 5 for m in read_metrics(ckpt)):
            assert first.poll() is None, f"first run exited early:\n{log.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"no step 5 in time:\n{log.read_text()[-5000:]}"
            time.sleep(0.2)
    finally:
        kill_session(first)  # killed between saves: step 5 trained, step 6 not saved
    assert (ckpt / TRACKER).read_text() == "3"
    assert (ckpt / "global_step_3" / "data.pt").is_file()
    first_run = {m["step"]: m for m in read_metrics(ckpt)}
    assert "checkpoint" in first_run[3] and "checkpoint" not in first_run[5]

    code, out = run_trainer([*common, "trainer.total_training_steps=5", "trainer.resume_mode=auto"], tmp_path, env)
    assert code == 0, out[-6000:]
    assert f"resumed from {ckpt}/global_step_3 (step 3)" in out and "data: epoch 2, position 6" in out
    second_run = read_metrics(ckpt)[len(first_run):]
    assert [m["step"] for m in second_run] == [4, 5]
    # One check per resume, across the driver and the 8 ranks: the driver hashed no shard or weights file, every
    # process hashed each it loaded once, as it loaded it; the ranks took the driver's record; one HF export check.
    loaded = [p for part in ("optimizer", "extra") for p in (ckpt / "global_step_3" / "actor" / part / "dist_ckpt").glob("*.distcp")]
    loaded += list((ckpt / "global_step_3" / "actor" / "model" / "huggingface").glob("*.safetensors"))
    assert second_run[0]["resume"] == {
        "bulk_files_checksummed": len(loaded), "bulk_checksums_by_driver": 0, "bulk_checksums_per_file_and_process_max": 1,
        "hf_export_checks": 1, "driver_record_taken": True,
    }  # fmt: skip
    assert "resume" not in second_run[1]
    val_key = "val-core/arithmetic/reward/mean@1"
    assert val_key in first_run[4] and val_key not in first_run[3] and val_key in second_run[1]  # every 4 steps and the last
    # Same prompts, same samples (seeded by step), same weights and optimizer state: the same metrics.
    for resumed in second_run:
        original = first_run[resumed["step"]]
        # every metric bit for bit, validation included (only the clocks and the save records differ)
        keys = [key for key in original if not key.startswith("timing_s/") and key not in ("time", "checkpoint", "checkpoint_committed")]
        assert {"actor/kl_loss", "actor/kl_coef", "actor/entropy", "actor/entropy_loss", "actor/grad_norm", "critic/score/mean"} <= set(keys)
        assert {key: resumed.get(key) for key in keys} == {key: original[key] for key in keys}
        assert resumed["actor/kl_loss"] > 0  # the actor moved away from the reference; a reference loaded from step 3 would change it
        assert resumed["ref/param_offloaded"] is True  # offloaded before and after each reference pass, on every rank
        assert resumed["rollout/log_prob_diff_max"] <= 1e-4
    assert (ckpt / TRACKER).read_text() == "5"
    manifest = json.loads((ckpt / "global_step_5/actor/manifest.json").read_text())
    assert manifest["parallel"] == {"world_size": 8, "tp": 2, "pp": 2, "ep": 2, "etp": 2, "cp": 1}
    assert manifest["use_distributed_optimizer"] is False
    assert "HF export: all 135 tensors present with the expected shapes" in out
    assert (ckpt / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Once more: the tracked step is already the last one, so nothing starts.
    code, out = run_trainer([*common, "trainer.total_training_steps=5"], tmp_path, env)
    assert code == 0, out[-3000:]
    assert "is already at trainer.total_training_steps=5: nothing to train" in out and "Ray instance" not in out


def test_param_offload_saves_without_distributed_optimizer(tmp_path, env, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    code, out = run_trainer(
        [
            *two_ranks_ep2(tiny_moe_path, ckpt),
            f"{MEGATRON}use_distributed_optimizer=False",
            f"{MEGATRON}param_offload=True",
            f"{MEGATRON}grad_offload=True",
            f"{MEGATRON}optimizer_offload=True",
            "trainer.total_training_steps=2",
        ],
        tmp_path,
        env,
    )
    assert code == 0, out[-6000:]
    steps = read_metrics(ckpt)
    # The weight sync from offloaded parameters, timed and sized every step; the vLLM-only metric is absent: the
    # tests' runs sample with hf unless they name a rollout (tests/main_leg.py's HF_ROLLOUT).
    assert all(m["timing_s/update_weights"] > 0 and m["checkpoint_engine/payload_mbytes"] > 0 for m in steps), steps
    assert not any("checkpoint_engine/vllm_slots_written" in m for m in steps)
    records = [m["checkpoint"] for m in steps]
    assert len(records) == 2
    for record in records:
        # Fix 1: with param_data None the worker's residence check falls back to the module's own parameters
        # and found them offloaded (its device answer, "cpu", would read the same resident on a CPU host);
        # it brought the weights back for the save, which exported every tensor, and offloaded them again.
        assert record["param_offloaded_before"] is True and record["param_offloaded_after"] is True
        assert record["hf"] == "all 135 tensors present with the expected shapes" and record["files"] > 0
        # where the save's time went, per phase on its slowest rank: the writer's phases and the transaction's
        assert {"finite_check", "staging", "commit", "tracker"} <= set(record["phase_s"]), record["phase_s"]
        assert all(seconds >= 0 for seconds in record["phase_s"].values()), record["phase_s"]
    assert (ckpt / TRACKER).read_text() == "2"
    assert "brought back for the save, then offloaded again" in out


def test_async_save_commits_every_step_and_tracks_it_last(tmp_path, env, tiny_moe_path):
    """checkpoint.async_save=True through the trainer: training goes on while the dist checkpoint is written;
    each step is committed, verified and tracked once durable (the last one before the run ends)."""
    ckpt = tmp_path / "ckpt"
    code, out = run_trainer(
        [*two_ranks_ep2(tiny_moe_path, ckpt), "actor_rollout_ref.actor.checkpoint.async_save=True", "trainer.total_training_steps=3"],
        tmp_path,
        env,
    )
    assert code == 0, out[-6000:]
    assert out.count("async save started") == 3
    assert all(f"committed async save of step {step}" in out for step in (1, 2, 3))
    assert (ckpt / TRACKER).read_text() == "3"
    for step in (1, 2, 3):
        assert (ckpt / f"global_step_{step}" / "data.pt").is_file()
        assert not (ckpt / f"global_step_{step}" / "actor.incomplete").exists()
    assert all(m["checkpoint"]["pending"] for m in read_metrics(ckpt))


BAD_CONFIGS = {
    "tp_vs_world": ([f"{MEGATRON}tensor_model_parallel_size=3"], f"is not divisible by TP x PP x CP = 3x2x1; set {MEGATRON}tensor_model_parallel_size"),
    "etp_ep_pp_vs_world": ([f"{MEGATRON}expert_model_parallel_size=4"], f"is not divisible by ETP x EP x PP = 2x4x2; set {MEGATRON}expert_tensor_parallel_size"),
    "experts_vs_ep": (
        ["trainer.n_gpus_per_node=3", "data.train_batch_size=6", f"{MEGATRON}tensor_model_parallel_size=1",
         f"{MEGATRON}pipeline_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=3", f"{MEGATRON}expert_tensor_parallel_size=1"],
        f"num_experts=8 is not divisible by expert_model_parallel_size=3; set {MEGATRON}expert_model_parallel_size",
    ),
    "layers_vs_pp": (
        [f"{MEGATRON}pipeline_model_parallel_size=8", f"{MEGATRON}tensor_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=1", "data.train_batch_size=2"],
        f"num_hidden_layers=4 is not divisible by pipeline_model_parallel_size=8; set {MEGATRON}pipeline_model_parallel_size",
    ),
    "heads_vs_tp": (
        [f"{MEGATRON}tensor_model_parallel_size=8", f"{MEGATRON}pipeline_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=1"],
        f"num_attention_heads=4 is not divisible by tensor_model_parallel_size=8; set {MEGATRON}tensor_model_parallel_size",
    ),
    "no_cuda": (["trainer.device=cuda"], "trainer.device=cuda but this host has no cuda device; set trainer.device=cpu"),
    "model_path": (["actor_rollout_ref.model.path=/nonexistent/model"], "actor_rollout_ref.model.path=/nonexistent/model does not exist"),
    "resume_path": (["trainer.resume_mode=resume_path"], "trainer.resume_mode=resume_path needs trainer.resume_from_path"),
    "async_save": (["actor_rollout_ref.actor.checkpoint.async_save=later"], "actor_rollout_ref.actor.checkpoint.async_save must be true or false, got 'later'"),
    "grad_offload": ([f"{MEGATRON}grad_offload=True"], f"set {MEGATRON}param_offload=True or grad_offload=False"),
    "batch_vs_mini": (["data.train_batch_size=6"], "is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=8"),
    "micro_vs_dp": (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"], "ppo_micro_batch_size_per_gpu=5; set it to a divisor of 64"),
    "group_of_one": (["actor_rollout_ref.rollout.n=1"], "set actor_rollout_ref.rollout.n to 2 or more"),
    "estimator": (["algorithm.adv_estimator=gae"], "only grpo is implemented here; set algorithm.adv_estimator=grpo"),
    "truncation": (["data.truncation=cut"], "data.truncation=cut is not one of ['error', 'left', 'right', 'middle']"),
    "vpp_layers": (
        [f"{MEGATRON}virtual_pipeline_model_parallel_size=4"],
        f"num_hidden_layers=4 does not split into pipeline_model_parallel_size=2 x virtual_pipeline_model_parallel_size=4 equal model chunks; set {MEGATRON}virtual_pipeline_model_parallel_size",
    ),
    "task": (["data.task=reverse"], "data.task=reverse is not one of ['add', 'first']; set data.task=first"),
}


def test_bad_configs_fail_fast_before_any_rank(tmp_path, env, tiny_moe_path):
    procs = {}
    for name, (overrides, _) in BAD_CONFIGS.items():
        model = [] if any(o.startswith("actor_rollout_ref.model.path=") for o in overrides) else [f"actor_rollout_ref.model.path={tiny_moe_path}"]
        args = [*model, *overrides, f"trainer.default_local_dir={tmp_path / name / 'ckpt'}"]
        (tmp_path / name).mkdir()
        procs[name] = (start_trainer(args, tmp_path / name, env, tmp_path / f"{name}.log"), time.monotonic())
    try:
        for name, (proc, started) in procs.items():
            proc.wait(timeout=120)
            procs[name] = (proc, time.monotonic() - started)
    finally:
        for proc, _ in procs.values():
            kill_session(proc)
    for name, (proc, seconds) in procs.items():
        out = (tmp_path / f"{name}.log").read_text()
        expected = BAD_CONFIGS[name][1]
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{out[-3000:]}"
        assert expected in out, f"{name}: {expected!r} not in\n{out[-3000:]}"
        assert "invalid configuration" in out
        assert "Ray instance" not in out and "ranks up" not in out, f"{name} got as far as Ray:\n{out[-3000:]}"
        assert not (tmp_path / name / "ckpt").exists()
        assert seconds < 60, f"{name} took {seconds:.0f}s to fail"


def test_the_data_config_knows_the_embedded_tasks():
    from verl.trainer.config.data import TASKS
    from verl.utils.dataset import arithmetic

    assert tuple(sorted(TASKS)) == tuple(sorted(arithmetic.TASKS))


def test_validation_contents_match_the_checkpoint_manager():
    from verl.trainer.config.config import CHECKPOINT_CONTENTS
    from verl.utils.checkpoint.checkpoint_manager import ALL_CONTENTS

    assert tuple(CHECKPOINT_CONTENTS) == tuple(ALL_CONTENTS)


def test_reward_reads_responses_character_by_character():
    """decode() of the char-level tokenizer spaces characters and drops out-of-vocabulary ids ("7x7" -> "7 7");
    the reward must see what the model wrote."""
    from verl.models.tiny import build_tokenizer
    from verl.trainer.ppo.ray_trainer import response_text
    from verl.utils.reward_score import default_compute_score

    tok = build_tokenizer()
    seven, one, two = (tok.convert_tokens_to_ids(c) for c in "712")
    assert response_text(tok, [one, two, tok.eos_token_id]) == "12"
    assert default_compute_score("arithmetic", response_text(tok, [one, two, tok.eos_token_id]), "12") == 1.0
    unknown = len(tok) + 5  # the model's vocabulary (256) is larger than the tokenizer's
    assert response_text(tok, [seven, unknown, seven]) == "7\ufffd7"


def test_grpo_on_a_gsm8k_format_parquet_file_with_validation(tmp_path, env):
    """A hand-made parquet file in upstream's RLHFDataset format (chat messages of different lengths,
    data_source openai/gsm8k, reward_model.ground_truth) trains 3 steps and validates before, at step 2
    (test_freq) and at the last, with upstream's metric name. 8 ranks at TP2 PP2 EP2 ETP2, DO=False: prompts are
    left-padded to one length that makes prompt + response a multiple of TP, the padding masked on both sides,
    so Megatron's log-probs match the rollout's (the parity gate, on by default, passes). The tensorboard logger
    writes event files under tensorboard_log/<project>/<experiment> holding every scalar of metrics.jsonl.

    The model is the tiny Mixtral (head_dim unset, top-k renormalised): the one run is also that family's run
    through the CLI, its saves at steps 2 and 3 verified complete by the commit step (docs/models.md); the
    families' rank-level parity, export and resume are tests/test_model_families.py's."""
    from tests.family_check import hf_state
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.dataset.rl_dataset import write_rlhf_parquet

    def rows(count: int, split: str) -> list[dict]:
        return [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"Tom has {i} apples{'!' * (i % 3)} How many? End with #### n."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(i)},
                "extra_info": {"split": split, "index": i},
            }
            for i in range(count)
        ]

    write_rlhf_parquet(rows(6, "train"), str(tmp_path / "train.parquet"))
    write_rlhf_parquet(rows(3, "test"), str(tmp_path / "test.parquet"))
    mixtral = make_tiny_hf_model(str(tmp_path / "mixtral"), kind="mixtral")
    ckpt = tmp_path / "ckpt"
    code, out = run_trainer(
        [
            f"actor_rollout_ref.model.path={mixtral}",
            "trainer.n_gpus_per_node=8",
            f"{MEGATRON}tensor_model_parallel_size=2",
            f"{MEGATRON}pipeline_model_parallel_size=2",
            f"{MEGATRON}expert_model_parallel_size=2",
            f"{MEGATRON}expert_tensor_parallel_size=2",
            f"{MEGATRON}use_distributed_optimizer=False",
            "trainer.logger=[console,file,tensorboard]", "trainer.project_name=gsm8k_proj", "trainer.experiment_name=tp2_pp2",
            f"data.train_files={tmp_path / 'train.parquet'}",
            f"data.val_files=[{tmp_path / 'test.parquet'}]",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "data.max_prompt_length=64", "data.max_response_length=3",
            "trainer.total_epochs=1", "trainer.total_training_steps=null", "trainer.test_freq=2", "trainer.save_freq=2",
            "trainer.log_val_generations=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
            f"trainer.default_local_dir={ckpt}",
        ],
        tmp_path,
        env,
    )  # fmt: skip
    assert code == 0, out[-6000:]
    assert "8 ranks on cpu" in out and "TP2 PP2 EP2 ETP2 CP1" in out
    assert "bridge: mbridge (use_mbridge=True, vanilla_mbridge=True;" in out
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.9: an inference-engine setting" in out
    assert "data: 6 train prompt(s), 3 validation prompt(s)" in out and "3 steps (trainer.total_epochs=1 x 3 per epoch)" in out
    assert "[trainer] val sample: " in out
    lines = read_metrics(ckpt)
    val_key = "val-core/openai/gsm8k/reward/mean@1"
    assert [m["step"] for m in lines] == [0, 1, 2, 3]  # val_before_train, then the 3 steps of one epoch
    assert val_key in lines[0] and val_key in lines[2] and val_key in lines[3] and val_key not in lines[1]
    assert all(0.0 <= m[val_key] <= 1.0 for m in lines if val_key in m)
    for m in lines[1:]:
        assert m["critic/score/mean"] in (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # 0/1 rewards of 8 responses
        assert m["rollout/log_prob_diff_max"] <= 1e-5, m  # mixed-length, left-padded prompts: rollout and Megatron agree
    tensors = len(hf_state(mixtral))
    assert [m["step"] for m in lines if "checkpoint" in m] == [2, 3] and (ckpt / TRACKER).read_text() == "3"
    assert all(m["checkpoint"]["hf"] == f"all {tensors} tensors present with the expected shapes" for m in lines if "checkpoint" in m)
    assert _tensorboard_scalars(tmp_path / "tensorboard_log" / "gsm8k_proj" / "tp2_pp2") == _jsonl_scalars(lines)


def _jsonl_scalars(lines: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for m in lines:
        for key, value in m.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out.setdefault(key, {})[m["step"]] = pytest.approx(float(value), rel=1e-6, abs=1e-7)
    return out


def _tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar series of the event files in ``log_dir``, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_parity_gate_stops_a_model_the_bridge_maps_differently(tmp_path, env, tiny_moe_path):
    """Every mapping difference the family matrix found is refused before start (docs/models.md), so the gate's
    mismatch here is its tolerance set below the ~1e-6 gap of a correct run. The gate, on by default, stops the
    run on the first batch, before any update or save, naming the gap, the tolerance, the dtype and the key that
    turns it off. 1 rank. With that key off the same model and tolerance train and log the gap (at PP2 VPP2): the
    uninterrupted run of tests/test_resume_schedules_cli.py's invsqrt-vpp2-2ranks case (no launch of its own)."""
    ckpt = tmp_path / "ckpt"
    one_rank = [
        f"actor_rollout_ref.model.path={tiny_moe_path}", "trainer.n_gpus_per_node=1", f"{MEGATRON}tensor_model_parallel_size=1",
        f"{MEGATRON}pipeline_model_parallel_size=1", f"{MEGATRON}expert_model_parallel_size=1",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", f"trainer.default_local_dir={ckpt}", f"{PARITY_GATE}.tolerance.float32=1e-12",
    ]  # fmt: skip
    code, out = run_trainer(one_rank, tmp_path, env)
    assert code == 1, out[-6000:]
    assert "log-prob parity gate: on the first batch the actor's log-probs differ from the rollout's by up to" in out, out[-6000:]
    assert f"over the float32 tolerance 1.0e-12 ({PARITY_GATE}.tolerance.float32)" in out and f"set {PARITY_GATE}.enable=False" in out
    assert not read_metrics(ckpt)  # stopped before the first step was logged

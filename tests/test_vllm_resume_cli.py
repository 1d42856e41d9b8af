"""Resume is exact under the vLLM rollout, through the CLI: a 2-rank run (EP2, one engine per rank) stopped by
SIGTERM while both engines are mid-generation stops as a SIGTERM stops any run (status 143, the one line naming
the committed step and the command that resumes), commits nothing of the step it was in, and, resumed with the
same command, logs the uninterrupted run's metrics at every step and ends with its weights, bit for bit.

What makes it exact: each request's vLLM sampling seed is a function of ``data.seed``, the step, the
data-parallel rank and the row (``vllm_rollout.InMemoryVLLMRollout.generate_sequences``), so a fresh engine
samples what the uninterrupted run's engine did. The engine runs in the rank's process, whose global torch RNG
the checkpoint restores: without per-request seeds the engine would sample from that stream and a plain resume
would still match. So both runs validate before their first step with sampling on (``val_kwargs``): the resumed
run's validation draws from the restored stream before its first step, where the uninterrupted run drew
nothing, and only samples seeded per request stay the uninterrupted run's. The resumed run's first step shows
that its new engine holds the resumed weights, not its dummy start: the rollout's log-probs are Megatron's
within 1e-4 there.

The stop point is ``generate`` of tests/save_points (vLLM's ``LLMEngine.step`` once a call's first step has
sampled); tests/test_save_process_lifetime.py SIGKILLs a run at the same point."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="the vLLM rollout (the main leg has vLLM)")

from tests.cli_runs import (
    TRACKER,
    comparable_by_step,
    kill_session,
    read_metrics,
    run_trainer,
    start_trainer,
    two_ranks_ep2,
)
from tests.save_points.points import ACTION, DIR, NTH, POINT, RANKS

POINTS_DIR = str(Path(__file__).resolve().parent / "save_points")
STEPS = 3
STOPPED_IN = 2  # the step whose generation the SIGTERM lands in
VLLM = "actor_rollout_ref.rollout.name=vllm"
EAGER = "actor_rollout_ref.rollout.enforce_eager=True"  # no engine compile at each of the three starts (~20 s each)


VAL_SAMPLING = [f"actor_rollout_ref.rollout.val_kwargs.{key}" for key in ("do_sample=True", "temperature=1.0")]
TRAINED = "actor/lr"  # in a training step's metrics line, not in a validation's


def _command(model_path: str, ckpt: Path, val_parquet: str) -> list[str]:
    """2 ranks at EP2 (two data-parallel groups: two engines), a save every step, a sampled validation before
    the first step (of the run, or after its resume) and no other."""
    return [
        *two_ranks_ep2(model_path, ckpt), VLLM, EAGER, f"trainer.total_training_steps={STEPS}", "trainer.logger=[console,file]",
        f"data.val_files={val_parquet}", "trainer.val_before_train=True", "trainer.test_freq=-1", *VAL_SAMPLING,
    ]  # fmt: skip


def _trained(lines: list[dict]) -> dict[int, dict]:
    return comparable_by_step([line for line in lines if TRAINED in line])


def _stop_mid_generation(command: list[str], cwd: Path, env: dict, ckpt: Path) -> str:
    """Run ``command`` until both ranks' engines are inside step ``STOPPED_IN``'s generation (held there), SIGTERM
    the driver; the run's output."""
    reached = cwd / "reached"
    reached.mkdir()
    held = {
        **env, "PYTHONPATH": os.pathsep.join([POINTS_DIR, env["PYTHONPATH"]]),
        POINT: "generate", RANKS: "0,1", NTH: str(STOPPED_IN + 1), ACTION: "pause", DIR: str(reached),  # after the validation's
    }  # fmt: skip
    log = cwd / "stopped.log"
    proc = start_trainer(command, cwd, held, log)
    try:
        deadline = time.monotonic() + 480
        while {name.split(".")[1] for name in os.listdir(reached)} < {"0", "1"}:
            assert proc.poll() is None, f"exited before the generation:\n{log.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"step {STOPPED_IN}'s generation not reached in time:\n{log.read_text()[-5000:]}"
            time.sleep(0.1)
        assert (ckpt / TRACKER).read_text() == str(STOPPED_IN - 1)  # what the stop must leave committed
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_session(proc)
    out = log.read_text()
    assert proc.returncode == 143, out[-5000:]
    return out


def _hf_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted((ckpt / f"global_step_{STEPS}" / "actor" / "model" / "huggingface").glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def test_a_run_sigtermed_mid_vllm_generation_resumes_exactly(tmp_path, env, tiny_moe_path, val_parquet):
    whole_dir, stopped_dir = tmp_path / "uninterrupted", tmp_path / "stopped"
    code, out = run_trainer(_command(tiny_moe_path, whole_dir, val_parquet), tmp_path, env)
    assert code == 0, out[-6000:]
    whole = _trained(read_metrics(whole_dir))
    assert [line["step"] for line in read_metrics(whole_dir) if TRAINED not in line] == [0]  # validated before step 1 only
    assert sorted(whole) == list(range(1, STEPS + 1))
    assert all(whole[step]["response_length/mean"] > 0 for step in whole)

    command = _command(tiny_moe_path, stopped_dir, val_parquet)
    out = _stop_mid_generation(command, tmp_path, env, stopped_dir)
    committed = STOPPED_IN - 1
    line = f"[main_ppo] stopped by SIGTERM at step {STOPPED_IN}: step {committed} is committed (tracker {stopped_dir / TRACKER}); resume with: "
    assert line in out, out[-5000:]
    assert f"{VLLM} {EAGER} trainer.total_training_steps={STEPS}" in out.split(line, 1)[1].splitlines()[0]
    # nothing of the step it was in: the tracker, the step directories and the metrics stop at the committed step
    assert (stopped_dir / TRACKER).read_text() == str(committed)
    assert sorted(path.name for path in stopped_dir.glob("global_step_*")) == [f"global_step_{committed}"]
    before = len(read_metrics(stopped_dir))
    first = _trained(read_metrics(stopped_dir))
    assert sorted(first) == [committed]

    code, out = run_trainer(command, tmp_path, env)  # the same command, resume_mode=auto
    assert code == 0, out[-6000:]
    assert f"resumed from {stopped_dir}/global_step_{committed} (step {committed})" in out
    resumed_lines = read_metrics(stopped_dir)[before:]
    assert [line["step"] for line in resumed_lines if TRAINED not in line] == [committed]  # the resumed run's validation
    resumed = _trained(resumed_lines)
    assert sorted(resumed) == list(range(STOPPED_IN, STEPS + 1))
    # the new engine generated from the resumed weights: its log-probs are the resumed actor's
    assert resumed[STOPPED_IN]["rollout/log_prob_diff_max"] < 1e-4, resumed[STOPPED_IN]["rollout/log_prob_diff_max"]
    combined = {**first, **resumed}
    for step in range(1, STEPS + 1):
        differing = sorted(k for k in set(whole[step]) | set(combined[step]) if combined[step].get(k) != whole[step].get(k))
        assert differing == [], f"step {step} differs in {differing}"
    expected, actual = _hf_weights(whole_dir), _hf_weights(stopped_dir)
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if not expected[name].equal(actual[name])] == []

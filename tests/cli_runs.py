"""The trainer run as a user runs it, ``python -m verl.trainer.main_ppo`` in a session of its own, for the CLI
tests: start, stop (SIGTERM once a step is tracked, or SIGKILL of everything it started), its metrics file, and
what of those metrics may differ between two runs of the same steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.main_leg import HF_ROLLOUT, MBRIDGE, with_rollout
from tests.process_marker import MARKER, kill_marked

REPO = Path(__file__).resolve().parents[1]
MEGATRON = "actor_rollout_ref.actor.megatron."
TRACKER = "latest_checkpointed_iteration.txt"
PARITY_GATE = "actor_rollout_ref.rollout.log_prob_parity_check"
CLOCKS = ("time", "checkpoint", "checkpoint_committed", "resume")  # what may differ between runs: times, save and resume records


def cli_env(model_cache: Path) -> dict:
    """The environment of a run: this repository importable, the embedded default model made in ``model_cache``
    (not in the user's ~/.cache)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "VERL_TINY_MODEL_CACHE": str(model_cache),
    }


def start_trainer(
    overrides: list[str], cwd: Path, env: dict, log: Path, bridge: str | None = MBRIDGE, rollout: str | None = HF_ROLLOUT
) -> subprocess.Popen:
    """The trainer in its own session, so it can be stopped with everything it started (Ray included).
    Every process of the run inherits a marker in its environment (see ``kill_session``). ``bridge``: the
    override naming the bridge (None: the config's default, Megatron-Bridge); ``rollout``: the override naming
    the rollout unless ``overrides`` name one (None: the run's default, vllm where it is installed)."""
    handle = open(log, "w")
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.trainer.main_ppo", *([bridge] if bridge else []), *with_rollout(overrides, rollout)],
        cwd=cwd, env={**env, MARKER: marker}, stdout=handle, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    proc.marker = marker
    return proc


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the run's session and every process that carries its marker (Ray's, started outside it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    kill_marked(proc.marker)


def run_trainer(
    overrides: list[str], cwd: Path, env: dict, timeout_s: float = 540, bridge: str | None = MBRIDGE, rollout: str | None = HF_ROLLOUT
) -> tuple[int, str]:
    """One run to its end (nothing it started outlives it): its exit status and its output (``bridge``,
    ``rollout``: as ``start_trainer``)."""
    log = cwd / f"run_{time.monotonic_ns()}.log"
    proc = start_trainer(overrides, cwd, env, log, bridge, rollout)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        kill_session(proc)
    return proc.returncode, log.read_text()


def read_metrics(ckpt: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` (the file logger's), one dict a step; none before the first step."""
    path = ckpt / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _logged(ckpt: Path, step: int) -> bool:
    """Whether ``metrics.jsonl`` holds a whole line of ``step`` (a line still being written is not one)."""
    path = ckpt / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # the text after the last newline: unfinished
    return any(json.loads(line)["step"] == step for line in lines if line)


def comparable(metrics: dict) -> dict:
    """One step's metrics without the clocks: what two runs of the same step must agree on."""
    return {k: v for k, v in metrics.items() if not k.startswith("timing_s/") and k not in CLOCKS}


def comparable_by_step(metrics: list[dict]) -> dict[int, dict]:
    return {m["step"]: comparable(m) for m in metrics}


def two_ranks_ep2(model_path: str, ckpt: Path) -> list[str]:
    """2 ranks, EP2 only (the cheapest MoE layout), a save every step into ``ckpt``."""
    return [
        f"actor_rollout_ref.model.path={model_path}",
        "trainer.n_gpus_per_node=2",
        f"{MEGATRON}tensor_model_parallel_size=1",
        f"{MEGATRON}pipeline_model_parallel_size=1",
        f"{MEGATRON}expert_model_parallel_size=2",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={ckpt}",
    ]


def stop_after_a_save(command: list[str], cwd: Path, env: dict, ckpt: Path, step: int, last: int, bridge: str | None = MBRIDGE) -> int:
    """Start the run (through ``bridge``, as ``start_trainer``), SIGTERM its driver once ``step`` is tracked and its
    metrics line (with the save's record) is written; the step it can resume from, before ``last``. The ranks move
    the tracker before the driver hears back from them: a stop in between leaves the step's line without its
    ``checkpoint`` record."""
    log = cwd / "stopped.log"
    proc = start_trainer(command, cwd, env, log, bridge)
    try:
        deadline = time.monotonic() + 480
        while not ((ckpt / TRACKER).is_file() and (ckpt / TRACKER).read_text() == str(step) and _logged(ckpt, step)):
            assert proc.poll() is None, f"exited early:\n{log.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"no save of step {step} in time:\n{log.read_text()[-5000:]}"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_session(proc)
    assert proc.returncode == 143, log.read_text()[-5000:]
    tracked = int((ckpt / TRACKER).read_text())
    assert tracked < last, f"the run finished before the stop (tracked step {tracked})"
    return tracked

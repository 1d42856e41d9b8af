"""Ray job submission against a head on loopback: scripts/ray_job_submit.sh starts the head (dashboard on
127.0.0.1), submits a short run with `ray job submit -- python -m verl.trainer.main_ppo ...`, waits for
SUCCEEDED and stops the head it started. The checkpoint the job wrote is then checked here."""

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

from tests.main_leg import HF_ROLLOUT
from tests.process_marker import MARKER, kill_marked

REPO = Path(__file__).resolve().parents[1]
MEGATRON = "actor_rollout_ref.actor.megatron."


def _free_ports(count: int) -> list[int]:
    """Ports free now, between Ray's worker ports (below 20000) and the kernel's ephemeral range: Ray binds them
    only once its head starts, and every outgoing connection (other tests' gloo groups) and bind to port 0
    meanwhile draws from that range."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = (20000, ephemeral_low) if ephemeral_low > 21000 else (61000, 65536)  # a host whose range starts low
    ports: list[int] = []
    pick = random.SystemRandom()
    for _ in range(10000):
        if len(ports) == count:
            return ports
        port = pick.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    raise AssertionError(f"no {count} free ports in {low}-{high}")


def test_ray_job_submit_to_loopback_head(tmp_path, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths live under it
    gcs_port, dashboard_port = _free_ports(2)
    env = {
        **os.environ,
        "RAY_PORT": str(gcs_port),
        "RAY_DASHBOARD_PORT": str(dashboard_port),
        "RAY_NUM_CPUS": "2",
        "RAY_TEMP_DIR": temp_dir,
        MARKER: uuid.uuid4().hex,
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [
            "bash", str(REPO / "scripts" / "ray_job_submit.sh"),
            HF_ROLLOUT,
            f"actor_rollout_ref.model.path={tiny_moe_path}",
            "trainer.n_gpus_per_node=2",
            f"{MEGATRON}tensor_model_parallel_size=1",
            f"{MEGATRON}pipeline_model_parallel_size=1",
            f"{MEGATRON}expert_model_parallel_size=2",
            f"{MEGATRON}use_distributed_optimizer=False",
            "trainer.total_training_steps=1",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={ckpt}",
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the script stops its head; this is only a safety net
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        kill_marked(env[MARKER])  # anything of the head's that outlived it
    assert proc.returncode == 0, out[-6000:]
    assert "SUCCEEDED" in out
    assert "[main_ppo] joined the Ray cluster at" in out and "Started a local Ray instance" not in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    manifest = json.loads((ckpt / "global_step_1" / "actor" / "manifest.json").read_text())
    assert manifest["parallel"]["world_size"] == 2 and manifest["parallel"]["ep"] == 2
    metrics = json.loads((ckpt / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["checkpoint"]["hf"] == "all 135 tensors present with the expected shapes"
    # A GRPO step ran: responses of 1 to max_response_length (2) tokens were sampled and scored 0 or 1 (so
    # the mean score is the share of right answers), the update stepped, and Megatron's logprobs matched.
    assert {metrics["critic/score/min"], metrics["critic/score/max"]} <= {0.0, 1.0}
    assert metrics["critic/score/mean"] == metrics["critic/accuracy"]
    assert 1.0 <= metrics["response_length/mean"] <= 2.0 and metrics["actor/update_ok"] is True
    assert metrics["rollout/log_prob_diff_max"] <= 1e-4

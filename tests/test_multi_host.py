"""``python -m verl.trainer.main_ppo`` with ``trainer.nnodes=2`` on two hosts: two network namespaces joined by a
link, a Ray node in each (tests/netns_hosts.py). 4 ranks (2 per node, EP2 x DP2), the tiny MoE model.

- a node that does not see the driver's ``trainer.default_local_dir`` (its Ray runs with a private tmpfs over the
  directory's parent) is refused in one line naming it, before any rank starts;
- the cluster trains and saves across the link: the ranks' rendezvous store and gloo sockets listen on their host's
  link address only; every process of host B killed during step 2's save fails the run within seconds, naming the
  lost node, with step 1 still tracked; on two fresh nodes the run resumes from step 1 and saves step 2.
"""

import json
import os
import re
import time
from pathlib import Path

from tests.netns_hosts import TwoHosts
from tests.save_points.points import ACTION, DIR, NTH, POINT, RANKS

REPO = Path(__file__).resolve().parents[1]
POINTS_DIR = str(REPO / "tests" / "save_points")
MEGATRON = "actor_rollout_ref.actor.megatron."
TRACKER = "latest_checkpointed_iteration.txt"
# Ray's worker ports end below 20000; the rendezvous store's and gloo's ports lie above (find_free_port, ephemeral).
LOWEST_RANK_PORT = 20000


def _two_nodes(model: str, ckpt: Path, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
        f"{MEGATRON}tensor_model_parallel_size=1", f"{MEGATRON}pipeline_model_parallel_size=1",
        f"{MEGATRON}expert_model_parallel_size=2", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
        f"trainer.default_local_dir={ckpt}",
    ]  # fmt: skip


def test_a_node_without_the_shared_checkpoint_dir_is_refused_before_any_rank(tmp_path, tiny_moe_path):
    ckpt = tmp_path / "shared" / "ckpt"
    with TwoHosts(tmp_path) as hosts:
        hosts.start_ray(private_dir=ckpt.parent)  # host B sees an empty tmpfs there, as a node-local disk
        code, out = hosts.run_trainer(_two_nodes(tiny_moe_path, ckpt, steps=1))
    assert code == 2, out[-5000:]
    refusals = [line for line in out.splitlines() if "is not the same directory on every node" in line]
    assert len(refusals) == 1, out[-5000:]
    assert refusals[0].startswith(f"[main_ppo] trainer.default_local_dir={ckpt} is not the same directory on every node: node 10.200.0.2 (")
    assert "lacks the check file the driver just wrote" in refusals[0] and "10.200.0.1" not in refusals[0]
    assert "ranks up" not in out and not (ckpt / TRACKER).exists()
    assert [p.name for p in ckpt.iterdir()] == [".verl_writer.lock"]  # the check files are gone


def test_two_hosts_train_save_lose_a_host_mid_save_and_resume(tmp_path, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    reached = tmp_path / "reached"
    reached.mkdir()
    # Host B's ranks stop in their second save (step 2) once its dist checkpoint starts.
    hold = {"PYTHONPATH": os.pathsep.join([POINTS_DIR, str(REPO)]), POINT: "dist_checkpoint", RANKS: "0,1,2,3", NTH: "2", ACTION: "pause", DIR: str(reached)}
    with TwoHosts(tmp_path) as hosts:
        hosts.start_ray(env_b=hold)
        log = tmp_path / "lost.log"
        proc = hosts.start_trainer(_two_nodes(tiny_moe_path, ckpt, steps=2), log)
        try:
            deadline = time.monotonic() + 240
            while len(os.listdir(reached)) < 2:
                assert proc.poll() is None, log.read_text()[-5000:]
                assert time.monotonic() < deadline, log.read_text()[-5000:]
                time.sleep(0.2)
            time.sleep(1.0)  # host A's ranks reach the save's collectives
            listening = {host.address: hosts.listeners(host) for host in hosts.hosts}
            lost_at = time.monotonic()
            hosts.b.kill_all()
            proc.wait(timeout=120)
            failed_within = time.monotonic() - lost_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = log.read_text()
        assert proc.returncode == 1, out[-5000:]
        assert failed_within < 30, failed_within  # not the collectives' timeout (actor_rollout_ref.nccl_timeout, 600 s)
        assert re.search(r"rank\(s\) failed; rank \d failed first, on node 10\.200\.0\.2 \(its process died", out), out[-5000:]
        assert re.search(r"node 10\.200\.0\.2 \(ranks \d, \d\) is lost: no Ray node answers there \(raylet 10\.200\.0\.2:\d+: ", out), out[-5000:]
        assert f"{ckpt} is the same directory on all 2 nodes of the run" in out
        assert (ckpt / TRACKER).read_text() == "1"
        assert not (ckpt / "global_step_2" / "actor").exists()
        # Each host's ranks listen on its link address only: the store (on rank 0's host) and gloo.
        for address, sockets in listening.items():
            ranks = [(ip, port) for ip, port, name in sockets if name.startswith("ray::ActorRollo") and port >= LOWEST_RANK_PORT]
            assert ranks and {ip for ip, _ in ranks} == {address}, sockets

        hosts.start_ray()  # two fresh nodes
        code, out = hosts.run_trainer([*_two_nodes(tiny_moe_path, ckpt, steps=2), "trainer.resume_mode=auto"])
    assert code == 0, out[-5000:]
    assert f"resumed from {ckpt}/global_step_1 (step 1)" in out
    assert (ckpt / TRACKER).read_text() == "2"
    manifest = json.loads((ckpt / "global_step_2" / "actor" / "manifest.json").read_text())
    assert manifest["parallel"]["world_size"] == 4
    steps = [json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and steps[-1] == 2

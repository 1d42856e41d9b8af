"""The Ray worker group: one actor per rank, torch.distributed + megatron state, dispatch, and no hang on failure."""

import os
import time
from pathlib import Path

import pytest
import ray

from tests.main_leg import MBRIDGE
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.megatron.worker import MegatronWorker
from verl.single_controller.base.worker import Worker
from verl.single_controller.ray import (
    MegatronRayWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
)
from verl.utils.logging_utils import silence_library_notices
from verl.utils.megatron.parallel import ParallelSizes

REPO = str(Path(__file__).resolve().parents[1])


class ProbeWorker(MegatronWorker):
    def __init__(self, tp: int = 1, fail_in_init_on: int | None = None) -> None:
        silence_library_notices()
        super().__init__()
        if self.rank == fail_in_init_on:
            raise RuntimeError(f"constructor of rank {self.rank} refuses to start")
        self._ray_listening = _listening()  # Ray's own worker server (token-protected), before torch's
        self.init_megatron(ParallelSizes(tp=tp), seed=1, timeout_s=120)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        import torch

        total = torch.tensor([float(self.rank)])
        torch.distributed.all_reduce(total)
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
        return {
            "env": env,
            "listening": sorted(_listening() - self._ray_listening),
            "rank_sum": total.item(),
            "threads": torch.get_num_threads(),
            **self.get_megatron_rank_info(),
        }

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def echo(self, item) -> tuple:
        return self.rank, item

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        import torch

        if self.rank == bad_rank:
            raise ValueError(f"boom on rank {self.rank}")
        torch.distributed.barrier()  # the healthy ranks wait for the failed one forever
        return self.rank


def _listening() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield
    ray.shutdown()


class EnvWorker(Worker):
    """A plain rank (no torch.distributed): answers what its environment holds."""

    def getenv(self, key: str, suffix: str = "") -> str:
        return os.environ.get(key, "unset") + suffix

    @register()
    def tagged(self, tag: str) -> tuple:
        return self.rank, tag


def test_resource_pool_has_upstreams_defaults():
    pool = RayResourcePool([2, 2])
    assert pool.use_gpu is True and pool.max_colocate_count == 10 and not pool.detached
    assert pool.accelerator_type is None and pool.store == [2, 2] and pool.world_size == 4
    assert len(pool.name_prefix) == 6 and pool.name_prefix != RayResourcePool([1]).name_prefix  # random
    with pytest.raises(ValueError, match="max_colocate_count"):
        RayResourcePool([1], max_colocate_count=0)


def test_worker_group_upstream_surface(local_ray):
    """worker_env, name_prefix, execute_all* (refs / values, list splitting), a bare @register() (ALL_TO_ALL),
    a second group colocated on the same pool, and attaching to running actors by name."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), name_prefix="envwg", worker_env={"MY_KEY": "v"})
    try:
        assert group.execute_all_sync("getenv", "MY_KEY") == ["v", "v"]
        assert group.execute_all_sync("getenv", "RAY_LOCAL_WORLD_SIZE") == ["2", "2"]
        assert group.execute_all_sync("getenv", "WG_PREFIX") == ["envwg", "envwg"]
        refs = group.execute_all("getenv", "RANK")
        assert all(isinstance(ref, ray.ObjectRef) for ref in refs) and ray.get(refs) == ["0", "1"]
        assert group.execute_all_sync("getenv", ["RANK", "WORLD_SIZE"], suffix=["!", "?"]) == ["0!", "2?"]
        assert ray.get(group.execute_rank_zero("getenv", "RANK")) == "0"
        assert group.tagged(["a", "b"]) == [(0, "a"), (1, "b")]
        assert group.worker_names == ["envwgEnvWorker_0:0", "envwgEnvWorker_0:1"]
        with pytest.raises(ValueError, match=r"protected system env \['WORLD_SIZE'\]"):
            RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), worker_env={"WORLD_SIZE": "100"})
        colocated = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker))  # the pool's second share
        assert colocated.execute_all_sync("getenv", "RANK") == ["0", "1"]
        attached = RayWorkerGroup(worker_names=group.worker_names, ray_cls_with_init=RayClassWithInitArgs(EnvWorker))
        assert attached.execute_all_sync("getenv", "MY_KEY") == ["v", "v"]
        assert attached.tagged(["x", "y"]) == [(0, "x"), (1, "y")]
    finally:
        group.shutdown()


def _group(world: int, **kwargs) -> MegatronRayWorkerGroup:
    return MegatronRayWorkerGroup(
        RayResourcePool([world], use_gpu=False, name_prefix="probe"), RayClassWithInitArgs(ProbeWorker, **kwargs), init_timeout_s=180
    )


def test_ranks_join_and_dispatch(local_ray):
    group = _group(4, tp=2)
    try:
        info = group.describe()
        assert [i["env"]["RANK"] for i in info] == ["0", "1", "2", "3"]
        assert {i["env"]["WORLD_SIZE"] for i in info} == {"4"}
        assert [i["env"]["LOCAL_RANK"] for i in info] == ["0", "1", "2", "3"]
        assert len({(i["env"]["MASTER_ADDR"], i["env"]["MASTER_PORT"]) for i in info}) == 1
        # One host: the rendezvous store and every socket torch opens in a rank (gloo's too) are on loopback.
        assert info[0]["env"]["MASTER_ADDR"] == "127.0.0.1"
        outside = [(rank, ip, port) for rank, i in enumerate(info) for ip, port in i["listening"] if ip != "127.0.0.1"]
        assert not outside, outside
        assert {i["env"]["OMP_NUM_THREADS"] for i in info} == {"1"} and {i["threads"] for i in info} == {1}
        assert {i["rank_sum"] for i in info} == {6.0}  # all_reduce over the 4 actors
        assert [i["tp_rank"] for i in info] == [0, 1, 0, 1] and [i["dp_rank"] for i in info] == [0, 0, 1, 1]
        # Each DP group gets its own item; the answer comes from the group's TP-rank-0 member.
        assert group.echo(["first", "second"]) == [(0, "first"), (2, "second")]
    finally:
        group.shutdown()


def test_failing_rank_reaches_driver_without_hang(local_ray):
    group = _group(4)
    workers = group.workers
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        group.fail_on([2] * 4)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "rank 2 failed first" in message
    assert "Traceback (most recent call last):" in message and ", in fail_on" in message
    assert "ValueError: boom on rank 2" in message
    assert "ranks [0, 1, 3] were still running and have been stopped" in message
    # The group is gone: no further calls, and the actors are dead.
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.describe()
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.get_node_and_pid.remote(), timeout=60)


def test_failing_constructor_reaches_driver(local_ray):
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        _group(2, fail_in_init_on=1)
    assert time.monotonic() - start < 60
    assert "constructor of rank 1 refuses to start" in str(err.value)


def test_actor_worker_async_save_is_pending_until_finalized(local_ray, tiny_moe_path, tmp_path):
    """The real actor worker: save returns pending, training goes on, finalize_checkpoint commits."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl.utils.checkpoint.integrity import verify_checkpoint
    from verl.workers.engine_workers import ActorRolloutRefWorker

    megatron = "actor_rollout_ref.actor.megatron."
    overrides = [f"{megatron}tensor_model_parallel_size=1", f"{megatron}pipeline_model_parallel_size=1",
                 f"{megatron}expert_model_parallel_size=2", f"{megatron}expert_tensor_parallel_size=1",
                 "actor_rollout_ref.actor.checkpoint.async_save=True", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.optim.total_training_steps=10"]  # fmt: skip
    with initialize_config_dir(config_dir=os.path.join(REPO, "verl", "trainer", "config"), version_base=None):
        config = OmegaConf.to_container(compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, *overrides]).actor_rollout_ref, resolve=True)
    config["model"]["path"] = tiny_moe_path
    group = MegatronRayWorkerGroup(
        RayResourcePool([2], use_gpu=False, name_prefix="async_actor"), RayClassWithInitArgs(ActorRolloutRefWorker, config=config), init_timeout_s=180
    )
    try:
        import torch

        built = group.init_model()
        assert all(r["frozen_objects"] > 100_000 for r in built), built  # torch, megatron, transformers: out of gc's scans
        generator = torch.Generator().manual_seed(0)

        def ppo_batches() -> list[dict]:  # one per data-parallel rank: 2 rows of 4 prompt + 2 response tokens
            batches = [{"input_ids": torch.randint(4, 90, (2, 6), generator=generator)} for _ in range(2)]
            for batch, old in zip(batches, group.compute_log_prob(batches), strict=True):
                batch.update(old, response_mask=torch.ones(2, 2, dtype=torch.long), advantages=torch.randn(2, 2, generator=generator))
            return batches

        group.update_actor(ppo_batches())
        step = str(tmp_path / "global_step_1" / "actor")
        assert all(r["pending"] for r in group.save_checkpoint(step, global_step=1))
        group.update_actor(ppo_batches())
        assert not os.path.exists(step)
        assert [r["path"] for r in group.finalize_checkpoint()] == [step, step]
        verify_checkpoint(step)
        assert [r["path"] for r in group.finalize_checkpoint()] == [None, None]  # nothing pending any more
    finally:
        group.shutdown()


def test_the_rendezvous_is_on_loopback_exactly_when_every_rank_is_on_one_host():
    from verl.single_controller.ray.base import rendezvous_host

    # several Ray nodes on one machine share its address: still one host
    assert rendezvous_host(["10.0.0.5"] * 8) == "127.0.0.1"
    assert rendezvous_host(["10.0.0.5", "10.0.0.5", "10.0.0.6"]) is None

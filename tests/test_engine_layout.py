"""Upstream HEAD's engine layout: the rank's engine and the Ray worker under upstream's paths, names
and checkpoint arguments; the pre-#6067 paths still import the same objects."""

import inspect
import os

import pytest
import torch

from tests.main_leg import actor_configs
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes
from verl.workers.engine import BaseEngine, MegatronEngine
from verl.workers.engine.megatron import transformer_impl
from verl.workers.engine_workers import ActorRolloutRefWorker

REQUIRED = object()
# Upstream verl at 1dda039: verl/workers/engine/base.py's BaseEngine (MegatronEngine's are the same),
# verl/workers/engine_workers.py's ActorRolloutRefWorker; parameter name -> default, in order.
UPSTREAM_ENGINE_SAVE = {"local_path": REQUIRED, "hdfs_path": None, "global_step": 0, "max_ckpt_to_keep": None}
UPSTREAM_ENGINE_LOAD = {"local_path": REQUIRED, "hdfs_path": None, "del_local_after_load": True}
UPSTREAM_WORKER_SAVE = UPSTREAM_ENGINE_SAVE
UPSTREAM_WORKER_LOAD = {"local_path": REQUIRED, "hdfs_path": None, "del_local_after_load": False}
# Every public method of upstream's BaseEngine at 1dda039; ours may have fewer, never another.
UPSTREAM_BASE_ENGINE = {
    "initialize", "is_param_offload_enabled", "is_optimizer_offload_enabled", "train_mode", "eval_mode",
    "optimizer_zero_grad", "optimizer_step", "lr_scheduler_step", "forward_backward_batch", "train_batch",
    "infer_batch", "get_per_tensor_param", "get_per_tensor_param_shard", "delta_pin_snapshots",
    "prime_delta_snapshots", "get_per_tensor_param_delta_shard", "get_data_parallel_size",
    "get_data_parallel_rank", "get_data_parallel_group", "to", "save_checkpoint", "load_checkpoint",
    "is_mp_src_rank_with_outputs", "disable_adapter",
}  # fmt: skip


def _leading(method, upstream: dict) -> list[tuple[str, object]]:
    params = list(inspect.signature(method).parameters.values())[1 : 1 + len(upstream)]
    return [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in params]


@pytest.mark.parametrize(
    "method, upstream",
    [
        (BaseEngine.save_checkpoint, UPSTREAM_ENGINE_SAVE),
        (BaseEngine.load_checkpoint, UPSTREAM_ENGINE_LOAD),
        (MegatronEngine.save_checkpoint, UPSTREAM_ENGINE_SAVE),
        (MegatronEngine.load_checkpoint, UPSTREAM_ENGINE_LOAD),
        (ActorRolloutRefWorker.save_checkpoint, UPSTREAM_WORKER_SAVE),
        (ActorRolloutRefWorker.load_checkpoint, UPSTREAM_WORKER_LOAD),
    ],
)
def test_checkpoint_methods_take_upstreams_arguments_in_order(method, upstream):
    assert _leading(method, upstream) == list(upstream.items())
    rest = list(inspect.signature(method).parameters.values())[1 + len(upstream) :]
    # upstream's engine methods end in **kwargs; ours add only keyword-only arguments (step_files, track)
    assert all(p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) for p in rest)


def test_the_engine_has_only_upstreams_names_and_is_one():
    assert issubclass(MegatronEngine, BaseEngine)
    ours = {name for name in vars(BaseEngine) if not name.startswith("_")}
    assert ours and ours <= UPSTREAM_BASE_ENGINE


def test_the_pre_engine_paths_import_the_same_objects():
    from verl.workers import megatron_rank, megatron_workers

    assert megatron_rank.MegatronActor is MegatronEngine
    assert megatron_rank.MegatronReference is transformer_impl.MegatronReference
    assert megatron_workers.ActorRolloutRefWorker is ActorRolloutRefWorker


def _refusals_and_upstream_load(model_path: str, root: str) -> dict:
    engine = MegatronEngine(*actor_configs(model_path, total_training_steps=2))  # the worker's form
    path = os.path.join(root, "global_step_1", "actor")
    refused = {}
    for name, call in {
        "save_hdfs": lambda: engine.save_checkpoint(path, "hdfs://cluster/ckpt", 1),
        "save_keyword": lambda: engine.save_checkpoint(path, global_step=1, step_file={"data.pt": b""}),
        "load_hdfs": lambda: engine.load_checkpoint(path, hdfs_path="hdfs://cluster/ckpt"),
    }.items():
        try:
            call()
        except (NotImplementedError, TypeError) as error:
            refused[name] = f"{type(error).__name__}: {error}"
    nothing_written = not os.path.exists(root) or os.listdir(root) == []
    batch = torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.train_step([batch])  # the optimizer has state to save
    assert engine.save_checkpoint(path, None, 1) is False  # upstream's positions; a sync save is committed
    phases = {"record": set(engine.last_committed.phase_seconds), "report": set(engine.checkpoint_manager.last_save.phase_seconds)}
    before = engine.parameters_snapshot()
    engine.train_step([batch])
    engine.load_checkpoint(path)  # upstream's default del_local_after_load=True: a local step is kept
    after = engine.parameters_snapshot()
    return {
        "refused": refused,
        "nothing_written": nothing_written,
        "restored": all(torch.equal(before[k], after[k]) for k in before),
        "kept": os.path.isdir(path),
        "phases": phases,
    }


@pytest.fixture(scope="module")
def upstream_calls(tiny_dense_path, tmp_path_factory) -> dict:
    """One engine's refused calls, its sync save and its load (1 rank), run once for this module's tests."""
    root = str(tmp_path_factory.mktemp("engine_layout") / "ckpt")
    return run_on_ranks(_refusals_and_upstream_load, 1, ParallelSizes(), args=(tiny_dense_path, root))[0]


def test_refusals_come_first_and_a_load_keeps_the_local_step(upstream_calls):
    result = upstream_calls
    refused = result["refused"]
    assert refused["save_hdfs"].startswith("NotImplementedError: MegatronEngine.save_checkpoint: hdfs_path=")
    assert refused["save_keyword"] == (
        "TypeError: MegatronEngine.save_checkpoint: unknown keyword(s) ['step_file']; "
        "it takes upstream's arguments, step_files and track only"
    )
    assert refused["load_hdfs"].startswith("NotImplementedError: MegatronEngine.load_checkpoint: hdfs_path=")
    assert result["nothing_written"] and result["restored"] and result["kept"]


def test_the_committed_record_carries_the_writers_phases_and_the_transactions(upstream_calls):
    """The engine's record of a save holds the manager's phases (the writer's) and the step transaction's; the
    manager's report keeps only its own: nothing writes into another owner's report."""
    phases = upstream_calls["phases"]
    transaction = {"staging", "hf_verify", "commit", "retention"}  # an untracked save: no "tracker" phase
    assert {"dist_checkpoints", "hf_weights"} <= phases["report"] and not phases["report"] & transaction
    assert phases["record"] == phases["report"] | transaction

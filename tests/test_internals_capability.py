"""No import-time refusal: each private internal is checked where first used.

With the installed release reported as another one (``importlib.metadata.version``, which the check reads),
the adapters import, warning once outside the tested releases; with one internal removed from the real
module, the feature that needs it fails naming it (or falls back where a public path exists), while every
other internal's check still passes. docs/cpu.md and setup.py state the tested points and declared range.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.internals import (
    CONTRACT_TEST,
    TESTED,
    TESTED_ON,
    InternalsChangedError,
    UntestedReleaseWarning,
    megatron_core,
)
from verl.utils.internals import mbridge as mbridge_internals
from verl.utils.internals import torch as torch_internals
from verl.utils.megatron.parallel import ParallelSizes

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = {"torch": torch_internals, "megatron-core": megatron_core, "mbridge": mbridge_internals}


def _report_release(monkeypatch, package: str, release: str) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == package else real(name))


def _untested_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UntestedReleaseWarning)]


# ------------------------------------------------------------------ another release


@pytest.mark.parametrize("package", list(ADAPTERS))
def test_an_untested_release_imports_and_warns_once_naming_the_contract_test(monkeypatch, package):
    release = {"torch": "2.11.0", "megatron-core": "0.18.0", "mbridge": "0.15.2"}[package]
    _report_release(monkeypatch, package, release)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.reload(ADAPTERS[package])
        importlib.reload(ADAPTERS[package])  # a second import in the process: no second warning
    [message] = _untested_warnings(caught)
    assert f"{package} {release}" in message and CONTRACT_TEST in message and TESTED[package][0] in message


@pytest.mark.parametrize("package", list(ADAPTERS))
def test_a_tested_release_imports_without_a_warning(monkeypatch, package):
    _report_release(monkeypatch, package, TESTED[package][0] + "+cu128")  # a local label is the same release
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.reload(ADAPTERS[package])
    assert _untested_warnings(caught) == []


def test_the_whole_package_imports_on_other_releases_of_all_three():
    """fix 1's module and the checkpoint manager, in a fresh process that sees torch 2.11.0, megatron-core
    0.18.0 and mbridge 0.15.2: one warning per package, no ImportError."""
    code = (
        "import importlib.metadata as m, json, warnings; real = m.version; "
        "fake = {'torch': '2.11.0', 'megatron-core': '0.18.0', 'mbridge': '0.15.2'}; "
        "m.version = lambda name: fake.get(name) or real(name); "
        "warnings.simplefilter('always'); "
        "from verl.utils.internals import UntestedReleaseWarning\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import verl.utils.megatron_utils, verl.utils.checkpoint.megatron_checkpoint_manager\n"
        "    import verl.models.mcore.mbridge, verl.utils.megatron.cpu_runtime\n"
        "print(json.dumps([str(w.message) for w in caught if issubclass(w.category, UntestedReleaseWarning)]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(m.split(" ")[0] for m in messages) == ["mbridge", "megatron-core", "torch"]
    assert all(CONTRACT_TEST in m for m in messages)


# ------------------------------------------------------------------ an internal removed


def _others_still_pass(removed) -> None:
    """Every other internal's check passes: only the features reading ``removed`` are affected."""
    attribute = removed.path.rsplit(".", 1)[-1].rsplit(":", 1)[-1]
    for adapter in ADAPTERS.values():
        for internal in adapter.INTERNALS:
            if not internal.path.endswith((f".{attribute}", f":{attribute}")):
                internal.get()


def _remove(monkeypatch, owner, name: str) -> None:
    """Delete ``name`` from ``owner`` and, for a class, from every class above it that defines it."""
    for klass in owner.__mro__ if isinstance(owner, type) else (owner,):
        if name in vars(klass):
            monkeypatch.delattr(klass, name)


def _fails_naming(internal, feature, *args) -> None:
    with pytest.raises(InternalsChangedError) as failed:
        feature(*args)
    message = str(failed.value)
    assert internal.name in message and internal.package in message and CONTRACT_TEST in message
    assert importlib.metadata.version(internal.package) in message


def test_dynamo_switch_gone_falls_back_to_a_warning_naming_the_public_switch(monkeypatch):
    import torch._dynamo.config as dynamo_config

    monkeypatch.delattr(dynamo_config, "disable")
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with pytest.warns(UserWarning, match=r"torch\._dynamo\.config\.disable is missing.*TORCH_COMPILE_DISABLE=1"):
        torch_internals.disable_dynamo()
    _others_still_pass(torch_internals.DYNAMO_DISABLE)


def test_default_store_getter_gone_falls_back_to_the_rendezvous_address_or_none(monkeypatch):
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_get_default_store")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert torch_internals.default_store_address() is None  # nowhere to meet: forked groups are not possible
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    with pytest.warns(UserWarning, match=r"_get_default_store is missing.*MASTER_ADDR:MASTER_PORT"):
        assert torch_internals.default_store_address() == ("127.0.0.1", 29511)
    _others_still_pass(torch_internals.DEFAULT_STORE)


def _forked_group_without_the_store_getter() -> dict:
    """On a rank: with ``_get_default_store`` gone, forked processes still meet (through MASTER_ADDR/PORT)."""
    from verl.utils import rank_comm

    del torch.distributed.distributed_c10d._get_default_store
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        possible = rank_comm.forked_groups_possible()
        comm = rank_comm.ForkedRankComm("capability-test")
    return {"possible": possible, "gathered": comm.all_gather_object(comm.rank)}


def test_forked_groups_still_form_without_the_default_store_getter():
    assert run_on_ranks(_forked_group_without_the_store_getter, 2) == [{"possible": True, "gathered": [0, 1]}] * 2


def _no_cdata(self):
    raise AttributeError("_cdata")


def test_storage_identity_gone_fails_the_offload_naming_it(monkeypatch):
    monkeypatch.setattr(torch.UntypedStorage, "_cdata", property(_no_cdata), raising=False)
    _fails_naming(torch_internals.STORAGE_CDATA, torch_internals.storage_id, torch.zeros(2))
    _others_still_pass(torch_internals.STORAGE_CDATA)


def test_dcp_storage_info_gone_fails_the_async_outcome_naming_it(monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    monkeypatch.delattr(dcp_filesystem, "_StorageInfo")
    _fails_naming(torch_internals.DCP_STORAGE_INFO, torch_internals.dcp_storage_info)


def test_allocator_settings_gone_fails_expandable_segments_naming_it(monkeypatch):
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    _fails_naming(torch_internals.ALLOCATOR_SETTINGS, torch_internals.set_allocator_expandable_segments, True)
    _others_still_pass(torch_internals.ALLOCATOR_SETTINGS)


def _module_and_name(internal):
    module_name, _, attrs = internal.path.partition(":")
    owner = importlib.import_module(module_name)
    *classes, name = attrs.split(".")
    for part in classes:
        owner = getattr(owner, part)
    return owner, name


def _mcore_features():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    return {  # internal: the feature reading it, with arguments that reach the check
        megatron_core.ASYNC_CALLS_QUEUE: (megatron_core.async_calls_queue,),
        megatron_core.ASYNC_REQUEST: (megatron_core.async_request, None, (), []),
        megatron_core.WRITER_FINISH: (megatron_core.write_checkpoint_metadata, strategy, "unused", []),
        megatron_core.CHECKPOINTING_CONFIG: (megatron_core.write_checkpoint_metadata, strategy, "unused", []),
        megatron_core.SAVE_CONFIG: (megatron_core.write_checkpoint_metadata, strategy, "unused", []),
        **{
            internal: (lambda: megatron_core.torch_dist_load_reader_and_planner(None, None).__enter__(),)
            for internal in (megatron_core.LOAD_READER, megatron_core.LOAD_PLANNER)
        },
        megatron_core.WRITE_RESULTS_QUEUE: (megatron_core.tie_write_results_queue, None),
        megatron_core.DUMMY_OPTIMIZER_STATE: (
            megatron_core.init_distributed_optimizer_state,
            object.__new__(DistributedOptimizer),
        ),
        megatron_core.GET_CUDA_RNG_STATE: (
            megatron_core.replace_cuda_rng_state,
            torch.get_rng_state,
            torch.set_rng_state,
        ),
        megatron_core.SET_CUDA_RNG_STATE: (
            megatron_core.replace_cuda_rng_state,
            torch.get_rng_state,
            torch.set_rng_state,
        ),
        **{
            internal: (lambda: megatron_core.rank_zero_files_taken(lambda common: common, lambda config, path: None).__enter__(),)
            for internal in megatron_core.RANK_ZERO_FILES
        },
        megatron_core.GATHER_FIRST_DIM: (megatron_core.replace_first_dim_collectives, None, None),
        megatron_core.REDUCE_SCATTER_FIRST_DIM: (megatron_core.first_dim_collectives,),
        **{
            internal: (megatron_core.replace_split_sizes_to_host, None)
            for internal in megatron_core.SPLIT_SIZES_TO_HOST
        },
    }


@pytest.mark.parametrize(
    "internal",
    [
        i
        for i in megatron_core.INTERNALS
        if i
        not in (
            megatron_core.WRITER_WRITE,
            megatron_core.LOAD_STATE_DICT,
            megatron_core.PARAM_ID_MAP,
            megatron_core.CAT_MERGE,
            megatron_core.SAVE_CALLBACKS,
            megatron_core.SHARD_ACCESS_COUNT,
        )
        and i not in megatron_core.IN_RANK_SAVE
    ],
    ids=lambda i: i.name,
)  # IN_RANK_SAVE falls back to megatron's writer instead: tests/test_dist_writer.py; the speed-ups below
def test_a_megatron_internal_removed_fails_the_feature_naming_it_and_replaces_nothing(monkeypatch, internal):
    feature, *args = _mcore_features()[internal]
    replaced = [_module_and_name(i) for i in megatron_core.INTERNALS if i != internal]
    before = {(id(owner), name): vars(owner).get(name) for owner, name in replaced}
    _remove(monkeypatch, *_module_and_name(internal))
    _fails_naming(internal, feature, *args)
    assert {(id(owner), name): vars(owner).get(name) for owner, name in replaced} == before  # none half-replaced
    _others_still_pass(internal)


def test_an_async_finalize_not_ending_with_megatrons_metadata_json_write_is_named_and_left_alone():
    request = megatron_core.async_request(None, (), [print, len])
    _fails_naming(megatron_core.SAVE_FINALIZE, megatron_core.replace_metadata_finalize, request, dict)
    assert request.finalize_fns == [print, len]


def test_a_one_rank_load_keeps_its_collectives_where_torchs_load_state_dict_changed(monkeypatch):
    """The one-rank swap is a speed-up with a public path beside it: without torch's ``load_state_dict`` where
    megatron's strategy module reaches it, the load runs with its collectives as before, nothing replaced."""
    owner, name = _module_and_name(megatron_core.LOAD_STATE_DICT)
    _remove(monkeypatch, owner, name)
    strategy_module = importlib.import_module(megatron_core.LOAD_STATE_DICT.path.partition(":")[0])
    before = strategy_module.checkpoint
    with megatron_core.torch_dist_load_reader_and_planner(len, dict, one_rank=True):
        assert strategy_module.checkpoint is before
    assert strategy_module.checkpoint is before


def _installed_without(monkeypatch, internal, install) -> tuple:
    """A speed-up's ``install`` (decided once per process) decided again with ``internal`` removed where it lives,
    then forgotten, so that later callers decide against the internal as restored; the internal's owner and name."""
    owner, name = _module_and_name(internal)
    _remove(monkeypatch, owner, name)
    install.cache_clear()
    try:
        install()
    finally:
        install.cache_clear()
    return owner, name


def test_the_optimizer_param_map_is_left_to_megatron_where_it_changed(monkeypatch):
    """``map_only_tracked_params`` is a speed-up with megatron's own path beside it: without megatron's map where
    the optimizers call it, nothing is installed and nothing fails (a save then formats what megatron formats)."""
    owner, name = _installed_without(monkeypatch, megatron_core.PARAM_ID_MAP, megatron_core.map_only_tracked_params)
    assert name not in vars(owner)


def test_the_shard_access_count_is_left_to_megatron_where_it_changed(monkeypatch):
    """``count_shard_access_at_once`` is a speed-up with megatron's own count beside it: without it where it lives,
    nothing is installed and nothing fails."""
    owner, name = _installed_without(monkeypatch, megatron_core.SHARD_ACCESS_COUNT, megatron_core.count_shard_access_at_once)
    assert name not in vars(owner)


def test_the_gated_mlp_merge_is_left_to_megatron_where_its_factory_changed(monkeypatch):
    """``merge_without_copy`` is a speed-up with megatron's own merge beside it: without what it recognises the merge
    by, a factory's merge is returned as it is, and nothing fails."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    fc1 = ShardedTensor.from_rank_offsets("fc1", torch.zeros(4, 2), replica_id=0)
    merge_fn = apply_swiglu_sharded_factory(fc1, ()).merge_fn  # megatron's own, which it would speed up
    owner, name = _module_and_name(megatron_core.CAT_MERGE)
    megatron_core.concatenating_merge_code.cache_clear()
    assert megatron_core.merge_without_copy(merge_fn) is not merge_fn  # recognised while the internal is there
    _remove(monkeypatch, owner, name)
    megatron_core.concatenating_merge_code.cache_clear()  # decided once per process: decide again, without it
    try:
        assert megatron_core.merge_without_copy(merge_fn) is merge_fn
    finally:
        megatron_core.concatenating_merge_code.cache_clear()


def _async_save_where_megatrons_callbacks_changed(root: str) -> dict:
    """An async save through the in-rank strategy, megatron's ``_get_save_and_finalize_callbacks`` taking its
    writer under another name: the warnings it gave, and whether the save loads back."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from verl.utils.checkpoint.dist_writer import InRankSaveStrategy

    original = TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks

    def changed(self, storage_writer, *rest):
        return original(self, storage_writer, *rest)

    TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks = changed
    weight = torch.arange(16.0).reshape(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        request = dist_checkpointing.save(
            {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)},
            root,
            sharded_strategy=InRankSaveStrategy(),
            async_sharded_save=True,
            **megatron_core.async_save_options(),
        )
        request.async_fn(*megatron_core.preloaded_args(request), **request.async_fn_kwargs)
        for finalize in request.finalize_fns:
            finalize()
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=0)}, root)
    return {"warned": [str(w.message) for w in caught if megatron_core.SAVE_CALLBACKS.name in str(w.message)], "loaded": torch.equal(loaded["w"], weight)}


def test_an_async_save_is_megatrons_own_with_a_warning_where_its_callbacks_changed(tmp_path):
    """Telling every rank of a failed ``.metadata`` write needs megatron's writer where its request is made:
    where that method changed, the save is megatron's as it is, and says what it lacks."""
    report = run_on_ranks(_async_save_where_megatrons_callbacks_changed, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert report["loaded"] and len(report["warned"]) == 1, report
    assert "fails on the coordinator fails there alone" in report["warned"][0] and CONTRACT_TEST in report["warned"][0]


def test_the_shard_overlap_check_stays_torchs_where_it_changed(monkeypatch):
    """``check_grid_shards_directly`` is a speed-up with torch's own check beside it: without it where it lives,
    nothing is installed in the modules that call it, and nothing fails."""
    callers = [importlib.import_module(module) for module in torch_internals.SHARD_OVERLAP_CALLERS]
    before = [vars(module)[_module_and_name(torch_internals.SHARD_OVERLAP_CHECK)[1]] for module in callers]
    _, name = _installed_without(monkeypatch, torch_internals.SHARD_OVERLAP_CHECK, torch_internals.check_grid_shards_directly)
    assert [vars(module)[name] for module in callers] == before


def test_another_request_layout_fails_reading_it_naming_the_writer():
    request = megatron_core.async_request(lambda buckets, queue, rank: None, (0, [], None), [])
    _fails_naming(megatron_core.WRITER_WRITE, megatron_core.write_buckets, request)
    _fails_naming(megatron_core.WRITER_WRITE, megatron_core.results_queue, request)


def test_async_save_asks_for_the_builtin_writer_where_the_release_offers_others(monkeypatch):
    from megatron.core import dist_checkpointing

    offers_others = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters  # 0.18, not 0.16.1
    assert megatron_core.async_save_options() == ({"async_strategy": "mcore"} if offers_others else {})
    real_save = dist_checkpointing.save

    def save_with_strategies(sharded_state_dict, checkpoint_dir, *args, async_strategy="nvrx", **kwargs):
        return real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)  # 0.18's signature, for the check

    monkeypatch.setattr(dist_checkpointing, "save", save_with_strategies)
    assert megatron_core.async_save_options() == {"async_strategy": "mcore"}


def _snapshot_fallbacks(root: str) -> dict:
    """On a rank: a strategy whose plan is reusable (two saves), then with each internal the snapshot save
    reads removed in turn, whether it still counts as reusable and what the warning named."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    for index in range(2):
        path = os.path.join(root, f"save{index}")
        os.makedirs(path)
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + index, replica_id=0)}
        request = dist_checkpointing.save(
            state, path, sharded_strategy=strategy, async_sharded_save=True, **megatron_core.async_save_options()
        )
        request.execute_sync()
    report = {"reusable": megatron_core.save_plan_is_reusable(strategy)}
    removal = pytest.MonkeyPatch()
    snapshot_reads = (
        *megatron_core.PLAN_CACHE,
        megatron_core.WRITER_WRITE,
        megatron_core.WRITER_FINISH,
        megatron_core.CHECKPOINTING_CONFIG,
        megatron_core.SAVE_CONFIG,
    )
    for internal in snapshot_reads:
        in_strategy = internal in megatron_core.PLAN_CACHE
        owner, name = (strategy, internal.path.rsplit(".", 1)[1]) if in_strategy else _module_and_name(internal)
        _remove(removal, owner, name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reusable = megatron_core.save_plan_is_reusable(strategy)
        removal.undo()
        report[internal.name] = (reusable, [str(w.message) for w in caught if CONTRACT_TEST in str(w.message)])
    report["reusable_after"] = megatron_core.save_plan_is_reusable(strategy)
    return report


def test_snapshot_save_falls_back_to_the_background_write_when_what_it_reads_is_gone(tmp_path):
    report = run_on_ranks(_snapshot_fallbacks, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert report.pop("reusable") and report.pop("reusable_after")
    assert len(report) == len(megatron_core.PLAN_CACHE) + 4
    for name, (reusable, messages) in report.items():
        assert not reusable, name
        assert len(messages) == 1 and name in messages[0] and "snapshot save is off" in messages[0]


def _build_without_encoder_and_decoder() -> dict:
    from megatron.core.transformer.enums import ModelType

    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.models.tiny import tiny_hf_config

    if hasattr(ModelType, "encoder_and_decoder"):  # megatron-core <= 0.17: removed as 0.18 removed it
        delattr(ModelType, "encoder_and_decoder")
    model = build_megatron_model(make_bridge(tiny_hf_config("moe", num_layers=2), dtype=torch.float32), wrap_with_ddp=False)
    return {
        "chunks": len(model),
        "model_type": model[0].model_type.name,
        "equal_to_a_member": any(member == ModelType.encoder_and_decoder for member in ModelType),
    }


def test_model_build_runs_on_a_megatron_core_without_encoder_and_decoder():
    # mbridge 0.15.1's get_model reads ModelType.encoder_and_decoder, which megatron-core 0.18 removed (upstream verl #6936)
    result = run_on_ranks(_build_without_encoder_and_decoder, 1, ParallelSizes())[0]
    assert result == {"chunks": 1, "model_type": "encoder_or_decoder", "equal_to_a_member": False}


def _bridge_class(model_type: str = "qwen3"):
    return mbridge_internals.bridge_class(model_type)


def test_mbridge_registry_gone_fails_making_a_bridge_naming_it(monkeypatch, tiny_dense_path):
    import mbridge.core.bridge

    from verl.models.mcore.mbridge import check_hf_config_supported, load_hf_config

    config = load_hf_config(tiny_dense_path)
    monkeypatch.delattr(mbridge.core.bridge, "_MODEL_REGISTRY")
    _fails_naming(mbridge_internals.MODEL_REGISTRY, check_hf_config_supported, config)
    _others_still_pass(mbridge_internals.MODEL_REGISTRY)


def test_mbridge_base_mlp_mapping_gone_fails_the_local_spec_bridge_naming_it(monkeypatch):
    from mbridge.core.bridge import Bridge

    cls = _bridge_class("qwen3_moe")
    monkeypatch.delattr(Bridge, "_MLP_MAPPING")
    _fails_naming(mbridge_internals.MLP_MAPPING, mbridge_internals.mlp_mapping_with_dense_layers, cls)
    _others_still_pass(mbridge_internals.MLP_MAPPING)


@pytest.mark.parametrize("hook", mbridge_internals.OVERRIDDEN_HOOKS, ids=lambda h: h.name)
def test_an_overridden_mbridge_hook_gone_fails_making_the_class_naming_it(monkeypatch, hook):
    cls = _bridge_class()
    _remove(monkeypatch, cls, hook.path.rsplit(".", 1)[1])
    with pytest.raises(InternalsChangedError) as failed:
        mbridge_internals.check_overridable(cls)
    assert hook.name in str(failed.value) and CONTRACT_TEST in str(failed.value)
    _others_still_pass(hook)


_CALLS = {  # method: the adapter function calling it, with placeholder arguments after the bridge
    "_weight_name_mapping_mcore_local_to_global": (mbridge_internals.local_to_global_names, None),
    "_weight_name_mapping_mcore_to_hf": (mbridge_internals.hf_names, "w"),
    "_get_hf_shared_weight_keys": (mbridge_internals.hf_shared_weight_keys,),
    "_weight_merge_across_tp": (mbridge_internals.merge_across_tp, "w", [], None),
    "_weight_split_across_tp": (mbridge_internals.split_across_tp, "w", None, None, 1),
    "_weight_to_hf_format": (mbridge_internals.to_hf_format, "w", None),
    "_weight_to_mcore_format": (mbridge_internals.to_mcore_format, "w", []),
    "_get_safetensor_io": (mbridge_internals.open_hf_weights, "unused"),
}


@pytest.mark.parametrize("name", list(_CALLS))
def test_an_mbridge_method_gone_fails_the_export_naming_it(monkeypatch, name):
    cls = _bridge_class()
    bridge = object.__new__(cls)  # never used: the check comes first
    _remove(monkeypatch, cls, name)
    feature, *args = _CALLS[name]
    _fails_naming(mbridge_internals.METHODS[name], feature, bridge, *args)
    _others_still_pass(mbridge_internals.METHODS[name])


# ------------------------------------------------------------------ the declared range and the tested points


def test_docs_state_the_tested_points_and_the_declared_range():
    """docs/cpu.md's stack table names, per package, setup.py's declared range and TESTED's points, dated."""
    tree = ast.parse((REPO / "setup.py").read_text())
    declared = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and node.targets[0].id == "DECLARED"
    )
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", (REPO / "requirements.txt").read_text(), re.MULTILINE))
    doc = (REPO / "docs" / "cpu.md").read_text()
    assert TESTED_ON in doc
    for package, points in TESTED.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {package} |"))
        assert f"`{declared[package]}`" in row and all(f"`{point}`" in row for point in points), row
        assert pins[package] in points, f"requirements.txt pins {package}=={pins[package]}, not a tested point"

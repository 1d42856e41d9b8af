"""The private megatron-core, mbridge and torch internals verl relies on, as the installed releases have them.

Each test names the adapter function (``verl/utils/internals``) whose internal it checks, so a version bump
that moves one fails here, saying what changed, instead of as a wrong checkpoint later.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.internals import InternalsChangedError, mbridge, megatron_core
from verl.utils.internals import torch as torch_internals
from verl.utils.megatron.parallel import ParallelSizes


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


# ------------------------------------------------------------------ the capability checks


@pytest.mark.parametrize("adapter", [torch_internals, megatron_core, mbridge], ids=lambda a: a.__name__)
def test_every_internal_an_adapter_checks_passes_its_check_on_the_installed_release(adapter):
    """What each adapter function checks where first used (``Internal``) holds here; the tests below say why."""
    failed = {}
    for internal in adapter.INTERNALS:
        try:
            internal.get()
        except InternalsChangedError as exc:
            failed[internal.name] = str(exc)
    assert not failed


# ------------------------------------------------------------------ torch


def test_torch_internals():
    assert isinstance(torch._dynamo.config.disable, bool)  # disable_dynamo
    assert _params(torch.distributed.distributed_c10d._get_default_store) == ()  # default_store_address
    assert _params(torch.cuda.memory._set_allocator_settings) == ("env",)  # set_allocator_expandable_segments
    # dcp_storage_info: the fields a background save's outcome file carries, by keyword and by position
    info = torch_internals.dcp_storage_info()("__0_0.distcp", 8, 16, None)
    assert (info.relative_path, info.offset, info.length, info.transform_descriptors) == ("__0_0.distcp", 8, 16, None)
    # storage_id: one identity for every view of a storage, kept when it is freed and reallocated (offload)
    tensor = torch.arange(8.0)
    key = torch_internals.storage_id(tensor)
    assert isinstance(key, int) and torch_internals.storage_id(tensor[2:4]) == key
    assert torch_internals.storage_id(torch.arange(8.0)) != key
    tensor.untyped_storage().resize_(0)
    tensor.untyped_storage().resize_(8 * tensor.element_size())
    assert torch_internals.storage_id(tensor) == key


def _grid(offsets: list[tuple[int, int]], sizes: tuple[int, int] = (2, 4)) -> list:
    from torch.distributed._shard.metadata import ShardMetadata

    return [ShardMetadata(list(offset), list(sizes), "rank:0/cpu") for offset in offsets]


def _sharded(offsets: list[tuple[int, int]], replica_id: int = 0, grid: tuple[int, int] = (3, 2)) -> list:
    from megatron.core.dist_checkpointing import ShardedTensor

    return [
        (rank, ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, row, grid[0]), (1, column, grid[1]), replica_id=replica_id))
        for rank, (row, column) in enumerate(offsets)
    ]


def test_shard_access_counted_at_once_is_megatrons_count_and_off_grid_cells_get_megatrons_own(monkeypatch):
    """count_shard_access_at_once: the same counts as megatron's (a gap, a duplicate, replicas left out); a cell
    off the grid goes to megatron's own, whose error stays."""
    from megatron.core.dist_checkpointing import validation

    original, calls = validation._compute_shards_access, []

    def counted(rank_sharding):
        calls.append(len(rank_sharding))
        return original(rank_sharding)

    monkeypatch.setattr(validation, "_compute_shards_access", counted)
    megatron_core.count_shard_access_at_once.cache_clear()
    try:
        megatron_core.count_shard_access_at_once()
        installed = validation._compute_shards_access
        megatron_core.count_shard_access_at_once()  # once per process: a second call keeps the first
        assert installed is validation._compute_shards_access and installed is not counted
        whole, gap_and_twice = [(r, c) for r in range(3) for c in range(2)], [(0, 0), (0, 0), (1, 1), (2, 0), (2, 1)]
        for shards in (_sharded(whole), _sharded(gap_and_twice), _sharded(whole) + _sharded(whole, replica_id=1)):
            assert torch.equal(installed(shards), original(shards))
        assert installed(_sharded(gap_and_twice)).tolist() == [[2, 0], [0, 1], [1, 1]]
        assert calls == []
        row_4_of_5 = _sharded([(4, 0)], grid=(5, 2))[0][1]  # off the first shard's grid of 3 rows
        with pytest.raises(IndexError):
            installed([*_sharded([(0, 0)]), (1, row_4_of_5)])
        assert calls == [2]
    finally:
        megatron_core.count_shard_access_at_once.cache_clear()


def test_grid_shards_skip_the_pairwise_check_and_any_other_list_gets_torchs_own(monkeypatch):
    """check_grid_shards_directly: distinct cells of one aligned grid pass without torch's check; duplicates
    (which overlap), and shards off the grid, go to torch's own, which refuses the overlap as before."""
    import importlib

    from torch.distributed._shard.sharding_spec import _internals

    original, calls = _internals.validate_non_overlapping_shards_metadata, []

    def counted(shards):
        calls.append(len(shards))
        return original(shards)

    callers = [importlib.import_module(name) for name in torch_internals.SHARD_OVERLAP_CALLERS]
    for module in (_internals, *callers):
        monkeypatch.setattr(module, "validate_non_overlapping_shards_metadata", counted)
    torch_internals.check_grid_shards_directly.cache_clear()
    try:
        torch_internals.check_grid_shards_directly()
        installed = {module.validate_non_overlapping_shards_metadata for module in callers}
        assert len(installed) == 1 and counted not in installed
        check = installed.pop()
        check(_grid([(0, 0), (0, 4), (2, 0), (2, 4), (4, 8)]))
        assert calls == []
        with pytest.raises(ValueError, match="overlap"):
            check(_grid([(0, 0), (2, 0), (0, 0)]))
        check(_grid([(0, 0), (0, 4)], (2, 3)))  # off the grid (4 is no multiple of 3), apart: torch's passes it
        with pytest.raises(ValueError, match="overlap"):
            check(_grid([(0, 0), (1, 0)]))  # off the grid and overlapping
        assert calls == [3, 2, 2]
    finally:
        torch_internals.check_grid_shards_directly.cache_clear()


def _default_store_address() -> tuple:
    return torch_internals.default_store_address(), (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def test_default_store_is_the_store_the_default_group_met_through():
    found, rendezvous = run_on_ranks(_default_store_address, 1)[0]
    assert found == rendezvous  # run_on_ranks meets through env://


# ------------------------------------------------------------------ megatron-core


def test_megatron_core_module_helpers_keep_their_parameters():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    expected = {  # adapter function: (internal, its parameters)
        "replace_cuda_rng_state/get": (mcore_random._get_cuda_rng_state, ("device", "clone", "graph_safe")),
        "replace_cuda_rng_state/set": (mcore_random._set_cuda_rng_state, ("new_state", "device", "graph_safe")),
        "first_dim_collectives/gather": (
            mappings._gather_along_first_dim,
            ("input_", "group", "output_split_sizes", "use_global_buffer"),
        ),
        "first_dim_collectives/reduce_scatter": (
            mappings._reduce_scatter_along_first_dim,
            ("input_", "group", "input_split_sizes", "use_global_buffer"),
        ),
        "replace_split_sizes_to_host/moe_utils": (
            moe_utils.maybe_move_tensor_to_cpu,
            ("tensor", "as_numpy", "record_stream"),
        ),
        "replace_split_sizes_to_host/token_dispatcher": (
            token_dispatcher.maybe_move_tensor_to_cpu,
            ("tensor", "as_numpy", "record_stream"),
        ),
        "init_distributed_optimizer_state": (DistributedOptimizer._init_optimizer_states_with_dummy_values, ("self",)),
    }
    changed = {name: _params(fn) for name, (fn, params) in expected.items() if _params(fn) != params}
    assert not changed, f"megatron-core changed internals verl replaces or calls: {changed}"
    assert "te_general_gemm" in inspect.getsource(moe_utils)  # define_missing_te_general_gemm: routing still reads it


def test_torch_dist_load_builds_its_reader_and_planner_from_the_swapped_globals(tmp_path):
    """torch_dist_load_reader_and_planner: megatron's load calls both by their module-global names, with the
    arguments the data-only factories take (0.18 adds ``async_strategy``), and the swap is undone on leaving."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from verl.utils.checkpoint.data_only import data_only_torch_dist_load

    load = torch_strategy.TorchDistLoadShardedStrategy.load
    assert {"_get_filesystem_reader", "MCoreLoadPlanner"} <= set(load.__code__.co_names)
    megatron_params = _params(torch_strategy._get_filesystem_reader)
    assert megatron_params[:2] == ("checkpoint_dir", "cache_metadata")
    with data_only_torch_dist_load(str(tmp_path)):
        data_only_params = _params(torch_strategy._get_filesystem_reader)
    assert set(megatron_params) <= set(data_only_params)  # every keyword megatron may pass is taken
    source = inspect.getsource(load)
    assert "_get_filesystem_reader(" in source and "cache_metadata=" in source and "planner=MCoreLoadPlanner(" in source
    original = torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner
    with megatron_core.torch_dist_load_reader_and_planner(len, dict):
        assert (torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner) == (len, dict)
    assert (torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner) == original


def test_a_one_rank_load_tells_torch_no_dist_through_the_module_megatron_calls(monkeypatch):
    """A one-rank swap passes ``no_dist`` through megatron's strategy module global ``checkpoint`` and puts the module
    back on leaving. (megatron-core 0.16.1's load calls ``checkpoint.load_state_dict`` there; 0.18's load reaches torch
    another way, where the swap changes nothing: the load keeps its collectives.)"""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    calls = []

    def load_state_dict(state_dict, storage_reader, process_group=None, coordinator_rank=0, no_dist=False, planner=None):
        calls.append(no_dist)

    monkeypatch.setattr(dcp, "load_state_dict", load_state_dict)
    with megatron_core.torch_dist_load_reader_and_planner(len, dict, one_rank=True):
        torch_strategy.checkpoint.load_state_dict({}, None, planner=None)
    with megatron_core.torch_dist_load_reader_and_planner(len, dict):
        torch_strategy.checkpoint.load_state_dict({}, None, planner=None)
    assert calls == [True, False]
    assert torch_strategy.checkpoint is dcp


def test_megatron_core_module_helpers_are_reached_through_their_module_only():
    """A replacement of a module attribute misses any megatron module that imported the name itself
    (a module with its own function of that name, e.g. Megatron-FSDP's RNG helpers, is not ours to patch)."""
    import megatron.core.models.gpt.gpt_model  # noqa: F401 - the model stack, as a rank imports it
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    owners = {  # name: the modules whose attribute verl replaces, the defining one first
        "_get_cuda_rng_state": (mcore_random,),
        "_set_cuda_rng_state": (mcore_random,),
        "_gather_along_first_dim": (mappings,),
        "_reduce_scatter_along_first_dim": (mappings,),
        "maybe_move_tensor_to_cpu": (moe_utils, token_dispatcher),
    }
    megatron_modules = [
        m for name, m in list(sys.modules.items()) if name.startswith("megatron.core") and m is not None
    ]
    holders = {
        name: sorted(
            m.__name__ for m in megatron_modules if m not in allowed and vars(m).get(name) is getattr(allowed[0], name)
        )
        for name, allowed in owners.items()
    }
    assert not any(holders.values()), (
        f"megatron-core modules holding their own reference (verl's CPU runtime would miss them): {holders}"
    )


def _param_maps() -> dict:
    import logging

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.optimizer import optimizer as megatron_optimizer

    formatted = []

    class Watched(torch.nn.Parameter):
        def __repr__(self) -> str:
            formatted.append(1)
            return "Watched()"

    tracked = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(3))]
    untracked = Watched(torch.ones(4))
    state = {
        "a": ShardedTensor.from_rank_offsets("a", tracked[0], replica_id=0),
        "nested": {"b": ShardedTensor.from_rank_offsets("b", tracked[1], replica_id=0)},
        # a factory (megatron's SwiGLU and expert weights) prints its data: a ShardedTensor's repr leaves it out
        "c": ShardedTensorFactory("c", untracked, build_fn=lambda *args: {}, merge_fn=lambda sub_state: sub_state),
    }
    original = megatron_core.PARAM_ID_MAP.get()
    expected = original(state, iter(tracked))
    formatted_by_megatron = len(formatted)
    megatron_core.map_only_tracked_params()
    replaced = megatron_optimizer.get_param_id_to_sharded_param_map
    megatron_core.map_only_tracked_params()  # once per process: a second call keeps the first
    installed_once = megatron_optimizer.get_param_id_to_sharded_param_map is replaced
    mapped = replaced(state, iter(tracked))
    formatted_after = len(formatted) - formatted_by_megatron
    logging.getLogger("megatron.core.dist_checkpointing.optimizer").setLevel(logging.DEBUG)
    replaced(state, iter(tracked))
    return {
        "same_map": {k: id(v) for k, v in mapped.items()} == {k: id(v) for k, v in expected.items()},
        "keys": sorted(v.key for v in mapped.values()),
        "megatron_formats_the_untracked": formatted_by_megatron,
        "formatted_after": formatted_after,
        "installed": replaced is not original and installed_once,
        "debug_keeps_megatron_s_own": len(formatted) - formatted_by_megatron - formatted_after,
    }


def test_the_optimizer_param_map_is_megatron_s_own_without_formatting_untracked_tensors():
    """map_only_tracked_params: megatron formats every model tensor an optimizer does not track into a debug
    message, values included, with debug logging off; the replacement gives the same map and formats none,
    and with megatron's logger at debug level megatron's own runs (its debug line kept)."""
    maps = run_on_ranks(_param_maps, 1, ParallelSizes(), timeout_s=120)[0]
    assert maps == {
        "same_map": True,
        "keys": ["a", "b"],
        "megatron_formats_the_untracked": 1,
        "formatted_after": 0,
        "installed": True,
        "debug_keeps_megatron_s_own": 1,
    }


def test_the_gated_mlp_merge_joins_halves_left_side_by_side_as_a_view_and_copies_others():
    """merge_without_copy: megatron's swiglu factory merges its halves with ``torch.cat``; halves a load left
    side by side in the factory's buffer come back as a view of it, with the same values; halves held
    elsewhere, and any other factory's merge, go to megatron's own."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    buffer = torch.arange(24, dtype=torch.float32).view(6, 4)
    factory = apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", buffer, replica_id=0), ())
    merge = megatron_core.merge_without_copy(factory.merge_fn)
    halves = [piece.data for piece in factory.build()]
    joined = merge(halves)
    assert torch.equal(joined, torch.cat(halves)) and joined.data_ptr() == buffer.data_ptr() and joined.is_contiguous()
    copies = [half.clone() for half in halves]
    merged = merge(copies)
    assert torch.equal(merged, buffer) and merged.data_ptr() not in (buffer.data_ptr(), copies[0].data_ptr())
    assert merge(halves[::-1]).data_ptr() != buffer.data_ptr()  # out of order: megatron's cat
    other = lambda pieces: pieces[0]  # noqa: E731 - a merge of another kind
    assert megatron_core.merge_without_copy(other) is other


def test_async_request_argument_positions():
    """write_buckets / results_queue / preloaded_args: torch_dist's async_fn_args are [rank, write_buckets, results_queue],
    the tail of the writer's parameters after the two get_save_function_and_args binds (the writer is
    write_preloaded_data_multiproc up to 0.17, write_preloaded_data_multithread in 0.18)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    writer = megatron_core.WRITER_WRITE.path.rsplit(".", 1)[1]
    params = _params(getattr(FileSystemWriterAsync, writer))
    assert params == ("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue")
    bound = 2  # transform_list, use_msc
    assert params[bound + megatron_core.WRITE_BUCKETS_ARG] == "write_buckets"
    assert params[bound + megatron_core.RESULTS_QUEUE_ARG] == "global_results_queue"
    source = inspect.getsource(FileSystemWriterAsync.get_save_function_and_args)
    assert f"partial(self.{writer}, transform_list, self.use_msc)" in source
    assert "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]" in source
    assert _params(FileSystemWriterAsync.finish) == ("self", "metadata", "results")  # write_checkpoint_metadata


def test_an_async_save_hands_its_writer_to_the_callbacks_that_make_its_request():
    """dist_writer's override of ``_get_save_and_finalize_callbacks`` (``SAVE_CALLBACKS``) keeps the writer's
    ``.metadata`` failure: megatron's async save must pass it the writer whose ``finish`` its finalize calls,
    and return that method's request."""
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_finalize
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    source = inspect.getsource(TorchDistSaveShardedStrategy.async_save)
    assert "return self._get_save_and_finalize_callbacks(writer, save_state_dict_ret" in source
    assert "storage_writer.finish(global_metadata, all_results)" in inspect.getsource(save_state_dict_async_finalize)


def test_save_strategy_plan_cache_attributes():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    for name in ("validated_cache_reuse", "cached_central_plan", "cached_global_metadata", "backend", "version"):
        assert hasattr(strategy, name), (
            f"TorchDistSaveShardedStrategy has no {name} (save_plan_is_reusable / write_checkpoint_metadata)"
        )
    assert not megatron_core.save_plan_is_reusable(strategy) and not megatron_core.save_plan_is_reusable(None)


def _three_async_saves(root: str) -> dict:
    """Three async saves with one strategy: two finalized by megatron, the third (its plan then reusable)
    written and finalized through the adapter as the snapshot save does; each loaded back."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    report: dict = {"reusable_before": [], "loaded": []}
    for index in range(3):
        path = os.path.join(root, f"save{index}")
        os.makedirs(path)
        report["reusable_before"].append(megatron_core.save_plan_is_reusable(strategy))
        weight = torch.arange(16.0).reshape(4, 4) + index
        state = {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}
        request = dist_checkpointing.save(
            state, path, sharded_strategy=strategy, async_sharded_save=True, **megatron_core.async_save_options()
        )
        request.async_fn(*megatron_core.preloaded_args(request), **request.async_fn_kwargs)
        if index < 2:
            for finalize in request.finalize_fns:
                finalize()
        else:
            buckets = megatron_core.write_buckets(request)
            results = megatron_core.results_queue(request).get()
            report["buckets"] = isinstance(buckets, list) and all(len(bucket) == 3 for bucket in buckets)
            report["one_result_per_bucket"] = isinstance(results, dict) and len(results) == len(buckets)
            megatron_core.write_checkpoint_metadata(strategy, path, [[r for rs in results.values() for r in rs]])
        loaded = dist_checkpointing.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=0)}, path
        )
        report["loaded"].append(torch.equal(loaded["w"], weight))
    return report


def test_a_real_async_save_through_the_adapter(tmp_path):
    report = run_on_ranks(_three_async_saves, 1, ParallelSizes(), args=(str(tmp_path),))[0]
    assert report == {
        "reusable_before": [False, False, True],  # the snapshot save's condition: from the third save on
        "buckets": True,
        "one_result_per_bucket": True,
        "loaded": [True, True, True],
    }


# ------------------------------------------------------------------ mbridge


def test_mbridge_private_methods_keep_their_parameters():
    from verl.models.support import SUPPORTED_MODEL_TYPES

    expected = {  # internal: its parameters (adapter function in the comment)
        "_weight_name_mapping_mcore_local_to_global": ("self", "model", "consider_ep"),  # local_to_global_names
        "_weight_name_mapping_mcore_to_hf": ("self", "mcore_weights_name"),  # hf_names
        "_get_hf_shared_weight_keys": ("self",),  # hf_shared_weight_keys
        "_weight_merge_across_tp": ("self", "mcore_weights_name", "mcore_weights", "param"),  # merge_across_tp
        "_weight_split_across_tp": (
            "self",
            "mcore_weights_name",
            "mcore_weights",
            "param",
            "tp_split_size",
        ),  # split_across_tp
        "_weight_to_hf_format": ("self", "mcore_weights_name", "mcore_weights"),  # to_hf_format
        "_weight_to_mcore_format": ("self", "mcore_weights_name", "hf_weights"),  # to_mcore_format
        "_get_safetensor_io": ("self", "weights_path"),  # open_hf_weights
    }
    for model_type in SUPPORTED_MODEL_TYPES:
        cls = mbridge.bridge_class(model_type)
        assert cls is not None, f"mbridge has no bridge for {model_type}"
        mbridge.check_overridable(cls)
        changed = {name: _params(getattr(cls, name, None) or (lambda: None)) for name, params in expected.items()}
        changed = {name: found for name, found in changed.items() if found != expected[name]}
        assert not changed, f"mbridge's {cls.__name__} changed: {changed}"
    assert mbridge.bridge_class("no_such_model") is None


def test_mbridge_mlp_mapping_gains_the_dense_layer_names():
    # mlp_mapping_with_dense_layers reads the class attribute _MLP_MAPPING (keyword -> HF name templates)
    qwen3_moe = mbridge.mlp_mapping_with_dense_layers(mbridge.bridge_class("qwen3_moe"))
    assert qwen3_moe["mlp.linear_fc2.weight"] == ["model.layers.{layer_number}.mlp.down_proj.weight"]
    assert qwen3_moe["mlp.router.weight"] == ["model.layers.{layer_number}.mlp.gate.weight"]
    llama = mbridge.bridge_class("llama")
    assert mbridge.mlp_mapping_with_dense_layers(llama) == dict(llama._MLP_MAPPING)


def test_mbridge_hooks_are_checked_when_a_bridge_class_is_made():
    with pytest.raises(InternalsChangedError, match="_get_transformer_layer_spec"):
        mbridge.check_overridable(
            type("NoHooks", (), {"_build_base_config": lambda self, text_config_key=None, **kwargs: None})
        )
    from mbridge.core.llm_bridge import LLMBridge

    # our _get_transformer_layer_spec sets has_vp_stage, which mbridge's model building reads
    assert "if vp_stage is not None and self.has_vp_stage" in inspect.getsource(LLMBridge)


def _conversions_round_trip(hf_path: str) -> dict:
    from verl.models.mcore.mbridge import load_hf_config, make_bridge
    from verl.models.mcore.model import build_megatron_model

    bridge = make_bridge(load_hf_config(hf_path), dtype=torch.float32)
    model = build_megatron_model(bridge, wrap_with_ddp=False)
    bridge.load_weights(model, hf_path)
    names = mbridge.local_to_global_names(bridge, model[0])
    local, global_name = next((k, v) for k, v in names.items() if "linear_qkv.weight" in v)
    param = dict(model[0].named_parameters())[local]
    hf = mbridge.hf_names(bridge, global_name)
    reader = mbridge.open_hf_weights(bridge, hf_path)
    hf_weights = reader.load_some_hf_weight(hf)
    full = mbridge.to_mcore_format(bridge, global_name, [hf_weights[n] for n in hf])
    pieces = mbridge.split_across_tp(bridge, global_name, full, param, 1)
    merged = mbridge.merge_across_tp(bridge, global_name, pieces, param)
    out_names, out = mbridge.to_hf_format(bridge, global_name, merged)
    return {
        "qkv_names": hf,
        "param_is_the_piece": torch.equal(pieces[0], param.detach()),
        "round_trip": out_names == hf
        and all(torch.equal(t, hf_weights[n]) for n, t in zip(out_names, out, strict=True)),
        "shared": mbridge.hf_shared_weight_keys(bridge),
    }


def test_mbridge_conversions_round_trip_on_a_real_bridge(tiny_dense_path):
    result = run_on_ranks(_conversions_round_trip, 1, ParallelSizes(), args=(tiny_dense_path,))[0]
    assert [name.rsplit(".", 2)[-2] for name in result["qkv_names"]] == ["q_proj", "k_proj", "v_proj"]
    assert result["param_is_the_piece"] and result["round_trip"]
    assert isinstance(result["shared"], list)

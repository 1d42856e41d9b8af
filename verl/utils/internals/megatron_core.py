"""The private megatron-core internals this package touches, for megatron-core 0.16.1 only (``require_version``).

Three groups: the dist-checkpoint save plan cache and async request layout (the snapshot save plans and
writes in a forked process) and the load strategy's reader and planner (a load reads data only), the distributed optimizer's state initialiser (a load into an optimizer that
never stepped), and the module-level helpers the CPU runtime replaces. Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from verl.utils.internals import require_version

WRITTEN_FOR = "0.16.1"
require_version("megatron-core", WRITTEN_FOR, __name__)

# FileSystemWriterAsync.get_save_function_and_args: async_fn_args = [rank, write_buckets, results_queue]
WRITE_BUCKETS_ARG = 1
RESULTS_QUEUE_ARG = 2


# ---------------------------------------------------------------- dist checkpointing


def save_plan_is_reusable(strategy: TorchDistSaveShardedStrategy | None) -> bool:
    """Whether ``strategy`` plans its next save with no collective: ``validated_cache_reuse`` (the central
    plan was the same on two saves) and ``cached_central_plan``, set by ``cached_metadata=True``. Only then
    can a forked process, which has no process group of the rank, plan alone."""
    return strategy is not None and bool(strategy.validated_cache_reuse) and strategy.cached_central_plan is not None


def write_buckets(request: AsyncRequest) -> list:
    """The write buckets (one per writer process) in a torch_dist request's ``async_fn_args``, by position."""
    return request.async_fn_args[WRITE_BUCKETS_ARG]


def results_queue(request: AsyncRequest) -> Any:
    """The queue a torch_dist request's writers report their write results to (``async_fn_args``, by position)."""
    return request.async_fn_args[RESULTS_QUEUE_ARG]


def preloaded_args(request: AsyncRequest) -> tuple:
    """``async_fn_args`` with the write buckets replaced by ``preload_fn()`` (device -> host copies), as
    megatron's own ``AsyncRequest.execute_sync`` does, for a caller that runs several requests in one process."""
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[WRITE_BUCKETS_ARG] = request.preload_fn()
    return tuple(args)


def write_checkpoint_metadata(strategy: TorchDistSaveShardedStrategy, path: str, all_results: list[list]) -> None:
    """Rank 0: ``.metadata`` from the strategy's ``cached_global_metadata`` (the plan's global metadata) and
    every rank's write results, then ``metadata.json`` from its ``backend`` / ``version``: what megatron's
    finalize does after a gather over the default group, which a forked save's parent does instead."""
    FileSystemWriterAsync(path).finish(strategy.cached_global_metadata, all_results)
    save_config(CheckpointingConfig(strategy.backend, strategy.version), path)


@contextlib.contextmanager
def torch_dist_load_reader_and_planner(reader: Callable[..., Any], planner: Callable[..., Any]) -> Iterator[None]:
    """While inside: ``TorchDistLoadShardedStrategy`` reads through ``reader(checkpoint_dir, cache_metadata=...)``
    and plans with ``planner(**kwargs)`` instead of its module globals ``_get_filesystem_reader`` and
    ``MCoreLoadPlanner`` (strategies/torch.py), which its ``load`` calls by name: the strategy takes no
    reader or planner, and torch's (a plain ``pickle.load`` of ``.metadata``, ``torch.load(weights_only=False)``
    of bytes items) would run code from the checkpoint. Main thread only: the swap is module-wide."""
    saved = torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner
    torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner = reader, planner
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader, torch_strategy.MCoreLoadPlanner = saved


# ---------------------------------------------------------------- optimizer


def init_distributed_optimizer_state(optimizer: DistributedOptimizer) -> None:
    """``DistributedOptimizer._init_optimizer_states_with_dummy_values``: creates the Adam state its
    ``load_state_dict`` reads, which an optimizer that never stepped lacks (megatron calls it itself only on
    its Megatron-FSDP load path)."""
    optimizer._init_optimizer_states_with_dummy_values()


# ---------------------------------------------------------------- the CPU runtime's replacements


def replace_cuda_rng_state(get_state: Callable[[], torch.Tensor], set_state: Callable[[torch.Tensor], None]) -> None:
    """``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the RNG tracker forks and
    restores the CUDA generator through these module-level helpers, which patching ``torch.cuda`` misses."""
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: get_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: set_state(new_state)


def first_dim_collectives() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``tensor_parallel.mappings._gather_along_first_dim`` and ``_reduce_scatter_along_first_dim`` as
    installed now: the MoE dispatcher's (possibly uneven) gather and reduce-scatter over a TP group."""
    return mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim


def replace_first_dim_collectives(
    gather: Callable[..., torch.Tensor], reduce_scatter: Callable[..., torch.Tensor]
) -> None:
    """Install replacements for the two ``first_dim_collectives`` (same parameters); the dispatcher calls
    them through the module, so the module attribute is the only place to reach them."""
    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def replace_split_sizes_to_host(move: Callable[..., Any]) -> None:
    """``maybe_move_tensor_to_cpu`` as ``moe_utils`` and ``token_dispatcher`` (which imported it by name)
    see it: the alltoall dispatcher moves its split sizes to host numpy arrays only when they are CUDA tensors."""
    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move


def define_missing_te_general_gemm() -> None:
    """megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` undefined without TransformerEngine, and
    routing reads it (NameError); None makes routing take its torch path (``if te_general_gemm is not None``)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

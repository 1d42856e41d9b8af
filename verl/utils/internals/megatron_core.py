"""The private megatron-core internals this package touches, each checked where first used (``Internal``).

Four groups: the dist-checkpoint save plan cache and async request layout (the background write and the
snapshot save, which plans and writes in a forked process), the load strategy's reader and planner (a load
reads data only), the distributed optimizer's state initialiser
(a load into an optimizer that never stepped), and the module-level helpers the CPU runtime replaces.
megatron is imported only inside the functions, so a moved module fails the feature that needs it, not
the import of verl. Where megatron-core releases differ (0.18: ``dist_checkpointing.save``'s
``async_strategy``, upstream verl #8000), the function takes whichever exists; mbridge's reading of
``ModelType.encoder_and_decoder``, gone in 0.18, is answered in ``verl.utils.internals.mbridge``. Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from verl.utils.internals import Internal, InternalsChangedError, warn_if_untested

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

warn_if_untested("megatron-core")

MC = "megatron-core"
_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FS_ASYNC}:FileSystemWriterAsync"
_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy"
_BACKGROUND = "checkpoint.async_save (the background write and the snapshot save)"
_SNAPSHOT = "the snapshot save"
_CPU = "the CPU runtime"

# FileSystemWriterAsync.get_save_function_and_args: async_fn_args = [rank, write_buckets, results_queue]
WRITE_BUCKETS_ARG = 1
RESULTS_QUEUE_ARG = 2

ASYNC_CALLS_QUEUE = Internal(MC, f"{_ASYNC}:AsyncCallsQueue", _BACKGROUND, params=("persistent",), exact=False)
ASYNC_REQUEST = Internal(
    MC, f"{_ASYNC}:AsyncRequest", _BACKGROUND, params=("async_fn", "async_fn_args", "finalize_fns"), exact=False
)


def _imported(module_name: str) -> Any:
    """The module, or None where it cannot be imported (its internals' checks then fail naming them)."""
    try:
        return importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - any failure to import it is a changed internal, named where it is read
        return None


def _as_installed(module_name: str, owner: str | None, names: tuple[str, ...]) -> str:
    """The first of ``names`` that the installed module (or its class ``owner``) has, else the first: for an
    internal megatron-core renamed between releases. A module that cannot be imported leaves the first name,
    whose check then fails naming it (so verl still imports; the module is imported by verl's callers anyway)."""
    try:
        found: Any = importlib.import_module(module_name)
        found = getattr(found, owner) if owner else found
    except (ImportError, AttributeError):
        return names[0]
    return next((name for name in names if hasattr(found, name)), names[0])


# The writer the request's async_fn runs: up to 0.17 it forks one writer process per bucket
# (``write_preloaded_data_multiproc``); 0.18 writes each bucket in a thread (``write_preloaded_data_multithread``).
# Both take the same parameters; the one installed is the one read and wrapped.
WRITER_WRITE = Internal(
    MC,
    f"{_WRITER}."
    + _as_installed(_FS_ASYNC, "FileSystemWriterAsync", ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")),
    f"{_BACKGROUND}: async_fn_args by position",
    params=("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
)
WRITER_FINISH = Internal(MC, f"{_WRITER}.finish", f"{_SNAPSHOT}'s .metadata", params=("self", "metadata", "results"))
CHECKPOINTING_CONFIG = Internal(
    MC,
    "megatron.core.dist_checkpointing.core:CheckpointingConfig",
    f"{_SNAPSHOT}'s metadata.json",
    params=("sharded_backend", "sharded_backend_version"),
    exact=False,
)
SAVE_CONFIG = Internal(
    MC,
    "megatron.core.dist_checkpointing.core:save_config",
    f"{_SNAPSHOT}'s metadata.json",
    params=("config", "checkpoint_dir"),
)
# Up to 0.17 ``_get_write_results_queue()``; 0.18 ``get_write_results_queue(mp_mode="spawn")``.
_RESULTS_QUEUE_NAME = _as_installed(_FS_ASYNC, None, ("_get_write_results_queue", "get_write_results_queue"))
WRITE_RESULTS_QUEUE = Internal(
    MC,
    f"{_FS_ASYNC}:{_RESULTS_QUEUE_NAME}",
    "a dist-checkpoint save's writers dying with their rank",
    params=() if _RESULTS_QUEUE_NAME.startswith("_") else ("mp_mode",),
)
# Set on each strategy by its constructor (``cached_metadata=True``): read from the instance.
PLAN_CACHE = tuple(
    Internal(MC, f"{_STRATEGY}.{name}", _SNAPSHOT)
    for name in ("validated_cache_reuse", "cached_central_plan", "cached_global_metadata", "backend", "version")
)
# The sync save's in-rank writer (verl/utils/checkpoint/dist_writer.py): megatron's torch_dist planning, driven
# with a writer of the rank's threads instead of the strategy's hard-coded forked one.
_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
_SAVER = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
_IN_RANK = "the sync dist-checkpoint save's in-rank writer"
IN_RANK_SAVE = (
    REPLACE_KEYS := Internal(
        MC, f"{_TORCH}:_replace_state_dict_keys_with_sharded_keys", _IN_RANK, params=("sharded_state_dict", "keep_only_main_replica")
    ),
    TO_PYT_STATE_DICT := Internal(MC, f"{_TORCH}:mcore_to_pyt_state_dict", _IN_RANK, params=("state_dict", "is_loading"), exact=False),
    SAVE_PLANNER := Internal(MC, f"{_TORCH}:MCoreSavePlanner", _IN_RANK),
    PLAN_SAVE := Internal(
        MC,
        f"{_SAVER}:save_state_dict_async_plan",
        _IN_RANK,
        params=("state_dict", "storage_writer", "process_group", "coordinator_rank", "planner", "cached_ckpt_structure"),
        exact=False,
    ),
)
# megatron's async save hands its writer to this method, which makes the request whose finalize writes the
# coordinator's ``.metadata``: dist_writer's strategy overrides it so that a failed write there fails every rank.
SAVE_CALLBACKS = Internal(
    MC,
    f"{_TORCH}:TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks",
    "every rank told of an async save's failed .metadata write",
    params=("self", "writer", "save_state_dict_ret"),
    exact=False,
)
# megatron's save writes two files on rank 0 alone, through two names of its module that it looks up per call:
# common.pt before the sharded strategy's first collective, metadata.json (``save_config``) before a barrier.
# Up to 0.17 common.pt comes from the strategy ``get_default_save_common_strategy()`` returns (its
# ``save_common``); 0.18 calls the function ``save_common`` itself. dist_writer's strategy takes both over for a
# save, so that a failed write there fails every rank in the save's own agreements instead of leaving the peers in
# a collective.
_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
_RANK_ZERO_FILES = "every rank told of a failed common.pt or metadata.json write"
METADATA_FINALIZE = "metadata_finalize_fn"  # the name of the function megatron's save ends an async finalize with
SAVE_FINALIZE = Internal(MC, f"{_SERIALIZATION}:save", _RANK_ZERO_FILES)  # its maker
_COMMON_NAME = _as_installed(_SERIALIZATION, None, ("save_common", "get_default_save_common_strategy"))
_COMMON_BY_STRATEGY = _COMMON_NAME == "get_default_save_common_strategy"
RANK_ZERO_FILES = (
    SAVE_COMMON := Internal(
        MC,
        f"{_SERIALIZATION}:{_COMMON_NAME}",
        _RANK_ZERO_FILES,
        params=("backend", "version") if _COMMON_BY_STRATEGY else ("common_state_dict", "checkpoint_dir"),
    ),
    SERIALIZATION_SAVE_CONFIG := Internal(MC, f"{_SERIALIZATION}:save_config", _RANK_ZERO_FILES, params=("config", "checkpoint_dir")),
    *(
        (Internal(MC, "megatron.core.dist_checkpointing.strategies.base:SaveCommonStrategy", _RANK_ZERO_FILES),)
        if _COMMON_BY_STRATEGY
        else ()
    ),
)
# Set on each strategy by its constructor: read from the instance, like PLAN_CACHE.
STRATEGY_SETTINGS = tuple(
    Internal(MC, f"{_STRATEGY}.{name}", _IN_RANK) for name in ("keep_only_main_replica", "cached_local_plan")
)
_LOAD = "a dist checkpoint's load, read as data only"
LOAD_READER = Internal(
    MC, "megatron.core.dist_checkpointing.strategies.torch:_get_filesystem_reader", _LOAD, params=("checkpoint_dir",), exact=False
)
LOAD_PLANNER = Internal(MC, "megatron.core.dist_checkpointing.strategies.torch:MCoreLoadPlanner", _LOAD)
# torch's dist-checkpoint module as megatron's load strategy holds it (``from torch.distributed import checkpoint``)
# and the call its ``load`` makes through it; one rank's load is told ``no_dist`` (``torch_dist_load_reader_and_planner``)
LOAD_STATE_DICT = Internal(
    MC,
    "megatron.core.dist_checkpointing.strategies.torch:checkpoint.load_state_dict",
    "a one-rank dist-checkpoint load without collectives",
    params=("state_dict", "storage_reader", "process_group", "coordinator_rank", "no_dist", "planner"),
)
# The gated MLP's merge of linear_fc1's two halves, a torch.cat along dim 0: from 0.18 megatron's shared
# ``cat_with_oom_fallback``; before it, a function nested in ``apply_swiglu_sharded_factory``, recognised by its code.
_CAT_MERGE_UTILS = "megatron.core.transformer.utils"
CAT_MERGE = Internal(
    MC,
    f"{_CAT_MERGE_UTILS}:cat_with_oom_fallback"
    if hasattr(_imported(_CAT_MERGE_UTILS), "cat_with_oom_fallback")
    else "megatron.core.transformer.mlp:apply_swiglu_sharded_factory",
    "a load's merge of gated-MLP halves without a copy",
)
DUMMY_OPTIMIZER_STATE = Internal(
    MC,
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values",
    "a load into a distributed optimizer that never stepped",
    params=("self",),
)
# megatron's optimizers call it by the name optimizer.py imported (``ChainedOptimizer`` once per optimizer it chains)
PARAM_ID_MAP = Internal(
    MC,
    "megatron.core.optimizer.optimizer:get_param_id_to_sharded_param_map",
    "an optimizer's sharded state dict without formatting the tensors it does not track",
    params=("model_sharded_state_dict", "optim_params_iter"),
)
# megatron's sharding check of a save and a load (rank 0): each grid cell's count of main replicas
SHARD_ACCESS_COUNT = Internal(
    MC,
    "megatron.core.dist_checkpointing.validation:_compute_shards_access",
    "the sharding check of a dist checkpoint's save and load, counted in one pass",
    params=("rank_sharding",),
)
_RANDOM = "megatron.core.tensor_parallel.random"
GET_CUDA_RNG_STATE = Internal(MC, f"{_RANDOM}:_get_cuda_rng_state", _CPU, params=("device", "clone", "graph_safe"))
SET_CUDA_RNG_STATE = Internal(MC, f"{_RANDOM}:_set_cuda_rng_state", _CPU, params=("new_state", "device", "graph_safe"))
_MAPPINGS = "megatron.core.tensor_parallel.mappings"
GATHER_FIRST_DIM = Internal(
    MC,
    f"{_MAPPINGS}:_gather_along_first_dim",
    _CPU,
    params=("input_", "group", "output_split_sizes", "use_global_buffer"),
)
REDUCE_SCATTER_FIRST_DIM = Internal(
    MC,
    f"{_MAPPINGS}:_reduce_scatter_along_first_dim",
    _CPU,
    params=("input_", "group", "input_split_sizes", "use_global_buffer"),
)
SPLIT_SIZES_TO_HOST = tuple(
    Internal(
        MC,
        f"megatron.core.transformer.moe.{module}:maybe_move_tensor_to_cpu",
        _CPU,
        params=("tensor", "as_numpy", "record_stream"),
    )
    for module in ("moe_utils", "token_dispatcher")
)
INTERNALS = (
    ASYNC_CALLS_QUEUE,
    ASYNC_REQUEST,
    WRITER_WRITE,
    WRITER_FINISH,
    CHECKPOINTING_CONFIG,
    SAVE_CONFIG,
    WRITE_RESULTS_QUEUE,
    LOAD_READER,
    LOAD_PLANNER,
    LOAD_STATE_DICT,
    CAT_MERGE,
    SAVE_CALLBACKS,
    *RANK_ZERO_FILES,
    DUMMY_OPTIMIZER_STATE,
    PARAM_ID_MAP,
    SHARD_ACCESS_COUNT,
    GET_CUDA_RNG_STATE,
    SET_CUDA_RNG_STATE,
    GATHER_FIRST_DIM,
    REDUCE_SCATTER_FIRST_DIM,
    *SPLIT_SIZES_TO_HOST,
    *IN_RANK_SAVE,
)  # those read from a module; PLAN_CACHE and STRATEGY_SETTINGS are read from a strategy


def _setattr(internal: Internal, value: Any) -> None:
    """Replace a module-level internal (already checked) by ``value``."""
    module_name, _, name = internal.path.partition(":")
    setattr(importlib.import_module(module_name), name, value)


# ---------------------------------------------------------------- dist checkpointing


_CALLS_QUEUES: weakref.WeakSet = weakref.WeakSet()  # every manager's queue in this process (drain_write_results)


def async_calls_queue() -> AsyncCallsQueue:
    """A non-persistent ``AsyncCallsQueue`` (each request forks its writer), made at a manager's first async save."""
    made = ASYNC_CALLS_QUEUE.get()(persistent=False)
    _CALLS_QUEUES.add(made)
    return made


def async_calls_pending() -> bool:
    """Whether any manager's queue in this process has a call not finalized yet (its fork may still write)."""
    return any(calls.get_num_unfinalized_calls() for calls in list(_CALLS_QUEUES))


def async_request(async_fn: Callable | None, async_fn_args: tuple, finalize_fns: list[Callable]) -> AsyncRequest:
    """megatron's ``AsyncRequest``: what the queue forks (``async_fn``) and then finalizes in the rank."""
    return ASYNC_REQUEST.get()(async_fn, async_fn_args, finalize_fns)


def async_save_options() -> dict[str, Any]:
    """Extra keywords for an async ``dist_checkpointing.save``: ``async_strategy="mcore"`` where the installed
    release has that parameter (megatron-core 0.18 defaults it to ``"nvrx"``, nvidia-resiliency-ext's writer:
    upstream verl #8000), since the background write and the snapshot save read megatron's built-in request
    layout; none where it is absent (0.16.1, whose only async writer is that one)."""
    from megatron.core import dist_checkpointing

    return (
        {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters else {}
    )


def _checked_layout(request: AsyncRequest) -> None:
    """The torch_dist request's ``async_fn`` takes (rank, write_buckets, results_queue) at the positions read."""
    params = tuple(inspect.signature(request.async_fn).parameters)
    if params[WRITE_BUCKETS_ARG : RESULTS_QUEUE_ARG + 1] != ("write_buckets", "global_results_queue"):
        raise WRITER_WRITE.changed(
            f"left the request's async_fn taking {params} (write_buckets, results queue by position)"
        )


def save_plan_is_reusable(strategy: TorchDistSaveShardedStrategy | None) -> bool:
    """Whether ``strategy`` plans its next save with no collective: ``validated_cache_reuse`` (the central
    plan was the same on two saves) and ``cached_central_plan``, set by ``cached_metadata=True``. Only then
    can a forked process, which has no process group of the rank, plan alone.

    Where the plan cache or the writer's layout the snapshot save reads is gone or changed, False with a
    warning naming it: the manager then keeps the public path, megatron's own async save (planned in the
    rank, written in the background)."""
    if strategy is None:
        return False
    try:
        for internal in PLAN_CACHE:
            internal.get(strategy)
        for internal in (WRITER_WRITE, WRITER_FINISH, CHECKPOINTING_CONFIG, SAVE_CONFIG):
            internal.get()
    except InternalsChangedError as exc:
        warnings.warn(f"{exc} The snapshot save is off; async saves are planned in the rank.", stacklevel=2)
        return False
    return bool(strategy.validated_cache_reuse) and strategy.cached_central_plan is not None


def write_buckets(request: AsyncRequest) -> list:
    """The write buckets (one per writer process) in a torch_dist request's ``async_fn_args``, by position."""
    _checked_layout(request)
    return request.async_fn_args[WRITE_BUCKETS_ARG]


def results_queue(request: AsyncRequest) -> Any:
    """The queue a torch_dist request's writers report their write results to (``async_fn_args``, by position)."""
    _checked_layout(request)
    return request.async_fn_args[RESULTS_QUEUE_ARG]


def preloaded_args(request: AsyncRequest) -> tuple:
    """``async_fn_args`` with the write buckets replaced by ``preload_fn()`` (device -> host copies), as
    megatron's own ``AsyncRequest.execute_sync`` does, for a caller that runs several requests in one process."""
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        _checked_layout(request)
        args[WRITE_BUCKETS_ARG] = request.preload_fn()
    return tuple(args)


def tie_write_results_queue(start_manager: Callable[[], Any]) -> None:
    """Make the queue megatron's dist-checkpoint writers report through on a Manager of ours: ``start_manager()``,
    called at this process's first save (then kept, and inherited by its forks, as megatron keeps its own).

    megatron's ``WRITE_RESULTS_QUEUE`` getter spawns a multiprocessing Manager server for it (exec'd: no fork
    hook runs there) that nothing stops when the rank dies (~290 MB each); ``start_manager`` starts one that
    dies with the process that started it. Idempotent; megatron's function is replaced module-wide, where
    ``prepare_write_data`` looks it up."""
    original = WRITE_RESULTS_QUEUE.get()
    if getattr(original, "verl_tied", False):
        return
    queue: list[Any] = []

    def tied_write_results_queue(*_args: Any, **_kwargs: Any) -> Any:
        if not queue:
            queue.append(start_manager().Queue())
        return queue[0]

    tied_write_results_queue.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    tied_write_results_queue.verl_tied = True  # type: ignore[attr-defined]
    tied_write_results_queue.verl_made = queue  # type: ignore[attr-defined]  # for drain_write_results
    _setattr(WRITE_RESULTS_QUEUE, tied_write_results_queue)


def start_write_results_queue() -> None:
    """Make this process's dist-checkpoint write-results queue now, if it has none yet (on a tied queue: start
    its Manager). A rank calls it before it forks a save: the fork's writers then report through the rank's
    Manager, inherited, instead of each fork starting a Manager of its own, which its exit must stop again
    (multiprocessing's finalizer waits 1 s for a Manager to shut down, then sends it SIGTERM). Where megatron's
    getter moved (``guard_writers`` warned), nothing: its writers then make the queue where they run."""
    try:
        getter = WRITE_RESULTS_QUEUE.get()
    except InternalsChangedError:
        return
    getter()


def drain_write_results() -> int:
    """Drop what megatron's dist-checkpoint writers of this process left in their results queue; how many items.

    Each write reports one item there, and megatron's finalize of that write reads it back. An async save whose
    finalize failed before those finalizes ran (a fork that died, on this rank or a peer) leaves its items
    behind, and the next save's finalize would read them as its own and write a wrong ``.metadata``. The queue
    is the process's, shared by every manager's queue of calls: nothing is dropped while any of them has a call
    not finalized (its fork may still write). Only the queue made on our Manager (``tie_write_results_queue``)
    is known here; none made yet, nothing to drop. Called inside a failure's handler: a Manager server that is
    gone (the process ending) is warned about, never raised, so the failure being reported stays the one raised."""
    import queue as queue_module

    try:
        made = getattr(WRITE_RESULTS_QUEUE.get(), "verl_made", None) or []
    except InternalsChangedError:  # not tied (``guard_writers`` warned): megatron's own queue is unknown here
        return 0
    if async_calls_pending():
        return 0
    dropped = 0
    for results in made:
        while True:
            try:
                results.get_nowait()
            except queue_module.Empty:
                break
            except (OSError, EOFError) as exc:
                warnings.warn(f"could not drain the write results queue: its Manager server is gone ({type(exc).__name__})", stacklevel=2)
                return dropped
            dropped += 1
    return dropped


def wrap_writer_processes(wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """``WRITER_WRITE`` (up to 0.17 forks one writer per bucket and waits for them all; 0.18 uses threads)
    replaced by ``wrap(original)``, which must take the same parameters (the request layout read by position).
    Idempotent. Every torch_dist save reaches it through ``get_save_function_and_args``, sync saves included."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = WRITER_WRITE.get()
    if getattr(original, "verl_wrapped", False):
        return
    wrapped = wrap(original)
    wrapped.verl_wrapped = True  # type: ignore[attr-defined]
    setattr(FileSystemWriterAsync, WRITER_WRITE.path.rsplit(".", 1)[1], staticmethod(wrapped))
    WRITER_WRITE.get()  # the replacement passes the same check


def write_checkpoint_metadata(strategy: TorchDistSaveShardedStrategy, path: str, all_results: list[list]) -> None:
    """Rank 0: ``.metadata`` from the strategy's ``cached_global_metadata`` (the plan's global metadata) and
    every rank's write results, then ``metadata.json`` from its ``backend`` / ``version``: what megatron's
    finalize does after a gather over the default group, which a forked save's parent does instead."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    WRITER_FINISH.get()
    write_config = checkpointing_config_writer(strategy)  # all checked before writing
    FileSystemWriterAsync(path).finish(PLAN_CACHE[2].get(strategy), all_results)
    write_config(path)


def checkpointing_config_writer(strategy: TorchDistSaveShardedStrategy) -> Callable[[str], None]:
    """What writes a dist checkpoint's ``metadata.json`` at a path (rank 0; the strategy's ``backend`` /
    ``version``), as megatron's save writes it; its internals checked now."""
    config_class, save_config = CHECKPOINTING_CONFIG.get(), SAVE_CONFIG.get()
    config = config_class(PLAN_CACHE[3].get(strategy), PLAN_CACHE[4].get(strategy))
    return functools.partial(save_config, config)


def replace_metadata_finalize(request: AsyncRequest, finalize: Callable[[], None]) -> None:
    """``finalize`` in place of the last of an async save's finalize functions: megatron's save appends one that
    writes ``metadata.json`` on rank 0, then waits in a barrier. ``InternalsChangedError`` where the request
    does not end with it (nothing replaced)."""
    last = request.finalize_fns[-1] if request.finalize_fns else None
    if getattr(last, "__name__", None) != METADATA_FINALIZE:
        raise SAVE_FINALIZE.changed(f"no longer ends an async save's finalize with {METADATA_FINALIZE} (found {last!r})")
    request.finalize_fns[-1] = finalize


@contextlib.contextmanager
def rank_zero_files_taken(keep: Callable[[Callable], Callable], save_config: Callable[[Any, Any], None]) -> Iterator[None]:
    """For its length, megatron's ``save`` writes ``common.pt`` with ``keep(its own writer)`` and ``metadata.json``
    with ``save_config``. ``InternalsChangedError`` before anything changes."""
    original_common, original_config = (internal.get() for internal in RANK_ZERO_FILES[:2])
    for internal in RANK_ZERO_FILES[2:]:
        internal.get()
    try:
        if _COMMON_BY_STRATEGY:
            _setattr(SAVE_COMMON, lambda *args, **kwargs: _common_strategy_with(original_common(*args, **kwargs), keep))
        else:
            _setattr(SAVE_COMMON, keep(original_common))
        _setattr(SERIALIZATION_SAVE_CONFIG, save_config)
        yield
    finally:
        _setattr(SAVE_COMMON, original_common)
        _setattr(SERIALIZATION_SAVE_CONFIG, original_config)


def _common_strategy_with(default: Any, keep: Callable[[Callable], Callable]) -> Any:
    """Up to 0.17: megatron's common strategy ``default``, its ``save_common`` through ``keep``."""
    return _kept_common_save_class(RANK_ZERO_FILES[2].get())(default, keep)


@functools.cache
def _kept_common_save_class(base: type) -> type:
    """A subclass of megatron's ``SaveCommonStrategy`` (``base``, which its save requires) delegating to another
    strategy but for ``save_common``: made once, not at every save."""

    class KeptCommonSave(base):
        def __init__(self, default: Any, keep: Callable[[Callable], Callable]) -> None:
            super().__init__(default.backend, default.version)
            self.default = default
            self.kept_save_common = keep(default.save_common)

        def save_common(self, common_state_dict: dict, checkpoint_dir: Any) -> None:
            self.kept_save_common(common_state_dict, checkpoint_dir)

        def save_sharded_objects(self, sharded_objects_state_dict: dict, checkpoint_dir: Any) -> None:
            self.default.save_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

        @property
        def can_handle_sharded_objects(self) -> bool:
            return self.default.can_handle_sharded_objects

    return KeptCommonSave


Place = tuple[str, tuple[int, ...]]  # a write item's key and global offset (DCP's ``MetadataIndex`` fqn, offset)


class TorchDistPlan(NamedTuple):
    """A planned torch_dist save: what its ``.metadata`` needs (the coordinator writes it), and the tensors
    resolved directly.

    ``direct``: tensor write items' data by place, resolved from megatron's own ``ShardedTensor`` (no torch
    ``ShardedTensor`` built for them); every other item resolves through the planner as before. ``agreed``:
    the places whose direct resolution is the very tensor megatron's conversion resolves (checked on a fresh
    plan; carried unchanged by a reused one), the only places a reused plan may resolve directly."""

    metadata: Any
    dist_wrapper: Any
    direct: dict[Place, torch.Tensor]
    agreed: frozenset[Place]


def _direct_tensors(flat: dict) -> dict[Place, torch.Tensor]:
    """Each local ``ShardedTensor``'s write item data by place, as ``mcore_to_pyt_state_dict`` resolves it,
    without building its torch ``ShardedTensor``: the data itself, or, where megatron builds a torch
    ``ShardedTensor`` (prepended axes on a regular grid), the data contiguous with the prepended axes as
    leading singleton dimensions. Keys it wraps in one ``LocalShardsContainer`` (several shards, no prepended
    axes) and flattened ranges are left out; the first shard at a place is the one DCP finds. Used only where
    a fresh plan found the two the same tensor (``plan_torch_dist_save``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    direct: dict[Place, torch.Tensor] = {}
    for key, shards in flat.items():
        first = shards[0]
        if not isinstance(first, ShardedTensor) or first.flattened_range is not None:
            continue
        torch_sharded = bool(first.prepend_axis_num) and getattr(first, "has_regular_grid", False)
        if len(shards) > 1 and not torch_sharded:
            continue
        for shard in shards:
            if not isinstance(shard, ShardedTensor) or shard.data is None:
                break
            data = shard.data.detach()
            if torch_sharded:
                data = data.contiguous().view((1,) * first.prepend_axis_num + tuple(shard.local_shape))
            direct.setdefault((key, tuple(shard.global_offset)), data)
    return direct


def _same_tensor(a: torch.Tensor, b: Any) -> bool:
    """The same memory seen the same way (what torch.save writes the same)."""
    return type(b) is torch.Tensor and (a.device, a.dtype, a.shape, a.stride(), a.data_ptr()) == (
        b.device,
        b.dtype,
        b.shape,
        b.stride(),
        b.data_ptr(),
    )


def plan_torch_dist_save(
    strategy: TorchDistSaveShardedStrategy, sharded_state_dict: dict, writer: Any, reuse: bool, agreed: frozenset[Place] = frozenset()
) -> TorchDistPlan:
    """Plan a torch_dist save of ``sharded_state_dict`` to be written by ``writer`` (a DCP ``StorageWriter`` that
    can plan decentrally), as ``TorchDistSaveShardedStrategy.async_save`` does up to its writer, which it
    hard-codes (``FileSystemWriterAsync``: forked writer processes, a spawned results queue). Same planner,
    keys, file prefixes and ``.metadata``, so the checkpoint is the one megatron writes.

    ``reuse``: plan from the strategy's cached plans (the caller checked, on every rank, that the sharded
    structure is the one planned), with no collective. Either way the strategy's plan cache is left valid for
    the next save (``validated_cache_reuse``), which megatron itself grants only from a third save.

    megatron's ``mcore_to_pyt_state_dict`` builds a torch ``ShardedTensor`` per key and validates its shards
    (most of a reused plan's cost); a reused plan only resolves each write item's data from it. So a fresh
    plan converts everything and then checks, item by item, which places ``_direct_tensors`` resolves to the
    very tensor the planner does (``agreed``, the caller keeps it with the plan); a reused plan converts only
    the other keys and hands the agreed places' current tensors to the writer (``TorchDistPlan.direct``). A
    release that resolves differently only loses the shortcut. Raises ``InternalsChangedError`` before
    planning where an internal is gone."""
    for internal in IN_RANK_SAVE:  # all checked before anything is planned
        internal.get()
    for internal in (*PLAN_CACHE[:3], *STRATEGY_SETTINGS):
        internal.get(strategy)
    keep_main = strategy.keep_only_main_replica
    flat, _, _ = REPLACE_KEYS.get()(sharded_state_dict, keep_main)
    direct = _direct_tensors(flat)
    if reuse:
        direct = {place: tensor for place, tensor in direct.items() if place in agreed}
        flat = {key: shards for key, shards in flat.items() if any((key, tuple(s.global_offset)) not in direct for s in shards)}
        direct = {place: tensor for place, tensor in direct.items() if place[0] not in flat}  # whole keys only
    pyt_state = TO_PYT_STATE_DICT.get()(flat, False)
    planner = SAVE_PLANNER.get()(dedup_replicated_tensors=not keep_main, flatten_state_dict=False)
    cached = (strategy.cached_central_plan, strategy.cached_local_plan, True) if reuse else None
    (_, metadata, dist_wrapper), central, local, _, _ = PLAN_SAVE.get()(
        pyt_state, writer, None, 0, planner=planner, cached_ckpt_structure=cached
    )
    strategy.cached_central_plan, strategy.cached_local_plan, strategy.validated_cache_reuse = central, local, True
    if metadata is not None:  # planned afresh: the coordinator holds the global metadata
        strategy.cached_global_metadata = metadata
    elif dist_wrapper.is_coordinator:
        metadata = strategy.cached_global_metadata
    if not reuse:
        agreed = _agreed_places(central, planner, direct)
        direct = {}  # this save resolves everything through megatron's conversion, as it checked
    return TorchDistPlan(metadata, dist_wrapper, direct, agreed)


def _agreed_places(central: Any, planner: Any, direct: dict[Place, torch.Tensor]) -> frozenset[Place]:
    """The places of ``direct`` with exactly one write item in the plan, which the planner resolves to that tensor."""
    from torch.distributed.checkpoint.planner import WriteItemType

    items: dict[Place, list] = {}
    for item in central.items:
        items.setdefault((item.index.fqn, tuple(item.index.offset or ())), []).append(item)
    return frozenset(
        place
        for place, tensor in direct.items()
        if len(items.get(place, ())) == 1
        and items[place][0].type == WriteItemType.SHARD
        and _same_tensor(tensor, planner.resolve_data(items[place][0]))
    )


@contextlib.contextmanager
def torch_dist_load_reader_and_planner(reader: Callable[..., Any], planner: Callable[..., Any], one_rank: bool = False) -> Iterator[None]:
    """While inside: ``TorchDistLoadShardedStrategy`` reads through ``reader(checkpoint_dir, cache_metadata=...)``
    and plans with ``planner(**kwargs)`` instead of its module globals ``_get_filesystem_reader`` and
    ``MCoreLoadPlanner`` (strategies/torch.py), which its ``load`` calls by name: the strategy takes no
    reader or planner, and torch's (a plain ``pickle.load`` of ``.metadata``, ``torch.load(weights_only=False)``
    of bytes items) would run code from the checkpoint. Without them: ``InternalsChangedError`` (no public
    path loads a dist checkpoint as data only). Main thread only: the swap is module-wide.

    ``one_rank`` (a world of one process): torch's load is also told ``no_dist``, so its plan is made, checked and
    its failures raised as with collectives (``CheckpointException`` the same), without the plans' pickled round
    trip through ``gather_object`` / ``scatter_object`` to the process itself (docs/perf.md)."""
    saved = LOAD_READER.get(), LOAD_PLANNER.get()
    strategy_module = dcp = None
    if one_rank:
        try:  # a speed-up only: where torch's load_state_dict changed, the load keeps its collectives
            LOAD_STATE_DICT.get()
            strategy_module = importlib.import_module(LOAD_STATE_DICT.path.partition(":")[0])
            dcp = strategy_module.checkpoint
        except (InternalsChangedError, ImportError, AttributeError):
            strategy_module = None
    _setattr(LOAD_READER, reader)
    _setattr(LOAD_PLANNER, planner)
    if strategy_module is not None:
        strategy_module.checkpoint = _WithoutCollectives(dcp)
    try:
        yield
    finally:
        _setattr(LOAD_READER, saved[0])
        _setattr(LOAD_PLANNER, saved[1])
        if strategy_module is not None:
            strategy_module.checkpoint = dcp


class _WithoutCollectives:
    """torch's dist-checkpoint module whose ``load_state_dict`` runs with ``no_dist=True`` (every other name its own)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["no_dist"] = True  # megatron passes everything after the state dict by keyword
        return self._module.load_state_dict(state_dict, *args, **kwargs)


@functools.cache
def concatenating_merge_code() -> types.CodeType | None:
    """The code of megatron's gated-MLP merge (``CAT_MERGE``: ``torch.cat`` of the halves along dim 0), or None
    where it changed."""
    try:
        found = CAT_MERGE.get()
    except InternalsChangedError:
        return None
    if CAT_MERGE.path.endswith(":cat_with_oom_fallback"):
        code = getattr(inspect.unwrap(found), "__code__", None)
    else:
        nested = [c for c in inspect.unwrap(found).__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "sh_ten_merge_fn"]
        code = nested[0] if len(nested) == 1 else None
    return code if code is not None and "cat" in code.co_names else None


def merge_without_copy(merge_fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """``merge_fn`` of a loaded factory, or where it is megatron's concatenating merge (the gated MLP's halves)
    one that returns the halves' joined view when the load left them side by side in one buffer, in order (the
    load read into views of the factory's own buffer): the same values as the copy, without the copy. Halves
    the load placed elsewhere (a copy made contiguous) go to megatron's merge."""
    code = concatenating_merge_code()
    if code is None or getattr(inspect.unwrap(merge_fn), "__code__", None) is not code:  # unwrap: a no_grad decorator
        return merge_fn

    def merge(pieces: list) -> Any:
        joined = _adjacent_joined(pieces)
        return merge_fn(pieces) if joined is None else joined

    return merge


def _adjacent_joined(pieces: Any) -> torch.Tensor | None:
    """``torch.cat(pieces)`` as a view, where the pieces are contiguous tensors of one dtype and trailing shape that
    follow each other in one storage; else None."""
    if not isinstance(pieces, (list, tuple)) or len(pieces) < 2 or not all(isinstance(p, torch.Tensor) for p in pieces):
        return None
    first = pieces[0]
    if first.dim() == 0 or any(
        p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.is_contiguous() or p.numel() == 0 for p in pieces
    ):
        return None
    storage = first.untyped_storage().data_ptr()
    for before, after in zip(pieces[:-1], pieces[1:], strict=True):
        if after.untyped_storage().data_ptr() != storage or after.data_ptr() != before.data_ptr() + before.nbytes:
            return None
    shape = (sum(p.shape[0] for p in pieces), *first.shape[1:])
    return first.as_strided(shape, _row_major_strides(shape), first.storage_offset())


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    """The strides, in elements, of a contiguous (row-major) array of ``shape``."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return strides


@functools.cache  # decided once per process: every save and load calls it
def count_shard_access_at_once() -> None:
    """Install, once per process, a ``_compute_shards_access`` that counts each grid cell's main replicas in a list
    and makes the tensor once: the same tensor as megatron's, which indexes its tensor once per shard (an
    optimizer's state has thousands; docs/perf.md). A cell off the grid (megatron then raises, or indexes a
    slice) goes to megatron's own. Nothing is installed where the internal changed."""
    try:
        original = SHARD_ACCESS_COUNT.get()
    except InternalsChangedError:
        return
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    def compute_shards_access(rank_sharding: list) -> torch.Tensor:
        grid = tuple(rank_sharding[0][1].axis_fragmentations)
        if not grid:
            return original(rank_sharding)
        strides = _row_major_strides(grid)
        counts = [0] * (strides[0] * grid[0])
        for _, sharding in rank_sharding:
            if is_main_replica(sharding.replica_id):
                cell = sharding.local_chunk_offset_in_global()
                if len(cell) != len(grid) or not all(0 <= i < n for i, n in zip(cell, grid, strict=True)):
                    return original(rank_sharding)
                counts[sum(i * stride for i, stride in zip(cell, strides, strict=True))] += 1
        return torch.tensor(counts, dtype=torch.int, device="cpu").view(grid)

    _setattr(SHARD_ACCESS_COUNT, compute_shards_access)


# ---------------------------------------------------------------- optimizer


def init_distributed_optimizer_state(optimizer: DistributedOptimizer) -> None:
    """``DistributedOptimizer._init_optimizer_states_with_dummy_values``: creates the Adam state its
    ``load_state_dict`` reads, which an optimizer that never stepped lacks (megatron calls it itself only on
    its Megatron-FSDP load path). No public path makes that state without stepping."""
    DUMMY_OPTIMIZER_STATE.get(type(optimizer))(optimizer)


@functools.cache  # decided once per process: a save calls it every time, and the source check reads a file
def map_only_tracked_params() -> None:
    """Install, once per process, a ``get_param_id_to_sharded_param_map`` that hands megatron's own only the
    model's sharded tensors the optimizer tracks: the same map, none of megatron's debug lines for the rest.
    megatron formats each tensor it does not track into its debug message, values included, whether or not
    debug logging is on, and ``ChainedOptimizer`` hands each optimizer it chains (dense, experts) the whole
    model: 8 tensors formatted per save on a rank of the default job (docs/perf.md). With megatron's logger
    at debug level, megatron's own runs as it is. Nothing is installed where the internal changed or no longer
    formats eagerly (a release may log lazily, or read the untracked tensors for something else)."""
    try:
        original = PARAM_ID_MAP.get()
    except InternalsChangedError:
        return
    if "logger.debug(f'{ten} is not tracked" not in inspect.getsource(original):
        return
    import logging

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import get_optim_param_to_id_map

    logger = logging.getLogger("megatron.core.dist_checkpointing.optimizer")

    def param_id_map(model_sharded_state_dict: dict, optim_params_iter: Any) -> dict:
        params = list(optim_params_iter)
        if logger.isEnabledFor(logging.DEBUG):
            return original(model_sharded_state_dict, params)
        tracked = get_optim_param_to_id_map(params)  # megatron's own ids (a DTensor's local tensor)
        kept = [
            value
            for value in nested_values(model_sharded_state_dict)
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and id(value.data) in tracked
        ]
        return original(dict(enumerate(kept)), params)

    _setattr(PARAM_ID_MAP, param_id_map)


# ---------------------------------------------------------------- the CPU runtime's replacements


def replace_cuda_rng_state(get_state: Callable[[], torch.Tensor], set_state: Callable[[torch.Tensor], None]) -> None:
    """``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the RNG tracker forks and
    restores the CUDA generator through these module-level helpers, which patching ``torch.cuda`` misses."""
    GET_CUDA_RNG_STATE.get(), SET_CUDA_RNG_STATE.get()
    _setattr(GET_CUDA_RNG_STATE, lambda device="cuda", clone=False, graph_safe=False: get_state())
    _setattr(SET_CUDA_RNG_STATE, lambda new_state, device=-1, graph_safe=False: set_state(new_state))


def first_dim_collectives() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``tensor_parallel.mappings._gather_along_first_dim`` and ``_reduce_scatter_along_first_dim`` as
    installed now: the MoE dispatcher's (possibly uneven) gather and reduce-scatter over a TP group."""
    return GATHER_FIRST_DIM.get(), REDUCE_SCATTER_FIRST_DIM.get()


def replace_first_dim_collectives(
    gather: Callable[..., torch.Tensor], reduce_scatter: Callable[..., torch.Tensor]
) -> None:
    """Install replacements for the two ``first_dim_collectives`` (same parameters); the dispatcher calls
    them through the module, so the module attribute is the only place to reach them."""
    first_dim_collectives()
    _setattr(GATHER_FIRST_DIM, gather)
    _setattr(REDUCE_SCATTER_FIRST_DIM, reduce_scatter)


def replace_split_sizes_to_host(move: Callable[..., Any]) -> None:
    """``maybe_move_tensor_to_cpu`` as ``moe_utils`` and ``token_dispatcher`` (which imported it by name)
    see it: the alltoall dispatcher moves its split sizes to host numpy arrays only when they are CUDA tensors."""
    for internal in SPLIT_SIZES_TO_HOST:
        internal.get()
    for internal in SPLIT_SIZES_TO_HOST:
        _setattr(internal, move)


def define_missing_te_general_gemm() -> None:
    """megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` undefined without TransformerEngine, and
    routing reads it (NameError); None makes routing take its torch path (``if te_general_gemm is not None``)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

"""What an async save's forked process is given and runs: state dicts' sources, paths, a communicator; no manager.

A process forked from the rank runs a save's background part (``ForkedSave``), the same pipeline for both async
writers on its copy-on-write image of the rank: the NaN/Inf check, the dist checkpoints (planned in the rank, or
planned here once megatron's plan is reusable) and, when the bridge saves in parallel, the HF export over the
forks' own group (``HFExport``). The ``background_write`` writer's fork first points the state at the host copy
the rank took of what lives in device memory (``host_copy``); the ``snapshot`` writer's reads the live tensors.
Either fork leaves its outcome for the ranks, which agree on it before megatron's finalize, so a fork that died
(killed in its first instant included) fails the save on every rank naming its own. Everything it touches is named in the dataclasses below (model and optimizer objects, the
strategies, the bridge, paths); of the manager it calls only the public ``on_save_phase`` hook it is handed, so
tests can observe (and kill) the fork at a phase. ``finish_forked_save`` agrees on the forks' outcomes in the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from verl.utils.checkpoint import durability, finite, layout, snapshot_save
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.host_copy import HostCopy
from verl.utils.checkpoint.megatron_state_dicts import DistParts, sharded_structure
from verl.utils.internals import megatron_core
from verl.utils.rank_comm import ForkedRankComm, RankComm

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest


def _untimed(phase: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A fork's phases: neither announced nor timed (no manager hook crosses a fork)."""
    return fn(*args)


def _attempt(timed: Callable[..., Any], phase: str, fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """Run one phase; its value, or its error, for every rank to agree on, not raised past its peers."""
    try:
        return timed(phase, fn), None
    except Exception as exc:
        return None, exc


@dataclasses.dataclass
class HFExport:
    """The HF export as one unit, in a rank or a fork, over any group of ranks: rank 0's config -> barrier (fix 2)
    -> every rank's weights -> barrier (every file complete on every rank; the parallel save's own last agreement,
    ``parallel_hf_save``, where the bridge saves in parallel); the step transaction then verifies it
    once. Each barrier carries the ranks' outcomes (``RankComm.agree``): a write that fails on one rank (a full
    disk) fails the export on all of them, where a plain barrier would hold the others until the group's timeout.
    ``timed(phase, fn, *args)``: how the rank announces and times ``hf_config`` and ``hf_weights``."""

    bridge: Any
    model: list
    hf_path: str
    save_kwargs: dict
    write_config: Callable[[], None]  # rank 0's ``megatron_metadata.write_hf_config``, bound to its arguments
    timed: Callable[..., Any] = _untimed

    def run(self, rank: int, comm: RankComm | None = None, wait_for_config: Callable[[Exception | None], None] | None = None) -> list[str] | None:
        """``comm`` None: the default group and any bridge; else a bridge that saves in parallel, over ``comm``.
        ``wait_for_config(config_failure)``: fix 2's barrier, carrying rank 0's outcome of the config write (the
        rank's public ``wait_for_hf_config``; default ``comm``'s ``agree``). Returns the files this rank wrote:
        on rank 0 the folder's files once its config is written (no rank writes a weight before the barrier),
        and the files the bridge's ``save_weights`` returns; None when the bridge returns none (mbridge's and
        Megatron-Bridge's own saves: rank 0 writes every file; ``durability.own_files``)."""
        group = comm or RankComm()
        failure, config_files = None, []
        if rank == 0:
            _, failure = _attempt(self.timed, "hf_config", self.write_config)
            config_files = durability.files_in(self.hf_path)
        (wait_for_config or functools.partial(group.agree, what="write the HF config"))(failure)
        kwargs = self.save_kwargs if comm is None else {**self.save_kwargs, "comm": comm}
        agrees_itself = getattr(self.bridge, "saves_in_parallel", False)
        weights, failure = _attempt(self.timed, "hf_weights", functools.partial(self.bridge.save_weights, self.model, self.hf_path, **kwargs))
        if not agrees_itself:
            group.agree(failure, "write its HF weights")  # every file complete on every rank, or every rank raises
        elif failure is not None:  # the parallel save's last agreement follows every rank's writes: all raise alike
            raise failure
        return None if weights is None else [*config_files, *weights]


@dataclasses.dataclass
class ForkedSave:
    """What a save's fork is given: the step's staging directory, the state's sources, megatron's save strategies
    (content -> (structure, strategy)), whether it checks the state for NaN/Inf, with ``hf`` the export and its
    forks' group name, and with ``host`` the host copy it reads the state from."""

    staging: str
    rank: int
    refusal: str  # the NaN/Inf error's prefix
    parts: DistParts
    strategies: dict[str, tuple]
    check: bool = True
    hf: HFExport | None = None
    group: str | None = None
    host: HostCopy | None = None


def planned_writes(requests: list[AsyncRequest]) -> Callable[[], None] | None:
    """The writes of ``requests``, one after another in the process that calls the result (None: nothing to write).

    Every torch_dist writer of a process reports through the same results queue, so the writes must
    finish in the order their finalize functions read the results: concurrent processes could swap
    them. Tensors are staged (``preload_fn``: device -> host on an accelerator) here, before the fork.
    """
    calls = [
        (request.async_fn, megatron_core.preloaded_args(request), dict(request.async_fn_kwargs))
        for request in requests
        if request.async_fn is not None
    ]

    def write_all() -> None:
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)

    return write_all if calls else None


def forked_request(save: ForkedSave, planned: list[AsyncRequest] | None) -> AsyncRequest:
    """The request whose fork runs ``save``'s pipeline (``run_in_fork``) on the writes the rank ``planned``, or,
    with ``planned`` None, plans them there too (``plan_and_write``). Finalized: the forks' outcomes agreed on
    first (``finish_forked_save``), then megatron's finalize of what the rank planned."""
    write_dist = functools.partial(plan_and_write, save) if planned is None else planned_writes(planned) or dict
    snapshot_save.reserve_outcome(save.staging, save.rank)  # so a fork that fills the disk can still say so
    megatron_core.start_write_results_queue()  # the fork's writers report through the rank's Manager, not one of its own
    return megatron_core.async_request(
        snapshot_save.ForkedJob(save.staging, save.rank, functools.partial(run_in_fork, save, write_dist), save.group),
        (),
        [functools.partial(finish_forked_save, save.staging, save.rank, save.strategies), *[fn for r in planned or () for fn in r.finalize_fns]],
    )


def run_in_fork(save: ForkedSave, write_dist: Callable[[], dict | None]) -> dict:
    """The forked process: with ``save.host`` the state pointed at its host copy, with ``save.check`` the NaN/Inf
    check of the state it is about to write, this rank's dist checkpoints (megatron's writer processes fsync each
    file), then with ``save.hf`` the HF export over the forks' group, whose files this process fsyncs
    (``durability``: on the host that wrote them). The group is formed first: a fork that fails later makes the
    others fail fast, not wait."""
    comm = ForkedRankComm(save.group) if save.hf is not None else None
    if save.host is not None:
        save.host.install()
    if save.check:
        finite.check_finite_here(save.parts.model, save.parts.optimizer, save.refusal, save.rank)
    outcome: dict[str, Any] = {"writes": write_dist() or {}}
    if comm is not None:
        written = save.hf.run(save.rank, comm)
        durability.fsync_written(save.staging, durability.own_files(save.hf.hf_path, written, save.rank))
    return outcome


def plan_and_write(save: ForkedSave) -> dict:
    """In the fork: plan this rank's dist checkpoints with the reused (validated) plans and write them; the write
    results per content, which the ranks' finalize turns into each checkpoint's ``.metadata``."""
    writes = {}
    for content, state, path in save.parts.build(save.staging):
        structure, strategy = save.strategies[content]
        if sharded_structure(state) != structure:
            raise CheckpointError(f"the {content} checkpoint's sharded structure changed after its save plan was validated")
        writes[content] = snapshot_save.write_dist_checkpoint(strategy, state, path, save.parts.metadata)
    return writes


def finish_forked_save(staging: str, rank: int, strategies: dict[str, tuple]) -> None:
    """Every rank: agree on the forks' outcomes, then rank 0 writes the metadata of each dist checkpoint the forks
    planned (megatron's own finalize does it for the writes planned in the rank), and every rank learns whether
    it could."""
    outcome = snapshot_save.read_outcome(staging, rank)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, outcome)
    failed = [(r, o["error"].strip().splitlines()[-1]) for r, o in enumerate(everyone) if not o["ok"]]
    if failed:
        failed.sort(key=lambda f: "without a result" not in f[1])  # a fork that died first is the cause
        raise CheckpointError(f"the background save failed on {len(failed)} rank(s): " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    if not everyone[0]["writes"]:  # rank 0 writes nothing here: the rank planned them, megatron's finalize writes
        return
    failure = None
    if rank == 0:
        try:
            for content in outcome["writes"]:
                path = layout.dist_path(staging, content)
                snapshot_save.finish_dist_checkpoint(strategies[content][1], path, [o["writes"][content] for o in everyone])
        except Exception as exc:  # noqa: BLE001 - every rank fails with it, in the agreement
            failure = exc
    # rank 0 alone writes them: the other ranks would otherwise go on into the next collective without it
    RankComm().agree(failure, "write its dist checkpoints' .metadata and metadata.json")

"""The fork machinery of ``MegatronCheckpointManager``'s async saves, out of the manager's module.

An async save gives training back while a process forked from the rank writes (``BACKGROUND_WRITE``: the
dist checkpoints planned in the rank) or plans and writes (``SNAPSHOT``: reusable plans, tensors on the host)
the parts; on the CPU runtime the fork also runs the NaN/Inf check on its copy-on-write image and, when the
bridge saves in parallel, the HF export with the forks' own barrier. ``finalize_async_save`` agrees on the
forks' outcomes and completes the save. ``ForkedSaves`` holds the manager's methods for it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from verl.utils.checkpoint import finite, layout, snapshot_save
from verl.utils.checkpoint.integrity import CheckpointError
from verl.utils.checkpoint.megatron_state_dicts import optimizer_layout, sharded_structure
from verl.utils.internals import megatron_core
from verl.utils.megatron_utils import get_hf_model_checkpoint_path
from verl.utils.rank_comm import ForkedRankComm

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from verl.utils.checkpoint.megatron_checkpoint_manager import SaveReport


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


def in_one_fork(requests: list[AsyncRequest]) -> AsyncRequest:
    """One request that runs the writes of ``requests`` in a single forked process, which ends with its rank."""
    writes = planned_writes(requests)

    def run() -> None:
        snapshot_save.fail_when_a_writer_dies(snapshot_save.report_to_stderr)
        writes()

    return megatron_core.async_request(run if writes else None, (), [fn for request in requests for fn in request.finalize_fns])


class ForkedSaves:
    """``MegatronCheckpointManager``'s async-save methods (a mixin: they use the manager's state and builders)."""

    def _continue_in_background(self, save: SaveReport, request: AsyncRequest) -> SaveReport:
        """Fork the background part and give training back; ``finalize_async_save`` completes the save."""
        if self._async_queue is None:
            self._async_queue = megatron_core.async_calls_queue()
        self._timed("fork", snapshot_save.fork, self._async_queue, request)
        self._pending = save
        save.blocked_seconds = time.monotonic() - save.started
        self._log(f"step {save.global_step}: returned after {save.blocked_seconds:.2f}s; {save.mode.value} runs in the background")
        return save

    def _plans_are_reusable(self) -> bool:
        """Whether the fork can do the whole save: every plan reusable without a collective, same structure."""
        if not self.async_save or not snapshot_save.on_host(self.model):
            return False
        if not all(megatron_core.save_plan_is_reusable(self._save_strategies.get(c, (None, None))[1]) for c in self._dist_contents()):
            return False
        return not self.should_save_optimizer or optimizer_layout(self.optimizer) == self._planned_optimizer_layout

    def _forked_request(
        self, save: SaveReport, write_dist: Callable[[], dict | None], finalize_planned: list[Callable] = ()
    ) -> AsyncRequest:
        """What an async save's fork runs when it holds the state (``checked_in_background``): the rest of the
        pipeline, ``_save_in_fork``, around ``write_dist`` (the writes planned in the rank, whose megatron
        finalize is ``finalize_planned``, or the snapshot's planning and writing, which returns its write
        results). When the save is finalized the forks' outcomes are agreed on first."""
        self._forked_saves += 1
        hf_group = f"{self.role}/step{save.global_step}/save{self._forked_saves}" if save.hf_weights_in_background else None
        job = functools.partial(self._save_in_fork, save, write_dist, hf_group)
        snapshot_save.reserve_outcome(save.local_path, self.rank)  # so a fork that fills the disk can still say so
        return megatron_core.async_request(
            snapshot_save.ForkedJob(save.local_path, self.rank, job, hf_group),
            (),
            [functools.partial(self._finish_forked_save, save.local_path), *finalize_planned],
        )

    def _save_in_fork(self, save: SaveReport, write_dist: Callable[[], dict | None], hf_group: str | None) -> dict:
        """The forked process, the save's pipeline on its copy-on-write image of the rank: the NaN/Inf check,
        this rank's dist checkpoints, then with ``hf_group`` the HF config (rank 0), the forks' barrier (fix 2)
        and the HF weights.

        The forks' group is formed first: a fork that fails later makes the others fail fast, not wait."""
        comm = ForkedRankComm(hf_group) if hf_group is not None else None
        finite.check_finite_here(self.model, self.optimizer, self._refusal(save), self.rank)
        outcome: dict[str, Any] = {"writes": write_dist() or {}}
        if comm is not None:
            self._save_hf_config_and_tokenizer(save.local_path)
            comm.barrier()
            self.bridge.save_weights(self.model, get_hf_model_checkpoint_path(save.local_path), comm=comm, **self.bridge_save_kwargs)
        return outcome

    def _plan_and_write_in_fork(self, local_path: str, extra_state: dict) -> dict:
        """The snapshot's dist part, in its fork: plan this rank's dist checkpoints with the reused plans and
        write them; the write results per content. The RNG state ``extra_state`` was taken in the rank (a forked
        process reseeds Python's ``random``)."""
        writes = {}
        metadata = self._build_sharded_state_dict_metadata()
        for content, state, path in self._dist_checkpoint_parts(local_path, metadata, extra_state):
            structure, strategy = self._save_strategies[content]
            if sharded_structure(state) != structure:
                raise CheckpointError(f"the {content} checkpoint's sharded structure changed after its save plan was validated")
            writes[content] = snapshot_save.write_dist_checkpoint(strategy, state, path, metadata)
        return writes

    def _finish_forked_save(self, local_path: str) -> None:
        """Every rank: agree on the forks' outcomes, then rank 0 writes the metadata of each dist checkpoint the
        forks planned (the snapshot's; megatron's own finalize does it for the writes planned in the rank)."""
        outcome = snapshot_save.read_outcome(local_path, self.rank)
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, outcome)
        failed = [(rank, o["error"].strip().splitlines()[-1]) for rank, o in enumerate(everyone) if not o["ok"]]
        if failed:
            failed.sort(key=lambda f: "without a result" not in f[1])  # a fork that died first is the cause
            raise CheckpointError(f"the background save failed on {len(failed)} rank(s): " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        if self.rank == 0:
            for content in outcome["writes"]:
                path = layout.dist_path(local_path, content)
                snapshot_save.finish_dist_checkpoint(self._save_strategies[content][1], path, [o["writes"][content] for o in everyone])

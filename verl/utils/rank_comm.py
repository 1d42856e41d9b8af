"""The few collectives the parallel HF export needs, over one of three groups of ranks.

``RankComm`` is torch.distributed's default group: what a rank uses while it trains; ``GroupRankComm`` a gloo
group of the same ranks, for collectives beside the default group's in another thread. ``ForkedRankComm``
joins processes forked from every rank (the background save writes from such a snapshot): a child
must never touch its parent's process groups, whose sockets and threads belong to the parent, so it
opens a gloo group of its own, meeting the other children through a new client of the default
group's TCP store.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from verl.utils.device import get_device_id, get_device_name
from verl.utils.internals import torch as torch_internals

# (tensor, peer rank, tag): a tensor to send to the peer or to fill from it.
Transfer = tuple[torch.Tensor, int, int]


class RankComm:
    """torch.distributed's default group, or ``group`` (of the same ranks). ``host_only``: the group sends
    tensors from host memory only (gloo's point-to-point), so a tensor on an accelerator travels as a host
    copy; the default group (NCCL on a GPU host) sends them where they are. ``keep_gathers``: this object
    lives across saves, so ``gather_unless_unchanged`` may answer from its last gather (only then)."""

    host_only = False

    def __init__(self, group: Any = None, keep_gathers: bool = False) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = group
        self.keep_gathers = keep_gathers
        self._gathered: dict[str, tuple[Any, Any]] = {}  # per key: this rank's last value and its gather (``keep_gathers``)

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        """Post every send and receive as one batch (NCCL needs them grouped), then wait for all."""
        ops = [dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag) for t, peer, tag in recvs]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def any(self, *flags: bool) -> list[bool]:
        """For each of ``flags``, whether it is set on any rank: one all-reduce of one number per flag, which
        also waits for every rank. Over gloo a fraction of an ``all_gather_object``'s cost (no pickling, one
        exchange instead of two: docs/perf.md). The numbers live in host memory where the group has a host
        backend, else on this rank's accelerator (NCCL)."""
        on_host = get_device_name() == "cpu" or "cpu:" in str(dist.get_backend_config(self.group))
        device = torch.device("cpu") if on_host else torch.device(get_device_name(), get_device_id())
        numbers = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(number) for number in numbers.tolist()]

    def agree(self, error: BaseException | None, what: str, share: Any = None, gather: Callable[[Any], Any] | None = None) -> Any:
        """A barrier that carries each rank's outcome of a step that only some ranks may fail (a write on a full
        disk): every rank raises when any failed, the failed rank its own error, the others ``PeerFailure``
        naming it, so no rank goes on into a collective that a failed peer never joins. The usual outcome, no
        failure anywhere, costs one ``any``; the failures' descriptions travel only when there is one.
        ``share`` (data the group can send: JSON data for ``ForkedRankComm``; None on every rank or on none):
        every rank's, in rank order, is returned, gathered unless unchanged (as ``gather_unless_unchanged``, under
        ``what``); whether it changed rides the same ``any``. ``gather`` replaces the all-gather: a gather to one
        rank (torch's ``_DistWrapper.gather_object``) returns the list there and None on the other ranks."""
        changed = share is not None and self._changed(what, share)
        failed, changed = self.any(error is not None, changed)
        if failed:
            self.fail_together(error, what)
        if share is None:
            return [None] * self.world_size
        return self._gather(what, share, gather or self.all_gather_object) if changed else self._last(what)

    def fail_together(self, error: BaseException | None, what: str) -> NoReturn:
        """Every rank, once an ``any`` has told them some rank failed ``what``: the failed rank raises its own
        ``error``, the others ``PeerFailure`` naming the first that failed (one gather of the descriptions)."""
        gathered = self.all_gather_object(describe(error) if error else None)
        if error is not None:
            raise error
        rank, cause = next((rank, cause) for rank, cause in enumerate(gathered) if cause)
        raise PeerFailure(f"rank {rank} could not {what}", cause)

    def gather_unless_unchanged(self, key: str, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``all_gather_object``); with ``keep_gathers``, when no rank's ``obj``
        changed since the last gather under ``key``, that result again for one ``any``. For what stays the same
        from call to call (which rank holds which piece of the model). Kept gathers assume the group's ranks stay
        the same for this object's life (a process group destroyed and made again needs a new one)."""
        if not self.keep_gathers:
            return self.all_gather_object(obj)
        (changed,) = self.any(self._changed(key, obj))
        return self._gather(key, obj, self.all_gather_object) if changed else self._last(key)

    def _changed(self, key: str, obj: Any) -> bool:
        """Whether this rank's ``obj`` differs from what it gave the last gather under ``key`` (always, without
        ``keep_gathers``, so that every rank gathers)."""
        last = self._gathered.get(key) if self.keep_gathers else None
        return last is None or last[0] != obj

    def _gather(self, key: str, obj: Any, gather: Callable[[Any], Any]) -> Any:
        gathered = gather(obj)
        if self.keep_gathers:
            self._gathered[key] = (obj, gathered)
        return self._last(key) if self.keep_gathers else gathered

    def _last(self, key: str) -> Any:
        """The last gather under ``key``, as a list of its own (None stays None: a rank a gather to one rank skips)."""
        gathered = self._gathered[key][1]
        return None if gathered is None else list(gathered)


class PeerFailure(RuntimeError):
    """Another rank failed a step every rank takes together (``RankComm.agree``): ``failed`` says which rank and
    what (``rank 0 could not write ...``), the text adds its cause (that rank's error, one line)."""

    def __init__(self, failed: str, cause: str) -> None:
        super().__init__(f"{failed} ({cause})")
        self.failed, self.cause = failed, cause

    def __reduce__(self) -> tuple:
        return type(self), (self.failed, self.cause)


def describe(error: BaseException) -> str:
    """One line for a peer: the error's type and its last line (an OSError keeps ``[Errno N]`` and its path)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"


class GroupRankComm(RankComm):
    """A gloo group of every rank, made collectively once (``dist.new_group``): collectives on it from a second
    thread cannot interleave with the default group's, which the rank's main thread goes on using."""

    host_only = True

    def __init__(self) -> None:
        super().__init__(dist.new_group(backend="gloo"), keep_gathers=True)


class ForkedRankComm(RankComm):
    """A gloo group of the processes that every rank forked for the same purpose (host tensors only).

    Every rank's child calls ``ForkedRankComm(name)`` with the same ``name`` (unique per use, e.g. per
    save); they meet under that prefix in the default group's store, which the parent of rank 0 keeps
    serving while it trains. Once they have met, a child that dies fails its peers' next collective
    at once (its sockets close); one that never arrives fails the others after ``meet_within`` (the
    children start within moments of each other: their parents fork at the same point of a save).
    ``timeout`` bounds each collective after that; it is long because a dead peer fails them at once
    anyway, and the first one waits for the slowest fork's dist-checkpoint write.
    """

    host_only = True

    def __init__(
        self,
        name: str,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        meet_within: datetime.timedelta = datetime.timedelta(minutes=2),
    ) -> None:
        super().__init__()
        self._store = dist.PrefixStore(f"forked/{name}/", _new_store_client(timeout))
        # gloo's own rendezvous would wait for a missing peer as long as ``timeout``: meet first.
        self._store.set(f"arrived/{self.rank}", b"")
        self._meet(meet_within)
        self._group = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, timeout)

    def _meet(self, within: datetime.timedelta, interval_s: float = 0.05) -> None:
        """Wait until every rank's fork has arrived; fail at once when a rank's parent says its fork died
        (``announce_death``: a fork killed before it arrived would otherwise keep its peers here for ``within``)."""
        arrived = [f"arrived/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + within.total_seconds()
        while not self._store.check(arrived):
            if self._store.add("deaths", 0):
                dead = [rank for rank in range(self.world_size) if self._store.check([f"died/{rank}"])]
                reasons = "; ".join(f"rank {rank}: {self._store.get(f'died/{rank}').decode()}" for rank in dead)
                raise RuntimeError(f"the forked process of rank(s) {dead} died before the forks met ({reasons})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every rank's forked process arrived within {within} (one died?)")
            time.sleep(interval_s)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every fork's ``obj``, which must be JSON data: a peer's message is parsed, never unpickled, so a
        crafted one cannot run code here (torch's ``all_gather_object`` unpickles)."""
        gathered = self.all_gather_bytes(json.dumps(obj).encode())
        return [_parse_message(data, rank) for rank, data in enumerate(gathered)]

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every fork's ``payload``. Through gloo, not the store: a peer that died fails this at once, not at the timeout."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._group.allgather([sizes], [torch.tensor([len(payload)])]).wait()
        padded = torch.zeros(int(max(sizes).item()), dtype=torch.uint8)
        if payload:
            padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._group.allgather([gathered], [padded]).wait()
        return [t[: int(n.item())].numpy().tobytes() for t, n in zip(gathered, sizes, strict=True)]

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        works = [self._group.send([t], peer, tag) for t, peer, tag in sends]
        works += [self._group.recv([t], peer, tag) for t, peer, tag in recvs]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        self._group.barrier().wait()

    def any(self, *flags: bool) -> list[bool]:
        numbers = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._group.allreduce([numbers], options).wait()
        return [bool(number) for number in numbers.tolist()]


def _parse_message(data: bytes, rank: int) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise RuntimeError(f"the forked process of rank {rank} sent a message that is not JSON ({exc}); refused, nothing of it was run") from exc


def announce_death(name: str, rank: int, reason: str) -> None:
    """In rank ``rank`` (the parent): its process forked for ``ForkedRankComm(name)`` died (``reason``); the
    peers' forks still waiting to meet it fail now instead of after ``meet_within``."""
    store = dist.PrefixStore(f"forked/{name}/", _new_store_client(datetime.timedelta(seconds=30)))
    store.set(f"died/{rank}", reason)
    store.add("deaths", 1)


def forked_groups_possible() -> bool:
    """Whether ``ForkedRankComm`` can form: the default group met through a TCP store (env:// or tcp://)."""
    return dist.is_initialized() and torch_internals.default_store_address() is not None


def _new_store_client(timeout: datetime.timedelta) -> dist.TCPStore:
    """A connection of our own to the TCP store behind the default group (the parent's is not ours)."""
    address = torch_internals.default_store_address()
    if address is None:
        raise RuntimeError("a forked process group needs the default group to meet through a TCPStore (env:// or tcp://)")
    return dist.TCPStore(*address, is_master=False, timeout=timeout, wait_for_workers=False)

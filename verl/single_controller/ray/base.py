"""A worker group on Ray: one Ray actor per rank, placed through placement groups.

- ``RayResourcePool``: ``process_on_nodes`` ranks per node; one STRICT_PACK placement group per node.
  Each rank's bundle holds one GPU on GPU hosts, or a fraction of a CPU on CPU hosts, so 8 or 16 ranks
  fit on a 2-core machine.
- ``RayWorkerGroup``: starts the actors with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
  MASTER_ADDR / MASTER_PORT set (the actors' constructors join torch.distributed themselves), binds
  every ``@register``-ed worker method as a method of the group, and collects the results.

A failing rank never leaves the driver waiting: the first failure (an exception in a rank, a rank that
died, a call past its timeout) stops every actor of the group, and the driver gets a ``WorkerGroupError``
that carries the failing ranks' tracebacks, the root cause first: a rank whose process died, then a rank's
own error, then the collectives that broke because of them (gloo's "Connection closed by peer" on rank 0 is
the echo of a peer that died, and often the first failure Ray reports).
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import string
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from verl.single_controller.base.decorator import Dispatch, registered_methods
from verl.single_controller.base.worker import get_node_ip
from verl.utils.distributed import find_free_port

logger = logging.getLogger(__name__)

# How long shutdown() waits for this node's killed ranks to be gone.
RANK_EXIT_WAIT_S = 10.0

# Environment every rank starts with (the group adds the rank variables).
DEFAULT_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class WorkerGroupError(RuntimeError):
    """One or more ranks failed; the message holds their tracebacks. The group has been shut down."""


class RayResourcePool:
    """Where the ranks go: ``process_on_nodes[i]`` ranks on node i, one placement group per node (upstream's
    signature and defaults: ``use_gpu=True``, a random ``name_prefix``).

    Each rank's bundle holds one GPU (``use_gpu``) and ``cpus_per_process`` CPUs; ``None``: one CPU per rank
    where the smallest node has that many, else that node's CPUs shared evenly (fractional Ray resources), so
    the ranks of a node always fit on it. Up to ``max_colocate_count`` worker groups can share the pool: each
    actor takes that fraction of its bundle. ``detached``: the placement groups outlive the driver;
    ``accelerator_type``: a Ray custom resource (e.g. ``accelerator_type:H100``) each bundle also asks for.
    """

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        *,
        cpus_per_process: float | None = None,
    ) -> None:
        if not process_on_nodes or any(n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must list at least one rank per node, got {process_on_nodes}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.name_prefix = _random_prefix() if name_prefix is None else name_prefix
        self.max_colocate_count = max_colocate_count
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.cpus_per_process = cpus_per_process
        self.pgs: list[PlacementGroup] = []

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def store(self) -> list[int]:
        """Ranks per node (upstream's name)."""
        return list(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle; its CPUs split evenly into ``max_colocate_count`` actor shares."""
        cpus = self.cpus_per_process
        if cpus is None:
            cpus = _default_cpus_per_process(max(self.process_on_nodes), self.use_gpu)
        # Ray counts resources in 1e-4 units: round down to a whole number of units per colocated actor.
        units = max(1, int(round(cpus * 10_000)) // self.max_colocate_count)
        bundle = {"CPU": units * self.max_colocate_count / 10_000}
        if self.use_gpu:
            bundle["GPU"] = 1
        if self.accelerator_type is not None:
            bundle[self.accelerator_type] = 1e-4
        return bundle

    def actor_resources(self) -> dict[str, float]:
        """What one actor takes of its bundle: ``1 / max_colocate_count`` of its CPUs and GPU."""
        bundle = self.bundle()
        share = {"num_cpus": round(bundle["CPU"] / self.max_colocate_count, 4)}
        share["num_gpus"] = int(10_000 / self.max_colocate_count) / 10_000 if self.use_gpu else 0
        return share

    def get_placement_groups(self, strategy: str = "STRICT_PACK", timeout_s: float = 300.0) -> list[PlacementGroup]:
        if self.pgs:
            return self.pgs
        bundle = self.bundle()
        lifetime = "detached" if self.detached else None
        self.pgs = [
            placement_group(
                [dict(bundle) for _ in range(count)], strategy=strategy, name=f"{self.name_prefix}_node{index}", lifetime=lifetime
            )
            for index, count in enumerate(self.process_on_nodes)
        ]
        _, not_ready = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=timeout_s)
        if not_ready:
            available = ray.cluster_resources()
            self.remove()
            raise WorkerGroupError(
                f"could not place {self.world_size} ranks ({self.process_on_nodes} per node, each {bundle}) within "
                f"{timeout_s:.0f}s; the cluster holds {available}. Set trainer.nnodes / trainer.n_gpus_per_node "
                "(and trainer.device) to what the cluster has."
            )
        return self.pgs

    def bundle_node_ids(self) -> list[str]:
        """The Ray node id of every rank's bundle, in rank order (after ``get_placement_groups``)."""
        tables = [placement_group_table(pg)["bundles_to_node_id"] for pg in self.pgs]
        return [table[index] for table in tables for index in sorted(table)]

    def remove(self) -> None:
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass
        self.pgs = []


def _random_prefix(length: int = 6) -> str:
    """Upstream's default name prefix: random letters, so groups started side by side never share a name."""
    return "".join(random.choices(string.ascii_lowercase, k=length))


def _default_cpus_per_process(ranks_per_node: int, use_gpu: bool) -> float:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if use_gpu:
        nodes = [node for node in nodes if node.get("Resources", {}).get("GPU", 0) > 0]
    cpus = [node.get("Resources", {}).get("CPU", 0.0) for node in nodes]
    smallest = min((c for c in cpus if c > 0), default=1.0)
    share = min(1.0, smallest / ranks_per_node)
    # Ray accepts at most four decimals of a resource.
    return max(0.0001, int(share * 10_000) / 10_000)


class RayClassWithInitArgs:
    """A worker class (plain or ``ray.remote``-decorated) with the arguments of its constructor."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.user_cls = getattr(cls, "__ray_actor_class__", cls)
        self.remote_cls = cls if hasattr(cls, "__ray_actor_class__") else ray.remote(cls)
        self.args = args
        self.kwargs = kwargs


LOOPBACK = "127.0.0.1"
# The interfaces every rank's gloo / NCCL sockets use, as those libraries name them: loopback on one host.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def rendezvous_host(node_addresses: list[str]) -> str | None:
    """Where rank 0's rendezvous store listens, from every rank's node address (rank 0's first).

    Loopback when every rank is on one host: decided by address, not by node count, so a Ray cluster of
    several nodes on one machine stays on loopback too. None for several hosts: then rank 0's node
    address, or the address of the interface ``GLOO_SOCKET_IFNAME`` names there (``_bind_address``).
    The store takes no authentication: across hosts it must stay on the cluster's private network."""
    return LOOPBACK if len(set(node_addresses)) == 1 else None


def _bind_address(ifname: str | None) -> str:
    """This node's address on interface ``ifname`` (the first IPv4 one), else its Ray node address."""
    if not ifname:
        return get_node_ip()
    import psutil

    ifname = ifname.split(",")[0].lstrip("^=")
    for addr in psutil.net_if_addrs().get(ifname, []):
        if addr.family == socket.AF_INET:
            return addr.address
    raise WorkerGroupError(f"GLOO_SOCKET_IFNAME={ifname}: this node has no IPv4 address on interface {ifname!r}; name one of {sorted(psutil.net_if_addrs())}")


@ray.remote(num_cpus=0)
def _address_and_free_port(host: str | None, ifname: str | None) -> tuple[str, int]:
    ip = host or _bind_address(ifname)
    return ip, find_free_port(ip)


# Set by the group for every rank; a ``worker_env`` may not override them (upstream refuses the same way).
PROTECTED_WORKER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_WORLD_SIZE",
)


class RayWorkerGroup:
    """One Ray actor per rank of ``resource_pool``; methods registered on the worker class become group calls.

    Upstream's signature: ``bin_pack`` (STRICT_PACK, else PACK placement), ``name_prefix`` (actor names
    ``<prefix><Class>_<node>:<local rank>``, random by default), ``detached`` (actors outlive the driver),
    ``worker_names`` / ``worker_handles`` (attach to running actors instead of starting them, with
    ``resource_pool=None``), and ``worker_env`` (extra environment for every rank). This package adds
    ``init_timeout_s`` (the ranks' constructors must all answer within it) and ``failure_grace_s``.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list[ray.actor.ActorHandle] | None = None,
        ray_wait_register_center_timeout: int = 300,
        *,
        worker_env: dict[str, str] | None = None,
        init_timeout_s: float | None = None,
        failure_grace_s: float = 3.0,
    ) -> None:
        worker_env = dict(worker_env or {})
        protected = sorted(set(worker_env) & set(PROTECTED_WORKER_ENV))
        if protected:
            raise ValueError(f"worker_env cannot override protected system env {protected}; drop those keys")
        attach = resource_pool is None
        if attach and not (worker_names or worker_handles):
            raise ValueError("RayWorkerGroup needs a resource_pool, or worker_names / worker_handles to attach to")
        self.resource_pool = resource_pool
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = _random_prefix() if name_prefix is None else name_prefix
        self.detached = detached
        self.customized_worker_env = worker_env
        self.failure_grace_s = failure_grace_s
        timeout = float(ray_wait_register_center_timeout if init_timeout_s is None else init_timeout_s)
        self._workers: list[ray.actor.ActorHandle] = []
        self._worker_names: list[str] = []
        self._node_pids: list[tuple[str, int]] = []
        self._alive = False
        try:
            if attach:
                self._attach(worker_names, worker_handles, timeout)
            else:
                self._start(worker_env, timeout, "STRICT_PACK" if bin_pack else "PACK")
        except BaseException:
            self.shutdown()
            raise
        if ray_cls_with_init is not None:
            self._bind_worker_methods(ray_cls_with_init.user_cls)

    # ------------------------------------------------------------------ start

    def _start(self, worker_env: dict[str, str], init_timeout_s: float, strategy: str) -> None:
        if self.ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup(resource_pool=...) needs ray_cls_with_init: the worker class to start")
        pool = self.resource_pool
        pgs = pool.get_placement_groups(strategy=strategy, timeout_s=init_timeout_s)
        resources = pool.actor_resources()
        master_addr, master_port = self._master_addr_port(pool.bundle_node_ids(), worker_env)
        if master_addr == LOOPBACK:  # one host: the ranks' own sockets on loopback too, unless named
            worker_env = {**{name: "lo" for name in SOCKET_IFNAME_VARS if name not in os.environ}, **worker_env}
        cls = self.ray_cls_with_init
        class_name = cls.user_cls.__name__
        rank = 0
        for node, (pg, local_world_size) in enumerate(zip(pgs, pool.process_on_nodes, strict=True)):
            for local_rank in range(local_world_size):
                env = {
                    **DEFAULT_WORKER_ENV,
                    **{k: str(v) for k, v in worker_env.items()},
                    "RANK": str(rank),
                    "WORLD_SIZE": str(pool.world_size),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                }
                name = f"{self.name_prefix}{class_name}_{node}:{local_rank}"
                options = {
                    **resources,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=local_rank
                    ),
                    "runtime_env": {"env_vars": env},
                    "max_restarts": 0,
                    "name": name,
                }
                if self.detached:
                    options["lifetime"] = "detached"
                self._workers.append(cls.remote_cls.options(**options).remote(*cls.args, **cls.kwargs))
                self._worker_names.append(name)
                rank += 1
        self._alive = True
        # The constructors join the process group together: wait for all of them, failing fast.
        self._node_pids = self.get(
            [worker.get_node_and_pid.remote() for worker in self._workers], timeout_s=init_timeout_s
        )

    def _attach(self, worker_names: list[str] | None, worker_handles: list | None, timeout_s: float) -> None:
        """Use running actors (e.g. a detached group's) by handle or by name, in rank order."""
        if worker_handles:
            self._workers = list(worker_handles)
            self._worker_names = list(worker_names or [])
        else:
            self._workers = [ray.get_actor(name) for name in worker_names]
            self._worker_names = list(worker_names)
        self._alive = True
        self._node_pids = self.get([worker.get_node_and_pid.remote() for worker in self._workers], timeout_s=timeout_s)

    def _master_addr_port(self, node_ids: list[str], env_vars: dict[str, str]) -> tuple[str, int]:
        """Where rank 0's store listens (``rendezvous_host``) and a port free there, asked on rank 0's node."""
        address_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        host = rendezvous_host([address_of.get(node, node) for node in node_ids])
        ifname = env_vars.get("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME"))
        if node_ids[0] == ray.get_runtime_context().get_node_id():
            ip = host or _bind_address(ifname)
            return ip, find_free_port(ip)
        strategy = NodeAffinitySchedulingStrategy(node_id=node_ids[0], soft=False)
        return ray.get(_address_and_free_port.options(scheduling_strategy=strategy).remote(host, ifname), timeout=120)

    def _bind_worker_methods(self, user_cls: type) -> None:
        for name, mode in registered_methods(user_cls).items():
            if hasattr(self, name):
                raise AttributeError(f"worker method {name!r} clashes with an attribute of {type(self).__name__}")
            setattr(self, name, self._make_group_method(name, mode))

    def _make_group_method(self, name: str, mode: Dispatch):
        def group_method(*args: Any, **kwargs: Any):
            return self.dispatch(name, mode, *args, **kwargs)

        group_method.__name__ = name
        group_method.__doc__ = f"Call {name} on the group ({mode.name})."
        return group_method

    # ------------------------------------------------------------------ calls

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list:
        return list(self._workers)

    @property
    def worker_names(self) -> list[str]:
        """The actors' Ray names, in rank order (attach another group to them with ``worker_names=``)."""
        return list(self._worker_names)

    def dispatch(self, method: str, mode: Dispatch, *args: Any, **kwargs: Any) -> list:
        """A registered method's call: ONE_TO_ALL sends the same arguments to every rank, ALL_TO_ALL one list
        entry per rank; every rank's result, in rank order."""
        if mode is Dispatch.ONE_TO_ALL:
            n = self.world_size
            return self._call_per_rank(method, [args] * n, [kwargs] * n)
        if mode is Dispatch.ALL_TO_ALL:
            return self.execute_per_rank(method, *args, **kwargs)
        raise NotImplementedError(f"{type(self).__name__} has no dispatch for {mode}")

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method_name`` on every rank; the object refs, in rank order. As upstream: when every argument
        is a list of ``world_size`` entries, rank r gets the r-th entries, else every rank gets them all."""
        self._check_alive()
        n = self.world_size
        values = (*args, *kwargs.values())
        if all(isinstance(v, list) and len(v) == n for v in values):
            per_rank_args = [tuple(a[r] for a in args) for r in range(n)]
            per_rank_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(n)]
        else:
            per_rank_args, per_rank_kwargs = [args] * n, [kwargs] * n
        return self._refs_per_rank(method_name, per_rank_args, per_rank_kwargs)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Upstream's alias of ``execute_all_async``: the object refs (``execute_all_sync`` waits for them)."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """``execute_all_async``, waited for: every rank's result in rank order; a failure stops the group."""
        return self.get(self.execute_all_async(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        self._check_alive()
        return getattr(self._workers[0], method_name).remote(*args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.get([self.execute_rank_zero_async(method_name, *args, **kwargs)])[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Upstream's alias of ``execute_rank_zero_async``."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_per_rank(self, method: str, *args: list, timeout_s: float | None = None, **kwargs: list) -> list:
        """Every argument is a list with one entry per rank; rank r is called with the r-th entries."""
        for value in (*args, *kwargs.values()):
            if not isinstance(value, (list, tuple)) or len(value) != self.world_size:
                raise ValueError(f"{method}: every argument must be a list of {self.world_size} entries (one per rank)")
        n = self.world_size
        per_rank_args = [tuple(a[r] for a in args) for r in range(n)]
        per_rank_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(n)]
        return self._call_per_rank(method, per_rank_args, per_rank_kwargs, timeout_s)

    def _refs_per_rank(self, method: str, args: list[tuple], kwargs: list[dict]) -> list:
        self._check_alive()
        return [getattr(w, method).remote(*a, **k) for w, a, k in zip(self._workers, args, kwargs, strict=True)]

    def _call_per_rank(self, method: str, args: list[tuple], kwargs: list[dict], timeout_s: float | None = None) -> list:
        return self.get(self._refs_per_rank(method, args, kwargs), timeout_s=timeout_s)

    def get(self, refs: list, timeout_s: float | None = None) -> list:
        """Wait for every ref (one per rank); on the first failure stop the group and raise ``WorkerGroupError``.

        After the first failure the other ranks get ``failure_grace_s`` to report their own errors (the
        root cause is often on one rank, its peers only see a broken collective); whatever is still running
        is then stopped with the group.
        """
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}  # in the order they were seen
        blame: dict[int, int] = {}  # _DIED / _OWN_ERROR / _ECHO per failed rank
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        grace_until = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in ready:
                try:
                    values[rank_of[ref]] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    failures[rank_of[ref]] = _describe_failure(exc)
                    blame[rank_of[ref]] = _blame(exc, failures[rank_of[ref]], rank_of[ref])
            now = time.monotonic()
            if failures and grace_until is None:
                grace_until = now + self.failure_grace_s
            if grace_until is not None and now >= grace_until:
                break
            if deadline is not None and now >= deadline and pending:
                for ref in pending:
                    failures[rank_of[ref]] = f"no answer within {timeout_s:.0f}s (hung collective?)"
                break
        if failures:
            unfinished = sorted(rank_of[ref] for ref in pending if rank_of[ref] not in failures)
            # A rank killed by a signal may not be reported by Ray within the grace period; its process is gone.
            for rank, text in self._dead_processes(unfinished).items():
                failures[rank], blame[rank] = text, _DIED
                unfinished.remove(rank)
            ordered = {rank: failures[rank] for rank in sorted(failures, key=lambda r: blame[r])}  # stable: seen order within a kind
            nodes = [node_ip for node_ip, _ in self._node_pids]
            lost = _unreachable_nodes({nodes[rank] for rank in ordered if rank < len(nodes)} - {get_node_ip()})
            self.shutdown()
            died = blame[next(iter(ordered))] == _DIED
            raise WorkerGroupError(_failure_report(ordered, unfinished, len(refs), died=died, nodes=nodes, lost=lost))
        return [values[rank] for rank in range(len(refs))]

    def _dead_processes(self, ranks: list[int]) -> dict[int, str]:
        """Of ``ranks``, those on this node whose process no longer runs, with a line saying so."""
        here, dead = get_node_ip(), {}
        for rank in ranks:
            if rank < len(self._node_pids):
                node_ip, pid = self._node_pids[rank]
                if node_ip == here and not _process_alive(pid):
                    dead[rank] = (
                        f"the rank's process (pid {pid}) is gone: it was killed (SIGKILL, the OOM killer) or crashed "
                        "before Ray reported it"
                    )
        return dead

    def _check_alive(self) -> None:
        if not self._alive:
            raise WorkerGroupError("the worker group has been shut down (an earlier call failed or shutdown() ran)")

    # ------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        """Stop every actor (and, on this node, the processes they started) and free the placement groups. Returns
        once this node's ranks are gone (bounded): what the driver removes after a failure is then written by no rank."""
        if self._workers:
            here = get_node_ip()
            local = [pid for node_ip, pid in self._node_pids if node_ip == here]
            for pid in local:
                _kill_descendants(pid)
            for worker in self._workers:
                try:
                    ray.kill(worker, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            deadline = time.monotonic() + RANK_EXIT_WAIT_S
            while any(_process_alive(pid) for pid in local) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._workers = []
        self._node_pids = []
        self._alive = False
        if self.resource_pool is not None:
            self.resource_pool.remove()

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _describe_failure(exc: BaseException) -> str:
    """The remote traceback Ray carries (RayTaskError / RayActorError render it in their text), as a
    plain Python traceback: colour codes and caret-only lines dropped, the usual header put back."""
    lines = [line for line in _ANSI.sub("", str(exc)).strip().splitlines() if line.strip(" ^")]
    if not lines:
        return repr(exc)
    if len(lines) > 1 and lines[1].startswith("  File ") and lines[0].startswith("ray::"):
        lines.insert(1, "Traceback (most recent call last):")
    return "\n".join(lines)


# How much a failure says about the root cause (lower first in the report).
_DIED, _OWN_ERROR, _ECHO = 0, 1, 2
# A collective that broke because a peer went away: the symptom on the surviving ranks, not the cause.
_BROKEN_COLLECTIVE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket closed|remote process exited|"
    r"NCCL communicator was aborted|Timed out waiting \d+ms for (recv|send)",
    re.IGNORECASE,
)


# An async save's failure as every rank reports it (the ranks agree on their forks' outcomes): "failed on N
# rank(s): rank R: why; ...". Its cause is the first rank listed whose fork died or failed on its own, not from a
# peer's death (a broken collective, a peer that never met it); on every other rank the report is an echo.
_AGREED_SAVE_FAILURE = re.compile(r"the background save failed on \d+ rank\(s\): (.*)", re.DOTALL)
_AGREED_ENTRY = re.compile(r"(?:^|; )rank (\d+): (.*?)(?=; rank \d+: |$)", re.DOTALL)
_PEER_LOST = re.compile(r"died before the forks met|arrived within")


def _blame(exc: BaseException, text: str, rank: int) -> int:
    if isinstance(exc, ray.exceptions.RayActorError):
        return _DIED
    agreed = _AGREED_SAVE_FAILURE.search(text)
    if agreed:  # the same text on every rank: only its cause's own
        entries = [(int(r), why) for r, why in _AGREED_ENTRY.findall(agreed.group(1))]
        causes = [r for r, why in entries if not (_BROKEN_COLLECTIVE.search(why) or _PEER_LOST.search(why))]
        return _OWN_ERROR if (causes or [r for r, _ in entries] or [rank])[0] == rank else _ECHO
    return _ECHO if _BROKEN_COLLECTIVE.search(text) else _OWN_ERROR


def _process_alive(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends: gone
        return False


def _failure_report(
    failures: dict[int, str], unfinished: list[int], world_size: int, died: bool = False,
    nodes: list[str] | None = None, lost: dict[str, str] | None = None,
) -> str:
    """``nodes``: each rank's node address (named when the group spans several); ``lost``: the nodes where no
    Ray node answers any more, with why (``_unreachable_nodes``)."""
    first = next(iter(failures))
    nodes = nodes or []
    where = f", on node {nodes[first]}" if len(set(nodes)) > 1 and first < len(nodes) else ""
    cause = " (its process died; the other ranks' errors follow from it)" if died and len(failures) > 1 else ""
    lines = [f"{len(failures)} of {world_size} rank(s) failed; rank {first} failed first{where}{cause}:"]
    for address, why in (lost or {}).items():
        ranks = ", ".join(str(rank) for rank, node in enumerate(nodes) if node == address)
        lines.append(f"node {address} (ranks {ranks}) is lost: no Ray node answers there ({why}); every rank on it is gone")
    for rank, text in failures.items():
        lines.append(f"--- rank {rank} ---\n{text}")
    if unfinished:
        lines.append(f"ranks {unfinished} were still running and have been stopped")
    return "\n".join(lines)


def _unreachable_nodes(addresses: set[str], timeout_s: float = 2.0) -> dict[str, str]:
    """Of these node addresses, those where no raylet accepts a connection any more (the host died, or every
    process of its Ray node did), each with the refusals seen. Asked of the raylets themselves: the GCS marks a
    node dead only after its health checks fail for a while."""
    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - the GCS is gone too: nothing to tell
        return {}
    ports: dict[str, list[int]] = {}
    for node in nodes:
        ports.setdefault(node["NodeManagerAddress"], []).append(int(node["NodeManagerPort"]))
    unreachable = {}
    for address in sorted(addresses):
        refusals = []
        for port in ports.get(address, []):
            try:
                socket.create_connection((address, port), timeout=timeout_s).close()
                break
            except OSError as exc:
                refusals.append(f"raylet {address}:{port}: {exc.strerror or exc}")
        else:
            if refusals:
                unreachable[address] = "; ".join(refusals)
    return unreachable


def _kill_descendants(pid: int) -> None:
    """Kill the processes a rank started (megatron's dist-checkpoint writers) before the rank itself goes."""
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the rank already gone
        return
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001
            pass

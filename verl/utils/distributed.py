"""Run one function on N local ranks (processes) joined by torch.distributed.

Used by the tests and the benchmarks in scripts/ (the main job starts its ranks as Ray actors). A rank
that raises, dies or exceeds the timeout fails the whole run with that rank's traceback; every other
rank is then killed, so a collective left waiting never hangs the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import queue
import random
import signal
import socket
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from verl.utils.megatron.parallel import ParallelSizes

_PRELOAD = ["verl.utils.rank_preload"]  # run once in the fork server: see that module


class RankFailure(RuntimeError):
    """One or more ranks failed; the message carries their tracebacks."""


# Ports at or above this may be Ray's worker ports (its default worker port range ends at 19999).
_LOWEST_RENDEZVOUS_PORT = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (bind to port 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(field) for field in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for rank 0's rendezvous store, chosen below the kernel's ephemeral range.

    The port is chosen here and bound later, by rank 0 once its process is up. A port the kernel picks (bind
    to 0) lies in the ephemeral range, from which every other bind to 0 and every outgoing connection draws
    too, and Ray starts servers and clients by the dozen while the ranks start: one of them took the chosen
    port before rank 0 bound it often enough to fail a CLI test (EADDRINUSE). Below that range, and above
    Ray's worker ports, a port is only ever taken by name. Falls back to the kernel's choice where the range
    leaves no room."""
    low, _ = _ephemeral_ports()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = list(range(_LOWEST_RENDEZVOUS_PORT, low))
    random.SystemRandom().shuffle(candidates)  # not the global ``random``: training seeds that stream
    for port in candidates[:200]:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def init_rank(
    rank: int, world_size: int, sizes: ParallelSizes | None, seed: int, timeout_s: float, device_index: int | None = None
) -> None:
    """Join the process group on this rank and, given sizes, initialise Megatron parallel state.

    ``device_index``: the accelerator this rank uses; None means LOCAL_RANK (a Ray actor that sees only
    its own GPU passes 0). Ignored on a CPU host.
    """
    import torch

    from verl.utils import process_lifetime
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
    from verl.utils.megatron import cpu_runtime

    process_lifetime.install()  # what this rank forks (a save's writers) dies with it
    cpu_runtime.enable()
    if get_device_name() != "cpu":
        get_torch_device().set_device(device_index if device_index is not None else int(os.environ.get("LOCAL_RANK", rank)))
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(
        backend=get_nccl_backend(),
        store=rendezvous_store(rank, world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    if sizes is not None:
        sizes.initialize_megatron(seed=seed)


_store_sockets: list[socket.socket] = []  # rank 0's listening socket, kept open for its store's lifetime


def rendezvous_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The TCP store the ranks meet through, at ``MASTER_ADDR:MASTER_PORT``; rank 0 serves it.

    torch's own store listens on every interface whatever ``MASTER_ADDR`` says; it takes no
    authentication, so rank 0 binds the listening socket itself, to ``MASTER_ADDR`` only (loopback on one
    host, docs/operations.md), and hands it to the store."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=4096)
    _store_sockets.append(listener)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno())


def _rank_entry(rank, world_size, port, fn, args, kwargs, sizes, seed, timeout_s, results, group_tag) -> None:
    os.environ.update(
        VERL_RANK_GROUP=group_tag,  # inherited by every process the rank starts; see _kill_tagged
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",  # the ranks' own sockets on loopback too
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import faulthandler

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # _collect asks a rank that hangs where it is
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        init_rank(rank, world_size, sizes, seed, timeout_s)
        value = fn(*args, **kwargs)
        results.put((rank, True, _by_value(value)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
        release_child_processes()
        return
    _teardown()
    release_child_processes()


def _by_value(value: Any) -> bytes:
    """A rank's result as bytes: torch's queue would pass tensors as shared-memory handles, which the parent
    cannot open once the rank has exited (a FileNotFoundError that depends on timing)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def release_child_processes() -> None:
    """Stop the processes this rank started (megatron's dist-checkpoint writer keeps a
    multiprocessing Manager alive for the whole process, ~250 MB, which outlives the rank)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _teardown() -> None:
    import torch

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    sizes: ParallelSizes | None = None,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 300.0,
    seed: int = 1234,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable by name (a module-level function). With ``sizes`` the parallel layout is
    validated first and megatron-core's parallel state is initialised on every rank before ``fn`` runs.
    """
    if sizes is not None:
        sizes.validate(world_size)
    ctx = _context()
    results = ctx.Queue()
    port = find_free_port()
    group_tag = uuid.uuid4().hex
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(rank, world_size, port, fn, args, kwargs or {}, sizes, seed, timeout_s, results, group_tag),
            name=f"rank{rank}",
            daemon=False,  # the dist-checkpoint writer starts processes of its own
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    ok = False
    try:
        values = _collect(procs, results, timeout_s)
        ok = True
        return values
    finally:
        _stop(procs, grace_s=30.0 if ok else 0.0)
        _kill_tagged(group_tag)


def _stop(procs: list, grace_s: float) -> None:
    """Let finished ranks exit on their own, then kill what is left with all its descendants.

    Killing a rank alone would orphan the processes megatron's dist-checkpoint writer started.
    """
    import psutil

    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if not proc.is_alive():
            continue
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        proc.kill()
        for child in family:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    for proc in procs:
        proc.join(timeout=10)


def _kill_tagged(group_tag: str) -> None:
    """Kill what the ranks started and left behind, also below a rank that was SIGKILLed (its
    children are reparented and no longer its descendants)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if proc.environ().get("VERL_RANK_GROUP") == group_tag:
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _dump_stacks(procs: list) -> None:
    """Every thread's Python stack of each process, on its stderr: where a hung rank waits."""
    for proc in procs:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)


def _collect(procs: list, results, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    grace_until = None  # after the first failure, a moment to hear from the rank that caused it
    while len(values) + len(failures) < len(procs):
        now = time.monotonic()
        if grace_until is not None and now > grace_until:
            break
        if now > deadline:
            missing = [r for r in range(len(procs)) if r not in values and r not in failures]
            _dump_stacks([procs[r] for r in missing])
            failures.update({r: f"rank {r} did not finish within {timeout_s:.0f} s (hung collective?)" for r in missing})
            break
        try:
            rank, ok, value = results.get(timeout=0.2)
            (values if ok else failures)[rank] = _from_bytes(value) if ok else value
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in values and rank not in failures and proc.exitcode not in (0, None):
                    failures[rank] = f"rank {rank} died with exit code {proc.exitcode}"
        if failures and grace_until is None:
            grace_until = time.monotonic() + 2.0
    if failures:
        # Ranks that died first: their peers' errors ("connection closed") are only the echo.
        order = sorted(failures, key=lambda r: (not failures[r].startswith(f"rank {r} died"), r))
        report = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in order)
        raise RankFailure(f"{len(failures)} rank(s) failed:\n{report}")
    return [values[r] for r in range(len(procs))]

"""One rank of a worker group.

The group starts each worker with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment (the torch.distributed names); the worker reads them here.
"""

from __future__ import annotations

import ipaddress
import os
import socket


class Worker:
    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        """``cuda_visible_devices``: when given, exported as ``CUDA_VISIBLE_DEVICES`` for this process (upstream's
        override of what the resource manager assigned)."""
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)
        missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
        if missing:
            raise RuntimeError(f"worker started without {missing} in its environment; start it through a worker group")
        self._rank = int(os.environ["RANK"])
        self._world_size = int(os.environ["WORLD_SIZE"])
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if "GLOO_SOCKET_IFNAME" not in os.environ and not _is_loopback(os.environ["MASTER_ADDR"]):
            ifname = interface_of(get_node_ip())
            if ifname is not None:
                # gloo would take the address the host name resolves to, often 127.0.0.1 (the peers could not reach it)
                os.environ["GLOO_SOCKET_IFNAME"] = ifname

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def get_node_and_pid(self) -> tuple[str, int]:
        """(IP of this worker's node, its process id): the group uses them to clean up after a failure."""
        return get_node_ip(), os.getpid()


def get_node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address``, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(addr.family in (socket.AF_INET, socket.AF_INET6) and addr.address.split("%")[0] == address for addr in addrs):
            return name
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"

"""Two hosts on one machine for the multi-node tests: two network namespaces joined by a veth pair, one Ray
node in each (the head on host A, a worker node on host B that joins A's address).

Each host has a network stack of its own: its own loopback, one address on the link (``10.200.0.1`` and
``10.200.0.2``) and no other route, so a socket bound to 127.0.0.1 on host A cannot be reached from host B,
as on separate machines. Host B's Ray can run in a mount namespace of its own with an empty tmpfs over one
directory (``private_dir``): a node that does not see the driver's checkpoint directory.

Needs root and iproute2's ``ip netns``; without them ``TwoHosts`` raises ``HostsUnavailable`` saying why (the
tests fail on it rather than skip). Everything it creates (the namespaces, the link, every process inside the
namespaces, Ray's temp directories) is removed on close, also after a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.main_leg import MBRIDGE, with_rollout
from tests.process_marker import MARKER, kill_marked

REPO = Path(__file__).resolve().parents[1]
SUBNET = "10.200.0"
GCS_PORT = 6379  # each host has its own port space: nothing else listens there
RAY = str(Path(sys.executable).with_name("ray"))


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class Host:
    def __init__(self, name: str, netns: str, address: str, temp_dir: Path) -> None:
        self.name, self.netns, self.address, self.temp_dir = name, netns, address, temp_dir
        self.ray: subprocess.Popen | None = None
        self.ifname = ""  # its end of the link

    def pids(self) -> list[int]:
        """Every process inside this host's network namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(pid) for pid in done.stdout.split()]

    def kill_all(self) -> None:
        """SIGKILL every process of the host, as a host that is lost: its Ray node, its ranks, their writers."""
        for _ in range(5):  # a process may be forked while the others are killed
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


class TwoHosts:
    """``with TwoHosts(work_dir) as hosts:`` host A (``hosts.a``) and host B (``hosts.b``) joined by a link;
    ``hosts.start_ray()`` starts a Ray head on A and a worker node on B. ``cpus``: Ray CPUs of each node."""

    def __init__(self, work_dir: Path, cpus: int = 2) -> None:
        if os.geteuid() != 0:
            raise HostsUnavailable("network namespaces need root (ip netns add): run the multi-host tests as root")
        if shutil.which("ip") is None:
            raise HostsUnavailable("iproute2's `ip` is not installed: the multi-host tests need `ip netns` and veth links")
        self.work_dir = work_dir
        self.cpus = cpus
        self.token = uuid.uuid4().hex[:6]
        self.marker = uuid.uuid4().hex
        self.temp_root = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths live under it
        self.a = Host("A", f"verl{self.token}a", f"{SUBNET}.1", self.temp_root / "a")
        self.b = Host("B", f"verl{self.token}b", f"{SUBNET}.2", self.temp_root / "b")
        self.private_dir: Path | None = None
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "RAY_AUTH_MODE": "disabled",  # a test cluster on the namespaces' private link only
            "RAY_ADDRESS": f"{self.a.address}:{GCS_PORT}",
            MARKER: self.marker,
        }

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def __enter__(self) -> TwoHosts:
        try:
            self._link()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _link(self) -> None:
        veth_a, veth_b = f"v{self.token}a", f"v{self.token}b"
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", veth_a, "netns", self.a.netns, "type", "veth", "peer", "name", veth_b, "netns", self.b.netns)
        for host, veth in ((self.a, veth_a), (self.b, veth_b)):
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", veth)
            _ip("-n", host.netns, "link", "set", veth, "up")
            host.ifname = veth

    def exec_prefix(self, host: Host) -> list[str]:
        """The command prefix that runs a program on ``host`` (on B inside its private mount, if it has one)."""
        prefix = ["ip", "netns", "exec", host.netns]
        if host is self.b and self.private_dir is not None:
            mount = 'mkdir -p "$0" && mount -t tmpfs -o size=16m verl-private "$0" && exec "$@"'
            prefix += ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(self.private_dir)]
        return prefix

    def start_ray(self, private_dir: Path | None = None, env_b: dict | None = None) -> None:
        """A Ray head on host A and a worker node on host B joined to it, fresh; returns once both are up.
        ``private_dir``: a directory host B's Ray sees as an empty tmpfs of its own (a node without the shared
        filesystem); ``env_b``: more environment for host B's Ray node (its workers, the ranks, inherit it)."""
        self.stop_ray()
        self.private_dir = private_dir
        for host in self.hosts:
            shutil.rmtree(host.temp_dir, ignore_errors=True)
            host.temp_dir.mkdir(parents=True)
            role = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if host is self.a else [f"--address={self.a.address}:{GCS_PORT}"]
            command = [
                *self.exec_prefix(host), RAY, "start", "--block", *role, f"--node-ip-address={host.address}",
                f"--num-cpus={self.cpus}", f"--temp-dir={host.temp_dir}", "--disable-usage-stats",
            ]  # fmt: skip
            env = {**self.env, **(env_b or {})} if host is self.b else self.env
            log = open(self.temp_root / f"ray_{host.name}.log", "w")
            host.ray = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_for_nodes(2)

    def stop_ray(self) -> None:
        """Kill every process of both hosts (their Ray nodes and whatever ran on them)."""
        for host in self.hosts:
            if os.path.exists(f"/run/netns/{host.netns}"):
                host.kill_all()
            if host.ray is not None:
                if host.ray.poll() is None:
                    os.killpg(host.ray.pid, signal.SIGKILL)
                host.ray.wait(timeout=30)
                host.ray = None

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        """Until the cluster has ``count`` live nodes (asked from host A, the only place that reaches the GCS)."""
        script = (
            "import sys, time, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]):\n"
            "    assert time.monotonic() < deadline, ray.nodes()\n"
            "    time.sleep(0.2)\n"
        )
        waiter = subprocess.Popen(
            [*self.exec_prefix(self.a), sys.executable, "-c", script, self.env["RAY_ADDRESS"], str(count), str(timeout_s)],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        while waiter.poll() is None:
            if any(host.ray is not None and host.ray.poll() is not None for host in self.hosts):
                waiter.kill()
                break
            time.sleep(0.2)
        if waiter.wait() != 0:
            raise RuntimeError(f"the two-host Ray cluster did not come up:\n{waiter.stdout.read()[-3000:]}\n{self.ray_logs()}")

    def ray_logs(self) -> str:
        return "\n".join(f"--- ray on host {path.stem[-1]} ---\n{path.read_text()[-2000:]}" for path in sorted(self.temp_root.glob("ray_*.log")))

    def start_trainer(self, overrides: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
        """``python -m verl.trainer.main_ppo`` on host A, joined to the cluster (RAY_ADDRESS)."""
        handle = open(log, "w")
        return subprocess.Popen(
            [*self.exec_prefix(self.a), sys.executable, "-m", "verl.trainer.main_ppo", MBRIDGE, *with_rollout(overrides)],
            cwd=self.work_dir, env={**self.env, **(extra_env or {})}, stdout=handle, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip

    def run_trainer(self, overrides: list[str], timeout_s: float = 300, extra_env: dict | None = None) -> tuple[int, str]:
        log = self.work_dir / f"run_{time.monotonic_ns()}.log"
        proc = self.start_trainer(overrides, log, extra_env)
        try:
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        return proc.returncode, log.read_text()

    def listeners(self, host: Host) -> list[tuple[str, int, str]]:
        """Every listening TCP socket on ``host``: (address, port, process name)."""
        done = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-ltnpH"], capture_output=True, text=True, check=True)
        found = []
        for line in done.stdout.splitlines():
            fields = line.split()
            address, _, port = fields[3].rpartition(":")
            for name in re.findall(r'\("([^"]+)",pid=', line):
                found.append((address.strip("[]"), int(port), name))
        return found

    def close(self) -> None:
        """Kill every process of both hosts, remove the namespaces (and with them the link) and Ray's temp dirs."""
        try:
            self.stop_ray()
        finally:
            kill_marked(self.marker)  # anything that left the namespaces (nothing should)
            for host in self.hosts:
                subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            shutil.rmtree(self.temp_root, ignore_errors=True)

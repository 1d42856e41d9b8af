"""Every node of a run must see the driver's ``trainer.default_local_dir``, checked before any rank starts.

Each rank writes its shards of a step into that directory and rank 0 commits what it finds there; a node where
the path is a local disk (or the shared filesystem is not mounted) would split every checkpoint across disks, and
rank 0's commit could not see that node's files. So before the ranks start, the driver writes a file holding a
random nonce into the directory, and one task on every node of the placement reads it back through that node's
own mount and answers with a file of its own, which the driver then reads. A node that cannot is refused in one
line naming it; the check files are removed either way.
"""

from __future__ import annotations

import os
import secrets

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

CHECK_PREFIX = ".verl_shared_dir_check."


class SharedDirError(RuntimeError):
    """A node of the run does not see ``trainer.default_local_dir`` as the driver does."""


@ray.remote(num_cpus=0)
def _read_back(probe: str, nonce: str, answer: str) -> tuple[str, str | None]:
    """On one node: (its address, what is wrong there or None); writes ``answer`` for the driver to read."""
    address = ray.util.get_node_ip_address()
    directory = os.path.dirname(probe)
    try:
        with open(probe) as handle:
            seen = handle.read()
    except FileNotFoundError:
        exists = "exists there but" if os.path.isdir(directory) else "does not exist there, so it"
        return address, f"the directory {exists} lacks the check file the driver just wrote ({os.path.basename(probe)})"
    except OSError as exc:
        return address, f"reading the driver's check file {probe} failed there ({exc.strerror or exc})"
    if seen != nonce:
        return address, f"the driver's check file {probe} holds something else there"
    try:
        with open(answer, "x") as handle:
            handle.write(nonce)
    except OSError as exc:
        return address, f"writing {answer} failed there ({exc.strerror or exc})"
    return address, None


def check_shared_dir(directory: str, node_ids: list[str], timeout_s: float = 120.0) -> None:
    """Raise ``SharedDirError`` unless every node in ``node_ids`` reads what the driver wrote into ``directory``
    and the driver reads what each node wrote back."""
    nonce = secrets.token_hex(16)
    probe = os.path.join(directory, f"{CHECK_PREFIX}{nonce}")
    nodes = list(dict.fromkeys(node_ids))
    answers = {node: f"{probe}.{index}" for index, node in enumerate(nodes)}
    with open(probe, "x") as handle:
        handle.write(nonce)
    try:
        refs = {
            node: _read_back.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
                probe, nonce, answers[node]
            )
            for node in nodes
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        problems = []
        for node, ref in refs.items():
            if ref not in ready:
                problems.append(f"node {node} did not answer within {timeout_s:.0f}s")
                continue
            try:
                address, problem = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the node went away during the check, say so
                problems.append(f"node {node[:12]}: the check failed there ({str(exc).strip().splitlines()[0]})")
                continue
            if problem is None and not _holds(answers[node], nonce):
                problem = f"the file it wrote there ({os.path.basename(answers[node])}) is not in the driver's directory"
            if problem is not None:
                problems.append(f"node {address} ({node[:12]}): {problem}")
    finally:
        for path in [probe, *answers.values()]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    if problems:
        raise SharedDirError(
            f"trainer.default_local_dir={directory} is not the same directory on every node: {'; '.join(problems)}. "
            "Every node's ranks write their shards there and rank 0 commits what it sees: mount one shared filesystem "
            "(NFS, Lustre, ...) at that path on every node, or set trainer.default_local_dir to a directory they all share."
        )


def _holds(path: str, nonce: str) -> bool:
    try:
        with open(path) as handle:
            return handle.read() == nonce
    except OSError:
        return False

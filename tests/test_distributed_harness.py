"""run_on_ranks: results in rank order; a failing, dying or hanging rank fails fast with its story."""

import os
import time

import pytest
import torch

from verl.utils.distributed import RankFailure, run_on_ranks
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes


def _rank_and_sum() -> tuple[int, float]:
    value = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(value)
    return torch.distributed.get_rank(), value.item()


def test_results_come_back_in_rank_order():
    assert run_on_ranks(_rank_and_sum, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def _what_the_fork_server_left() -> dict:
    import gc
    import sys

    return {"preloaded": "verl.utils.rank_preload" in sys.modules, "frozen": gc.get_freeze_count()}


def test_each_rank_starts_from_the_preloaded_frozen_server():
    """The fork server's preload ran to its end before the fork (a preload that fails does so silently, leaving
    each rank ~7 s of imports): the rank has its module and the ~500k objects it froze out of the collections."""
    (left,) = run_on_ranks(_what_the_fork_server_left, 1)
    assert left["preloaded"] and left["frozen"] > 100_000, left


def _rank_one_raises() -> None:
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()


def _rank_one_dies() -> None:
    if torch.distributed.get_rank() == 1:
        os._exit(3)
    torch.distributed.barrier()


def _rank_one_hangs() -> None:
    if torch.distributed.get_rank() == 1:
        time.sleep(3600)
    torch.distributed.barrier()


@pytest.mark.parametrize(
    ("rank_fn", "timeout_s", "story"),
    [
        (_rank_one_raises, 60, r"(?s)rank 1.*ValueError: boom on purpose"),
        (_rank_one_dies, 60, "rank 1 died with exit code 3"),
        (_rank_one_hangs, 8, r"rank 1 did not finish within 8 s"),
    ],
    ids=["raises", "dies", "hangs"],
)
def test_a_bad_rank_fails_fast_with_its_story(rank_fn, timeout_s, story):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=story):
        run_on_ranks(rank_fn, 2, timeout_s=timeout_s)
    assert time.monotonic() - start < 30


def test_layout_is_validated_before_any_rank_starts():
    with pytest.raises(ParallelConfigError, match="not divisible by TP x PP x CP"):
        run_on_ranks(_rank_and_sum, 3, ParallelSizes(tp=2))


def test_the_rendezvous_port_is_one_no_other_process_is_handed_and_leaves_the_seeded_streams_alone():
    """Chosen now, bound by rank 0 later: outside the kernel's ephemeral range, so no bind to port 0 nor
    outgoing connection (Ray's, by the dozen while the ranks start) can take it in between."""
    import random
    import socket

    from verl.utils.distributed import find_free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        ephemeral_low = int(handle.read().split()[0])
    random.seed(7)
    state = random.getstate()
    port = find_free_port("127.0.0.1")
    assert random.getstate() == state  # the training's seeded ``random`` stream is not drawn from
    assert 20000 <= port < ephemeral_low
    taken = []
    try:
        for _ in range(500):  # what other processes starting meanwhile are handed
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            taken.append(sock)
        assert port not in {sock.getsockname()[1] for sock in taken}
        with socket.create_server(("127.0.0.1", port)):  # rank 0's bind, as rendezvous_store makes it
            pass
    finally:
        for sock in taken:
            sock.close()

"""The groups a rank agrees over: the default group, a gloo group beside it, and the group a background save's forked processes form among themselves."""

import datetime
import os
import time

import pytest

from tests.checkpoint_builders import CreatesFile
from verl.utils.distributed import run_on_ranks


def _one_peer_never_arrives() -> str:
    import torch.distributed as dist

    from verl.utils.rank_comm import ForkedRankComm

    if dist.get_rank() == 1:
        return "absent"  # as a fork that died before meeting the others
    start = time.monotonic()
    try:
        ForkedRankComm("never_met", meet_within=datetime.timedelta(seconds=3))
    except RuntimeError as exc:
        return f"{time.monotonic() - start:.1f} {exc}"
    return "met"


def test_a_peer_that_never_arrives_fails_the_others_within_meet_within():
    waited, message = run_on_ranks(_one_peer_never_arrives, 2, timeout_s=120)[0].split(" ", 1)
    assert float(waited) < 30, "gloo's own rendezvous would have waited the full collective timeout (30 min)"
    assert "not every rank's forked process arrived within 0:00:03" in message


def _a_peer_sends_a_pickle(marker: str) -> str:
    import pickle

    import torch.distributed as dist

    from verl.utils.rank_comm import ForkedRankComm

    comm = ForkedRankComm("crafted", meet_within=datetime.timedelta(seconds=60))
    if dist.get_rank() == 1:  # the same collectives as all_gather_object, with a pickle in place of JSON
        comm.all_gather_bytes(pickle.dumps(CreatesFile(marker)))
        return "sent"
    try:
        comm.all_gather_object({"shards": [1, 2]})
    except RuntimeError as exc:
        return str(exc)
    return "accepted"


def test_a_forked_peer_message_is_data_and_a_pickle_is_refused_unrun(tmp_path):
    marker = str(tmp_path / "ran")
    refused, sent = run_on_ranks(_a_peer_sends_a_pickle, 2, args=(marker,), timeout_s=120)
    assert sent == "sent"
    assert "the forked process of rank 1 sent a message that is not JSON" in refused and "nothing of it was run" in refused
    assert not os.path.exists(marker)


def _agreements(kind: str) -> dict:
    import torch.distributed as dist

    from verl.utils.rank_comm import ForkedRankComm, GroupRankComm, PeerFailure, RankComm

    comm = {
        "default": lambda: RankComm(keep_gathers=True),
        "gloo group": GroupRankComm,
        "forked": lambda: ForkedRankComm(f"agree-{kind}"),
    }[kind]()
    rank = dist.get_rank()
    seen: dict = {"any": [comm.any(rank == other) for other in range(3)] + [comm.any(False, rank == 2)]}
    seen["shares"] = comm.agree(None, "share", share={"rank": rank})
    try:
        comm.agree(OSError(28, "No space left on device") if rank == 1 else None, "write its files", share={"rank": rank})
    except PeerFailure as exc:
        seen["failure"] = f"peer: {exc}"
    except OSError as exc:
        seen["failure"] = f"own: {exc}"
    first = comm.gather_unless_unchanged("sizes", {"a": 4})
    again = comm.gather_unless_unchanged("sizes", {"a": 4})
    changed = comm.gather_unless_unchanged("sizes", {"a": 8} if rank == 2 else {"a": 4})
    seen["gathered"] = [first, again, changed]
    seen["reused"] = again[0] is first[0]  # the kept gather's own entries, not a new gather's

    def to_rank_zero(obj):  # as torch's _DistWrapper.gather_object: the list on rank 0, None elsewhere
        everyone = comm.all_gather_object(obj)
        return everyone if rank == 0 else None

    shares = [{"n": rank}, {"n": rank}, {"n": rank + (rank == 1)}]  # the third changed on rank 1
    seen["to_rank_zero"] = [comm.agree(None, "results", share=share, gather=to_rank_zero) for share in shares]
    return seen


@pytest.mark.parametrize("kind", ["default", "gloo group", "forked"])
def test_an_agreement_reports_every_failure_and_a_changed_value_is_never_missed(kind):
    ranks = run_on_ranks(_agreements, 3, args=(kind,), timeout_s=120)
    for rank, seen in enumerate(ranks):
        assert seen["any"] == [[True], [True], [True], [False, True]]
        assert seen["shares"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        expected = "own: [Errno 28] No space left on device" if rank == 1 else "peer: rank 1 could not write its files (OSError: [Errno 28] No space left on device)"
        assert seen["failure"] == expected
        assert seen["gathered"] == [[{"a": 4}] * 3, [{"a": 4}] * 3, [{"a": 4}, {"a": 4}, {"a": 8}]]
        assert seen["reused"] == (kind != "forked")  # a forked group lives for one save: it keeps no gather
        everyone = [{"n": 0}, {"n": 1}, {"n": 2}]
        assert seen["to_rank_zero"] == ([everyone, everyone, [{"n": 0}, {"n": 2}, {"n": 2}]] if rank == 0 else [None] * 3)


def test_a_peer_failure_keeps_which_rank_failed_at_what_through_a_pickle():
    """A rank's error may cross a process boundary (a spawned rank's result): the failed rank and step stay."""
    import pickle

    from verl.utils.rank_comm import PeerFailure

    failure = pickle.loads(pickle.dumps(PeerFailure("rank 0 could not write its HF files", "OSError: [Errno 28] No space left on device: '/x'")))
    assert failure.failed == "rank 0 could not write its HF files"
    assert str(failure) == "rank 0 could not write its HF files (OSError: [Errno 28] No space left on device: '/x')"


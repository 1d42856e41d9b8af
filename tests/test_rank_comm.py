"""ForkedRankComm: the group a background save's forked processes form among themselves."""

import datetime
import time

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

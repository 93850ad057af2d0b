"""The server's rules for a rank whose process is gone (``Server.lose``), without a runtime: which step
names it, what later steps expect, and ``set_world_size`` after the loss (tests/test_lost_rank.py runs
the same on Ray with a real ``ray.kill``)."""

import pytest

from rlmetrics.engine.server import Server
from rlmetrics.messages import Message
from rlmetrics.packing import pack

RANKS = ["rank0", "rank1", "rank2"]


def send(server, rank, step, world_size=3, close=True):
    value = float(RANKS.index(rank) + 10 * step)
    items = [(step, step, world_size, pack({"x/mean": value, "n/total": 1.0}))]
    server.handle([Message(rank, items, [step] if close else [])])


@pytest.mark.parametrize("lost_when", ["before the step opens", "while it is pending"])
def test_the_step_a_lost_rank_did_not_close_ends_partial_naming_it_and_later_steps_complete(lost_when):
    server = Server()
    for rank in RANKS:
        send(server, rank, 0)
    assert server.engine.is_finalized(0)
    if lost_when == "before the step opens":
        server.lose("rank2", "its Ray actor is dead")
    for rank in RANKS[:2]:
        send(server, rank, 1)
    if lost_when == "while it is pending":
        assert not server.read(1).ready()
        server.lose("rank2", "its Ray actor is dead")
    assert server.read(1).ready()  # no deadline: it ends as soon as the others closed it
    res = server.read(1).end()
    assert not res.meta.complete and res.meta.missing_ranks == ["rank2"], res.meta
    assert res.meta.lost == {"rank2": "its Ray actor is dead"}, res.meta
    assert res.meta.missing_metrics["x/mean"] == [2, 3], res.meta
    assert res["x/mean"] == pytest.approx(10.5) and res["n/total"] == 2
    for rank in RANKS[:2]:  # no set_world_size: the names rank2 sent expect 2
        send(server, rank, 2)
    res = server.read(2).end()
    assert res.meta.complete and res.meta.contributions == [4, 4] and not res.meta.lost, res.meta
    for rank in RANKS[:2]:  # set_world_size(2) after the loss: not counted twice
        send(server, rank, 3, world_size=2)
    assert not server.read(4).ready()
    res = server.read(3).end()
    assert res.meta.complete and res.meta.contributions == [4, 4], res.meta


def test_a_lost_ranks_late_message_does_not_make_it_waited_for_again():
    server = Server()
    for rank in RANKS:
        send(server, rank, 0)
    for rank in RANKS[:2]:
        send(server, rank, 1)
    server.lose("rank2", "its node was lost")
    send(server, "rank2", 1, close=False)  # its last message, in flight when it died
    assert server.read(1).end().meta.missing_ranks == ["rank2"]
    for rank in RANKS[:2]:
        send(server, rank, 2)
    assert server.read(2).ready() and server.read(2).end().meta.complete

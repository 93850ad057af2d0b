"""The server rules on the in-process backend: what finalizes a step, and what memory stays bounded.

Real clients on a real :class:`~rlmetrics.backends.local.LocalMetricWorker`; the engine's own
counters (names, schemas, layouts, pending steps) and the clients' (schemas, kept steps) are read
directly. The Ray versions of the long runs are in ``tests/test_soak.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlmetrics import LocalMetricWorker, MetricClient
from rlmetrics.core.packing import Packed, pack
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.server import Server


def engine_counts(engine: Aggregator) -> tuple[int, int, int]:
    held = engine.memory()
    return held["names"], held["schemas"], held["layouts"]


@pytest.mark.slow
def test_names_that_change_every_step_are_forgotten_and_memory_stays_flat():
    """2000 steps, 200 names each step that no other step uses (plus 5 kept): the engine holds the
    names of the last ``forget_after`` steps, the client a bounded schema cache, and every step's
    values are exact."""
    steps, new = 2000, 200
    worker = LocalMetricWorker(forget_after=32)
    ranks = [MetricClient(worker, world_size=2) for _ in range(2)]
    counts, kept = [], []
    for step in range(steps):
        names = [f"kept/m{k}/max" for k in range(5)] + [f"s{step}/m{k}/mean" for k in range(new)]
        values = [np.random.default_rng([r, step]).random(len(names)) for r in range(2)]
        for client, v in zip(ranks, values):
            client.submit_metric(dict(zip(names, v.tolist())))
            client.wait_submit()
        if step % 97 == 0 or step == steps - 1:
            res = ranks[0].result(step)
            want = np.where(
                [n.endswith("max") for n in names], np.maximum(*values), (values[0] + values[1]) / 2
            )
            assert [res[n] for n in names] == pytest.approx(want.tolist(), rel=1e-12)
        if step >= 200:
            counts.append(engine_counts(worker.engine))
            kept.append((len(ranks[0]._schemas), len(ranks[0]._kept)))
    window = 32 + 2  # steps whose names may still be held
    assert max(c[0] for c in counts) <= 5 + window * new, max(counts)
    assert max(c[1] for c in counts) <= window and max(c[2] for c in counts) <= window, max(counts)
    assert worker.engine.memory()["columns"] <= 5 + (window + 1) * new  # columns are reused
    assert max(k[0] for k in kept) <= 514 and max(k[1] for k in kept) <= 1, max(kept)


def test_a_forgotten_name_that_comes_back_is_learned_again_and_merges_exactly():
    worker = LocalMetricWorker(forget_after=4)
    rank = MetricClient(worker, world_size=1)
    for step in range(25):
        rank.submit_metric(
            {"often/mean": [1.0, float(step)]} | ({"rare/max": [step, -1.0]} if step % 9 == 0 else {})
        )
        rank.wait_submit()
        res = rank.result(step)
        assert res["often/mean"] == (1.0 + step) / 2
        assert ("rare/max" in res) == (step % 9 == 0) and res.get("rare/max", step) == step
    assert "rare/max" not in worker.engine.columns.names  # last used in step 18, forgotten 4 steps later


def test_steps_nobody_reads_are_finalized_when_complete():
    """A driver that reads every 10th step: the other steps are finalized when complete all the
    same, so neither the aggregator nor the clients hold them, and the results read are exact."""
    worker = LocalMetricWorker()
    ranks = [MetricClient(worker, world_size=3) for _ in range(3)]
    driver = MetricClient(worker)
    for step in range(300):
        for r, client in enumerate(ranks):
            client.submit_metric({"x/mean": [float(r + step)] * (r + 1)})
            client.wait_submit()
        assert len(worker.engine.pending_steps()) == 0
        assert max(len(c._kept) for c in ranks) <= 1
        if step % 10 == 0:
            assert driver.result(step)["x/mean"] == pytest.approx(step + 4 / 3, rel=1e-12)
    assert worker.engine.late == 0


def test_a_dead_rank_does_not_keep_steps_forever():
    """One of two ranks dies; nobody reads: at most ``max_pending`` steps stay pending, the oldest
    are finalized partial and flagged stale."""
    engine = Aggregator(max_pending=8)
    for step in range(50):
        for rank in ("r0", "r1")[: 1 if step >= 3 else 2]:
            engine.submit(rank, step, step, 2, pack({"x": 1.0}))
            engine.close(rank, step)
        assert len(engine.pending_steps()) <= 8
    assert engine.pending_steps() == list(range(42, 50))
    stale = engine.result(41)
    assert stale.meta.stale and not stale.meta.complete and stale.meta.missing_metrics == {"x": [1, 2]}


def test_reading_a_step_ahead_finalizes_that_step_alone():
    engine = Aggregator()
    engine.submit("r", 0, 0, 1, pack({"x": 1.0}))
    engine.close("r", 0)
    engine.finalize(0)
    engine.finalize(5)  # a reader's deadline passed for step 5
    assert [engine.is_finalized(s) for s in range(7)] == [True, False, False, False, False, True, False]
    for step in (1, 2, 3, 4):
        assert engine.submit("r", step, step, 1, pack({"x": float(step)}))  # not late
        engine.close("r", step)
        assert engine.finalize(step) == {"x": float(step)}
    assert engine.finalized_state() == (6, [])


def test_a_sender_speaks_only_for_the_clients_relayed_to_it():
    """Items keyed by other clients' submissions and closes on their behalf (a node's forward) are
    refused from a sender no relay named for them, and merged once relayed."""
    server = Server()
    one = pack({"x/mean": 1.0})
    item = (0, (("rank0", 0), ("rank1", 0)), 2, Packed(one.schema, one.stats, contributions=2))  # two merged
    errors = server.merge("intruder", [item], [(0, ("rank0", "rank1"))])
    assert len(errors) == 2 and all(
        "does not speak for" in e or "does not close for" in e for e in errors.values()
    )
    assert server.engine.pending_steps() == [] or not server.engine.has_closed_data(0)
    for rank in ("rank0", "rank1"):
        assert server.relay("node", rank, "node-actor") is None
    assert server.merge("node", [item], [(0, ("rank0", "rank1"))]) == {}
    server.finalize_complete([0])
    res = server.result(0)
    assert res.meta.complete and res.meta.contributors == ["rank0", "rank1"] and dict(res) == {"x/mean": 1.0}
    assert server.nodes_of(0) == []


def test_a_new_session_ends_only_the_sessions_that_are_over():
    """The first client of a new session ends the sessions ``session_ended`` reports over: their
    clients are not waited for, their open contributions are dropped, their messages refused; a
    session still running is left alone."""
    over: set[str] = set()
    server = Server(session_ended=lambda session: session in over, step_timeout=100.0)
    assert server.merge("a", [(0, 0, 2, pack({"x/mean": 100.0}))], [0], session="old") == {}
    server.announce(5, "a")  # and closed step 5 below a node, which had not forwarded it
    assert server.register("b", "live") is None  # another run, still going: "old" is not over
    over.add("old")  # the old run's driver is killed
    assert server.register("c", "new") is None  # a restarted run's first client ends "old"
    assert server.engine.clients == {"b", "c"}
    # nothing of the ended run's steps is left: no deadline, and no step for wait_final_res to target
    assert server.next_due() is None and server.engine.newest_closed is None
    assert "ended" in server.merge("a", [(1, 1, 2, pack({"x/mean": 7.0}))], [1], session="old")["a"]
    for client, value, session in (("b", 1.0, "live"), ("c", 3.0, "new")):
        assert server.merge(client, [(0, 0, 2, pack({"x/mean": value}))], [0], session=session) == {}
    server.finalize_complete([0])
    res = server.result(0)
    assert res.meta.complete and res.meta.contributors == ["b", "c"], res.meta
    assert dict(res) == {"x/mean": 2.0}  # rank a's 100.0 is gone
